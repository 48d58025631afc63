"""The Ray runtime's driver: training on real processes, with workers that join, leave or
crash while the run goes on (the actors and their jobs: pool.py).

One process (the one `main.py` runs) drives: it starts or joins Ray, creates one actor per
worker (and the server actors where the algorithm or the server form needs them), decides
which contributions make a round, and moves references; a synchronous round's collective
runs among its members (replicas.py: one message to each, one outcome back). What a
finished job does, and what a mark is, is the progress policy the algorithm declares
(`Algorithm.progress`, progress.py): asynchronous pushes (pushes.py), quorum rounds
(quorum.py) or collaborative epochs (epochs.py), each given its form: the server actors
(forms/server.py) or the workers' replicas (replicas.py). This driver holds what they
share: the actors, the counts, checkpoints and the run loop's side.

`ray.apply_order` says which finished job is taken next: the first to finish ('arrival')
or the first started ('dispatch': a run that repeats exactly). Failures: a worker that dies
loses its job in flight; a server that dies is rebuilt from the last checkpoint and fed the
calls since, in order (pool.py). Membership changes are rows of metrics.jsonl (`event`) and
counts in summary.json.
"""

import dataclasses
import logging
import math
import pathlib
import time

import ml_collections

from lowcomm_jax.errors import ConfigError
from lowcomm_jax.run import loop
from lowcomm_jax.assemble.build import build
from lowcomm_jax.run.checkpoint import CheckpointMismatch
from lowcomm_jax.runtimes.ray import checkpoints, cluster, records
from lowcomm_jax.runtimes.ray.accounts import Counts, Timeline
from lowcomm_jax.runtimes.ray.actors import initial_params, server_rules, server_view
from lowcomm_jax.runtimes.ray.chaos import with_worker_slots
from lowcomm_jax.runtimes.ray import forms
from lowcomm_jax.runtimes.ray.epochs import Epochs
from lowcomm_jax.runtimes.ray.forms.server import ServerForm
from lowcomm_jax.runtimes.ray.pair_rounds import PairReplicas
from lowcomm_jax.runtimes.ray.pool import Pool
from lowcomm_jax.runtimes.ray.pushes import Pushes
from lowcomm_jax.runtimes.ray.quorum import QuorumRounds
from lowcomm_jax.runtimes.ray.replicas import Replicas
from lowcomm_jax.runtimes.ray.regions import Regions
from lowcomm_jax.parallel.server_names import GLOBAL
from lowcomm_jax.run.files import RunFiles
from lowcomm_jax.assemble.plan import make_plan, one_device
from lowcomm_jax.run.workdir import holds_lock


@holds_lock  # one run per workdir (run/workdir.py)
def run(config: ml_collections.ConfigDict, workdir: str | pathlib.Path, *,
        stop_after_checkpoints: int | None = None) -> dict:
  """Trains (or resumes) the Ray run in `workdir` and returns its summary.
  `stop_after_checkpoints` ends this invocation after that many saves (resume tests)."""
  t_start = time.time()
  files = RunFiles(config, workdir)  # refuses a changed config before any work
  return loop.run(RayDriver(config), files, t_start=t_start,
                  stop_after_checkpoints=stop_after_checkpoints)


PROGRESS = {"pushes": Pushes, "rounds": QuorumRounds, "epochs": Epochs}


class RayDriver:
  """The run loop's driver for runtime='ray' (loop.Driver)."""

  writes_files = True
  reads_late = False

  def __init__(self, config: ml_collections.ConfigDict):
    self.c = config
    # Shapes, tokens, the plan; no compute, and no worker held here (nor its memory).
    self.r = r = build(server_view(one_device(config)), check_memory=False)
    # The servers keep a row per worker id the run may use (chaos adds some): the shapes of
    # their checkpoints are those of the run built that way.
    self.server_run = (r if with_worker_slots(config) is config
                       else checkpoints.run_of(config))
    self.plan = make_plan(r.config, r)
    self.counts = Counts(next_worker=config.num_workers)
    self.timeline = Timeline()
    self.pool = Pool(config, self.counts, self._restore_latest, self._note,
                     hosts=self.server_run.topology.hosts)
    # HALoS: regional servers beside the global one (regions.py)
    self.regions = Regions(self.plan) if set(server_rules(r)) != {GLOBAL} else None
    if self.regions is not None:
      self.pool.server_of = self.regions.server_of
    self.ray = self.pool.ray
    self.started_ray = False
    self.files: RunFiles | None = None
    self.finished, self.mark, self._wall_before = False, 0, 0.0
    # the policy, given its form: the workers' replicas where its rounds close among them
    # (pair swaps: NoLoCo's gossip, whose progress is rounds), else the server actors
    form = (ServerForm if not forms.among_workers(config, r.algorithm)
            else Replicas if r.sync.partners is None else PairReplicas)
    self.progress = PROGRESS[r.algorithm.progress(config)](self, form(self))
    self.unit = self.progress.unit
    self.pool.on_join = self.progress.start_next
    self.pool.on_lose = self.progress.on_lose
    self.journals = records.journals(self)  # a record of each round to the workers
    self.taken_up_at = None  # when this driver took up a dead one's live workers
    self._notes = []  # event rows not yet written (`_note`)

  def _note(self, event: str, **fields) -> None:
    """A membership or recovery event: a metrics.jsonl row and a log line (rows of events
    before the metrics files are open, as a run is taken up, wait for them)."""
    logging.info("ray: %s %s", event, fields)
    self._notes.append((self.progress.step_count(),
                        {"event": event, "pushes": self.counts.pushes, **fields}))
    self._write_notes()

  def _write_notes(self) -> None:
    if self._notes and self.files is not None and self.files.logger is not None:
      for step, row in self._notes:
        self.files.logger.note(step, row)
      self._notes = []

  # --- jobs (what a finished one does: the progress policy's) -----------------------------

  def idle_start(self) -> None:
    """Every live worker with nothing running gets its next job, if the mode has one."""
    clock = self.counts.dispatched_steps // self.c.num_workers
    for w in sorted(self.pool.actors):
      if w not in self.pool.jobs:
        self.progress.start_next(w, clock)

  # --- the run loop's driver --------------------------------------------------------------

  def advance(self, due) -> loop.Mark | None:
    self._write_notes()  # (those of the opening: a run taken up)
    if self.finished:
      return None
    self.finished = self.progress.work_to_mark()
    self.mark = self.progress.mark()
    mark_due = due(self.mark, last_of_run=self.finished, last_of_call=self.finished)
    return loop.Mark(self.mark, mark_due,
                     self._reading(mark_due.write) if mark_due.metrics else None)

  def _reading(self, take_train_loss: bool) -> loop.Reading:
    n = self.counts
    norm = self.progress.global_call("param_norm")
    problem = None
    if not (math.isfinite(n.loss_sum) and math.isfinite(norm)):
      problem = f"push {n.pushes} (train-loss sum {n.loss_sum}, global param norm {norm})"
    scalars = {**self._accounts(), "workers_live": len(self.pool.actors)}
    if take_train_loss and n.loss_count:
      n.last_train_loss = scalars["train_loss"] = n.loss_sum / n.loss_count
      n.loss_sum, n.loss_count = 0.0, 0
    return loop.Reading(self.progress.step_count(), scalars, time.perf_counter(), problem)

  def _accounts(self) -> dict:
    """The figures both a metrics row and the summary report."""
    return {**self.counts.figures(self.progress.tokens(), self.c.num_workers,
                                  self.progress.late_figures),
            **self.progress.figures()}

  def read(self, handle: loop.Reading) -> loop.Reading:
    return handle

  def evaluate(self) -> dict[str, float]:
    return self.r.evaluation(self.progress.global_call("evaluate"))

  def position(self) -> tuple[int, int, int]:
    return self.mark, self.progress.step_count(), self.progress.tokens()

  def wall_before(self) -> float:
    return self._wall_before

  # --- checkpoints (their layout: checkpoints.py) ----------------------------------------

  def _region_names(self) -> tuple:
    return self.regions.names if self.regions is not None else ()

  def _parts(self, mark: int, meta: dict) -> tuple[dict, dict]:
    """Where checkpoint `mark`'s parts lie, as its actors are handed them (each reads its
    own): ({server name: {"part", "version"}}, {live worker: {"part"}})."""
    where = checkpoints.at(self.files.ckpt, mark)
    return ({name: {"part": where, "version": v} for name, v in meta["versions"].items()},
            {int(w): {"part": where} for w in meta["live"]})

  def _restore_latest(self, server: str = GLOBAL) -> tuple[dict | None, int | None]:
    """Where server `server`'s state in the newest checkpoint lies, and its mark."""
    ckpt = self.files.ckpt
    ckpt.wait()
    latest = ckpt.latest_round()
    if latest is None:
      return None, None
    return self._parts(latest, ckpt.restore_meta(latest))[0][server], latest

  def open(self, files: RunFiles, latest: int | None) -> dict | None:
    self.files, ckpt, pool = files, files.ckpt, self.pool
    servers, meta, workers = {}, None, {}
    if latest is not None:
      meta = ckpt.restore_meta(latest)
      if not checkpoints.written_here(meta):
        ckpt.close()
        raise CheckpointMismatch(f"the checkpoint in {ckpt.directory} was not written by "
                                 "this version of the Ray runtime; pass another --workdir")
      if meta["finished"] and (summary := files.finished_summary()) is not None:
        if summary.get("rounds", self.c.rounds) != self.c.rounds:
          raise ConfigError([
              f"rounds={self.c.rounds}: the Ray run in {files.workdir} finished its "
              f"{summary['rounds']} rounds and cannot be extended; pass another --workdir"])
        return summary
      ckpt.discard_after(latest)
      servers, workers = self._parts(latest, meta)
    self.started_ray = cluster.connect(self.c, files.workdir)
    t0, self.opened_at = time.perf_counter(), time.time()
    # A driver run again: the live workers of the one that died go on from its newest
    # record of a closed round, if they hold one at or past the checkpoint (records.py).
    taken = records.take_up(self, latest)
    if taken is not None:
      meta, found = taken
    if meta is not None:
      self._resume_from(meta)
    if taken is not None:
      servers = {GLOBAL: {"version": meta["version"],
                          "held": records.step_back(self, meta, found)}}
      self.taken_up_at = t0
    # θ₀ made once here, not by each process that starts (a rejoining worker's start-up).
    pool.theta0 = self.ray.put(initial_params(self.r))
    self.progress.restore_global(servers.get(GLOBAL))
    for name in self._region_names():
      pool.start_server(servers.get(name), name)
    live = (sorted(int(w) for w in meta["live"]) if meta is not None
            else list(range(self.c.num_workers)))
    if taken is None:
      for w in live:
        pool.start_worker(w, workers.get(w))
    live = [w for w in live if w in pool.actors]  # (a worker taken up that died since: lost)
    self.ray.get([pool.actors[w].ping.remote() for w in live])
    pool.start_standby()
    logging.info("ray: %d servers and %d workers up in %.1fs (%s)", len(pool.servers),
                 len(live), time.perf_counter() - t0,
                 "taken up" if taken else "resumed" if meta else "fresh")
    self.progress.opened()
    self.timeline.open(self.counts.applied_steps)
    for j in sorted(meta["in_flight"] if meta else [], key=lambda j: j["order"]):
      self.progress.resume_job(j)
    self.idle_start()
    self.mark = self.progress.mark()
    return None

  def save(self, ckpt, mark: int, *, last: bool, wall: float) -> None:
    """The server (θ, its rule's state, the models jobs in flight pulled), every live
    worker's state as it was before its unfinished job (inner optimizer, codec buffer, data
    stream), and those jobs: a resumed run starts them again and repeats this one. (A
    quorum run saves as a round closes: no contribution is pending.) Each part is written
    by the actor that holds it (checkpoints.py); the driver commits the round once every
    part is written."""
    pool = self.pool
    step = mark + 1 if last and self.finished else mark
    where = checkpoints.at(ckpt, step)
    workers = pool.answers({  # (one that dies is not in this checkpoint)
        w: actor.save_part.remote(where, None if job is None or job.micro else job.order)
        for w, actor in sorted(pool.actors.items()) for job in [pool.jobs.get(w)]},
        "at a checkpoint")
    while True:
      try:
        in_flight = self._in_flight()
        servers = self.progress.global_parts(where, in_flight)
        break
      except self.ray.exceptions.RayActorError as e:  # a server died: recover it, again
        for name in list(pool.servers):
          if not pool.server_alive(name):
            pool.recover_server(f"save failed: {type(e).__name__}", name)
    checkpoints.commit(ckpt, step, servers, workers,
                       {**self._meta(wall, last), "in_flight": in_flight})
    pool.checkpointed()

  def _in_flight(self) -> list[dict]:
    """The jobs a resumed run starts again, as a checkpoint keeps them."""
    jobs = self.progress.jobs_to_resume()
    return [j.record(v) for j, v in zip(jobs, self.ray.get([j.version for j in jobs]))]

  def record(self) -> dict:
    """The driver's record of the round just closed, which the workers keep (records.py):
    a checkpoint's meta, the replicas' version and the next job's order."""
    version = self.progress.form.version
    return {**self._meta(self._wall_before + time.time() - self.opened_at, last=False),
            "in_flight": self._in_flight(), "version": version, "versions": {GLOBAL: version},
            "mark": self.progress.mark(), "next_order": self.counts.next_order,
            "live": [str(w) for w in sorted(self.pool.actors)]}

  def _meta(self, wall: float, last: bool) -> dict:
    """What the driver keeps in a checkpoint's meta, besides the servers' versions and the
    jobs in flight: its counts, the workers' data positions, membership, chaos delays and
    DyLU's measured speeds and settled H (a resumed run keeps them)."""
    pool = self.pool
    return {"unsent": self.regions.unsent if self.regions is not None else {},
            "counts": dataclasses.asdict(self.counts), "data": pool.data, "lost": pool.lost,
            "delays": {str(k): v for k, v in pool.delays.items()},
            "speeds": {str(k): v for k, v in pool.rows.speeds.items()},
            "inner_steps": {str(k): v for k, v in pool.rows.inner_steps.items()},
            "wall_seconds": wall, "finished": last and self.finished}

  def _resume_from(self, meta: dict) -> None:
    """The driver's part of a checkpoint's meta (`_meta`), taken back."""
    pool, as_ints = self.pool, lambda d: {int(k): v for k, v in d.items()}
    self.counts.__dict__.update(Counts(**meta["counts"]).__dict__)
    if self.regions is not None:
      self.regions.unsent = dict(meta["unsent"])
    pool.data, pool.lost = meta["data"], list(meta["lost"])
    pool.delays = as_ints(meta["delays"])
    pool.rows.speeds = as_ints(meta.get("speeds", {}))  # (not in checkpoints before DyLU kept them)
    pool.rows.inner_steps = as_ints(meta.get("inner_steps", {}))
    self._wall_before, self.finished = meta["wall_seconds"], meta["finished"]

  def complete(self) -> bool:
    return self.finished

  def stopped(self) -> dict:
    return {"stopped_at": self.mark, "pushes": self.counts.pushes}

  def summary(self, eval_loss: float, scalars: dict, wall: float) -> dict:
    n, c, model = self.counts, self.c, self.r.model
    out = {"algorithm": c.algorithm, "num_workers": c.num_workers,
           "inner_steps": c.inner_steps, "rounds": c.rounds, "model": model.name,
           "params": model.param_count + model.frozen_count,
           "trainable_params": model.param_count, "codec": c.compress.codec,
           "eval_loss": eval_loss, **self._accounts(),
           **n.run_figures(self.plan, c.num_workers), **self.timeline.figures(),
           "wall_seconds": wall}
    return {**out, **self.progress.summary()}

  def close(self) -> None:
    self.pool.close()
    if self.started_ray:
      self.ray.shutdown()
      self.started_ray = False
