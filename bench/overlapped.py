"""The overlapped DiLoCo variants against DiLoCo: loss at equal inner steps, and the virtual
time each takes over a slow and a fast network.

    python bench/overlapped.py                    # both networks, 4 workers, small model
    python bench/overlapped.py --workers 2 --rounds 6
    python bench/overlapped.py --only diloco one_step_delay eager --set outer.momentum=0.0 --tag mom0

Each case is one simulator run (`simulate.run`) per seed (`--seeds`, 3 by default) on the
`small` model with the same workers, rounds, H and data: DiLoCo, Streaming DiLoCo (P = 2,
τ = 1), one-step-delay, eager updates and Overlap Local-SGD (α = 0.2). Each case's loss is
compared with DiLoCo's paired by seed (95% t interval and verdict, bench/stats.py); with
--only, name diloco too for that column.
Networks: `slow`, every worker in its own region joined by 1 Gb/s, 50 ms links; `fast`,
one region at 100 Gb/s. The loss does not depend on the network (the simulator's math never
does): each case trains once per seed, and its virtual time on each network is a replay of
its schedule (sim/replay.py). Results go to bench/results/overlapped.json.
"""

import argparse
import json
import os
import pathlib
import runpy
import tempfile
import time

import stats

REPO = pathlib.Path(__file__).resolve().parents[1]
# Its BENCHMARKS rows ran on 8 virtual CPU devices (it took the test suite's settings then).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

CASES = {
    "diloco": {"algorithm": "diloco"},
    "streaming": {"algorithm": "streaming", "streaming.fragments": 2,
                  "streaming.overlap_steps": 1},
    "one_step_delay": {"algorithm": "one_step_delay"},
    "eager": {"algorithm": "eager"},
    "overlap": {"algorithm": "overlap", "overlap.alpha": 0.2},
}


def _config(**fields):
  config = runpy.run_path(str(REPO / "configs" / "base.py"))["get_config"]()
  config.update_from_flattened_dict(fields)
  return config


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
  parser.add_argument("--seeds", type=int, default=3)
  args = parser.parse_args()
  overrides = {}
  for item in args.set:
    field, _, value = item.partition("=")
    try:
      overrides[field] = float(value)
    except ValueError:
      overrides[field] = value
  from lowcomm_jax.runtimes.simulator import simulate
  w = args.workers
  common = {"runtime": "simulator", "num_workers": w, "rounds": args.rounds,
            "inner_steps": args.inner_steps, "model.name": "small", "eval_every": 0,
            "checkpoint_every": 0, "log_every": 5, "sim.step_seconds": args.step_seconds,
            **overrides}
  networks = {"slow": {"sim.network.regions": w, "sim.network.inter_gbps": 1.0,
                       "sim.network.inter_latency_s": 0.05},
              "fast": {"sim.network.regions": 1, "sim.network.intra_gbps": 100.0}}
  compute = args.rounds * args.inner_steps * args.step_seconds  # no communication at all
  print(f"compute-only floor: {compute:.2f} virtual s\n")
  names = [n for n in CASES if not args.only or n in args.only]
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for name in names:
      row = {"case": name, "eval_loss": [], "wall_seconds": 0.0}
      for seed in range(args.seeds):
        t0 = time.perf_counter()
        config = _config(**common, **CASES[name], **networks["slow"], seed=seed)
        s = simulate.run(config, pathlib.Path(tmp) / f"{name}_{seed}")
        row["eval_loss"].append(s["eval_loss"])
        row["total_inner_steps"] = s["total_inner_steps"]
        row["wall_seconds"] += time.perf_counter() - t0
      for net, net_fields in networks.items():  # the clock alone, by replay
        clock = simulate.clock(_config(**common, **CASES[name], **net_fields))
        row[f"virtual_seconds_{net}"] = clock[-1][0]
      rows.append(row)
  base = next((r for r in rows if r["case"] == "diloco"), None)
  print("| case | eval loss (mean ± sd) | vs DiLoCo (paired) | 95% interval | verdict (worse "
        "than DiLoCo?) | virtual s, 1 Gb/s 50 ms | virtual s, 100 Gb/s | wall s |")
  print("|---|---|---|---|---|---|---|---|")
  for row in rows:
    m, sd = stats.mean_sd(row["eval_loss"])
    cols = ["", "", ""]
    if base and row is not base and len(row["eval_loss"]) > 1:
      d = stats.paired(row["eval_loss"], base["eval_loss"], higher_is_better=True)
      row["vs_diloco"] = d
      cols = [f"{d['mean']:+.4f} ± {d['sd']:.4f}", f"{d['ci95'][0]:+.4f} to {d['ci95'][1]:+.4f}",
              {"holds": "worse", "reversed": "better"}.get(d["verdict"], d["verdict"])]
    print(f"| {row['case']} | {m:.4f} ± {sd:.4f} | " + " | ".join(cols)
          + f" | {row['virtual_seconds_slow']:.2f} | {row['virtual_seconds_fast']:.2f} | "
          f"{row['wall_seconds']:.0f} |", flush=True)
  out = REPO / "bench" / "results" / f"overlapped{'_' + args.tag if args.tag else ''}.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"args": vars(args), "compute_only_seconds": compute,
                             "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
  main()
