"""The simulator's clock held against real processes over real slow links (issue 54).

For each case (an argument of configs/real_links.py) and seed:
1. the real run: the config on runtime='ray', over namespaces and `tbf` links built from
   its `sim.network` (bench/real_links.py): the server (with Ray's head and the driver) on
   node 0, worker w on node w+1, each pinned there by a custom resource;
2. the replay: the same config in the simulator's clock (no training), each worker's speed
   its measured compute seconds per inner step (the median of its jobs after the first,
   whose time holds its compilation), on the same links;
3. real over predicted wall time, per round and for the run after its first round (which
   holds the compilations the simulator does not model).

The replay is made twice where it differs: with the collective the config names ('auto':
the simulator's model of a synchronous round before issue 54, an all-reduce among the
workers) and with 'server' (the Ray runtime's rounds: pulls from the parameter server,
then contributions to it).

  python bench/real_vs_sim.py --cases diloco,10,20 diloco,50,100 --seeds 0 1 2 \
      --out /tmp/real_vs_sim            # needs root; each run's folder and result.json
  python bench/real_vs_sim.py --report /tmp/real_vs_sim   # the table, from the results
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import real_links

ROOT = pathlib.Path(__file__).resolve().parents[1]


def links_for(config) -> real_links.Links:
  """The links `config.sim.network` describes, node 0 the server's and node w+1 worker
  w's: every NIC at intra_gbps; with several regions (or the server in one of its own),
  each region behind an uplink of region_gbps (0: inter_gbps). Refused in one line where the
  links cannot be what the simulator models: a delay (no netem here), per-pair rates (they
  need HTB), or an uplink faster than the link between regions."""
  n, workers = config.sim.network, config.num_workers
  if n.intra_latency_s or n.inter_latency_s or n.inter_latency_matrix:
    raise ValueError("sim.network latencies must be 0 for real links: this kernel has no netem "
                     "to delay packets; set intra_latency_s and inter_latency_s to 0")
  if n.inter_gbps_matrix:
    raise ValueError("sim.network.inter_gbps_matrix: per-pair rates need HTB classes, not "
                     "built; use the scalar inter_gbps")
  if n.region_gbps and n.region_gbps > n.inter_gbps:
    raise ValueError(f"sim.network.region_gbps={n.region_gbps} > inter_gbps={n.inter_gbps}: "
                     "the link between two regions would bind, which one uplink cannot "
                     "model; use region_gbps <= inter_gbps")
  placed = (list(n.worker_regions) if n.worker_regions
            else [w * n.regions // workers for w in range(workers)])
  server = n.server_region if n.server_region >= 0 else n.regions
  regions = n.regions + (n.server_region < 0)
  nic = n.intra_gbps * 1000
  if regions == 1:
    return real_links.Links(workers + 1, nic)
  uplink = (n.region_gbps or n.inter_gbps) * 1000
  return real_links.Links(workers + 1, nic, regions=[server] + placed,
                          region_mbps=[uplink] * regions)


def real_run(links: real_links.Links, env: dict, case: str, seed: int, workdir: pathlib.Path,
             workers: int) -> dict:
  """The case's real run on Ray over `links` (a fresh workdir); its summary."""
  nodes = "(" + ",".join(f"'node{w + 1}'" for w in range(workers)) + ",)"
  command = [sys.executable, "-m", "lowcomm_jax.main", f"--config=configs/real_links.py:{case}",
             "--config.runtime=ray", "--config.ray.address=auto", f"--config.seed={seed}",
             f"--config.ray.worker_nodes={nodes}", "--config.ray.server_node=node0",
             f"--workdir={workdir}"]
  with open(workdir.with_suffix(".log"), "w") as log:
    done = links.run(0, command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if done.wait(timeout=1800):
      raise RuntimeError(f"{case} seed {seed}: the real run failed (rc {done.returncode}); "
                         f"see {workdir.with_suffix('.log')}")
  return json.loads((workdir / "summary.json").read_text())


def measured_speeds(step_seconds_by_job: dict, workers: int) -> list[float]:
  """Each worker's seconds per inner step: the median of its jobs after the first (whose
  time holds the compilation), or its only job's."""
  out = []
  for w in range(workers):
    jobs = step_seconds_by_job[str(w)]
    out.append(statistics.median(jobs[1:] if len(jobs) > 1 else jobs))
  return out


def replay(workdir: pathlib.Path, step_seconds: list[float], collective: str | None):
  """[(virtual seconds, inner steps applied)] of the run in `workdir` replayed in the
  simulator's clock with these per-worker step times (`collective`: None keeps the
  config's)."""
  from lowcomm_jax import export
  from lowcomm_jax.runtimes.simulator import simulate
  c = export.config_of(workdir)
  fastest = min(step_seconds)
  with c.unlocked():
    c.runtime = "spmd"
    c.sim.enabled = True
    c.sim.step_seconds = fastest
    c.sim.speeds = tuple(fastest / s for s in step_seconds)
    if collective is not None:
      c.sim.network.collective = collective
  return simulate.clock(c)


def at_marks(points, per_mark: int, marks: int) -> list[float]:
  """The first time the applied steps reach each multiple of `per_mark` (1..marks)."""
  out = []
  for k in range(1, marks + 1):
    out.append(next(t for t, steps in points if steps >= k * per_mark))
  return out


def compare(real: list[float], predicted: list[float]) -> dict:
  """Real over predicted: each round after the first, and the run after its first round."""
  real_rounds = [b - a for a, b in zip(real, real[1:])]
  predicted_rounds = [b - a for a, b in zip(predicted, predicted[1:])]
  return {"round_ratio": [r / p for r, p in zip(real_rounds, predicted_rounds)],
          "run_ratio": (real[-1] - real[0]) / (predicted[-1] - predicted[0]),
          "real_after_first_s": real[-1] - real[0],
          "predicted_after_first_s": predicted[-1] - predicted[0],
          "real_first_s": real[0], "predicted_first_s": predicted[0]}


def run_case(case: str, seeds: list[int], out: pathlib.Path) -> None:
  from lowcomm_jax.config.command_line import load_config
  config = load_config(str(ROOT / f"configs/real_links.py:{case}"))
  links = links_for(config)
  per_mark, marks = config.num_workers * config.inner_steps, config.rounds
  folder = out / case.replace(",", "_")
  folder.mkdir(parents=True, exist_ok=True)
  with links:
    env = dict(real_links.ray_env(), RAY_ADDRESS=links.start_ray())
    for seed in seeds:
      workdir = folder / f"seed{seed}"
      if (workdir / "result.json").exists():
        continue
      started = time.time()
      summary = real_run(links, env, case, seed, workdir, config.num_workers)
      steps = measured_speeds(summary["step_seconds_by_job"], config.num_workers)
      real = at_marks(summary["timeline"], per_mark, marks)
      result = {"case": case, "seed": seed, "step_seconds": steps, "real_marks_s": real,
                "eval_loss": summary["eval_loss"], "run_seconds": time.time() - started}
      for name, collective in (("configured", None), ("server", "server")):
        if name == "server" and config.algorithm not in ("diloco", "ddp"):
          continue  # asynchronous schedules already time a server's pulls and pushes
        predicted = at_marks(replay(workdir, steps, collective), per_mark, marks)
        result[name] = {"predicted_marks_s": predicted, **compare(real, predicted)}
      (workdir / "result.json").write_text(json.dumps(result, indent=1))
      print(json.dumps({k: result[k] for k in ("case", "seed", "step_seconds")}),
            {k: round(result[k]["run_ratio"], 3) for k in ("configured", "server")
             if k in result}, flush=True)


def report(out: pathlib.Path) -> str:
  """A markdown table: per case, real over predicted for the run after its first round
  (mean ± sd over seeds, each seed's), and the range of the per-round ratios."""
  rows = ["| case | seeds | real s (after round 1) | model | real / predicted, run | "
          "per round (min–max) |", "|---|---|---|---|---|---|"]
  for folder in sorted(p for p in out.iterdir() if p.is_dir()):
    results = [json.loads(p.read_text()) for p in sorted(folder.glob("seed*/result.json"))]
    if not results:
      continue
    for model in ("configured", "server"):
      if model not in results[0]:
        continue
      runs = [r[model]["run_ratio"] for r in results]
      rounds = [x for r in results for x in r[model]["round_ratio"]]
      sd = statistics.stdev(runs) if len(runs) > 1 else 0.0
      real_s = statistics.mean(r[model]["real_after_first_s"] for r in results)
      rows.append(f"| {results[0]['case']} | {len(runs)} | {real_s:.1f} | {model} | "
                  f"{statistics.mean(runs):.3f} ± {sd:.3f} ({', '.join(f'{x:.3f}' for x in runs)})"
                  f" | {min(rounds):.3f}–{max(rounds):.3f} |")
  return "\n".join(rows)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--cases", nargs="+", default=[], help="configs/real_links.py arguments")
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/real_vs_sim"))
  p.add_argument("--report", type=pathlib.Path, help="print the table of a finished --out")
  a = p.parse_args()
  if a.report:
    print(report(a.report))
    return
  try:
    real_links.preflight()
  except real_links.LinksError as e:
    sys.exit(f"error: {e}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  for case in a.cases:
    run_case(case, a.seeds, a.out.resolve())
  print(report(a.out.resolve()))


if __name__ == "__main__":
  main()
