"""The Ray runtime's driver: asynchronous parameter-server training on real processes, with
workers that join, leave or crash while the run goes on.

One process (the one `main.py` runs) drives: it starts or joins Ray, creates the server
actor and one actor per worker, and moves references. Tensors go from actor to actor
through Ray's object store and never through the driver:

    pull:  server.pull()  ──ref──►  worker.job(pulled, lr step, steps) ──► (meta, Δ)
    push:  server.push(meta, Δ ref)  ──►  staleness, drift            (the driver: meta)

`ray.apply_order` says which finished job is pushed next: the first to finish ('arrival')
or the first started ('dispatch': a run that repeats exactly). Progress is counted as in
the simulator, in round-equivalents (W·H inner steps applied), and reported to the run loop
(run_loop.py), which evaluates, logs and checkpoints on them.

Failures. A worker that dies loses its job in flight (`pushes_dropped`); its steps go back
into the budget and the others go on. If the server dies, a new one restores the last
checkpoint and the pushes applied since are pushed again, from the object store, in their
order: no work is lost while their Δ survive (the driver owns them). Membership changes
are rows of metrics.jsonl (`event`) and counts in summary.json.
"""

import collections
import dataclasses
import logging
import math
import pathlib
import time

import jax
import ml_collections

from lowcomm_jax import run_loop
from lowcomm_jax.build import build
from lowcomm_jax.checkpoint import CheckpointMismatch
from lowcomm_jax.hosts import settle_inner_steps
from lowcomm_jax.parallel import mesh as mesh_lib
from lowcomm_jax.ray_runtime import chaos as chaos_lib, cluster
from lowcomm_jax.ray_runtime.actors import ServerProcess, WorkerProcess, server_rule
from lowcomm_jax.run_files import RunFiles, TrainingDiverged  # noqa: F401 - raised by the loop
from lowcomm_jax.simulate import make_plan, one_device
from lowcomm_jax.workdir import holds_lock

_FORMAT = 1  # of the checkpoint's meta


@holds_lock  # one run per workdir (workdir.py)
def run(config: ml_collections.ConfigDict, workdir: str | pathlib.Path, *,
        stop_after_checkpoints: int | None = None) -> dict:
  """Trains (or resumes) the Ray run in `workdir` and returns its summary.
  `stop_after_checkpoints` ends this invocation after that many saves (resume tests)."""
  t_start = time.time()
  files = RunFiles(config, workdir)  # refuses a changed config before any work
  return run_loop.run(RayDriver(config), files, t_start=t_start,
                      stop_after_checkpoints=stop_after_checkpoints)


@dataclasses.dataclass
class _Job:
  worker: int
  order: int  # dispatch order (apply_order='dispatch' pushes in this order)
  lr_step: int
  steps: int
  version: object  # ObjectRef of the pulled version (an int)
  params: object  # ObjectRef of the pulled θ
  meta: object  # ObjectRef of the job's meta dict
  sent: object  # ObjectRef of what it sends (Δ, or the codec's payload)

  def record(self, version: int) -> dict:
    """What a checkpoint keeps of a job in flight (a resumed run starts it again)."""
    return {"worker": self.worker, "order": self.order, "lr_step": self.lr_step,
            "steps": self.steps, "version": version}


@dataclasses.dataclass
class Counts:
  """The run's accounts (JSON: checkpointed in the meta)."""
  dispatched_steps: int = 0  # of jobs started and not lost
  applied_steps: int = 0
  pushes: int = 0
  staleness_sum: int = 0
  staleness_histogram: dict = dataclasses.field(default_factory=dict)  # staleness -> pushes
  drift_sum: float = 0.0
  drift_count: int = 0
  loss_sum: float = 0.0  # since the last reading
  loss_count: int = 0
  last_train_loss: float | None = None
  workers_joined: int = 0  # after the start
  workers_lost: int = 0
  pushes_dropped: int = 0
  server_restarts: int = 0
  pushes_replayed: int = 0
  next_order: int = 0
  next_worker: int = 0  # the id a new worker gets
  pushes_per_worker: dict = dataclasses.field(default_factory=dict)
  compute_seconds: dict = dataclasses.field(default_factory=dict)
  recoveries: list = dataclasses.field(default_factory=list)  # {"what", "seconds", ...}
  chaos_done: int = 0  # chaos events already fired


class RayDriver:
  """The run loop's driver for runtime='ray' (run_loop.Driver)."""

  unit = "round-equivalent"
  writes_files = True
  reads_late = False

  def __init__(self, config: ml_collections.ConfigDict):
    self.c = config
    self.r = r = build(one_device(config))  # shapes, tokens, the plan; no compute
    self.plan = make_plan(r.config, r)
    self.per_mark = config.num_workers * config.inner_steps  # a round-equivalent: W·H steps
    self.events = chaos_lib.parse(config.ray.chaos)
    self.counts = Counts(next_worker=config.num_workers)
    self.ray = cluster.import_ray()
    self.started_ray = False
    self.server = None
    self.actors: dict[int, object] = {}  # live workers
    self.delays: dict[int, float] = {}
    self.data: dict[str, dict] = {}  # worker id -> its stream's state after its last push
    self.lost: list[int] = []  # workers gone (a rejoin brings one back)
    self.jobs: dict[int, _Job] = {}  # worker -> its job in flight
    self.since_checkpoint: list[tuple[dict, object]] = []  # (meta, Δ ref) pushed since
    self.files: RunFiles | None = None
    self.inner_steps: dict[int, int] = {}  # H per worker where DyLU settled one
    self.speeds: dict[int, float] = {}  # DyLU: steps per second, per worker
    self.finished, self.mark, self._wall_before = False, 0, 0.0

  # --- actors -----------------------------------------------------------------------------

  def _new_server(self, restored: dict | None):
    remote = self.ray.remote(**cluster.actor_options(self.c, worker=False))(ServerProcess)
    server = remote.remote(self.c, restored)
    self.ray.get(server.ping.remote(), timeout=self.c.ray.recover_timeout_s)
    return server

  def _start_worker(self, worker: int, restored: dict | None = None) -> None:
    """Starts `worker`'s process: from `restored` (a checkpoint's), else where its data
    stream was (a worker that rejoins), else fresh."""
    sleeps = list(self.c.ray.step_sleep_s)
    sleep = sleeps[worker] if worker < len(sleeps) else 0.0
    if restored is None and str(worker) in self.data:
      restored = {"data": self.data[str(worker)]}
    # Two threads: a checkpoint reads the worker's state while a job runs.
    remote = self.ray.remote(max_concurrency=2,
                             **cluster.actor_options(self.c, worker=True))(WorkerProcess)
    self.actors[worker] = remote.remote(self.c, worker, restored, sleep)
    if worker in self.delays:
      self.actors[worker].delay.remote(self.delays[worker])

  def _note(self, event: str, **fields) -> None:
    """A membership or recovery event: a metrics.jsonl row and a log line."""
    step = self.counts.applied_steps // self.c.num_workers
    logging.info("ray: %s %s", event, fields)
    if self.files is not None and self.files.logger is not None:
      self.files.logger.note(step, {"event": event, "pushes": self.counts.pushes, **fields})

  # --- jobs -------------------------------------------------------------------------------

  def _inner_steps(self, worker: int) -> int:
    return self.inner_steps.get(worker, self.c.inner_steps)

  def _measured(self, worker: int, meta: dict) -> None:
    """DyLU (`outer.dylu`): a worker's speed is its steps per second of job (its first job
    compiles, so it is not counted); H is settled again from the live workers' speeds once
    all are known, and whenever membership changes."""
    if not self.c.outer.dylu:
      return
    jobs = self.counts.pushes_per_worker.get(str(worker), 0)
    if jobs <= 1:
      return
    first = worker not in self.speeds
    self.speeds[worker] = meta["steps"] / max(meta["job_seconds"], 1e-9)
    if first:
      self._settle_inner_steps("speed measured")

  def _settle_inner_steps(self, why: str) -> None:
    if not self.c.outer.dylu:
      return
    live = sorted(self.actors)
    speeds = [self.speeds.get(w, 0.0) for w in live]
    settled = dict(zip(live, settle_inner_steps(self.c, [self.c.inner_steps] * len(live),
                                                speeds)))
    if settled != {w: self._inner_steps(w) for w in live}:
      self.inner_steps.update(settled)
      self._note("inner_steps", why=why, inner_steps={str(w): h for w, h in settled.items()})

  def _dispatch(self, worker: int, lr_step: int | None = None, steps: int | None = None,
                order: int | None = None, version: int | None = None) -> None:
    """Starts `worker`'s next job (or, with the arguments, starts a job again as it was:
    from `version`'s θ, a resumed run's)."""
    n = self.counts
    if steps is None:
      remaining = self.plan.total_steps - n.dispatched_steps
      if remaining <= 0:
        return
      steps = min(self._inner_steps(worker), remaining)
      n.dispatched_steps += steps
      # The inner lr schedules run on the run's clock: inner steps applied per worker.
      lr_step = n.applied_steps // self.c.num_workers
      order, n.next_order = n.next_order, n.next_order + 1
    pulled_version, params = self.server.pull.options(num_returns=2).remote(version)
    meta, sent = self.actors[worker].job.options(num_returns=2).remote(
        pulled_version, params, lr_step, steps, order)
    self.jobs[worker] = _Job(worker, order, lr_step, steps, pulled_version, params, meta, sent)

  def _next_done(self) -> _Job:
    if self.c.ray.apply_order == "dispatch":
      job = min(self.jobs.values(), key=lambda j: j.order)
      self.ray.wait([job.meta])
      return job
    by_ref = {j.meta: j for j in self.jobs.values()}
    ready, _ = self.ray.wait(list(by_ref), num_returns=1)
    return by_ref[ready[0]]

  def _server_alive(self) -> bool:
    try:
      self.ray.get(self.server.ping.remote(), timeout=self.c.ray.recover_timeout_s)
      return True
    except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
      return False

  def _lose(self, worker: int, why: str) -> None:
    job = self.jobs.pop(worker, None)
    actor = self.actors.pop(worker, None)
    if actor is not None:
      self.ray.kill(actor, no_restart=True)
    n = self.counts
    n.workers_lost += 1
    self.lost.append(worker)
    if job is not None:
      self._discard(job)
      n.pushes_dropped += 1
      n.dispatched_steps -= job.steps  # someone else takes them
      self.server.drop.remote(job.version)  # (a pull from a dead server fails: no matter)
    self._note("worker_lost", worker=worker, why=why, live=len(self.actors))
    self.speeds.pop(worker, None)
    self._settle_inner_steps("worker lost")
    # Its steps go to whoever is idle (a worker whose budget ran out may start again).
    for w in self.actors:
      if w not in self.jobs:
        self._dispatch(w)
    if not self.actors and not self._budget_spent():
      raise RuntimeError(f"every worker is gone ({why}); the run cannot go on. Resume it "
                         "from its last checkpoint when workers are back")

  def _budget_spent(self) -> bool:
    return self.counts.applied_steps >= self.plan.total_steps

  def _recover_server(self, why: str) -> None:
    """A new server from the last checkpoint, the pushes since replayed in order, then the
    jobs whose pull failed started again as they were."""
    t0 = time.perf_counter()
    n = self.counts
    ckpt = self.files.ckpt
    ckpt.wait()
    latest = ckpt.latest_round()
    restored = self._restore(latest)[0] if latest is not None else None
    self.server = self._new_server(restored)
    # Jobs out that pulled from the dead server keep their models (drift, checkpoints); those
    # whose pull failed start again, as they were, once the pushes are replayed.
    held, failed = collections.Counter(), []
    for job in sorted(self.jobs.values(), key=lambda j: j.order):
      try:
        held[self.ray.get(job.version)] += 1
      except self.ray.exceptions.RayError:
        failed.append(job)
    self.server.expect.remote(dict(held))
    for meta, sent in self.since_checkpoint:
      self.ray.get(self.server.push.remote(meta, sent))
    n.pushes_replayed += len(self.since_checkpoint)
    n.server_restarts += 1
    for job in failed:
      self._discard(job)
      self._dispatch(job.worker, job.lr_step, job.steps, job.order)
    seconds = time.perf_counter() - t0
    n.recoveries.append({"what": "server", "seconds": seconds,
                         "replayed": len(self.since_checkpoint), "from_checkpoint": latest})
    self._note("server_restarted", why=why, seconds=round(seconds, 3),
               replayed=len(self.since_checkpoint), checkpoint=latest)

  def _discard(self, job: _Job) -> None:
    """Reads a failed job's results (their error is expected: Ray would log it unread)."""
    for ref in (job.meta, job.sent):
      try:
        self.ray.get(ref, timeout=self.c.ray.recover_timeout_s)
      except self.ray.exceptions.RayError:
        pass

  def _push(self, job: _Job, meta: dict) -> dict:
    while True:
      try:
        return self.ray.get(self.server.push.remote(meta, job.sent))
      except self.ray.exceptions.RayActorError as e:
        self._recover_server(f"push failed: {type(e).__name__}")

  def _finish(self, job: _Job) -> bool:
    """Takes a finished job: pushes it, accounts, starts the worker's next. False when the
    job failed (its worker was lost, or it pulled from a server that died)."""
    try:
      meta = self.ray.get(job.meta)
    except self.ray.exceptions.RayError as e:
      if not self._server_alive():
        self._recover_server(f"pull failed: {type(e).__name__}")
      elif self.jobs.get(job.worker) is job:  # the worker itself failed
        self._lose(job.worker, f"{type(e).__name__}")
      return False
    del self.jobs[job.worker]
    info = self._push(job, meta)
    self.since_checkpoint.append((meta, job.sent))
    n = self.counts
    w = str(job.worker)
    n.pushes += 1
    n.applied_steps += job.steps
    n.staleness_sum += info["staleness"]
    key = str(info["staleness"])
    n.staleness_histogram[key] = n.staleness_histogram.get(key, 0) + 1
    if info["drift"] is not None:
      n.drift_sum += info["drift"]
      n.drift_count += 1
    n.loss_sum += meta["loss"]
    n.loss_count += 1
    n.pushes_per_worker[w] = n.pushes_per_worker.get(w, 0) + 1
    n.compute_seconds[w] = n.compute_seconds.get(w, 0.0) + meta["compute_seconds"]
    self.data[w] = meta["data"]
    self._measured(job.worker, meta)
    self._chaos()
    if job.worker in self.actors:
      self._dispatch(job.worker)
    return True

  def _chaos(self) -> None:
    n = self.counts
    while n.chaos_done < len(self.events) and self.events[n.chaos_done].after <= n.pushes:
      e = self.events[n.chaos_done]
      n.chaos_done += 1
      logging.info("ray: chaos %s", e)
      if e.action == "kill_worker" and e.worker in self.actors:
        self.ray.kill(self.actors[e.worker], no_restart=True)
      elif e.action == "kill_server":
        self.ray.kill(self.server, no_restart=True)
      elif e.action == "delay_worker":
        self.delays[e.worker] = e.seconds
        if e.worker in self.actors:
          self.actors[e.worker].delay.remote(e.seconds)
      elif e.action in ("add_worker", "rejoin_worker"):
        worker = e.worker if e.action == "rejoin_worker" else n.next_worker
        n.next_worker += e.action == "add_worker"
        self._join(worker)

  def _join(self, worker: int) -> None:
    t0 = time.perf_counter()
    self._start_worker(worker)
    self.ray.get(self.actors[worker].ping.remote(), timeout=self.c.ray.recover_timeout_s)
    if worker in self.lost:
      self.lost.remove(worker)
    self.counts.workers_joined += 1
    seconds = time.perf_counter() - t0
    self.counts.recoveries.append({"what": "join", "worker": worker, "seconds": seconds})
    self._note("worker_joined", worker=worker, seconds=round(seconds, 3),
               live=len(self.actors))
    self._settle_inner_steps("worker joined")
    self._dispatch(worker)

  # --- the run loop's driver --------------------------------------------------------------

  def _abstract(self, meta: dict):
    """Shapes (with this process's shardings) of the checkpoint described by `meta`: the
    server's tree, and the live workers' states."""
    r = self.r
    rep = mesh_lib.replicated(r.topology.mesh)
    placed = lambda tree: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), tree)
    params = r.state_spec.abstract.params
    server = {"params": params, "opt_state": jax.eval_shape(server_rule(r).init, params)}
    if meta["in_flight"]:
      server["snapshots"] = {str(j["version"]): params for j in meta["in_flight"]}
    one_row = lambda tree: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((1,) + a.shape[1:], a.dtype), tree)
    worker = {"state": one_row(r.abstract_workers()[0])}
    if r.sync.codec is not None:
      worker["codec"] = jax.eval_shape(
          lambda: jax.tree.map(lambda x: x[None], r.sync.codec.init(r.model.layout.abstract)))
    return placed(server), placed({str(w): worker for w in meta["live"]})

  def _restore(self, mark: int) -> tuple[dict, dict, dict]:
    """(the server's restored state, the meta, each live worker's restored state)."""
    ckpt = self.files.ckpt
    meta = ckpt.restore_meta(mark)
    server, workers = self._abstract(meta)
    tree, meta, workers, data = ckpt.restore(mark, server, workers)
    workers = {int(w): {**jax.device_get(s), "data": data["streams"][w]}
               for w, s in workers.items()}
    return {**jax.device_get(tree), "version": meta["version"]}, meta, workers

  def open(self, files: RunFiles, latest: int | None) -> dict | None:
    self.files, ckpt = files, files.ckpt
    server, meta, workers, in_flight = None, None, {}, []
    if latest is not None:
      meta = ckpt.restore_meta(latest)
      if meta.get("format") != _FORMAT or meta.get("runtime") != "ray":
        ckpt.close()
        raise CheckpointMismatch(f"the checkpoint in {ckpt.directory} was not written by "
                                 "this version of the Ray runtime; pass another --workdir")
      if meta["finished"] and (summary := files.finished_summary()) is not None:
        return summary
      ckpt.discard_after(latest)
      server, meta, workers = self._restore(latest)
      self.counts = Counts(**meta["counts"])
      self.data, self.lost = meta["data"], list(meta["lost"])
      self.delays = {int(k): v for k, v in meta["delays"].items()}
      self._wall_before, self.finished = meta["wall_seconds"], meta["finished"]
      in_flight = meta["in_flight"]  # started again as they were
    self.started_ray = cluster.connect(self.c)
    t0 = time.perf_counter()
    self.server = self._new_server(server)
    live = (sorted(int(w) for w in meta["live"]) if meta is not None
            else list(range(self.c.num_workers)))
    for w in live:
      self._start_worker(w, workers.get(w))
    self.ray.get([self.actors[w].ping.remote() for w in live])
    logging.info("ray: server and %d workers up in %.1fs (%s)", len(live),
                 time.perf_counter() - t0, "resumed" if meta else "fresh")
    for j in sorted(in_flight, key=lambda j: j["order"]):
      self._dispatch(j["worker"], j["lr_step"], j["steps"], j["order"], j["version"])
    for w in live:
      if w not in self.jobs:
        self._dispatch(w)
    self.mark = self.counts.applied_steps // self.per_mark
    return None

  def position(self) -> tuple[int, int, int]:
    steps = self.counts.applied_steps
    return self.mark, steps // self.c.num_workers, self.r.tokens(steps)

  def wall_before(self) -> float:
    return self._wall_before

  def advance(self, due) -> run_loop.Mark | None:
    if self.finished:
      return None
    while self.jobs:
      job = self._next_done()
      if self._finish(job) and self.counts.applied_steps // self.per_mark != self.mark:
        break
    self.finished = not self.jobs and self._budget_spent()
    self.mark = self.counts.applied_steps // self.per_mark
    mark_due = due(self.mark, last_of_run=self.finished, last_of_call=self.finished)
    return run_loop.Mark(self.mark, mark_due,
                         self._reading(mark_due.write) if mark_due.metrics else None)

  def _reading(self, take_train_loss: bool) -> run_loop.Reading:
    n, w = self.counts, self.c.num_workers
    norm = self.ray.get(self.server.param_norm.remote())
    problem = None
    if not (math.isfinite(n.loss_sum) and math.isfinite(norm)):
      problem = f"push {n.pushes} (train-loss sum {n.loss_sum}, global param norm {norm})"
    scalars = {"total_inner_steps": n.applied_steps, "tokens": self.r.tokens(n.applied_steps),
               "pushes": n.pushes, "bytes_sent": n.pushes * self.plan.delta_bytes // w,
               "mean_staleness": n.staleness_sum / max(n.pushes, 1),
               "mean_drift": n.drift_sum / max(n.drift_count, 1),
               "workers_live": len(self.actors), "workers_joined": n.workers_joined,
               "workers_lost": n.workers_lost, "pushes_dropped": n.pushes_dropped}
    if take_train_loss and n.loss_count:
      n.last_train_loss = scalars["train_loss"] = n.loss_sum / n.loss_count
      n.loss_sum, n.loss_count = 0.0, 0
    return run_loop.Reading(n.applied_steps // w, scalars, time.perf_counter(), problem)

  def read(self, handle: run_loop.Reading) -> run_loop.Reading:
    return handle

  def evaluate(self) -> float:
    while True:
      try:
        return self.ray.get(self.server.evaluate.remote())
      except self.ray.exceptions.RayActorError as e:
        self._recover_server(f"evaluation failed: {type(e).__name__}")

  def save(self, ckpt, mark: int, *, last: bool, wall: float) -> None:
    """The server (θ, its rule's state, the models jobs in flight pulled), every live
    worker's state as it was before its unpushed job (inner optimizer, codec buffer, data
    stream), and those jobs: a resumed run starts them again and repeats this one."""
    while True:
      try:
        jobs = sorted(self.jobs.values(), key=lambda j: j.order)
        in_flight = [j.record(v) for j, v in zip(jobs, self.ray.get([j.version for j in jobs]))]
        state = self.ray.get(self.server.state.remote([j["version"] for j in in_flight]))
        break
      except self.ray.exceptions.RayActorError as e:
        self._recover_server(f"save failed: {type(e).__name__}")
    workers = {}
    for w, actor in sorted(self.actors.items()):
      job = self.jobs.get(w)
      try:
        workers[w] = self.ray.get(actor.checkpoint_state.remote(None if job is None
                                                                else job.order))
      except self.ray.exceptions.RayActorError:  # it died: found lost at its job's result
        in_flight = [j for j in in_flight if j["worker"] != w]
    tree = {"params": state["params"], "opt_state": state["opt_state"]}
    if in_flight:
      tree["snapshots"] = state["snapshots"]
    meta = {"format": _FORMAT, "runtime": "ray", "version": state["version"],
            "counts": dataclasses.asdict(self.counts), "data": self.data, "lost": self.lost,
            "live": [str(w) for w in workers], "in_flight": in_flight,
            "delays": {str(k): v for k, v in self.delays.items()},
            "wall_seconds": wall, "finished": last and self.finished}
    ckpt.save(mark + 1 if last and self.finished else mark, tree, meta,
              {str(w): {k: v for k, v in s.items() if k != "data" and jax.tree.leaves(v)}
               for w, s in workers.items()},
              {"streams": {str(w): s["data"] for w, s in workers.items()}})
    self.since_checkpoint = []

  def complete(self) -> bool:
    return self.finished

  def stopped(self) -> dict:
    return {"stopped_at": self.mark, "pushes": self.counts.pushes}

  def summary(self, eval_loss: float, scalars: dict, wall: float) -> dict:
    n, c = self.counts, self.c
    return {
        "algorithm": c.algorithm, "runtime": "ray", "num_workers": c.num_workers,
        "inner_steps": c.inner_steps, "rounds": c.rounds, "model": self.r.model.name,
        "params": self.r.model.param_count, "codec": c.compress.codec,
        "eval_loss": eval_loss, "train_loss": n.last_train_loss,
        "total_inner_steps": n.applied_steps, "tokens": self.r.tokens(n.applied_steps),
        "pushes": n.pushes, "pushes_per_worker": n.pushes_per_worker,
        "mean_staleness": n.staleness_sum / max(n.pushes, 1),
        "staleness_histogram": dict(sorted(n.staleness_histogram.items(),
                                           key=lambda kv: int(kv[0]))),
        "mean_drift": n.drift_sum / max(n.drift_count, 1),
        "workers_joined": n.workers_joined, "workers_lost": n.workers_lost,
        "pushes_dropped": n.pushes_dropped, "server_restarts": n.server_restarts,
        "pushes_replayed": n.pushes_replayed, "recoveries": n.recoveries,
        "compute_seconds_per_worker": n.compute_seconds,
        "bytes_sent": n.pushes * self.plan.delta_bytes // c.num_workers,
        "bytes_sent_total": n.pushes * self.plan.delta_bytes,
        "server_bytes_sent": n.pushes * self.plan.param_bytes,
        "bytes_sent_ddp_equivalent": self.plan.param_bytes * n.applied_steps // c.num_workers,
        "wall_seconds": wall,
    }

  def close(self) -> None:
    for actor in list(self.actors.values()) + ([self.server] if self.server else []):
      try:
        self.ray.kill(actor, no_restart=True)
      except Exception:  # noqa: BLE001 - already gone
        pass
    self.actors, self.server, self.jobs = {}, None, {}
    if self.started_ray:
      self.ray.shutdown()
      self.started_ray = False
