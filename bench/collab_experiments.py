"""The collaborative fine-tuning experiments: SmolLM2-135M-Instruct (GGUF, fetched by
launch/fetch_smollm2.py) fine-tuned on TinyShakespeare with LoRA, target batch 128.

  python bench/collab_experiments.py [--workdir DIR] [--epochs N] [--only NAME ...]
                                     [--repeats 3] [--random_init]

`--random_init` runs SmolLM2-135M's shape from random weights with a byte tokenizer (no
download): the same compute and bytes, so the same seconds, but not the same losses.

1. One peer vs two peers of different speeds (real processes, each pinned to one core;
   peer 1 is slowed to half speed, an emulated slower GPU), over an emulated link
   (collab.link_gbps / link_latency_s: each epoch's sync waits a ring all-reduce of its
   bytes over it, LINK below), and against the baseline without counting: a static split
   of the target batch in proportion to speed (collab.static_split). `--repeats` runs the
   three in turn that many times; the speed-ups are paired by repeat (bench/stats.py).
   Validation loss against training time and against epochs, and seconds per epoch.
2. Per-device batch 1, 4 and 8 at the same target batch (and batch 8 with another seed, for
   the noise): at a fixed target batch the curves per epoch should coincide.
3. LAMB vs AdamW at the same target batch, two learning rates each (the reference run b8
   is AdamW at 1e-3).

Runs 2 and 3 take one process on both cores. Each run is a subprocess writing to
<workdir>/<name>; finished runs are reused. Writes <workdir>/result.json and the plots
<workdir>/collab_peers.png, collab_batch.png, collab_optimizers.png.
"""

import argparse
import json
import os
import pathlib
import runpy
import socket
import subprocess
import sys

from lowcomm_jax import report

REPO = pathlib.Path(__file__).resolve().parents[1]

# Shared by every run: LoRA rank 8 on attention and MLP, sequences of 32 tokens.
COMMON = {"collab.target_batch_size": 128, "data.seq_len": 32, "lora.rank": 8,
          "lora.alpha": 16.0, "eval_batches": 8, "data.batch_size": 8,
          "optimizer.warmup_steps": 2}
# name: (hosts as (batch, speed) pairs, overrides). The reference run is b8: AdamW, lr 1e-3.
RUNS = {
    "b8": ([(8, 1.0)], {}),
    "b4": ([(4, 1.0)], {}),
    "b1": ([(1, 1.0)], {}),
    "b8_seed1": ([(8, 1.0)], {"seed": 1}),
    "lamb_1e-3": ([(8, 1.0)], {"optimizer.name": "lamb"}),
    "lamb_1e-2": ([(8, 1.0)], {"optimizer.name": "lamb", "optimizer.lr": 1e-2}),
    "adamw_3e-4": ([(8, 1.0)], {"optimizer.lr": 3e-4}),
}
PEERS = {  # real processes, one core each: (hosts, overrides)
    "one_peer": ([(8, 1.0)], {}),
    "two_peers": ([(8, 1.0), (8, 0.5)], {}),
    "two_peers_static": ([(8, 1.0), (8, 0.5)], {"collab.static_split": True}),
}
# The peers' emulated link: 100 Mb/s and 50 ms (an office uplink). Sent per epoch: a ring
# all-reduce of the adapters' gradient.
LINK = {"collab.link_gbps": 0.1, "collab.link_latency_s": 0.05}
CONFIG = '''import runpy
from lowcomm_jax.assemble.hosts import host
_base = runpy.run_path({base!r})


def get_config():
  c = _base["get_config"]()
  c.hosts = [host(1.0, batch_size=b, speed=s) for b, s in {hosts!r}]
  c.num_workers = len(c.hosts)
  return c
'''


def _args(name, gguf, epochs, overrides):
  model = ({"model.init_from": str(gguf), "data.tokenizer": str(gguf)} if gguf else
           {"model.name": "smollm2_135m", "data.tokenizer": "byte"})
  values = {**COMMON, "rounds": epochs, "eval_every": 2, "checkpoint_every": epochs,
            "optimizer.name": "adamw", "optimizer.lr": 1e-3, **model, **overrides}
  return [f"--config.{k}={v}" for k, v in values.items()]


def _config_file(workdir: pathlib.Path, name: str, hosts) -> pathlib.Path:
  path = workdir / f"{name}_config.py"
  path.write_text(CONFIG.format(base=str(REPO / "configs" / "collab_lora.py"), hosts=hosts))
  return path


def run_virtual(workdir, name, gguf, epochs):
  hosts, overrides = RUNS[name]
  out = workdir / name
  if report.has_summary(out):
    return
  cmd = [sys.executable, "-m", "lowcomm_jax.main",
         f"--config={_config_file(workdir, name, hosts)}", f"--workdir={out}",
         *_args(name, gguf, epochs, overrides)]
  subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)


def run_peers(workdir, name, gguf, epochs):
  """Each peer a process pinned to its own core (taskset), joined by jax.distributed.
  `name` is a PEERS key, with `_r<k>` for the k-th repeat."""
  hosts, overrides = PEERS[name.rsplit("_r", 1)[0]]
  out = workdir / name
  if report.has_summary(out):
    return
  config = _config_file(workdir, name, hosts)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = []
  for i in range(len(hosts)):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    if len(hosts) > 1:
      env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(len(hosts)),
                 JAX_PROCESS_ID=str(i))
    procs.append(subprocess.Popen(
        ["taskset", "-c", str(i), sys.executable, "-m", "lowcomm_jax.main", f"--config={config}",
         f"--workdir={out}", *_args(name, gguf, epochs, {**LINK, **overrides})],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL))
  codes = [p.wait() for p in procs]
  if any(codes):
    raise SystemExit(f"{name}: exit codes {codes}")


# Epochs whose time holds compilation, left out of the seconds per epoch. Epoch 1 compiles
# the micro-batch and the optimizer step, epoch 2 ends with the first evaluation's. In a
# two-process run epochs 2 and 3 also hold the second process's compiles: JAX's persistent
# cache is written by process 0 only, so peer 1 compiles on every run while peer 0 loads,
# and peer 0 waits for it at the next collective (measured: +35 s in epoch 2, +2 to 12 s in
# epoch 3, in 5 of 6 warm two-peer runs).
WARMUP_EPOCHS = 3


def curves(run_dir: pathlib.Path) -> dict:
  """Per evaluated epoch: validation loss, and the training seconds so far (Σ epoch_seconds,
  each warm-up epoch counted at the steady mean of the epochs after it)."""
  rows = [json.loads(l) for l in (run_dir / "collab.jsonl").read_text().splitlines()]
  epochs = {r["epoch"]: r for r in rows if not r.get("live")}
  seconds = [epochs[e]["epoch_seconds"] for e in sorted(epochs)]
  if len(seconds) <= WARMUP_EPOCHS:
    raise SystemExit(f"{run_dir.name}: {len(seconds)} epochs; the seconds per epoch need more "
                     f"than the {WARMUP_EPOCHS} warm-up epochs (--epochs)")
  steady = sum(seconds[WARMUP_EPOCHS:]) / (len(seconds) - WARMUP_EPOCHS)
  seconds[:WARMUP_EPOCHS] = [steady] * WARMUP_EPOCHS
  elapsed, total = {}, 0.0
  for e, s in zip(sorted(epochs), seconds):
    total += s
    elapsed[e] = total
  evals = [(m["step"], m["eval_loss"]) for m in report.read_metrics(run_dir) if "eval_loss" in m]
  samples = [sum(epochs[e]["samples"]) for e in sorted(epochs)]
  return {"epochs": [e for e, _ in evals], "eval_loss": [v for _, v in evals],
          "seconds": [elapsed[e] for e, _ in evals],
          "seconds_per_epoch": steady,
          "samples_per_epoch": sum(samples) / len(samples),
          "samples_per_peer": [sum(epochs[e]["samples"][i] for e in epochs) / len(epochs)
                               for i in range(len(epochs[1]["samples"]))]}


def plot(result: dict, workdir: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  panels = [("collab_peers.png", ["one_peer_r0", "two_peers_r0", "two_peers_static_r0"], True),
            ("collab_batch.png", ["b1", "b4", "b8", "b8_seed1"], False),
            ("collab_optimizers.png", ["b8", "adamw_3e-4", "lamb_1e-3", "lamb_1e-2"], False)]
  for file, names, with_time in panels:
    names = [n for n in names if n in result]
    if not names:
      continue
    fig, axes = plt.subplots(1, 2 if with_time else 1, figsize=(11 if with_time else 6, 4),
                             squeeze=False)
    for n in names:
      r = result[n]
      label = {"b8": "b8 (AdamW 1e-3)"}.get(n, n)
      axes[0][0].plot(r["epochs"], r["eval_loss"], marker="o", label=label)
      if with_time:
        axes[0][1].plot(r["seconds"], r["eval_loss"], marker="o", label=label)
    axes[0][0].set_xlabel("epoch (target batch 128)")
    axes[0][0].set_ylabel("validation loss")
    if with_time:
      axes[0][1].set_xlabel("training seconds")
    for ax in axes[0]:
      ax.legend()
      ax.grid(alpha=0.3)
    fig.suptitle("SmolLM2-135M + LoRA on TinyShakespeare, collaborative epochs")
    fig.tight_layout()
    fig.savefig(workdir / file, dpi=100)
    plt.close(fig)


def speedups(result: dict, repeats: int) -> list[str]:
  """Seconds per epoch of one peer over two, per repeat, for counting and the static split,
  and their paired difference."""
  import stats  # bench/stats.py: it loads scipy, needed here only
  ratio = {kind: [result[f"one_peer_r{k}"]["seconds_per_epoch"]
                  / result[f"{kind}_r{k}"]["seconds_per_epoch"] for k in range(repeats)]
           for kind in ("two_peers", "two_peers_static")}
  lines = [f"{kind}: speed-up over one peer {m:.3f} ± {sd:.3f} ({', '.join(f'{x:.3f}' for x in v)})"
           for kind, v in ratio.items() for m, sd in [stats.mean_sd(v)]]
  if repeats > 1:
    d = stats.paired(ratio["two_peers"], ratio["two_peers_static"], higher_is_better=True)
    lines.append(f"counting − static split: {d['mean']:+.3f} ± {d['sd']:.3f} (95% interval "
                 f"{d['ci95'][0]:+.3f} to {d['ci95'][1]:+.3f}): {d['verdict']}")
  return lines


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workdir", type=pathlib.Path, default=REPO / "runs" / "bench_collab")
  p.add_argument("--epochs", type=int, default=12)
  p.add_argument("--gguf", type=pathlib.Path)
  p.add_argument("--random_init", action="store_true")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--only", nargs="*")
  args = p.parse_args()
  os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))
  gguf = None
  if not args.random_init:
    gguf = args.gguf or runpy.run_path(str(REPO / "launch" / "fetch_smollm2.py"))["fetch"]()
  args.workdir.mkdir(parents=True, exist_ok=True)
  # The timed runs first, on an idle machine, the three kinds in turn.
  timed = [f"{kind}_r{k}" for k in range(args.repeats) for kind in PEERS]
  names = args.only or [*timed, *RUNS]
  for name in names:
    print(f"running {name}…", flush=True)
    (run_peers if name in timed else run_virtual)(args.workdir, name, gguf, args.epochs)
  result = {n: curves(args.workdir / n) for n in [*RUNS, *timed]
            if report.has_summary(args.workdir / n)}
  (args.workdir / "result.json").write_text(json.dumps(result, indent=1))
  plot(result, args.workdir)
  for n, r in result.items():
    print(f"{n:18s} final val {r['eval_loss'][-1]:.4f}  {r['seconds_per_epoch']:.1f} s/epoch  "
          f"samples/epoch {r['samples_per_epoch']:.0f} {r['samples_per_peer']}")
  if all(n in result for n in timed):
    print("\n".join(speedups(result, args.repeats)))


if __name__ == "__main__":
  main()
