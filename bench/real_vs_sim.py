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

Issue 61's scaling table: one case at W workers in each form of the Ray runtime's rounds
(`server`: through the parameter server; `direct`: among the workers in one exchange;
`hierarchical`: among the workers, by region; collective_form), each run replayed
with the simulator's model of that form:

  python bench/real_vs_sim.py --scaling diloco,10,20 --workers 2 4 8 --seeds 0 1 2 \
      --out /tmp/real_vs_sim
  python bench/real_vs_sim.py --scaling diloco,10,20,colocated --workers 4 \
      --forms direct hierarchical --out /tmp/real_vs_sim   # two regions behind 5 Mb/s uplinks
  python bench/real_vs_sim.py --time_to_loss --form direct --out /tmp/real_vs_sim
                                     # DiLoCo H 50 against DDP, rounds among the workers
"""

import argparse
import bisect
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time

import real_links

ROOT = pathlib.Path(__file__).resolve().parents[1]


def links_for(config, modem: bool = False, idle_restart: bool = True) -> real_links.Links:
  """The links `config.sim.network` describes, node 0 the server's and node w+1 worker
  w's: every NIC at intra_gbps; with several regions (or the server in one of its own),
  each region behind an uplink of region_gbps (0: inter_gbps). Refused in one line where the
  links cannot be what the simulator models: a delay (no netem here), per-pair rates (they
  need HTB), or an uplink faster than the link between regions. `modem`: each node's link
  shaped in a box beside it, ACKs first (real_links.Links). `idle_restart` False: TCP keeps
  its window across idle spells on every node (a diagnosis)."""
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
    return real_links.Links(workers + 1, nic, modem=modem, acks_first=modem,
                            idle_restart=idle_restart)
  uplink = (n.region_gbps or n.inter_gbps) * 1000
  return real_links.Links(workers + 1, nic, regions=[server] + placed,
                          region_mbps=[uplink] * regions)


def real_run(links: real_links.Links, env: dict, case: str, seed: int, workdir: pathlib.Path,
             workers: int, overrides: tuple = ()) -> dict:
  """The case's real run on Ray over `links` (a fresh workdir); its summary. `overrides`:
  more '--config.FIELD=VALUE' flags."""
  nodes = "(" + ",".join(f"'node{w + 1}'" for w in range(workers)) + ",)"
  command = [sys.executable, "-m", "lowcomm_jax.main", f"--config=configs/real_links.py:{case}",
             "--config.runtime=ray", "--config.ray.address=auto", f"--config.seed={seed}",
             f"--config.ray.worker_nodes={nodes}", "--config.ray.server_node=node0",
             f"--workdir={workdir}", *overrides]
  with open(workdir.with_suffix(".log"), "w") as log:
    done = links.run(0, command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if done.wait(timeout=1800):
      raise RuntimeError(f"{case} seed {seed}: the real run failed (rc {done.returncode}); "
                         f"see {workdir.with_suffix('.log')}")
  from lowcomm_jax import report
  return report.read_summary(workdir)


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
    c.runtime = "simulator"
    c.sim.step_seconds = fastest
    c.sim.speeds = tuple(fastest / s for s in step_seconds)
    if collective is not None:
      c.collective_form = collective
  return simulate.clock(c)


def time_at(points, applied: int) -> float:
  """The first time in `points` ([seconds, inner steps applied]) the steps reach `applied`."""
  return next(t for t, steps in points if steps >= applied)


def at_marks(points, per_mark: int, marks: int) -> list[float]:
  """The first time the applied steps reach each multiple of `per_mark` (1..marks)."""
  return [time_at(points, k * per_mark) for k in range(1, marks + 1)]


def _sd(xs: list[float]) -> float:
  return statistics.stdev(xs) if len(xs) > 1 else 0.0


def compare(real: list[float], predicted: list[float]) -> dict:
  """Real over predicted: each round after the first, and the run after its first round."""
  real_rounds = [b - a for a, b in zip(real, real[1:])]
  predicted_rounds = [b - a for a, b in zip(predicted, predicted[1:])]
  return {"round_ratio": [r / p for r, p in zip(real_rounds, predicted_rounds)],
          "run_ratio": (real[-1] - real[0]) / (predicted[-1] - predicted[0]),
          "real_after_first_s": real[-1] - real[0],
          "predicted_after_first_s": predicted[-1] - predicted[0],
          "real_first_s": real[0], "predicted_first_s": predicted[0]}


# Issue 61: each form of the Ray runtime's rounds, and the simulator's model of it.
# form (collective_form on Ray) -> the simulator's model a run is replayed with: Ray's
# 'direct' is one direct exchange, every pair at once (issue 61 called it 'ring', replayed
# with 'auto', a ring, until hierarchical rounds existed on Ray: on one region the same
# bytes per NIC; issue 70 gave it its own name)
FORMS = {"server": "server", "direct": "direct", "ring": "ring",
         "hierarchical": "hierarchical"}


def run_scaling(case: str, workers: list[int], seeds: list[int], out: pathlib.Path,
                forms=("server", "direct"), modem: bool = False,
                idle_restart: bool = True, settings: tuple = ()) -> None:
  """`case` at each worker count in each of `forms` (FORMS): the real runs over links built
  for W workers, each replayed with its form's model; result.json per run, written as it
  goes (a finished one is skipped). `settings`: more 'FIELD=VALUE' for every run (give
  each set of settings its own `out`: the folders are named by case alone)."""
  from lowcomm_jax.config.command_line import load_config
  for w in workers:
    for form in forms:
      model = FORMS[form]
      overrides = (f"--config.num_workers={w}", f"--config.collective_form={form}",
                   *(f"--config.{kv}" for kv in settings))
      config = load_config(str(ROOT / f"configs/real_links.py:{case}"))
      config.num_workers, config.collective_form = w, form
      folder = out / "scaling" / _folder(case, w, form)
      folder.mkdir(parents=True, exist_ok=True)
      with links_for(config, modem, idle_restart) as links:
        env = dict(real_links.ray_env(), RAY_ADDRESS=links.start_ray())
        for seed in seeds:
          workdir = folder / f"seed{seed}"
          if (workdir / "result.json").exists():
            continue
          started, before, lost_before = time.time(), links.link_bytes(), links.losses()
          with sampled(links, flat=config.sim.network.regions == 1) as samples:
            summary = real_run(links, env, case, seed, workdir, w, overrides)
          # each node's link, as the kernel counted it (node 0: the driver's, and the
          # server's in the server form; node w+1: worker w's)
          link_bytes = [[a - c, b - d] for (a, b), (c, d) in zip(links.link_bytes(), before)]
          losses = [{"dropped": [a - b for a, b in zip(x["dropped"], y["dropped"])],
                     **{k: x[k] - y[k] for k in ("retrans_segs", "timeouts")}}
                    for x, y in zip(links.losses(), lost_before)]
          steps = measured_speeds(summary["step_seconds_by_job"], w)
          per_mark = w * config.inner_steps
          real = at_marks(summary["timeline"], per_mark, config.rounds)
          predicted = at_marks(replay(workdir, steps, model), per_mark, config.rounds)
          result = {"case": case, "workers": w, "form": form, "model": model, "seed": seed,
                    "settings": list(settings),
                    "step_seconds": steps, "real_marks_s": real,
                    "predicted_marks_s": predicted, **compare(real, predicted),
                    "eval_loss": summary["eval_loss"],
                    "wire_bytes_per_worker": summary.get("wire_bytes_per_worker", {}),
                    "link_bytes_per_node": link_bytes, "losses_per_node": losses,
                    "link_samples": samples,
                    "run_seconds": time.time() - started}
          if summary.get("job_moments"):
            result["phases"] = phases(summary["job_moments"])
          (workdir / "result.json").write_text(json.dumps(result, indent=1))
          print(json.dumps({k: result[k] for k in ("case", "workers", "form", "seed")}),
                round(result["run_ratio"], 3), flush=True)


@contextlib.contextmanager
def sampled(links: real_links.Links, flat: bool, period_s: float = 0.1):
  """[(time, each node's (sent, received) so far)] every `period_s` while the block runs
  (`Links.veth_bytes`; none where the links are not of one region)."""
  samples, stop = [], threading.Event()

  def loop():
    while not stop.is_set():
      samples.append((time.time(), links.veth_bytes()))
      stop.wait(period_s)

  thread = threading.Thread(target=loop, daemon=True)
  if flat:
    thread.start()
  try:
    yield samples
  finally:
    stop.set()
    if flat:
      thread.join()


def collective_bytes_report(out: pathlib.Path) -> str:
  """Issue 71: each worker's link in its rounds' collectives, as the kernel counted it (the
  veth counters sampled at 0.1 s, from the last sample before a collective began to the
  first after it committed, rounds after the first), against the ledger's count
  (`wire_bytes_per_worker` a round) and 2·(W−1)/W·P (P: a member's payload, from the
  ledger), and the collective's seconds (the driver's first message to the last commit)."""
  from lowcomm_jax import report
  results = [json.loads(p.read_text()) for p in sorted(out.glob("scaling/*/seed*/result.json"))]
  rows = ["| case | W | seeds | collective s | kernel MB a worker's link a round (out, in) | "
          "ledger's | 2·(W−1)/W·P | kernel / ledger (out, in) |", "|---|---|---|---|---|---|---|---|"]
  keys = sorted({(r["case"], r["workers"], r["form"]) for r in results
                 if r["form"] != "server" and r.get("link_samples")})
  for case, w, form in keys:
    runs = [r for r in results if (r["case"], r["workers"], r["form"]) == (case, w, form)]
    seconds, kernel, ledger, ideal = [], [], [], []
    for r in runs:
      summary = report.read_summary(out / "scaling" / _folder(case, w, form) / f"seed{r['seed']}")
      # (the moments count from the timeline's start, the samples from the epoch)
      times = [t - summary["timeline_started_at"] for t, _ in r["link_samples"]]
      rounds = [c for c in summary["collective_moments"] if c[0] >= 1]
      for c in rounds:
        a = max(bisect.bisect_right(times, c[2]) - 1, 0)
        b = min(bisect.bisect_left(times, c[6]), len(times) - 1)
        before, after = r["link_samples"][a][1], r["link_samples"][b][1]
        for node in range(1, w + 1):
          kernel.append([after[node][k] - before[node][k] for k in (0, 1)])
        seconds.append(c[6] - c[2])
      count = len(summary["collective_moments"])
      ledger += [[x / count for x in v] for v in summary["wire_bytes_per_worker"].values()]
      ideal.append(2 * (w - 1) / w * summary["bytes_sent"] * w / summary["pushes"])
    mean = lambda xs, k: statistics.mean(x[k] for x in xs) / 1e6
    rows.append(f"| {case} | {w} | {len(runs)} | {statistics.mean(seconds):.2f} ± "
                f"{_sd(seconds):.2f} | {mean(kernel, 0):.3f}, {mean(kernel, 1):.3f} | "
                f"{mean(ledger, 0):.3f}, {mean(ledger, 1):.3f} | "
                f"{statistics.mean(ideal) / 1e6:.3f} | {mean(kernel, 0) / mean(ledger, 0):.3f}, "
                f"{mean(kernel, 1) / mean(ledger, 1):.3f} |")
  return "\n".join(rows)


def scaling_report(out: pathlib.Path) -> str:
  """Seconds per round after round 1, and round 1, per worker count and form (mean ± sd
  over seeds), and real over predicted by the form's model."""
  results = [json.loads(p.read_text()) for p in sorted(out.glob("scaling/*/seed*/result.json"))]
  if not results:
    return ""
  rows = ["| case | W | form | seeds | s / round after round 1 | round 1 s | "
          "real / predicted, after round 1 (each seed) | per round (min–max) | "
          "MB / round through node 0's link (out + in) | through the busiest worker's | "
          "communication s / round, real | predicted |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  keys = sorted({(r["case"], r["workers"], r["form"]) for r in results})
  for case, w, form in keys:
    runs = [r for r in results if (r["case"], r["workers"], r["form"]) == (case, w, form)]
    per_round = [r["real_after_first_s"] / (len(r["real_marks_s"]) - 1) for r in runs]
    first = [r["real_first_s"] for r in runs]
    ratios = [r["run_ratio"] for r in runs]
    rounds = [x for r in runs for x in r["round_ratio"]]
    marks = len(runs[0]["real_marks_s"])
    # communication a round: the round's time less its slowest worker's compute, after
    # round 1 (real: from each job's moments; predicted: the replay's round less H steps)
    comm_real = [statistics.mean(_communication(out / "scaling" / _folder(case, w, form) /
                                                f"seed{r['seed']}", w)) for r in runs]
    comm_predicted = [statistics.mean(
        b - a - max(r["step_seconds"]) * _inner_steps(case)
        for a, b in zip(r["predicted_marks_s"], r["predicted_marks_s"][1:])) for r in runs]
    node0 = [sum(r["link_bytes_per_node"][0]) / marks / 1e6 for r in runs]
    busiest = [max(sum(x) for x in r["link_bytes_per_node"][1:]) / marks / 1e6 for r in runs]
    rows.append(f"| {case} | {w} | {form} | {len(runs)} | {statistics.mean(per_round):.2f} ± "
                f"{_sd(per_round):.2f} | {statistics.mean(first):.1f} ± {_sd(first):.1f} | "
                f"{statistics.mean(ratios):.3f} ± {_sd(ratios):.3f} "
                f"({', '.join(f'{x:.3f}' for x in ratios)}) | "
                f"{min(rounds):.3f}–{max(rounds):.3f} | {statistics.mean(node0):.2f} | "
                f"{statistics.mean(busiest):.2f} | {statistics.mean(comm_real):.2f} ± "
                f"{_sd(comm_real):.2f} | {statistics.mean(comm_predicted):.2f} |")
  return "\n".join(rows)


def split_report(out: pathlib.Path) -> str:
  """Issue 70: each round after round 1 split into compute (the median job's, of the
  round's jobs) and communication (its collective: the driver's first message to the
  last commit, `collective_moments`), against the ring's bytes time 2·(W−1)/W·P/B (P: a
  member's payload, from the ledger; B: the case's link), per W and form, over seeds."""
  from lowcomm_jax import report
  results = [json.loads(p.read_text()) for p in sorted(out.glob("scaling/*/seed*/result.json"))]
  rows = ["| case | W | seeds | round s | median job's compute s | collective s | ring's bytes s "
          "| collective / ring (each seed) | round − collective − compute s |",
          "|---|---|---|---|---|---|---|---|---|"]
  keys = sorted({(r["case"], r["workers"], r["form"]) for r in results if r["form"] != "server"})
  for case, w, form in keys:
    runs = [r for r in results if (r["case"], r["workers"], r["form"]) == (case, w, form)]
    mbps = float(case.split(",")[2])
    per = []
    for r in runs:
      summary = report.read_summary(out / "scaling" / _folder(case, w, form) / f"seed{r['seed']}")
      rounds = len(r["real_marks_s"]) - 1
      round_s = r["real_after_first_s"] / rounds
      collective = statistics.mean(c[6] - c[2] for c in summary["collective_moments"]
                                   if c[0] >= 1)
      jobs = sorted(summary["job_moments"], key=lambda m: m[5])[w:]  # (after round 1)
      compute = statistics.mean(statistics.median(m[4] - m[3] for m in jobs[k:k + w])
                                for k in range(0, len(jobs), w))
      # a member's Δ, from the ledger: bytes_sent is a worker's over the run (the lockstep
      # ledger's), `pushes` every worker's contributions
      payload = summary["bytes_sent"] * w / summary["pushes"]
      ring = 2 * (w - 1) / w * payload * 8 / (mbps * 1e6)
      per.append((round_s, compute, collective, ring))
    mean = lambda k: statistics.mean(x[k] for x in per)
    ratios = [x[2] / x[3] for x in per]
    rows.append(f"| {case} | {w} | {len(per)} | {mean(0):.2f} | {mean(1):.2f} | {mean(2):.2f} ± "
                f"{_sd([x[2] for x in per]):.2f} | {mean(3):.2f} | "
                f"{statistics.mean(ratios):.3f} ({', '.join(f'{x:.3f}' for x in ratios)}) | "
                f"{mean(0) - mean(2) - mean(1):.2f} |")
  return "\n".join(rows)


def _folder(case: str, workers: int, form: str) -> str:
  return f"{case.replace(',', '_')}_w{workers}_{form}"


def _inner_steps(case: str) -> int:
  return int(case.split(",")[1])


def _communication(workdir: pathlib.Path, workers: int) -> list[float]:
  """Per round after the first: its time (timeline) less its slowest job's compute (job
  moments: started → finished), the jobs of round k the k-th W taken."""
  from lowcomm_jax import report
  summary = report.read_summary(workdir)
  points = [t for t, _ in summary["timeline"]]
  jobs = sorted(summary["job_moments"], key=lambda m: m[5])
  out = []
  for k in range(2, len(points)):
    mine = jobs[(k - 1) * workers:k * workers]
    out.append(points[k] - points[k - 1] - max(m[4] - m[3] for m in mine))
  return out


def run_case(case: str, seeds: list[int], out: pathlib.Path) -> None:
  from lowcomm_jax.config.command_line import load_config
  config = load_config(str(ROOT / f"configs/real_links.py:{case}"))
  links = links_for(config)
  folder = out / case.replace(",", "_")
  folder.mkdir(parents=True, exist_ok=True)
  with links:
    env = dict(real_links.ray_env(), RAY_ADDRESS=links.start_ray())
    for seed in seeds:
      workdir = folder / f"seed{seed}"
      if (workdir / "result.json").exists():
        continue
      started = time.time()
      real_run(links, env, case, seed, workdir, config.num_workers)
      result = predictions(workdir, case, seed)
      result["run_seconds"] = time.time() - started
      (workdir / "result.json").write_text(json.dumps(result, indent=1))
      print(json.dumps({k: result[k] for k in ("case", "seed", "step_seconds")}),
            {k: round(result[k]["run_ratio"], 3) for k in MODELS}, flush=True)


# The simulator's models of the real run: the config's own collective ('auto': an all-reduce
# among the workers for a synchronous round, each contribution sent once computed), and the
# Ray runtime's ('server': rounds through the parameter server, one contribution taken at a
# time).
MODELS = {"configured": None, "server": "server"}


def predictions(workdir: pathlib.Path, case: str, seed: int) -> dict:
  """The real run in `workdir` against each model's replay of it."""
  from lowcomm_jax import export, report
  config = export.config_of(workdir)
  summary = report.read_summary(workdir)
  per_mark, marks = config.num_workers * config.inner_steps, config.rounds
  steps = measured_speeds(summary["step_seconds_by_job"], config.num_workers)
  real = at_marks(summary["timeline"], per_mark, marks)
  result = {"case": case, "seed": seed, "step_seconds": steps, "real_marks_s": real,
            "eval_loss": summary["eval_loss"]}
  for name, collective in MODELS.items():
    predicted = at_marks(replay(workdir, steps, collective), per_mark, marks)
    result[name] = {"predicted_marks_s": predicted, **compare(real, predicted)}
  if summary.get("job_moments"):
    result["phases"] = phases(summary["job_moments"])
  return result


def phases(moments: list) -> dict:
  """Where the real jobs' time went, each phase's median and maximum over the jobs after
  each worker's first: its pull (dispatched → started: θ over the link), its compute
  (started → finished) and its intake (finished → taken: waiting for the driver, the
  contribution over the link, the server's apply)."""
  seen, later = set(), []
  for m in moments:
    if m[0] in seen:
      later.append(m)
    seen.add(m[0])
  out = {}
  for name, (a, b) in {"pull": (2, 3), "compute": (3, 4), "intake": (4, 5)}.items():
    spans = [m[b] - m[a] for m in later]
    if spans:
      out[name] = {"median_s": round(statistics.median(spans), 3), "max_s": round(max(spans), 3)}
  return out


def replay_all(out: pathlib.Path) -> None:
  """Every finished real run under `out` replayed again (the simulator changed; the real
  runs did not): result.json rewritten, its run_seconds kept."""
  for done in sorted(out.glob("*/seed*/result.json")):
    if done.parts[-3].startswith("time_to_loss"):
      continue
    old = json.loads(done.read_text())
    result = predictions(done.parent, old["case"], old["seed"])
    result["run_seconds"] = old.get("run_seconds")
    done.write_text(json.dumps(result, indent=1))
    print(old["case"], old["seed"], {k: round(result[k]["run_ratio"], 3) for k in MODELS},
          flush=True)


def replay_scaling(out: pathlib.Path) -> None:
  """Every finished --scaling run under `out` replayed again with its form's model (FORMS:
  the simulator changed, the real runs did not); the earlier prediction is kept in the
  result as `before` (its model and run ratio)."""
  from lowcomm_jax import export
  for done in sorted(out.glob("scaling/*/seed*/result.json")):
    old = json.loads(done.read_text())
    model = FORMS[old["form"]]
    config = export.config_of(done.parent)
    per_mark = old["workers"] * config.inner_steps
    predicted = at_marks(replay(done.parent, old["step_seconds"], model), per_mark,
                         config.rounds)
    result = {**old, "model": model, "predicted_marks_s": predicted,
              **compare(old["real_marks_s"], predicted),
              "before": old.get("before", {"model": old["model"],
                                           "run_ratio": old["run_ratio"]})}
    done.write_text(json.dumps(result, indent=1))
    print(old["case"], old["workers"], old["form"], old["seed"], model,
          round(result["run_ratio"], 3), "before:", result["before"], flush=True)


# Time to loss: DiLoCo (H 50) against DDP, every step through the server, at one rate;
# evaluations along the way (each on the server, in the real wall time).
TIME_TO_LOSS = {"diloco,50,100": ("--config.rounds=4", "--config.eval_every=1"),
                "ddp,1,100": ("--config.rounds=200", "--config.eval_every=10")}


def run_time_to_loss(seeds: list[int], out: pathlib.Path, form: str = "server") -> None:
  """Each TIME_TO_LOSS case's real runs in `form` (a FORMS key: the Ray runtime's rounds
  through the server, or among the workers), their evaluations and timelines, and the
  replay's clock (the form's model) at the same steps."""
  from lowcomm_jax import report
  from lowcomm_jax.config.command_line import load_config
  for case, overrides in TIME_TO_LOSS.items():
    config = load_config(str(ROOT / f"configs/real_links.py:{case}"))
    folder = out / _time_to_loss_folder(form) / case.replace(",", "_")
    folder.mkdir(parents=True, exist_ok=True)
    with links_for(config) as links:
      env = dict(real_links.ray_env(), RAY_ADDRESS=links.start_ray())
      for seed in seeds:
        workdir = folder / f"seed{seed}"
        if (workdir / "result.json").exists():
          continue
        summary = real_run(links, env, case, seed, workdir, config.num_workers,
                           overrides + (f"--config.collective_form={form}",))
        steps = measured_speeds(summary["step_seconds_by_job"], config.num_workers)
        evals = [(row["total_inner_steps"], row["eval_loss"])
                 for row in report.read_metrics(workdir) if "eval_loss" in row]
        predicted = replay(workdir, steps, FORMS[form])
        result = {"case": case, "seed": seed, "step_seconds": steps,
                  "evals": [{"applied_steps": a, "eval_loss": loss,
                             "real_s": time_at(summary["timeline"], a),
                             "predicted_s": time_at(predicted, a)} for a, loss in evals]}
        (workdir / "result.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result["evals"][-1]), flush=True)


def _time_to_loss_folder(form: str) -> str:
  return "time_to_loss" if form == "server" else f"time_to_loss_{form}"


def time_to_loss_report(out: pathlib.Path, form: str = "server") -> str:
  """Real and predicted seconds to the target: the highest last eval loss of any run (every
  run reaches it), per case, mean ± sd over seeds (`form`: which runs)."""
  results = {case: [json.loads(p.read_text()) for p in sorted(
      (out / _time_to_loss_folder(form) / case.replace(",", "_")).glob("seed*/result.json"))]
      for case in TIME_TO_LOSS}
  if not all(results.values()):
    return ""
  target = max(r["evals"][-1]["eval_loss"] for runs in results.values() for r in runs)
  rows = [f"Rounds {form}: target eval loss {target:.4f} (the highest last evaluation of any "
          "run).", "",
          "| case | seeds | real s to target | predicted s | real / predicted |",
          "|---|---|---|---|---|"]
  for case, runs in results.items():
    hits = [next(e for e in r["evals"] if e["eval_loss"] <= target) for r in runs]
    real = [h["real_s"] for h in hits]
    predicted = [h["predicted_s"] for h in hits]
    ratio = [a / b for a, b in zip(real, predicted)]
    rows.append(f"| {case} | {len(runs)} | {statistics.mean(real):.1f} ± {_sd(real):.1f} | "
                f"{statistics.mean(predicted):.1f} ± {_sd(predicted):.1f} | "
                f"{statistics.mean(ratio):.3f} ± {_sd(ratio):.3f} |")
  return "\n".join(rows)


def report(out: pathlib.Path) -> str:
  """A markdown table: per case, real over predicted for the run after its first round
  (mean ± sd over seeds, each seed's), and the range of the per-round ratios."""
  rows = ["| case | seeds | real s (after round 1) | model | real / predicted, run | "
          "per round (min–max) |", "|---|---|---|---|---|---|"]
  for folder in sorted(p for p in out.iterdir()
                       if p.is_dir() and not p.name.startswith("time_to_loss")
                       and p.name != "scaling"):
    results = [json.loads(p.read_text()) for p in sorted(folder.glob("seed*/result.json"))]
    if not results:
      continue
    for model in (m for m in MODELS if m in results[0]):
      runs = [r[model]["run_ratio"] for r in results]
      rounds = [x for r in results for x in r[model]["round_ratio"]]
      real_s = statistics.mean(r[model]["real_after_first_s"] for r in results)
      rows.append(f"| {results[0]['case']} | {len(runs)} | {real_s:.1f} | {model} | "
                  f"{statistics.mean(runs):.3f} ± {_sd(runs):.3f} ({', '.join(f'{x:.3f}' for x in runs)})"
                  f" | {min(rounds):.3f}–{max(rounds):.3f} |")
  return "\n".join(rows)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--cases", nargs="+", default=[], help="configs/real_links.py arguments")
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/real_vs_sim"))
  p.add_argument("--form", choices=list(FORMS), default="server",
                 help="--time_to_loss: the form of the Ray runtime's rounds")
  p.add_argument("--time_to_loss", action="store_true",
                 help="also DiLoCo (H 50) against DDP to a fixed eval loss (TIME_TO_LOSS)")
  p.add_argument("--scaling", help="a configs/real_links.py argument run at --workers "
                 "workers in each form of the Ray runtime's rounds (FORMS)")
  p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
  p.add_argument("--forms", nargs="+", choices=list(FORMS), default=["server", "direct"],
                 help="--scaling: the forms to run ('hierarchical' needs a PLACE of regions)")
  p.add_argument("--modem", action="store_true", help="--scaling over links shaped in a box "
                 "beside each node, ACKs first (real_links.Links), not at the node's NIC")
  p.add_argument("--no_idle_restart", action="store_true", help="--scaling with every node's "
                 "TCP keeping its window across idle spells (net.ipv4.tcp_slow_start_after_idle"
                 "=0 in each node's namespace): where a round's fixed cost comes from")
  p.add_argument("--set", nargs="+", default=[], metavar="FIELD=VALUE",
                 help="--scaling: config fields set in every run (e.g. ray.sends_in_flight=1); "
                 "give each set its own --out")
  p.add_argument("--report", type=pathlib.Path, help="print the tables of a finished --out")
  p.add_argument("--replay", type=pathlib.Path,
                 help="replay every real run of a finished --out again, then print the tables")
  a = p.parse_args()
  if a.replay:
    replay_all(a.replay.resolve())
    replay_scaling(a.replay.resolve())
    a.report = a.replay
  if a.report:
    print(report(a.report))
    for form in FORMS:
      print(time_to_loss_report(a.report, form))
    print(scaling_report(a.report))
    print(split_report(a.report))
    print(collective_bytes_report(a.report))
    return
  try:
    real_links.preflight()
  except real_links.LinksError as e:
    sys.exit(f"error: {e}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  for case in a.cases:
    run_case(case, a.seeds, a.out.resolve())
  if a.scaling:
    run_scaling(a.scaling, a.workers, a.seeds, a.out.resolve(), a.forms, a.modem,
                not a.no_idle_restart, tuple(a.set))
  if a.time_to_loss:
    run_time_to_loss(a.seeds, a.out.resolve(), a.form)
  print(report(a.out.resolve()))
  for form in FORMS:
    print(time_to_loss_report(a.out.resolve(), form))
  print(scaling_report(a.out.resolve()))
  print(split_report(a.out.resolve()))
  print(collective_bytes_report(a.out.resolve()))


if __name__ == "__main__":
  main()
