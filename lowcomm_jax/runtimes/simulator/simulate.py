"""The simulator: many virtual workers on one machine, on a virtual clock.

`run(config, workdir)` (`runtime='simulator'`) builds the run as the real runner does, then lets the
event loop (sim/events.py) and the algorithm's schedule (sim/*_schedules.py) decide when each worker
pulls, computes and sends, while runtimes/simulator/backend.py does the real training. Each batch of
simultaneous events is followed by one `flush` that runs the jobs they started. Progress is counted
in round-equivalents (W·H inner steps applied, or synchronous rounds): `SimDriver` reports each to
the run loop the runner uses (run/loop.py), which puts evaluation, metric writes and checkpoints on
them, so `eval_every` etc. mean the same as in the real runner. A checkpoint holds the clock and its
queue, the schedule's state, the servers, in-flight messages and pulled snapshots, the workers'
optimizer states and data streams: resuming continues the same simulation.
"""

import logging
import math
import pathlib
import time

import jax
import ml_collections
import numpy as np
import optax

from lowcomm_jax.errors import ConfigError
from lowcomm_jax.run import loop
from lowcomm_jax.assemble import memory
from lowcomm_jax.assemble.build import build
from lowcomm_jax.assemble.jitted import init_run, jitted_steps
from lowcomm_jax.assemble.plan import make_plan, one_device
from lowcomm_jax.run.checkpoint import Checkpointer, CheckpointMismatch
from lowcomm_jax.run.metrics import announce_compile, format_eta
from lowcomm_jax.run.workdir import holds_lock
from lowcomm_jax.parallel import mesh as mesh_lib
from lowcomm_jax.sim import EventLoop
from lowcomm_jax.runtimes.simulator.backend import SimBackend
from lowcomm_jax.run.files import RunFiles, TrainingDiverged  # noqa: F401 - raised by the loop


def build_run(config: ml_collections.ConfigDict):
  """The run as the runner builds it, on one device; its memory counted as the simulator
  holds it (every worker's state stacked, jobs `sim.jobs_per_call` at a time)."""
  r = build(one_device(config), check_memory=False)
  memory.check(r, jobs_per_call=memory.sim_width(r.config))
  return r


def clock(config: ml_collections.ConfigDict) -> list[tuple[float, int]]:
  """The simulation's clock without its training: [(virtual seconds, inner steps applied)]
  (sim/replay.py). Builds the run (data, model shapes) but compiles and trains nothing."""
  from lowcomm_jax.sim import replay
  r = build_run(config)
  return replay.clock(make_plan(r.config, r), r.algorithm.schedule, r.config)


class Simulation:
  """One simulation's moving parts, and saving/restoring them together."""

  def __init__(self, config: ml_collections.ConfigDict):
    self.r = r = build_run(config)
    self.c = r.config
    self.plan = make_plan(self.c, r)
    # Nothing donated: its servers outlive the calls (backend.py).
    self.programs = programs = jitted_steps(r, donate=False)
    state, workers = init_run(r, programs)
    self.backend = SimBackend(r, programs, self.plan, state, workers[0],
                              width=memory.choose_sim_width(r))
    self.schedule = r.algorithm.schedule(self.plan, self.backend)
    self.loop = EventLoop()
    self.streams = r.data.streams[0]

  def next_batches(self, ids: np.ndarray, steps: int) -> np.ndarray:
    if self.streams.batch_mode == "same":  # validated: synchronous, every worker, one H
      return self.streams.next_round(steps)
    return self.streams.next_steps(ids, steps)

  def flush(self) -> None:
    with jax.set_mesh(self.r.topology.local_mesh):
      self.backend.flush(self.next_batches)

  def advance(self) -> None:
    """Handles every event at the next virtual instant, then runs the jobs they started."""
    for event in self.loop.pop_simultaneous():
      self.schedule.handle(event, self.loop)
    self.flush()

  def fingerprint(self) -> dict:
    """What a checkpoint must agree with to be continued by this config."""
    p = self.plan
    # format 2: worker states hold θ_w, messages record their shapes (issue 15); format 3:
    # asynchronous workers' inner lr schedules run on the run's clock (backend started_steps);
    # format 4: transfers share links (sim/flows.py), the schedules checkpoint their flows.
    return {"format": 4, "algorithm": self.c.algorithm, "inner_steps": p.inner_steps,
            "total_steps": p.total_steps, "speeds": list(p.speeds.speeds),
            "worker_region": list(p.network.worker_region),
            "sync_every": p.exchange_rule.sync_every if p.exchange_rule else 8,
            "codec": self.c.compress.codec}

  def save(self, ckpt: Checkpointer, mark: int, extra: dict) -> None:
    meta = {"loop": self.loop.state_dict(), "schedule": self.schedule.state_dict(),
            "backend": self.backend.checkpoint_meta(), "plan": self.fingerprint(), **extra}
    ckpt.save(mark, self.backend.checkpoint_tree(), meta, self.backend.workers,
              {"streams": self.streams.get_state()})

  def restore(self, ckpt: Checkpointer, mark: int, meta: dict) -> None:
    """Continues from checkpoint `mark`, whose metadata (`ckpt.restore_meta`) is `meta`."""
    if meta.get("plan") != self.fingerprint():
      ckpt.close()
      raise CheckpointMismatch(
          f"the simulation checkpointed in {ckpt.directory} ran {meta.get('plan')}; this "
          f"config asks for {self.fingerprint()}. Resume with the config that wrote it, or "
          "pass another --workdir for a new simulation")
    rep = mesh_lib.replicated(self.r.topology.mesh)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep),
                            self.backend.abstract_tree(meta["backend"]))
    tree, _, workers, data = ckpt.restore(mark, abstract, self.r.abstract_workers()[0])
    self.backend.load(tree, meta["backend"])
    self.backend.workers = workers
    self.schedule.load_state(meta["schedule"])
    self.loop = EventLoop.from_state(meta["loop"])
    self.streams.set_state(data["streams"])


@holds_lock  # one run per workdir (run/workdir.py)
def run(config: ml_collections.ConfigDict, workdir: str | pathlib.Path, *,
        stop_after_checkpoints: int | None = None) -> dict:
  """Simulates (or resumes) the run in `workdir` and returns its summary.

  `stop_after_checkpoints` ends this invocation after that many checkpoints, as a
  preemption would (resume tests).
  """
  t_start = time.time()
  files = RunFiles(config, workdir)  # refuses a changed config before any work
  return loop.run(SimDriver(Simulation(config)), files, t_start=t_start,
                      stop_after_checkpoints=stop_after_checkpoints)


class SimDriver:
  """The simulator's progress for the run loop: the events of one virtual instant at a time
  until progress reaches the next round-equivalent. Its metrics are the schedule's accounts,
  taken at the mark."""

  unit = "round-equivalent"
  writes_files = True
  reads_late = False  # the accounts move on with the next events

  def __init__(self, sim: Simulation):
    self.sim, self.c = sim, sim.c
    self.param_norm = jax.jit(optax.tree.norm)
    self.finished, self._wall_before = False, 0.0
    self._progress = SimProgress(sim.plan.total_steps)

  def open(self, files: RunFiles, latest: int | None) -> dict | None:
    sim, c, ckpt = self.sim, self.c, files.ckpt
    announce_compile(sim.backend.local_round, "the local program and the server updates")
    if latest is not None:
      meta = ckpt.restore_meta(latest)
      if meta["finished"] and (summary := files.finished_summary()) is not None:
        done = summary.get("rounds", c.rounds)
        if done != c.rounds:
          raise ConfigError([
              f"rounds={c.rounds}: the simulation in {files.workdir} finished its {done} rounds "
              "and cannot be extended (its schedule drained every worker); pass another "
              "--workdir"])
        return summary
      ckpt.discard_after(latest)  # parts of a save cut short; they are redone
      sim.restore(ckpt, latest, meta)
      self._wall_before, self.finished = meta["wall_seconds"], meta["finished"]
      logging.info("resumed simulation %s at virtual t=%.1fs", files.workdir, sim.loop.now)
    else:
      sim.schedule.start(sim.loop)
      sim.flush()  # the first jobs
    self.mark = sim.schedule.progress()
    self.windows = jax.device_put(sim.r.data.eval_windows,
                                  mesh_lib.replicated(sim.r.topology.mesh))
    plan = sim.plan
    logging.info("simulating %s: %d workers, speeds %s, H %s, regions %s, %d bytes per "
                 "contribution", c.algorithm, c.num_workers,
                 [f"{v:.2f}" for v in plan.speeds.speeds], plan.inner_steps,
                 plan.network.worker_region, plan.delta_bytes)
    return None

  def position(self) -> tuple[int, int, int]:
    a = self.sim.schedule.acct
    return self.mark, a.applied_steps // self.c.num_workers, self.sim.r.tokens(a.applied_steps)

  def wall_before(self) -> float:
    return self._wall_before

  def advance(self, due) -> loop.Mark | None:
    sim, schedule = self.sim, self.sim.schedule
    if self.finished:
      return None
    while len(sim.loop):
      sim.advance()
      self._progress.tick(sim.loop.now, schedule.acct.applied_steps)
      if schedule.progress() != self.mark:
        break
    # The schedule drained every worker: the final evaluation and checkpoint.
    self.finished = not len(sim.loop)
    self.mark = schedule.progress()
    mark_due = due(self.mark, last_of_run=self.finished, last_of_call=self.finished)
    return loop.Mark(self.mark, mark_due,
                         self._reading(mark_due.write) if mark_due.metrics else None)

  def _reading(self, take_train_loss: bool) -> loop.Reading:
    """The accounts now (the jobs' results waited for: their work is done by `now`)."""
    sim, schedule, w = self.sim, self.sim.schedule, self.c.num_workers
    schedule.settle()
    ready = time.perf_counter()
    a = schedule.acct
    losses = a.loss_sum  # NaN in any job's loss since the last reading stays here
    norm = float(self.param_norm(sim.backend.global_params()))
    problem = None
    if not (math.isfinite(losses) and math.isfinite(norm)):
      problem = (f"virtual t={sim.loop.now:.1f}s (train-loss sum {losses}, global param "
                 f"norm {norm})")
    scalars = {"virtual_seconds": sim.loop.now, "total_inner_steps": a.applied_steps,
               "tokens": sim.r.tokens(a.applied_steps),
               "bytes_sent": a.bytes_sent // w,
               "server_bytes_sent": a.server_bytes_sent,
               "mean_staleness": a.staleness_sum / max(a.applied_jobs, 1),
               "mean_drift": a.drift_sum / max(a.drift_count, 1),
               "idle_fraction_per_worker": _idle_fractions(a, sim.loop.now)}
    if take_train_loss and (train_loss := schedule.take_train_loss()) is not None:
      scalars["train_loss"] = train_loss
    return loop.Reading(a.applied_steps // w, scalars, ready, problem)

  def read(self, handle: loop.Reading) -> loop.Reading:
    return handle

  def evaluate(self) -> dict[str, float]:
    fns, sim = self.sim.programs, self.sim
    announce_compile(fns.eval, "evaluation")
    with jax.set_mesh(sim.r.topology.mesh):
      return sim.r.evaluation(fns.eval(sim.backend.global_params(), self.windows))

  def save(self, ckpt, mark: int, *, last: bool, wall: float) -> None:
    # The finished state goes one past the last mark, so it is always the newest.
    self.sim.save(ckpt, mark + 1 if last else mark, {"wall_seconds": wall, "finished": last})

  def complete(self) -> bool:
    return self.finished

  def stopped(self) -> dict:
    return {"stopped_at": self.mark, "virtual_seconds": self.sim.loop.now}

  def summary(self, eval_loss: float, scalars: dict, wall: float) -> dict:
    return _summary(self.sim, eval_loss, wall)

  def close(self) -> None:
    pass


class SimProgress:
  """A log line every `every_s` wall seconds between the run loop's own: virtual time,
  inner steps applied of the run's, wall time and an ETA from the applied steps' rate since
  the first one (a round-equivalent of many slow workers can take minutes)."""

  def __init__(self, total_steps: int, every_s: float = 10.0):
    self.total, self.every_s = total_steps, every_s
    self.first = None  # (wall time, applied steps) when steps were first applied
    self.last_line = time.perf_counter()

  def tick(self, virtual_seconds: float, applied: int) -> None:
    now = time.perf_counter()
    if applied and self.first is None:
      self.first = (now, applied)
    if self.first is None or now - self.last_line < self.every_s:
      return
    self.last_line = now
    wall, done = now - self.first[0], applied - self.first[1]
    left = (self.total - applied) * wall / done if done > 0 else math.inf
    logging.info("sim: virtual %.1fs  %s/%s inner steps applied  wall %s  ETA %s",
                 virtual_seconds, f"{applied:,}", f"{self.total:,}", format_eta(wall),
                 format_eta(left))


def _idle_fractions(a, now: float) -> list[float]:
  """Per worker, the share of virtual time not spent computing (waiting at a barrier or for
  a transfer). Compute is booked when a job starts, so mid-run values are a lower bound."""
  return [max(0.0, 1.0 - t / now) if now else 0.0 for t in a.compute_seconds]


def _summary(sim: Simulation, eval_loss: float, wall: float) -> dict:
  c, plan, a = sim.c, sim.plan, sim.schedule.acct
  total = sim.loop.now
  idle = _idle_fractions(a, total)
  workers = [{"worker": w, "speed": plan.speeds.speeds[w], "region": plan.network.worker_region[w],
              "inner_steps": plan.inner_steps[w], "jobs": a.jobs[w],
              "compute_seconds": a.compute_seconds[w], "idle_fraction": idle[w]}
             for w in range(c.num_workers)]
  return {
      "algorithm": c.algorithm, "simulated": True, "num_workers": c.num_workers,
      "heterogeneity": c.sim.heterogeneity if not c.sim.speeds else "explicit",
      "dylu": c.outer.dylu, "inner_steps": c.inner_steps, "rounds": c.rounds,
      "model": sim.r.model.name, "params": sim.r.model.param_count + sim.r.model.frozen_count,
      "trainable_params": sim.r.model.param_count, "codec": c.compress.codec,
      "eval_loss": eval_loss, "train_loss": a.last_train_loss,
      "total_inner_steps": a.applied_steps,
      "tokens": sim.r.tokens(a.applied_steps),
      "virtual_seconds": total,
      "mean_staleness": a.staleness_sum / max(a.applied_jobs, 1),
      "staleness_histogram": _histogram([s for _, s, _ in a.contributions]),
      "mean_drift": a.drift_sum / max(a.drift_count, 1),
      **_drift_stats(a.contributions, c.num_workers),
      "contributions": a.applied_jobs,
      "bytes_sent": a.bytes_sent // c.num_workers,  # what a worker sent, mean over workers
      "bytes_sent_total": a.bytes_sent,
      # The largest single contribution a worker sends (streaming: one fragment's).
      "bytes_sent_peak_sync": max(plan.fragment_bytes) if c.num_workers > 1 else 0,
      # Models sent by servers: pulls by asynchronous workers, HALoS's LPS <-> GPS traffic.
      "server_bytes_sent": a.server_bytes_sent,
      # DDP would all-reduce dense fp32 gradients at every inner step.
      "bytes_sent_ddp_equivalent": plan.param_bytes * a.applied_steps // c.num_workers,
      "wall_seconds": wall,
      "jobs_per_call": sim.backend.width,
      "server_region": plan.network.server_region,
      # The global server shares a region with workers (an explicit choice: sim.network).
      "server_colocated": plan.network.server_region in plan.network.worker_region,
      "collective": sim.schedule.collective_used,
      "regions": _regional(a, plan.network.worker_region),
      "workers": workers,
  }


def _regional(a, worker_region) -> list[dict]:
  """Per region with workers: their share of the applied inner steps, and the mean
  staleness of their applied contributions."""
  out = []
  for region in sorted(set(worker_region)):
    members = [w for w, r in enumerate(worker_region) if r == region]
    stale = [s for w, s, _ in a.contributions if worker_region[w] == region]
    out.append({"region": region, "workers": members,
                "applied_step_share": (sum(a.applied_steps_by_worker[w] for w in members)
                                       / max(a.applied_steps, 1)),
                "mean_staleness": float(np.mean(stale)) if stale else None})
  return out


def final_global_params(config: ml_collections.ConfigDict, workdir: str | pathlib.Path):
  """The global model of the newest checkpoint in `workdir` (tests, inspection)."""
  sim = Simulation(config)
  ckpt = Checkpointer(pathlib.Path(workdir) / "checkpoints", max_to_keep=config.keep_checkpoints)
  try:
    latest = ckpt.latest_round()
    sim.restore(ckpt, latest, ckpt.restore_meta(latest))
  finally:
    ckpt.close()
  return sim.backend.global_params()


def _histogram(values) -> dict[str, int]:
  """{value: count} in increasing order (JSON keys are strings)."""
  out = {}
  for v in sorted(values):
    out[str(v)] = out.get(str(v), 0) + 1
  return out


def _drift_stats(contributions: list, num_workers: int) -> dict:
  """The drift distribution of the applied contributions (those whose drift is known):
  its 90th percentile, and per worker the 10/50/90th percentiles and the mean staleness."""
  drift = lambda rows: np.asarray([d for _, _, d in rows if d is not None], np.float64)
  quantiles = lambda x: ([float(q) for q in np.quantile(x, (0.1, 0.5, 0.9))] if x.size
                         else None)
  every = drift(contributions)
  per_worker = []
  for w in range(num_workers):
    rows = [row for row in contributions if row[0] == w]
    per_worker.append({"worker": w, "drift_p10_p50_p90": quantiles(drift(rows)),
                       "mean_staleness": float(np.mean([s for _, s, _ in rows])) if rows else None})
  return {"drift_p90": float(np.quantile(every, 0.9)) if every.size else None,
          "drift_per_worker": per_worker}
