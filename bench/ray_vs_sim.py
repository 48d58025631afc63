"""Sim ↔ real (issue 29): the same asynchronous run in the simulator and on the Ray runtime.

  python bench/ray_vs_sim.py [--seeds 0,1,2] [--algorithm async_dn] [--model small]
      [--rounds 10] [--inner_steps 10] [--base_sleep_s 0.25] [--out ray_vs_sim.jsonl]

Four workers at 'moderate' heterogeneity. The simulator gives worker w the relative speed
s_w (sim/speeds.level_speeds, by seed); on Ray the same slowness is imposed by a sleep of
base_sleep_s / s_w per inner step (ray.step_sleep_s), large beside a step's compute so the
ratios hold. Per run: final eval loss, the staleness histogram, each worker's share of the
pushes, and pushes per fastest-worker step time (virtual seconds / sim.step_seconds in the
simulator, wall seconds / base_sleep_s on Ray; Ray's start-up excluded). A row per run is
appended to --out as soon as it ends; then paired differences (Ray − sim) over seeds.
"""

import argparse
import json
import os
import pathlib
import runpy
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(REPO.parent / "shared" / "data" / "tiktoken"))

import numpy as np  # noqa: E402


def config(args, seed: int, runtime: str):
  from lowcomm_jax.sim.speeds import level_speeds
  c = runpy.run_path(str(REPO / "configs" / "base.py"))["get_config"]()
  c.algorithm, c.seed, c.num_workers = args.algorithm, seed, 4
  c.rounds, c.inner_steps = args.rounds, args.inner_steps
  c.eval_every, c.checkpoint_every, c.log_every = args.rounds, args.rounds, 1
  c.model.name, c.data.tokenizer = args.model, "byte"
  c.data.seq_len, c.data.batch_size = 64, 8
  c.optimizer.warmup_steps = 20
  c.mesh.replica = 1
  speeds = level_speeds("moderate", 4, seed)
  if runtime == "sim":
    c.runtime, c.sim.speeds = "simulator", tuple(speeds)
  else:
    c.runtime = "ray"
    c.ray.step_sleep_s = tuple(args.base_sleep_s / s for s in speeds)
  return c, speeds


def run_one(args, seed: int, runtime: str) -> dict:
  c, speeds = config(args, seed, runtime)
  with tempfile.TemporaryDirectory() as workdir:
    if runtime == "sim":
      from lowcomm_jax.runtimes.simulator import simulate
      s = simulate.run(c, workdir)
      shares = [w["jobs"] for w in s["workers"]]
      pushes = s["contributions"]
      time_units = s["virtual_seconds"] / c.sim.step_seconds
    else:
      from lowcomm_jax.runtimes.ray import driver
      s = driver.run(c, workdir)
      shares = [s["pushes_per_worker"].get(str(w), 0) for w in range(4)]
      pushes = s["pushes"]
      # training time without the start-up (processes, first compiles)
      time_units = (s["wall_seconds"] - s["startup_seconds"]) / args.base_sleep_s
  total = max(sum(shares), 1)
  return {"runtime": runtime, "seed": seed, "speeds": speeds, "eval_loss": s["eval_loss"],
          "mean_staleness": s["mean_staleness"],
          "staleness_histogram": s["staleness_histogram"],
          "push_share": [x / total for x in shares], "pushes": pushes,
          "pushes_per_step_time": pushes / max(time_units, 1e-9)}


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--algorithm", default="async_dn")
  p.add_argument("--model", default="small")
  p.add_argument("--rounds", type=int, default=10)
  p.add_argument("--inner_steps", type=int, default=10)
  p.add_argument("--base_sleep_s", type=float, default=0.25)
  p.add_argument("--out", default="ray_vs_sim.jsonl")
  args = p.parse_args()
  rows = []
  for seed in (int(x) for x in args.seeds.split(",")):
    for runtime in ("sim", "ray"):
      row = run_one(args, seed, runtime)
      rows.append(row)
      with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")
      print(json.dumps(row), flush=True)
  by = {(r["runtime"], r["seed"]): r for r in rows}
  seeds = sorted({r["seed"] for r in rows})
  for key in ("eval_loss", "mean_staleness", "pushes_per_step_time"):
    sim = np.asarray([by["sim", s][key] for s in seeds])
    ray = np.asarray([by["ray", s][key] for s in seeds])
    d = ray - sim
    print(f"{key}: sim {sim.mean():.4f} ± {sim.std(ddof=1) if len(seeds) > 1 else 0:.4f}, "
          f"ray {ray.mean():.4f} ± {ray.std(ddof=1) if len(seeds) > 1 else 0:.4f}, "
          f"ray − sim {d.mean():+.4f} ± {d.std(ddof=1) if len(seeds) > 1 else 0:.4f}")


if __name__ == "__main__":
  main()
