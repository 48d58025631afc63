"""Compression at equal tokens on TinyShakespeare (4 workers, model `small`), and codec speed.

  python bench/codecs.py [--workdir DIR] [--only NAME ...]
  python bench/codecs.py --speed_only
  python bench/codecs.py --sweep            # also the SWEEP runs toward the 1000x target
  python bench/codecs.py --long             # the LONG runs: 4x the tokens
  python bench/codecs.py --muloco           # DiLoCo with Muon inside, dense and compressed
  python bench/codecs.py --muloco --seeds 3 --only ddp_lr5e-3 diloco_muon
                                            # each method on 3 seeds, paired against DDP
  python bench/codecs.py --requant --seeds 3  # int8/int4 reduce-scattered vs all-gathered

Methods: DDP, DiLoCo (H=20), DiLoCo + int8 / 4-bit / SparseLoCo, DDP + DeMo, DDP + DeMo 1-bit,
all 2,457,600 tokens. Prints a table of final eval loss, bytes sent per worker and the ratio
vs DDP (with `--seeds N`, each method's mean ± sd over seeds 0..N-1 and its difference from
the reference run, `--reference`, paired by seed: bench/stats.py), and the encode+decode time of every codec per 10M parameters (ten 1000x1000 fp32
matrices, jitted, median of 5). Writes <workdir>/result.json. Finished runs are reused.
"""

import argparse
import json
import os
import pathlib
import runpy
import statistics
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))

import jax  # noqa: E402

import stats  # noqa: E402
from lowcomm_jax import compress  # noqa: E402
from lowcomm_jax import report  # noqa: E402
from lowcomm_jax.runtimes.spmd import train

METHODS = {  # name: (config file, overrides)
    "ddp": ("ddp", {}),
    "diloco": ("diloco_hetero", {"hosts": []}),
    "diloco_int8": ("diloco_hetero", {"hosts": [], "compress.codec": "int8"}),
    "diloco_int4": ("diloco_hetero", {"hosts": [], "compress.codec": "int4"}),
    "diloco_sparseloco": ("diloco_sparseloco", {}),
    "ddp_demo": ("ddp_demo", {}),
    "ddp_demo_1bit": ("ddp_demo", {"compress.value_bits": 1}),
}

# Toward "≥ 1000x fewer bytes than DDP within 3% of its loss" (--sweep): shorter rounds
# (more of them, same tokens), fewer entries per chunk, DiLoCo's Nesterov outer rule.
SWEEP = {
    "ddp_demo_lr3e-3": ("ddp_demo", {"optimizer.lr": 3e-3}),
    "diloco_h5": ("diloco_hetero", {"hosts": [], "rounds": 60, "inner_steps": 5,
                                    "eval_every": 20, "checkpoint_every": 20}),
    "diloco_sparseloco_nesterov": ("diloco_sparseloco", {"outer.lr": 0.7, "outer.momentum": 0.9}),
    "diloco_sparseloco_h5_k24_nesterov": (
        "diloco_sparseloco", {"rounds": 60, "inner_steps": 5, "eval_every": 20,
                              "checkpoint_every": 20, "compress.k": 24, "outer.lr": 0.7,
                              "outer.momentum": 0.9}),
}
# DiLoCo's outer rule at this short budget (15 rounds): (lr, momentum) around the published
# 0.7 / 0.9, and H=10 at the best of them.
for _lr, _m in [(1.0, 0.0), (1.5, 0.0), (0.5, 0.9), (1.0, 0.5), (1.0, 0.7), (1.5, 0.5),
                (0.8, 0.6)]:
  SWEEP[f"diloco_outer_lr{_lr}_m{_m}"] = ("diloco_hetero", {"hosts": [], "outer.lr": _lr,
                                                            "outer.momentum": _m})
SWEEP["diloco_h10_outer_lr1.0_m0.5"] = ("diloco_hetero", {
    "hosts": [], "outer.lr": 1.0, "outer.momentum": 0.5, "rounds": 30, "inner_steps": 10,
    "eval_every": 10, "checkpoint_every": 10})
# Is the remaining gap a matter of the inner learning rate? Each side tuned on its own: DiLoCo
# (best outer rule above) and DDP, AdamW lr below and above the shared 3e-3.
for _lr in (2e-3, 5e-3, 1e-2):
  SWEEP[f"diloco_outer_lr1.0_m0.5_inner_lr{_lr:g}"] = ("diloco_hetero", {
      "hosts": [], "outer.lr": 1.0, "outer.momentum": 0.5, "optimizer.lr": _lr})
  SWEEP[f"ddp_lr{_lr:g}"] = ("ddp", {"optimizer.lr": _lr})

# --long: the same comparison at 4x the tokens (1,200 steps, 9,830,400 tokens per run):
# DiLoCo with H=30 under one of the two best outer rules of the short sweep (0.8 / 0.6, within
# 0.002 of 1.0 / 0.5) and under the published one, and SparseLoCo on the same rounds.
_LONG_ROUNDS = {"rounds": 40, "inner_steps": 30, "eval_every": 10, "checkpoint_every": 20}
LONG = {
    "ddp": ("ddp", {"rounds": 1200, "eval_every": 200, "checkpoint_every": 400,
                    "log_every": 50}),
    "diloco_h30": ("diloco_hetero", {"hosts": [], "outer.lr": 0.8, "outer.momentum": 0.6,
                                     **_LONG_ROUNDS}),
    "diloco_h30_outer_lr0.7_m0.9": ("diloco_hetero", {"hosts": [], **_LONG_ROUNDS}),
    "diloco_h30_sparseloco": ("diloco_sparseloco", _LONG_ROUNDS),
}


# --muloco (MuLoCo, Thérien et al. 2025: Muon inner steps make DiLoCo's pseudo-gradients
# less sensitive to compression): DiLoCo, DiLoCo + int4, DiLoCo + SparseLoCo, each with the
# AdamW inner optimizer above and with Muon (lr 0.02 on the hidden matrices, its AdamW part
# at the runs' 3e-3), at the same tokens.
_MUON = {"optimizer.name": "muon", "optimizer.lr": 0.02, "optimizer.adam_lr": 3e-3}
MULOCO = {
    **{k: METHODS[k] for k in ("ddp", "diloco", "diloco_int4", "diloco_sparseloco")},
    # DDP at its tuned AdamW lr (the SWEEP's best of 2e-3 / 3e-3 / 5e-3 / 1e-2).
    "ddp_lr5e-3": ("ddp", {"optimizer.lr": 5e-3}),
    "diloco_muon": ("diloco_hetero", {"hosts": [], **_MUON}),
    "diloco_muon_int4": ("diloco_hetero", {"hosts": [], "compress.codec": "int4", **_MUON}),
    "diloco_muon_sparseloco": ("diloco_sparseloco", _MUON),
}


# --requant (issue 71): the quantized reduce-scatter's second quantization (each shard's
# owner re-encodes the mean; compress.reduce='scatter') against the all-gather, paired by
# seed. DiLoCo H = 50 on the table's tokens (6 rounds), the sweep's best outer rule at H = 20
# (lr 1.0, Nesterov 0.5; not tuned again at H = 50, the same for both arms), scales per 256
# entries on both sides, so that the re-quantization is all that differs.
REQUANT = {f"diloco_h50_{codec}_{reduce}": ("diloco_hetero", {
    "hosts": [], "rounds": 6, "inner_steps": 50, "eval_every": 3, "checkpoint_every": 3,
    "outer.lr": 1.0, "outer.momentum": 0.5, "compress.codec": codec,
    "compress.reduce": reduce, "compress.quant_block": 256})
    for codec in ("int8", "int4") for reduce in ("gather", "scatter")}


def _config(file: str, overrides: dict):
  config = runpy.run_path(str(REPO / "configs" / f"{file}.py"))["get_config"]()
  config.update_from_flattened_dict(overrides)  # dotted keys, e.g. "compress.codec"
  return config


def codec_speed(repeats: int = 5) -> dict[str, float]:
  """Seconds for encode + decode of 10M parameters, per codec (its default settings)."""
  tree = {f"m{i}": jax.random.normal(jax.random.key(i), (1000, 1000)) for i in range(10)}
  out = {}
  defaults = _config("base", {})
  for name in compress.CODECS[1:]:
    cfg = defaults.compress.copy_and_resolve_references()
    cfg.codec = name
    codec = compress.make_codec(cfg)
    state = codec.init(tree)
    key = jax.random.key(0)
    fn = jax.jit(lambda t, s, k: codec.decode(codec.encode(t, s, k)[0], t, k))
    jax.block_until_ready(fn(tree, state, key))
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(tree, state, key))
      times.append(time.perf_counter() - t0)
    out[name] = statistics.median(times)
    print(f"{name:>10}: {out[name] * 1e3:8.1f} ms per 10M params "
          f"(payload {codec.payload_bytes(tree) / 1e6:.2f} MB of {4e-6 * 1e7:.0f} MB)", flush=True)
  return out


def _run(file: str, overrides: dict, workdir: pathlib.Path) -> dict:
  """One run's summary (a finished run is read back, not rerun)."""
  summary = (report.read_summary(workdir) if report.has_summary(workdir)
             else train.run(_config(file, overrides), workdir))
  return {k: summary[k] for k in ("eval_loss", "bytes_sent", "tokens", "compression_ratio",
                                  "wall_seconds")}


def _print_table(rows: dict[str, list[dict]], reference: str) -> None:
  """Means over seeds; losses and bytes relative to the reference's means."""
  mean = lambda runs, k: statistics.fmean(r[k] for r in runs)
  ref = rows.get(reference)
  print(f"| method | eval loss | vs {reference} | MiB sent per worker | "
        f"{reference} bytes / bytes | wall s |")
  print("|---|---|---|---|---|---|")
  for name, runs in rows.items():
    loss, sd = stats.mean_sd(r["eval_loss"] for r in runs)
    vs = f"{mean(runs, 'eval_loss') / mean(ref, 'eval_loss') - 1:+.1%}" if ref else "-"
    ratio = f"{mean(ref, 'bytes_sent') / mean(runs, 'bytes_sent'):,.0f}" if ref else "-"
    spread = f" ± {sd:.4f}" if len(runs) > 1 else ""
    print(f"| {name} | {loss:.4f}{spread} | {vs} | {mean(runs, 'bytes_sent') / 2**20:.3f} | "
          f"{ratio} | {mean(runs, 'wall_seconds'):.0f} |")


def _print_paired(rows: dict[str, list[dict]], reference: str) -> dict:
  """Each method's eval loss minus the reference's, paired by seed."""
  out = {}
  print(f"\n| method | eval loss − {reference}'s, paired (mean ± sd) | 95% interval | "
        "lower than the reference? |")
  print("|---|---|---|---|")
  ref = [r["eval_loss"] for r in rows[reference]]
  for name, runs in rows.items():
    if name == reference:
      continue
    d = stats.paired([r["eval_loss"] for r in runs], ref, higher_is_better=False)
    out[name] = d
    print(f"| {name} | {d['mean']:+.4f} ± {d['sd']:.4f} | [{d['ci95'][0]:+.4f}, "
          f"{d['ci95'][1]:+.4f}] | {d['verdict']} |")
  return out


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--workdir", type=pathlib.Path, default=None,
                 help="default bench/results/codecs (codecs_long with --long)")
  p.add_argument("--only", nargs="*", default=None)
  p.add_argument("--speed_only", action="store_true")
  p.add_argument("--seeds", type=int, default=1,
                 help="run each method on seeds 0..N-1 (runs named <method>_s<k>)")
  p.add_argument("--reference", default="ddp",
                 help="the method the others are compared with")
  p.add_argument("--sweep", action="store_true", help="also run the SWEEP methods")
  p.add_argument("--long", action="store_true",
                 help="run the LONG methods (4x tokens) instead; default workdir codecs_long")
  p.add_argument("--muloco", action="store_true",
                 help="run the MULOCO methods instead; default workdir codecs (shared runs)")
  p.add_argument("--requant", action="store_true",
                 help="run the REQUANT methods instead (each scatter paired with its gather)")
  args = p.parse_args()
  if args.long + args.sweep + args.muloco + args.requant > 1:
    p.error("--long, --sweep and --muloco are separate tables; run them one at a time")
  if args.workdir is None:
    args.workdir = REPO / "bench/results" / ("codecs_long" if args.long else
                                             "codecs_requant" if args.requant else "codecs")
  result = {"speed_ms_per_10M": {k: v * 1e3 for k, v in codec_speed().items()}}
  if not args.speed_only:
    methods = (LONG if args.long else MULOCO if args.muloco else REQUANT if args.requant
               else {**METHODS, **(SWEEP if args.sweep else {})})
    methods = {k: v for k, v in methods.items() if not args.only or k in args.only}
    rows = {name: [_run(file, {**overrides, **({"seed": k} if args.seeds > 1 else {})},
                        args.workdir / (f"{name}_s{k}" if args.seeds > 1 else name))
                   for k in range(args.seeds)]
            for name, (file, overrides) in methods.items()}
    result["runs"] = rows
    _print_table(rows, args.reference)
    if args.seeds > 1 and args.requant:  # each scatter against its own codec's gather
      result["paired_vs_reference"] = {
          name: _print_paired({name: rows[name], gather: rows[gather]}, gather)[name]
          for name in rows if name.endswith("_scatter")
          for gather in [name.replace("_scatter", "_gather")] if gather in rows}
    elif args.seeds > 1 and args.reference in rows:
      result["paired_vs_reference"] = _print_paired(rows, args.reference)
  args.workdir.mkdir(parents=True, exist_ok=True)
  (args.workdir / "result.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
  main()
