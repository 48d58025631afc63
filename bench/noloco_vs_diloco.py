"""NoLoCo against DiLoCo on the simulator's geo layout (configs/sim_geo.py: 4 regions x 4
workers, 0.1-1 Gb/s between regions): eval loss at the same inner steps, bytes per worker
and virtual time, each method at its best outer lr, over seeds.

    python bench/noloco_vs_diloco.py --out results.jsonl            # runs, one line each
    python bench/noloco_vs_diloco.py --out results.jsonl --report   # the table
    python bench/noloco_vs_diloco.py --clock     # virtual times only (sim/replay.py)
    python bench/noloco_vs_diloco.py --clock --diloco_collective ring   # DiLoCo on a flat ring

Each run is the real command line in its own process. The model is `tiny` on bytes, and
`sim.network.bytes_scale` makes its payload take a 124M-parameter model's time on the wire
(the ledger's bytes stay the tiny model's). Both methods send one model-sized message per
worker per round (DiLoCo's all-reduce, NoLoCo's swap with one peer); concurrent transfers
share the links (sim/flows.py). Virtual time depends only on the schedule, so `--clock`
replays both schedules without training, per seed (NoLoCo's pairings depend on it).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

from lowcomm_jax.report import read_summary

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY_PARAMS = 35_712  # the tiny preset's parameters: 124M / this is the wire scale
COMMON = ["--config.model.name=tiny", "--config.data.tokenizer=byte",
          "--config.data.seq_len=64", "--config.rounds=20", "--config.eval_every=10",
          "--config.checkpoint_every=20", "--config.outer.momentum=0.9",
          f"--config.sim.network.bytes_scale={124_000_000 / TINY_PARAMS:.1f}"]
METHODS = ("diloco", "noloco")
LRS = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
SEEDS = (0, 1, 2)


def run(method: str, lr: float, seed: int) -> dict:
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  with tempfile.TemporaryDirectory() as tmp:
    done = subprocess.run([sys.executable, "-m", "lowcomm_jax.main",
                           "--config=configs/sim_geo.py:diloco",
                           f"--config.algorithm={method}", f"--config.outer.lr={lr}",
                           f"--config.seed={seed}", *COMMON, f"--workdir={tmp}"],
                          cwd=ROOT, env=env, check=False, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if done.returncode:
      raise SystemExit(f"{method} lr={lr} seed={seed} failed:\n{done.stderr[-2000:]}")
    s = read_summary(tmp)
  return {"method": method, "lr": lr, "seed": seed, "eval_loss": s["eval_loss"],
          "virtual_seconds": s["virtual_seconds"], "bytes_sent": s["bytes_sent"],
          "num_workers": s["num_workers"]}


def report(rows: list[dict]) -> None:
  by = {}
  for r in rows:
    by.setdefault((r["method"], r["lr"]), {})[r["seed"]] = r
  seeds = sorted({r["seed"] for r in rows})
  print("| method | outer lr | eval loss (mean ± sd over seeds) | virtual s | MB sent per worker |")
  print("|---|---|---|---|---|")
  best = {}
  for (method, lr), runs in sorted(by.items()):
    loss = np.array([runs[s]["eval_loss"] for s in seeds if s in runs])
    t = np.mean([r["virtual_seconds"] for r in runs.values()])
    mb = np.mean([r["bytes_sent"] / r["num_workers"] / 1e6 for r in runs.values()])
    print(f"| {method} | {lr} | {loss.mean():.4f} ± {loss.std(ddof=1) if len(loss) > 1 else 0:.4f} "
          f"| {t:.1f} | {mb:.3f} |")
    if len(loss) == len(seeds) and (method not in best or loss.mean() < best[method][0]):
      best[method] = (loss.mean(), lr)
  if set(best) == set(METHODS):
    a, b = (by[(m, best[m][1])] for m in METHODS)
    diff = np.array([b[s]["eval_loss"] - a[s]["eval_loss"] for s in seeds])
    ratio = np.array([b[s]["virtual_seconds"] / a[s]["virtual_seconds"] for s in seeds])
    print(f"\nbest lr: diloco {best['diloco'][1]}, noloco {best['noloco'][1]}; paired over "
          f"seeds {seeds}: noloco − diloco eval loss {diff.mean():+.4f} ± {diff.std(ddof=1):.4f}, "
          f"virtual time ratio {ratio.mean():.3f} ± {ratio.std(ddof=1):.3f}")


def clock(diloco_collective: str = "auto") -> None:
  """NoLoCo's virtual time over DiLoCo's for the runs' 20 rounds, per seed; DiLoCo's
  all-reduce as `diloco_collective` ('auto': the faster of ring and hierarchical, as the runs
  had it; 'ring' separates what shared links alone did to the ratio)."""
  import runpy
  from lowcomm_jax.runtimes.simulator import simulate
  ratios = []
  for seed in SEEDS:
    seconds = {}
    for method in METHODS:
      c = runpy.run_path(str(ROOT / "configs" / "sim_geo.py"))["get_config"]("diloco")
      c.update_from_flattened_dict({
          "algorithm": method, "seed": seed, "model.name": "tiny", "data.tokenizer": "byte",
          "data.seq_len": 64, "rounds": 20,
          "sim.network.bytes_scale": float(f"{124_000_000 / TINY_PARAMS:.1f}")})
      if method == "diloco":
        c.collective_form = diloco_collective
      seconds[method] = simulate.clock(c)[-1][0]
    ratios.append(seconds["noloco"] / seconds["diloco"])
    print(f"seed {seed}: diloco {seconds['diloco']:.1f} s, noloco {seconds['noloco']:.1f} s, "
          f"ratio {ratios[-1]:.3f}", flush=True)
  print(f"noloco / diloco virtual time: {np.mean(ratios):.3f} ± {np.std(ratios, ddof=1):.3f}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out")
  parser.add_argument("--report", action="store_true", help="print the table of --out")
  parser.add_argument("--clock", action="store_true", help="virtual times only, no training")
  parser.add_argument("--diloco_collective", default="auto", choices=("auto", "ring", "hierarchical"),
                      help="--clock: DiLoCo's all-reduce")
  a = parser.parse_args()
  if a.clock:
    return clock(a.diloco_collective)
  if a.diloco_collective != "auto":
    parser.error("--diloco_collective is for --clock (the runs use the config's collective)")
  if not a.out:
    parser.error("--out is required (or --clock)")
  out = pathlib.Path(a.out)
  rows = [json.loads(l) for l in out.read_text().splitlines()] if out.exists() else []
  if not a.report:
    done = {(r["method"], r["lr"], r["seed"]) for r in rows}
    for seed in SEEDS:
      for method in METHODS:
        for lr in LRS:
          if (method, lr, seed) not in done:
            row = run(method, lr, seed)
            rows.append(row)
            with out.open("a") as f:
              f.write(json.dumps(row) + "\n")
            print(row, flush=True)
  report(rows)


if __name__ == "__main__":
  main()
