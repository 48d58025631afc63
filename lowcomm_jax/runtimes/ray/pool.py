"""The Ray runtime's actors and the jobs in flight: starting them, taking results, telling a
dead worker from a dead server (its recovery: server_recovery.py), chaos and DyLU. The
driver (driver.py) decides what a result does (a push applied at once, or a contribution
to a quorum round) and calls the server through `call`, which survives the server's death.

    dispatch(w):  server.pull() ──(version, θ, outer state) refs──► worker w.job(..., lr step, H)
                  ──► (meta, payload) refs                       (the driver holds refs only)
    dispatch_own(w): worker w.job(version, ...) from its own replica of θ (the peer form of
                  quorum rounds: replicas.py), no pull
"""

import logging
import time
from typing import Callable

import ml_collections

from lowcomm_jax.runtimes.ray import chaos as chaos_lib, cluster, server_recovery
from lowcomm_jax.runtimes.ray.accounts import Counts, Job
from lowcomm_jax.runtimes.ray.rows import WorkerRows
from lowcomm_jax.runtimes.ray.server import ServerProcess
from lowcomm_jax.runtimes.ray.worker import WorkerProcess
from lowcomm_jax.parallel.server_names import GLOBAL


class Pool:
  """The server actors (by name: the global one, and HALoS's regional ones), the live
  worker actors and their jobs. `restore_latest(name)` gives that server's state in the
  newest checkpoint and its mark ((None, None): there is none); `note(event, **fields)`
  records a membership or recovery event; `server_of(worker)` names the server a worker
  pulls from and pushes to."""

  def __init__(self, config: ml_collections.ConfigDict, counts: Counts,
               restore_latest: Callable[[], tuple], note: Callable[..., None], hosts=()):
    """`hosts`: the host table with a row for every worker id the run may use (rows.py)."""
    self.c, self.counts = config, counts
    self.restore_latest, self.note = restore_latest, note
    self.rows = WorkerRows(config, hosts, note)  # each worker's tier and H (DyLU)
    self.ray = cluster.import_ray()
    self.events = chaos_lib.parse(config.ray.chaos)
    self.servers: dict[str, object] = {}
    self.standby = None  # a server process with no state yet (ray.standby_server)
    # The run's θ₀ in the object store (the driver's): processes that start fresh rows or
    # a fresh server take it instead of making it (None: each makes its own).
    self.theta0 = None
    self.server_of: Callable[[int], str] = lambda worker: GLOBAL
    self.actors: dict[int, object] = {}  # live workers
    self.jobs: dict[int, Job] = {}  # worker -> its job in flight
    self.delays: dict[int, float] = {}
    self.data: dict[str, dict] = {}  # worker id -> its stream's state after its last job
    self.lost: list[int] = []  # workers gone (a rejoin brings one back)
    # Server calls that changed a server's state since the last checkpoint, in order, as
    # (server, method, args): a restored server is fed its own again.
    self.since_checkpoint: list[tuple[str, str, tuple]] = []
    self.on_join: Callable[[int], None] = lambda worker: None
    self.heal_for: Callable[[int], object] = lambda worker: None  # a joiner's state (forms)
    self.on_lose: Callable[[int], None] = lambda worker: None
    self.jobs_done: dict[int, int] = {}  # per live worker process
    # Workers started mid-run and not up yet (worker -> when it was started): their first
    # job waits in the actor's queue; nobody waits for them (a quorum does not count them).
    self.joining: dict[int, float] = {}
    self.in_sync: dict = {}  # chaos told in the next collective's message (chaos.in_sync)

  # --- actors -----------------------------------------------------------------------------

  @property
  def server(self):
    """The global server's actor."""
    return self.servers.get(GLOBAL)

  def start_server(self, restored: dict | None, name: str = GLOBAL) -> bool:
    """Server `name` from `restored` (or fresh): the standby takes it if there is one (and
    is alive), else a new process. Returns whether the standby took it."""
    standby, self.standby = self.standby, None
    if standby is not None:
      try:
        self.ray.get(standby.load.remote(restored, name), timeout=self.c.ray.recover_timeout_s)
        self.servers[name] = standby
        return True
      except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError) as e:
        logging.warning("ray: the standby server is gone (%s); starting a new one",
                        type(e).__name__)
        self.ray.kill(standby, no_restart=True)
    self.servers[name] = self._server_remote().remote(self.c, restored, name,
                                                      params0=self.theta0)
    self.ray.get(self.servers[name].ping.remote(), timeout=self.c.ray.recover_timeout_s)
    return False

  def _server_remote(self):
    return self.ray.remote(**cluster.actor_options(self.c, worker=False))(ServerProcess)

  def start_standby(self) -> None:
    """With `ray.standby_server`, a server process built beside the live ones, without
    waiting for it: a dead server's successor then skips the process start."""
    if self.c.ray.standby_server and self.standby is None:
      self.standby = self._server_remote().remote(self.c, standby=True, params0=self.theta0)

  def start_worker(self, worker: int, restored: dict | None = None, heal=None) -> None:
    """Starts `worker`'s process: from `restored` (a checkpoint's), else where its data
    stream was (a worker that rejoins), else fresh; its state a peer's `heal` (a reference)."""
    sleeps = list(self.c.ray.step_sleep_s)
    sleep = sleeps[worker] if worker < len(sleeps) else 0.0
    if restored is None and str(worker) in self.data:
      restored = {"data": self.data[str(worker)]}
    # Threads: a job, a collective's part (it waits for peers), short calls beside them.
    remote = self.ray.remote(max_concurrency=8,
                             **cluster.actor_options(self.c, worker=True, index=worker))(
                                 WorkerProcess)
    self.actors[worker] = remote.remote(self._config_of(worker), worker, restored, sleep,
                                        params0=self.theta0, heal=heal)
    self.jobs_done[worker] = 0  # of this process (its first compiles)
    if worker in self.delays:
      self.actors[worker].delay.remote(self.delays[worker])

  def answers(self, refs: dict, doing: str) -> dict:
    """{worker: its answer} of the calls `refs`; one that dies `doing` it is lost."""
    out = {}
    for w, ref in refs.items():
      try:
        out[w] = self.ray.get(ref)
      except self.ray.exceptions.RayActorError as e:
        self.lose(w, f"{type(e).__name__} {doing}")
    return out

  def _config_of(self, worker: int) -> ml_collections.ConfigDict:
    """The run's config as `worker` builds it: with its own batch size (ray.batch_sizes)."""
    sizes = list(self.c.ray.batch_sizes)
    if worker >= len(sizes) or sizes[worker] == self.c.data.batch_size:
      return self.c
    config = self.c.copy_and_resolve_references()
    config.data.batch_size = sizes[worker]
    return config

  def join(self, worker: int) -> None:
    """Starts `worker` mid-run and gives it its first job at once, without waiting for its
    process: the job runs once the process is up (`_came_up` then records how long that
    took).
    A worker that is not up within ray.recover_timeout_s is lost (`overdue`)."""
    if worker in self.actors:
      logging.warning("ray: worker %d is live; it does not join again", worker)
      return
    self.start_worker(worker, heal=self.heal_for(worker))
    self.joining[worker] = time.perf_counter()
    if worker in self.lost:
      self.lost.remove(worker)
    self.counts.workers_joined += 1
    self.note("worker_joined", worker=worker, live=len(self.actors),
              **self.rows.tier_fields(worker, self.actors))
    self.rows.settle("worker joined", self.actors)
    self.on_join(worker)

  def up(self) -> list[int]:
    """The live workers whose processes are up (a quorum counts these)."""
    return sorted(w for w in self.actors if w not in self.joining)

  def _came_up(self, worker: int, meta: dict) -> None:
    """A joiner's first result: from its start to its first job's is its recovery time."""
    started = self.joining.pop(worker, None)
    if started is None:
      return
    seconds = max(time.perf_counter() - started - meta.get("job_seconds", 0.0), 0.0)
    self.counts.recoveries.append({"what": "join", "worker": worker, "seconds": seconds})
    self.note("worker_up", worker=worker, seconds=round(seconds, 3))

  def overdue(self) -> None:
    """Loses the joining workers that are not up within ray.recover_timeout_s."""
    now = time.perf_counter()
    for worker, started in list(self.joining.items()):
      if now - started > self.c.ray.recover_timeout_s:
        self.lose(worker, f"not up within ray.recover_timeout_s={self.c.ray.recover_timeout_s}")

  def _join_deadline(self) -> float | None:
    """Seconds until the first joining worker is overdue (None: none is joining)."""
    if not self.joining:
      return None
    first = min(self.joining.values())
    return max(first + self.c.ray.recover_timeout_s - time.perf_counter(), 0.0) + 0.01

  def lose(self, worker: int, why: str) -> None:
    """Drops a dead worker and its job (the job's steps go back into the budget)."""
    job = self.jobs.pop(worker, None)
    actor = self.actors.pop(worker, None)
    self.joining.pop(worker, None)
    if actor is not None:
      self.ray.kill(actor, no_restart=True)
    n = self.counts
    n.workers_lost += 1
    self.lost.append(worker)
    if job is not None:
      self.discard(job)
      if not job.micro:
        n.pushes_dropped += 1
        n.dispatched_steps -= job.steps
        if not job.own:  # (a pull from a dead server fails: no matter)
          self.servers[job.server].drop.remote(job.version)
    self.on_lose(worker)
    self.note("worker_lost", worker=worker, why=why, live=len(self.actors),
              **self.rows.tier_fields(worker, self.actors))
    self.rows.say_untrained(self.actors)
    self.rows.speeds.pop(worker, None)
    self.rows.settle("worker lost", self.actors)
    if not self.actors:
      raise RuntimeError(f"every worker is gone ({why}); the run cannot go on. Resume it "
                         "from its last checkpoint when workers are back")

  def close(self) -> None:
    standby = [self.standby] if self.standby is not None else []
    for actor in list(self.actors.values()) + list(self.servers.values()) + standby:
      try:
        self.ray.kill(actor, no_restart=True)
      except Exception:  # noqa: BLE001 - already gone
        pass
    self.actors, self.servers, self.jobs, self.standby = {}, {}, {}, None

  # --- jobs -------------------------------------------------------------------------------

  def dispatch(self, worker: int, lr_step: int, steps: int, order: int | None = None,
               version: int | None = None) -> None:
    """Starts a job of `worker`: `steps` inner steps from the server's newest θ (or from
    `version`'s: a job started again as it was), its lr schedule at `lr_step`."""
    if order is None:
      order, self.counts.next_order = self.counts.next_order, self.counts.next_order + 1
    server = self.server_of(worker)
    # Stamped before the calls: the worker may start the job before `.remote()` returns
    # here, and a job's start must not precede its dispatch (accounts.Timeline).
    dispatched_at = time.time()
    pulled_version, params, outer = self.servers[server].pull.options(num_returns=3).remote(
        version, worker)
    meta, sent = self.actors[worker].job.options(num_returns=2).remote(
        pulled_version, params, outer, lr_step, steps, order)
    self.jobs[worker] = Job(worker, order, lr_step, steps, pulled_version, meta, sent,
                            server=server, dispatched_at=dispatched_at)

  def dispatch_own(self, worker: int, version, lr_step: int, steps: int,
                   order: int | None = None) -> None:
    """Starts a job of `worker` from the θ its own replica holds (the peer form of quorum
    rounds): `version`, the version it starts from (an int, or the reference an adopt of
    a peer's replica returns: the job waits for it)."""
    if order is None:
      order, self.counts.next_order = self.counts.next_order, self.counts.next_order + 1
    if isinstance(version, int):
      version = self.ray.put(version)
    dispatched_at = time.time()  # (before: with no pull to wait for, the job starts at once)
    meta, sent = self.actors[worker].job.options(num_returns=2).remote(
        version, None, None, lr_step, steps, order)
    self.jobs[worker] = Job(worker, order, lr_step, steps, version, meta, sent,
                            dispatched_at=dispatched_at, own=True)

  def dispatch_micro(self, worker: int, version: int, params) -> None:
    """Starts a micro-batch of `worker` at θ of `version` (`params`: its ObjectRef)."""
    order, self.counts.next_order = self.counts.next_order, self.counts.next_order + 1
    meta = self.actors[worker].micro.remote(version, params)
    self.jobs[worker] = Job(worker, order, 0, 0, version, meta, None, micro=True)

  def next_done(self, timeout: float | None = None) -> Job | None:
    """The next finished job: the first to finish, or (apply_order='dispatch') the first
    started; None if none finished within `timeout` seconds (or none is in flight).
    Joining workers that are overdue are lost meanwhile."""
    end = None if timeout is None else time.perf_counter() + timeout
    while True:
      left = None if end is None else max(end - time.perf_counter(), 0.0)
      deadline = self._join_deadline()
      wait = deadline if left is None else left if deadline is None else min(left, deadline)
      job = self._wait_one(wait)
      if job is not None or (end is None and not self.jobs):
        return job
      self.overdue()
      if end is not None and time.perf_counter() >= end:
        return None

  def _wait_one(self, timeout: float | None) -> Job | None:
    if not self.jobs:
      if timeout is not None:
        time.sleep(timeout)
      return None
    if self.c.ray.apply_order == "dispatch":
      job = min(self.jobs.values(), key=lambda j: j.order)
      ready, _ = self.ray.wait([job.meta], timeout=timeout)
      return job if ready else None
    by_ref = {j.meta: j for j in self.jobs.values()}
    ready, _ = self.ray.wait(list(by_ref), num_returns=1, timeout=timeout)
    if not ready:
      return None
    # ray.wait lists finished jobs in the order they were asked for, not the order they
    # finished: with a backlog (the server takes one contribution at a time) the workers
    # late in that order would wait for ever. Of every finished job, the first to finish.
    ready, _ = self.ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)
    return min((by_ref[ref] for ref in ready), key=self._finished_at)

  def _finished_at(self, job: Job) -> float:
    try:
      return self.ray.get(job.meta).get("finished_at", 0.0)
    except self.ray.exceptions.RayError:  # a failed job first: its worker is dealt with
      return float("-inf")

  def result(self, job: Job) -> dict | None:
    """A finished job's meta, taken off the jobs in flight; None if it failed (its worker
    is dropped, or it pulled from a server that died: then it has started again)."""
    try:
      meta = self.ray.get(job.meta)
    except self.ray.exceptions.RayActorError as e:  # the worker's process, or the server's
      if not (job.micro or job.own) and not self.server_alive(job.server):  # (no pull)
        self.recover_server(f"pull failed: {type(e).__name__}", job.server)
      elif self.jobs.get(job.worker) is job:  # the worker itself died
        self.lose(job.worker, f"{type(e).__name__}")
      return None
    except self.ray.exceptions.RayTaskError as e:  # an error in the job's code: no retry
      raise RuntimeError(f"worker {job.worker}'s job failed: {e}") from e
    del self.jobs[job.worker]
    self._came_up(job.worker, meta)
    if "data" in meta:
      self.data[str(job.worker)] = meta["data"]
    self.jobs_done[job.worker] += 1
    if self.jobs_done[job.worker] > 1:  # (its first job compiles: not a speed)
      self.rows.measured(job.worker, meta, self.actors)
    return meta

  def discard(self, job: Job) -> None:
    """Reads a failed job's results (their error is expected: Ray would log it unread)."""
    for ref in (job.meta, job.sent):
      if ref is None:
        continue
      try:
        self.ray.get(ref, timeout=self.c.ray.recover_timeout_s)
      except self.ray.exceptions.RayError:
        pass

  # --- the server -------------------------------------------------------------------------

  def call(self, method: str, *args, server: str = GLOBAL, changes: bool = False,
           keep_second: bool = False):
    """Server `server`'s `method(*args)`, once it answers: a dead server is recovered
    first. `changes`: the call changes the server's state (kept for a replay).
    `keep_second`: the method returns two values; the second stays in the object store
    and its reference is returned beside the first."""
    while True:
      actor = getattr(self.servers[server], method)
      try:
        if keep_second:
          first, second = actor.options(num_returns=2).remote(*args)
          out = (self.ray.get(first), second)
        else:
          out = self.ray.get(actor.remote(*args))
        break
      except self.ray.exceptions.RayActorError as e:
        self.recover_server(f"{method} failed: {type(e).__name__}", server)
    if changes:
      self.since_checkpoint.append((server, method, args))
    return out

  def worker_alive(self, worker: int) -> bool:
    try:
      self.ray.get(self.actors[worker].ping.remote(), timeout=self.c.ray.recover_timeout_s)
      return True
    except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
      return False

  def server_alive(self, server: str = GLOBAL) -> bool:
    try:
      self.ray.get(self.servers[server].ping.remote(), timeout=self.c.ray.recover_timeout_s)
      return True
    except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
      return False

  def recover_server(self, why: str, server: str = GLOBAL) -> None:
    """A new server `server` from the last checkpoint (server_recovery.py)."""
    server_recovery.recover(self, why, server)

  def checkpointed(self) -> None:
    self.since_checkpoint = []

  # --- chaos and DyLU ---------------------------------------------------------------------

  def chaos(self, progress: int | None = None) -> None:
    """Fires the chaos events due at the pushes counted so far (or at `progress`: a
    collaborative run's micro-batches)."""
    n = self.counts
    progress = n.pushes if progress is None else progress
    while n.chaos_done < len(self.events) and self.events[n.chaos_done].after <= progress:
      e = self.events[n.chaos_done]
      n.chaos_done += 1
      logging.info("ray: chaos %s", e)
      if e.action == "kill_worker" and e.worker in self.actors:
        self.lose(e.worker, "chaos: killed")
      elif e.action in chaos_lib.MESSAGED:
        self.in_sync = {**self.in_sync, **chaos_lib.in_sync(e)}  # (two due at once: both)
      elif e.action == "flip_bit" and e.worker in self.actors:
        self.actors[e.worker].flip_bit.remote()
      elif e.action == "kill_server":
        self.ray.kill(self.server, no_restart=True)
      elif e.action == "delay_worker":
        self.delays[e.worker] = e.seconds
        if e.worker in self.actors:
          self.actors[e.worker].delay.remote(e.seconds)
      elif e.action in ("add_worker", "rejoin_worker"):
        worker = e.worker if e.action == "rejoin_worker" else n.next_worker
        n.next_worker += e.action == "add_worker"
        self.join(worker)
