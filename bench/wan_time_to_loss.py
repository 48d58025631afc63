"""Time to a target loss over a slow wide-area network, in the simulator.

16 workers in 4 regions (100 Gb/s inside a region; 1 Gb/s and 50 ms between regions),
`moderate` speeds (0.5–1×), the same tokens for every method: DDP, DiLoCo, Streaming
DiLoCo, one-step-delay, eager, Overlap Local-SGD, async DN + DyLU and HALoS (+ DyLU), each
dense, with its best codec (DeMo for DDP, SparseLoCo for the rest; see DEMO, SPARSELOCO) and
dense with free communication (its compute-only floor).

The CPU trains the byte-level `small` model, but the clock is that of `gpt2_124m` on
A100-class GPUs: an inner step takes STEP_SECONDS at speed 1 and every payload travels as
if it were BYTES_SCALE times larger (sim.network.bytes_scale), so the ratio of communication
to computation is that of the large model over these links (see `_scales`).

Reported per case: virtual time to L* (the eval loss dense DiLoCo ends at; "never" if the
case does not reach it), that time over the method's compute-only floor's, the speed-up
over DiLoCo, and the eval loss after a fixed virtual-time budget; a plot of eval loss
against virtual time.

  python bench/wan_time_to_loss.py [--jobs 16] [--rounds 15] [--workdir DIR]

Writes <workdir>/wan.md, wan.png and result.json (bench/results/wan by default).
"""

import argparse
import json
import os
import pathlib
import runpy
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))

import sim_grid  # noqa: E402

GPT2_PARAMS = 124_475_904  # gpt2_124m (vocab 50304), as bench/mfu.py counts it
# gpt2_124m on an A100 (312 TFLOP/s bf16 dense) at 40% MFU, 16 × 1024 tokens per step:
# 855 MFLOP per token (model/flops.py) -> 16384 · 855e6 / (0.4 · 312e12) s.
STEP_SECONDS = 16384 * 855e6 / (0.4 * 312e12)
# The best codec for each method, as its authors configure it: DDP sends DeMo's top DCT
# coefficients of its momentum and steps on their sign (configs/ddp_demo.py); the others
# send SparseLoCo's top-k 2-bit pseudo-gradients with error feedback, under SparseLoCo's
# outer SGD at lr 1 without momentum (configs/diloco_sparseloco.py; Overlap Local-SGD's
# anchor rule has no lr, and keeps its own).
DEMO = ("demo", {"compress.codec": "demo", "compress.beta": 0.999, "compress.chunk": 64,
                 "compress.k": 32, "optimizer.lr": 1e-3})
SPARSELOCO = ("sparseloco", {"compress.codec": "sparseloco", "compress.beta": 0.95,
                             "compress.chunk": 64, "compress.k": 64, "outer.lr": 1.0,
                             "outer.momentum": 0.0})
METHODS = {
    "ddp": {"algorithm": "ddp"},
    "diloco": {"algorithm": "diloco"},
    "streaming": {"algorithm": "streaming", "streaming.fragments": 2,
                  "streaming.overlap_steps": 1},
    # The delayed outer steps diverge with DiLoCo's outer momentum 0.9 (BENCHMARKS.md,
    # overlapped variants): they run without momentum.
    "one_step_delay": {"algorithm": "one_step_delay", "outer.momentum": 0.0},
    "eager": {"algorithm": "eager", "outer.momentum": 0.0},
    "overlap": {"algorithm": "overlap"},
    "async_dn_dylu": {"algorithm": "async_dn", "outer.dylu": True},
    "halos": {"algorithm": "halos", "outer.dylu": True, "outer.halos.sync_every": 4},
}
FREE = {"sim.network.bytes_scale": 1e-12, "sim.network.intra_latency_s": 0.0,
        "sim.network.inter_latency_s": 0.0}


def cases(args) -> dict[str, dict]:
  out = {}
  for m, fields in METHODS.items():
    out[m] = fields
    name, codec = DEMO if m == "ddp" else SPARSELOCO
    if m == "overlap":
      codec = {k: v for k, v in codec.items() if not k.startswith("outer.")}
    out[f"{m}+{name}"] = {**fields, **codec}
    out[f"{m}@free"] = {**fields, **FREE}
  return out


def _scales(args) -> tuple[float, int]:
  """(sim.network.bytes_scale, the small model's parameters): payloads as gpt2_124m's."""
  from lowcomm_jax.build import build
  small = build(config("diloco", METHODS["diloco"], args, 1.0)).model.param_count
  return GPT2_PARAMS / small, small


def config(name: str, fields: dict, args, bytes_scale: float):
  c = runpy.run_path(str(REPO / "configs" / "base.py"))["get_config"]()
  ddp = fields["algorithm"] == "ddp"
  c.update_from_flattened_dict({
      "num_workers": 16, "model.name": "small", "data.tokenizer": "byte",
      "data.batch_size": 8, "data.seq_len": 32, "optimizer.warmup_steps": 20,
      # Equal tokens: DDP takes rounds·H single steps.
      "rounds": args.rounds * (args.inner_steps if ddp else 1),
      "inner_steps": 1 if ddp else args.inner_steps,
      "optimizer.decay_steps": args.rounds * args.inner_steps,
      "eval_every": args.inner_steps if ddp else 1, "eval_batches": 4,
      "checkpoint_every": 0, "log_every": args.inner_steps if ddp else 1,
      "sim.enabled": True, "sim.heterogeneity": "moderate", "sim.step_seconds": STEP_SECONDS,
      "sim.network.regions": 4, "sim.network.intra_gbps": 100.0,
      "sim.network.inter_gbps": 1.0, "sim.network.inter_latency_s": 0.05,
      "sim.network.bytes_scale": bytes_scale, "seed": args.seed})
  c.update_from_flattened_dict(fields)
  return c


def _curve(workdir: pathlib.Path) -> list[tuple[float, float]]:
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [(r["virtual_seconds"], r["eval_loss"]) for r in rows if "eval_loss" in r]


def _time_to(curve, target: float) -> float | None:
  return next((t for t, loss in curve if loss <= target), None)


def _loss_at(curve, budget: float) -> float | None:
  seen = [loss for t, loss in curve if t <= budget]
  return seen[-1] if seen else None


def report(args, grid: dict[str, dict]) -> str:
  curves = {n: _curve(args.workdir / n) for n in grid}
  summaries = {n: json.loads((args.workdir / n / "summary.json").read_text()) for n in grid}
  target = summaries["diloco"]["eval_loss"]
  budget = 2 * summaries["diloco@free"]["virtual_seconds"]
  dil = _time_to(curves["diloco"], target)
  fmt = lambda x, f="{:.1f}": "never" if x is None else f.format(x)
  lines = [f"L* = {target:.4f} (dense DiLoCo's final eval loss); fixed budget "
           f"{budget:.1f} virtual s (2 × DiLoCo's compute-only time). Floor: the method's "
           "run with free communication (`@free`): its time to L*, or where it never gets "
           "there its whole compute time.", "",
           "| case | final eval loss | virtual s | time to L* | floor | × floor | vs DiLoCo | "
           "eval loss at budget | MiB sent/worker |", "|---|---|---|---|---|---|---|---|---|"]
  for n in grid:
    if n.endswith("@free"):
      continue
    method = n.split("+")[0]
    t = _time_to(curves[n], target)
    free = f"{method}@free"
    floor = _time_to(curves[free], target) or summaries[free]["virtual_seconds"]
    s = summaries[n]
    lines.append(
        f"| {n} | {s['eval_loss']:.4f} | {s['virtual_seconds']:.1f} | {fmt(t)} | "
        f"{floor:.1f} | {fmt(t / floor if t else None, '{:.2f}')} | "
        f"{fmt(dil / t if t and dil else None, '{:.2f}×')} | "
        f"{fmt(_loss_at(curves[n], budget), '{:.4f}')} | {s['bytes_sent'] / 2**20:.1f} |")
  lines += ["", "Compute-only runs (free communication): " + ", ".join(
      f"{n.split('@')[0]} eval {summaries[n]['eval_loss']:.4f} in "
      f"{summaries[n]['virtual_seconds']:.1f} s, L* at {fmt(_time_to(curves[n], target))}"
      for n in grid if n.endswith("@free"))]
  return "\n".join(lines)


def plot(args, grid, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(9, 5.5))
  colours = {m: f"C{i}" for i, m in enumerate(METHODS)}  # one per method; codec dashed
  for n in grid:
    if n.endswith("@free"):
      continue
    t, loss = zip(*_curve(args.workdir / n))
    ax.plot(t, loss, "--" if "+" in n else "-", color=colours[n.split("+")[0]], label=n)
  ax.set_xscale("log")
  ax.set_xlabel("virtual seconds (gpt2_124m on A100s over 1 Gb/s between regions)")
  ax.set_ylabel("eval loss")
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rounds", type=int, default=15)
  p.add_argument("--inner_steps", type=int, default=10)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--jobs", type=int, default=2)
  p.add_argument("--workdir", type=pathlib.Path, default=REPO / "bench/results/wan")
  p.add_argument("--only", help=argparse.SUPPRESS)
  args = p.parse_args()
  grid = cases(args)
  bytes_scale, small = _scales(args)
  if args.only:
    sim_grid.run_case(config(args.only, grid[args.only], args, bytes_scale),
                      args.workdir / args.only)
    return
  print(f"bytes_scale {bytes_scale:.1f} (gpt2_124m {GPT2_PARAMS:,} / small {small:,} params), "
        f"step {STEP_SECONDS:.3f} virtual s", flush=True)
  failed = sim_grid.run_grid(__file__, list(grid), args.workdir, args.jobs,
                             [a for a in sys.argv[1:]])
  if failed:
    sys.exit(f"failed: {failed} (logs in {args.workdir / 'logs'})")
  table = report(args, grid)
  print(table)
  (args.workdir / "wan.md").write_text(table + "\n")
  plot(args, grid, args.workdir / "wan.png")


if __name__ == "__main__":
  main()
