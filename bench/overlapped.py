"""The overlapped DiLoCo variants against DiLoCo: loss at equal inner steps, and the virtual
time each takes over a slow and a fast network.

    python bench/overlapped.py                    # both networks, 4 workers, small model
    python bench/overlapped.py --workers 2 --rounds 6
    python bench/overlapped.py --only one_step_delay eager --set outer.momentum=0.0 --tag mom0

Each case is one simulator run (`simulate.run`) on the `small` model with the same workers,
rounds, H and data: DiLoCo, Streaming DiLoCo (P = 2, τ = 1), one-step-delay, eager updates
and Overlap Local-SGD (α = 0.2). Networks: `slow`, every worker in its own region joined
by 1 Gb/s, 50 ms links; `fast`, one region at 100 Gb/s. The loss does not depend on the
network (the simulator's math never does), so it is reported once per case. Results go to
bench/results/overlapped.json.
"""

import argparse
import json
import pathlib
import runpy
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

CASES = {
    "diloco": {"algorithm": "diloco"},
    "streaming": {"algorithm": "streaming", "streaming.fragments": 2,
                  "streaming.overlap_steps": 1},
    "one_step_delay": {"algorithm": "one_step_delay"},
    "eager": {"algorithm": "eager"},
    "overlap": {"algorithm": "overlap", "overlap.alpha": 0.2},
}


def _config(**fields):
  from conftest import set_fields
  return set_fields(runpy.run_path(str(REPO / "configs" / "base.py"))["get_config"](), fields)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workers", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--inner_steps", type=int, default=20)
  parser.add_argument("--step_seconds", type=float, default=0.1,
                      help="virtual seconds per inner step")
  parser.add_argument("--only", nargs="*", choices=tuple(CASES), help="run these cases only")
  parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                      help="config overrides for every case (numbers parsed as floats)")
  parser.add_argument("--tag", default="", help="suffix of the results file")
  args = parser.parse_args()
  overrides = {}
  for item in args.set:
    field, _, value = item.partition("=")
    try:
      overrides[field] = float(value)
    except ValueError:
      overrides[field] = value
  from lowcomm_jax import simulate
  w = args.workers
  common = {"sim.enabled": True, "num_workers": w, "rounds": args.rounds,
            "inner_steps": args.inner_steps, "model.name": "small", "eval_every": 0,
            "checkpoint_every": 0, "log_every": 5, "sim.step_seconds": args.step_seconds,
            **overrides}
  networks = {"slow": {"sim.network.regions": w, "sim.network.inter_gbps": 1.0,
                       "sim.network.inter_latency_s": 0.05},
              "fast": {"sim.network.regions": 1, "sim.network.intra_gbps": 100.0}}
  compute = args.rounds * args.inner_steps * args.step_seconds  # no communication at all
  print(f"compute-only floor: {compute:.2f} virtual s\n")
  print("| case | eval loss | virtual s, 1 Gb/s 50 ms | virtual s, 100 Gb/s | wall s |")
  print("|---|---|---|---|---|")
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for name, fields in CASES.items():
      if args.only and name not in args.only:
        continue
      row = {"case": name}
      t0 = time.perf_counter()
      for net, net_fields in networks.items():
        s = simulate.run(_config(**common, **fields, **net_fields),
                         pathlib.Path(tmp) / f"{len(rows)}_{net}")
        row[f"virtual_seconds_{net}"] = s["virtual_seconds"]
        # The network decides when, never what: the same loss on both.
        assert row.setdefault("eval_loss", s["eval_loss"]) == s["eval_loss"], (name, s)
        row["total_inner_steps"] = s["total_inner_steps"]
      row["wall_seconds"] = time.perf_counter() - t0
      rows.append(row)
      print(f"| {name} | {row['eval_loss']:.4f} | {row['virtual_seconds_slow']:.2f} | "
            f"{row['virtual_seconds_fast']:.2f} | {row['wall_seconds']:.0f} |", flush=True)
  out = REPO / "bench" / "results" / f"overlapped{'_' + args.tag if args.tag else ''}.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"args": vars(args), "compute_only_seconds": compute,
                             "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
  main()
