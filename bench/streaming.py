"""Streaming DiLoCo vs DiLoCo: loss and bytes at equal tokens, and simulated wall time.

    python bench/streaming.py --part train   # runner, CPU model: eval loss, total/peak bytes
    python bench/streaming.py --part sim     # simulator over 1 Gb/s links: virtual seconds

`train`: DiLoCo and Streaming DiLoCo (P = 2, 4; τ = 0, 1, 2; α = 0, 0.5) on the same tokens
(workers x rounds x H x batch x seq), each a real `train.run` on the `small` model.
`sim`: the same inner steps in the simulator, every worker in its own region joined by
1 Gb/s, 50 ms links; DiLoCo vs Streaming with τ = 0 and τ > 0 (how much of each fragment's
transfer the τ inner steps hide). Results go to bench/results/streaming_<part>.json.
"""

import argparse
import itertools
import json
import os
import pathlib
import runpy
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
# Its BENCHMARKS rows ran on 8 virtual CPU devices (it took the test suite's settings then).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def _config(**fields):
  config = runpy.run_path(str(REPO / "configs" / "base.py"))["get_config"]()
  config.update_from_flattened_dict(fields)
  return config


def train_part(args) -> list[dict]:
  from lowcomm_jax.runtimes.spmd import train
  common = {"num_workers": args.workers, "rounds": args.rounds, "inner_steps": args.inner_steps,
            "model.name": "small", "eval_every": 0, "checkpoint_every": 0, "log_every": 5}
  cases = [("diloco", {"algorithm": "diloco"})]
  for p, tau, alpha in itertools.product((2, 4), (0, 1, 2), (0.0, 0.5)):
    cases.append((f"streaming P={p} tau={tau} alpha={alpha}", {
        "algorithm": "streaming", "streaming.fragments": p, "streaming.overlap_steps": tau,
        "streaming.mix": alpha}))
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for name, fields in cases:
      t0 = time.perf_counter()
      s = train.run(_config(**common, **fields), pathlib.Path(tmp) / str(len(rows)))
      rows.append({"case": name, "eval_loss": s["eval_loss"], "tokens": s["tokens"],
                   "bytes_sent": s["bytes_sent"], "bytes_sent_peak_sync": s["bytes_sent_peak_sync"],
                   "seconds": time.perf_counter() - t0})
      r = rows[-1]
      print(f"| {name} | {r['eval_loss']:.4f} | {r['tokens']:,} | {r['bytes_sent'] / 2**20:.2f} | "
            f"{r['bytes_sent_peak_sync'] / 2**20:.3f} |", flush=True)
  return rows


def sim_part(args) -> list[dict]:
  from lowcomm_jax.runtimes.simulator import simulate
  w = args.workers
  common = {"runtime": "simulator", "num_workers": w, "rounds": args.rounds,
            "inner_steps": args.inner_steps, "model.name": "small", "eval_every": 0,
            "checkpoint_every": 0, "log_every": 5, "sim.step_seconds": args.step_seconds,
            "sim.network.regions": w, "sim.network.inter_gbps": 1.0,
            "sim.network.inter_latency_s": 0.05}
  half = args.inner_steps // 2
  cases = [("diloco", {"algorithm": "diloco"})]
  for tau in (0, 1, half // 2, half - 1):
    cases.append((f"streaming P=2 tau={tau}", {"algorithm": "streaming",
                                               "streaming.fragments": 2,
                                               "streaming.overlap_steps": tau}))
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for name, fields in cases:
      s = simulate.run(_config(**common, **fields), pathlib.Path(tmp) / str(len(rows)))
      rows.append({"case": name, "virtual_seconds": s["virtual_seconds"],
                   "total_inner_steps": s["total_inner_steps"], "eval_loss": s["eval_loss"],
                   "bytes_sent": s["bytes_sent"]})
      r = rows[-1]
      print(f"| {name} | {r['virtual_seconds']:.2f} | {r['total_inner_steps']:,} | "
            f"{r['eval_loss']:.4f} |", flush=True)
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", choices=("train", "sim"), required=True)
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--inner_steps", type=int, default=20)
  parser.add_argument("--step_seconds", type=float, default=0.1,
                      help="sim: virtual seconds per inner step")
  args = parser.parse_args()
  if args.part == "train":
    print("| case | eval loss | tokens | MiB sent / worker | peak sync MiB |\n|---|---|---|---|---|")
    rows = train_part(args)
  else:
    print("| case | virtual s | inner steps | eval loss |\n|---|---|---|---|")
    rows = sim_part(args)
  out = REPO / "bench" / "results" / f"streaming_{args.part}.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
  main()
