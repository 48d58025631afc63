"""Schedules decide *when*: which worker starts which job from which server version, when
its contribution arrives, when servers talk. The backend (the driver, lowcomm_jax/
sim_backend.py) does the math: inner steps, outer rules, merges. A schedule only sees
versions, virtual times and byte counts, so it is plain Python and checkpoints as JSON (the
device scalars the backend hands back are read in one transfer when metrics are due).

A `Job` is H inner steps of one worker from one server's current parameters. The backend
pulls the parameters when the job starts and computes the pseudo-gradient at the next
`flush` (jobs pulled from the same version with the same H are vmapped together); the
schedule later asks it to apply the contribution. New schedules (Streaming DiLoCo's
fragments, one-step-delay or eager overlap) are new subclasses that pull, flush and apply on
other events; the event loop, the backend and the accounting stay as they are.
"""

import dataclasses
from typing import Any, Protocol

import jax

from lowcomm_jax.sim.events import Event, EventLoop
from lowcomm_jax.sim.network import Network
from lowcomm_jax.sim.speeds import SpeedModel

GLOBAL = "global"


def region_server(region: int) -> str:
  return f"region{region}"


@dataclasses.dataclass
class Job:
  id: int
  worker: int
  server: str
  version: int  # the server's version when the job pulled its parameters
  steps: int
  start: float  # virtual time it pulled
  compute_seconds: float
  segment: int = 0  # which segment of a round it computes (Streaming DiLoCo)


class Backend(Protocol):
  """What a schedule asks of the training side. Messages are in-flight payloads by id."""

  def version(self, server: str) -> int: ...
  def start_job(self, job: Job) -> None: ...  # pull now; compute at the next flush
  # Applies the job's contribution at job.server: (drift, train loss), device scalars.
  def apply_job(self, job: Job) -> tuple: ...
  # Aggregates every job's contribution at GLOBAL in one outer step: per-job train losses.
  # Synchronous syncs return (the jobs' train losses in worker order, the drift of what the
  # sync applied or None where it is not known, that contribution's staleness in versions).
  def sync_round(self, jobs: list[Job]) -> tuple[list, Any, int]: ...
  # The same for one segment's fragment (the round's last segment completes a version).
  def sync_segment(self, jobs: list[Job], segment: int) -> tuple[list, Any, int]: ...
  def push_update(self, src: str, msg: int) -> None: ...  # src's unpushed change (HALoS)
  def apply_push(self, dst: str, msg: int) -> None: ...  # dst applies message msg
  def send_params(self, src: str, msg: int) -> None: ...  # src's parameters as message msg
  def merge(self, dst: str, msg: int, alpha: float) -> None: ...  # dst merges params msg


@dataclasses.dataclass
class Plan:
  """The simulated deployment: who is how fast, the links, the sizes, the budget."""
  inner_steps: list[int]  # H per worker (DyLU already applied)
  rounds: int  # synchronous rounds
  total_steps: int  # asynchronous budget: inner steps over all workers
  speeds: SpeedModel
  network: Network
  delta_bytes: int  # one worker's contribution on the wire (the codec's payload)
  param_bytes: int  # a dense model (pulls, LPS↔GPS)
  compressed: bool  # synchronous aggregation all-gathers payloads instead of all-reducing
  server_region: int = 0  # where the (global) server sits
  sync_every: int = 8  # HALoS: LPS updates between pushes (K)
  merge_alpha: float = 0.25  # HALoS: weight of the GPS model in a merge
  fragment_bytes: tuple[int, ...] = ()  # Streaming: each fragment's contribution on the wire
  overlap_steps: int = 0  # Streaming: τ, steps between sending a fragment and needing it

  @property
  def num_workers(self) -> int:
    return len(self.inner_steps)


@dataclasses.dataclass
class Accounting:
  """What the summary and metrics report (JSON-serializable, checkpointed)."""
  compute_seconds: list[float]
  jobs: list[int]  # per worker
  applied_steps: int = 0
  applied_jobs: int = 0
  staleness_sum: float = 0.0
  drift_sum: float = 0.0
  drift_count: int = 0  # contributions whose drift is known (a sync's first rounds' is not)
  # Per applied contribution: [worker, staleness, drift or None] (the drift study's data).
  contributions: list = dataclasses.field(default_factory=list)
  bytes_sent: int = 0  # what workers sent (contributions), all workers together
  server_bytes_sent: int = 0  # what servers sent (models to workers, HALoS LPS <-> GPS)
  loss_sum: float = 0.0  # train losses of jobs applied since the last log
  loss_count: int = 0
  last_train_loss: float | None = None  # of the last interval that applied any job


class Schedule:
  """Base: owns the plan, the accounting and id counters."""

  def __init__(self, plan: Plan, backend: Backend):
    self.plan, self.backend = plan, backend
    w = plan.num_workers
    self.acct = Accounting([0.0] * w, [0] * w)
    self.next_id = 0
    self.dispatched_steps = 0
    self._pending = []  # (drift, loss) device scalars, summed on the host when read

  def new_id(self) -> int:
    self.next_id += 1
    return self.next_id

  def start(self, loop: EventLoop) -> None:
    raise NotImplementedError

  def handle(self, event: Event, loop: EventLoop) -> None:
    raise NotImplementedError

  def _new_job(self, loop: EventLoop, worker: int, server: str, steps: int,
               segment: int = 0) -> Job:
    job = Job(self.new_id(), worker, server, self.backend.version(server), steps, loop.now,
              self.plan.speeds.job_seconds(worker, self.acct.jobs[worker], steps), segment)
    self.acct.jobs[worker] += 1
    self.acct.compute_seconds[worker] += job.compute_seconds
    self.dispatched_steps += steps
    self.backend.start_job(job)
    return job

  def _applied(self, job: Job, staleness: int, drift, loss) -> None:
    a = self.acct
    a.applied_steps += job.steps
    a.applied_jobs += 1
    a.staleness_sum += staleness
    self._pending.append((job.worker, staleness, drift, loss))

  def settle(self) -> None:
    """Reads the pending device scalars (one transfer) into the accounting."""
    if self._pending:
      for worker, staleness, drift, loss in jax.device_get(self._pending):
        if drift is not None:
          self.acct.drift_sum += float(drift)
          self.acct.drift_count += 1
        self.acct.contributions.append(
            [int(worker), int(staleness), None if drift is None else float(drift)])
        self.acct.loss_sum += float(loss)
        self.acct.loss_count += 1
      self._pending = []

  def take_train_loss(self) -> float | None:
    """Mean train loss of the jobs applied since the last call."""
    self.settle()
    a = self.acct
    if not a.loss_count:
      return None
    a.last_train_loss = a.loss_sum / a.loss_count
    a.loss_sum, a.loss_count = 0.0, 0
    return a.last_train_loss

  def progress(self) -> int:
    """Round-equivalents done: synchronous rounds, or W·H inner steps applied."""
    return self.acct.applied_steps // (self.plan.num_workers * max(self.plan.inner_steps))

  def state_dict(self) -> dict:
    self.settle()
    return {"acct": dataclasses.asdict(self.acct), "next_id": self.next_id,
            "dispatched_steps": self.dispatched_steps}

  def load_state(self, state: dict) -> None:
    self.acct = Accounting(**state["acct"])
    self.next_id, self.dispatched_steps = state["next_id"], state["dispatched_steps"]


class SyncRounds(Schedule):
  """Synchronous DiLoCo: every worker starts a round from the same global version; the
  round ends when the slowest finishes plus one ring all-reduce (all-gather if compressed)."""

  def __init__(self, plan: Plan, backend: Backend):
    super().__init__(plan, backend)
    ring = (plan.network.ring_allgather_seconds if plan.compressed
            else plan.network.ring_allreduce_seconds)
    self.comm_seconds = ring(range(plan.num_workers), plan.delta_bytes)

  def start(self, loop: EventLoop) -> None:
    self._begin_round(loop)

  def _begin_round(self, loop: EventLoop) -> None:
    p = self.plan
    jobs = [self._new_job(loop, w, GLOBAL, p.inner_steps[w]) for w in range(p.num_workers)]
    if p.num_workers > 1:  # a lone worker talks to nobody
      self.acct.bytes_sent += p.num_workers * p.delta_bytes
    end = loop.now + max(j.compute_seconds for j in jobs) + self.comm_seconds
    loop.schedule(end, "round_end", jobs=[dataclasses.asdict(j) for j in jobs])

  def handle(self, event: Event, loop: EventLoop) -> None:
    if event.kind != "round_end":
      raise ValueError(f"unexpected event {event.kind!r}")
    jobs = sorted((Job(**j) for j in event.data["jobs"]), key=lambda j: j.worker)
    losses, drift, staleness = self.backend.sync_round(jobs)  # in worker order
    for job, loss in zip(jobs, losses):
      self._applied(job, staleness=staleness, drift=drift, loss=loss)
    if self.backend.version(GLOBAL) < self.plan.rounds:
      self._begin_round(loop)

  def progress(self) -> int:
    return self.backend.version(GLOBAL)


class GossipRounds(SyncRounds):
  """Rounds without a global collective (NoLoCo): after its round-t job each worker swaps
  `delta_bytes` with its round's peer (`peers(t)[w]`) over the link between their regions,
  both ways at once, and starts round t+1 when the peer's message has arrived. A pair waits
  for its own slower member only, not for the slowest worker. With r_w the time worker w
  starts round t, c_w its compute and p its peer,

      r'_w = max(r_w + c_w, r_p + c_p) + transfer(region_p → region_w, delta_bytes)

  The math is the lockstep sync's (a pair's step reads only the pair's round-t state), run
  when the round's last exchange is done; jobs carry their own start times."""

  def __init__(self, plan: Plan, backend: Backend, peers):
    Schedule.__init__(self, plan, backend)
    self.peers = peers  # round -> [peer of each worker]
    self.ready = [0.0] * plan.num_workers  # when each worker starts its next round

  def _begin_round(self, loop: EventLoop) -> None:
    p, net = self.plan, self.plan.network
    t = self.backend.version(GLOBAL)
    jobs = [self._new_job(loop, w, GLOBAL, p.inner_steps[w]) for w in range(p.num_workers)]
    for job in jobs:
      job.start = self.ready[job.worker]
    finish = [self.ready[j.worker] + j.compute_seconds for j in jobs]
    peer = self.peers(t)
    if p.num_workers > 1:
      self.acct.bytes_sent += p.num_workers * p.delta_bytes
    region = net.worker_region
    self.ready = [max(finish[w], finish[peer[w]])
                  + net.transfer_seconds(region[peer[w]], region[w], p.delta_bytes)
                  for w in range(p.num_workers)]
    loop.schedule(max(self.ready), "round_end", jobs=[dataclasses.asdict(j) for j in jobs])

  def state_dict(self) -> dict:
    return {**super().state_dict(), "ready": self.ready}

  def load_state(self, state: dict) -> None:
    super().load_state(state)
    self.ready = state["ready"]


class StreamingRounds(SyncRounds):
  """Streaming DiLoCo: a round is P segments of H/P steps; segment k ends with fragment k's
  ring all-reduce. The wire carries one fragment at a time, and the workers go on computing
  while it is on the wire: the result is needed τ steps into the next segment, so up to τ
  steps of compute hide the transfer (τ = 0: they wait for it, as in DiLoCo; τ = S: the
  result is needed when the next segment ends, as in one-step-delay DiLoCo).

  With c_w worker w's compute for the segment, e its end (the slowest worker's) and d the
  time the previous fragment's transfer is done, the next segment ends at

      e' = max_w [ max(e + (τ/S)·c_w, d) + (1 − τ/S)·c_w ]

  and its fragment is on the wire from max(e', d) for the ring's time. Syncs are events at
  the time their transfer is done (the math does not depend on when).
  """

  def __init__(self, plan: Plan, backend: Backend):
    Schedule.__init__(self, plan, backend)
    ring = (plan.network.ring_allgather_seconds if plan.compressed
            else plan.network.ring_allreduce_seconds)
    self.transfer_seconds = [ring(range(plan.num_workers), b) for b in plan.fragment_bytes]
    self.compute_end = 0.0  # e: when the slowest worker finished the last segment

  @property
  def segments(self) -> int:
    return len(self.plan.fragment_bytes)

  def start(self, loop: EventLoop) -> None:
    self._begin_segment(loop, 0)

  def _begin_segment(self, loop: EventLoop, k: int) -> None:
    p = self.plan
    steps = [h // self.segments for h in p.inner_steps]
    jobs = [self._new_job(loop, w, GLOBAL, steps[w], k) for w in range(p.num_workers)]
    if p.num_workers > 1:
      self.acct.bytes_sent += p.num_workers * p.fragment_bytes[k]
    arrived = loop.now  # the previous fragment's transfer is done (this event's time)
    hidden = [min(p.overlap_steps / s, 1.0) for s in steps]  # τ/S: at most the whole segment
    end = max(max(self.compute_end + h * j.compute_seconds, arrived)
              + (1.0 - h) * j.compute_seconds for j, h in zip(jobs, hidden))
    self.compute_end = end
    loop.schedule(max(end, arrived) + self.transfer_seconds[k], "segment_end", segment=k,
                  jobs=[dataclasses.asdict(j) for j in jobs])

  def handle(self, event: Event, loop: EventLoop) -> None:
    if event.kind != "segment_end":
      raise ValueError(f"unexpected event {event.kind!r}")
    k = event.data["segment"]
    jobs = sorted((Job(**j) for j in event.data["jobs"]), key=lambda j: j.worker)
    losses, drift, staleness = self.backend.sync_segment(jobs, k)  # in worker order
    for job, loss in zip(jobs, losses):
      self._applied(job, staleness=staleness, drift=drift, loss=loss)
    last = k == self.segments - 1
    if not last or self.backend.version(GLOBAL) < self.plan.rounds:
      self._begin_segment(loop, 0 if last else k + 1)

  def state_dict(self) -> dict:
    return {**super().state_dict(), "compute_end": self.compute_end}

  def load_state(self, state: dict) -> None:
    super().load_state(state)
    self.compute_end = state["compute_end"]


class AsyncWorkers(Schedule):
  """Asynchronous Local-SGD: a worker pulls the latest parameters of its server, computes H
  steps, sends its pseudo-gradient; the server applies it on arrival (outer rule: plain
  Nesterov or Delayed Nesterov, the backend's) and the worker pulls again, until the
  budget of inner steps is spent."""

  def server_of(self, worker: int) -> str:
    return GLOBAL

  def server_region(self, server: str) -> int:
    return self.plan.server_region

  def start(self, loop: EventLoop) -> None:
    for w in range(self.plan.num_workers):
      self._dispatch(loop, w)

  def _dispatch(self, loop: EventLoop, worker: int) -> bool:
    p = self.plan
    remaining = p.total_steps - self.dispatched_steps
    if remaining <= 0:
      return False
    server = self.server_of(worker)
    region, home = p.network.worker_region[worker], self.server_region(server)
    job = self._new_job(loop, worker, server, min(p.inner_steps[worker], remaining))
    down = p.network.transfer_seconds(home, region, p.param_bytes)
    up = p.network.transfer_seconds(region, home, p.delta_bytes)
    self.acct.bytes_sent += p.delta_bytes
    self.acct.server_bytes_sent += p.param_bytes
    loop.schedule(loop.now + down + job.compute_seconds + up, "arrive",
                  job=dataclasses.asdict(job))
    return True

  def handle(self, event: Event, loop: EventLoop) -> None:
    if event.kind != "arrive":
      raise ValueError(f"unexpected event {event.kind!r}")
    self._arrive(loop, Job(**event.data["job"]))

  def _arrive(self, loop: EventLoop, job: Job) -> None:
    staleness = self.backend.version(job.server) - job.version
    drift, loss = self.backend.apply_job(job)
    self._applied(job, staleness, drift, loss)
    self._dispatch(loop, job.worker)


class Halos(AsyncWorkers):
  """HALoS: asynchronous workers behind one local parameter server per region; an LPS
  pushes its change to the global server once `sync_every` updates are unsent (and no push
  is in flight) and merges the model it gets back. Updates applied while a push is in
  flight go with the next push; when the budget is spent, LPSs push what they have left."""

  def __init__(self, plan: Plan, backend: Backend):
    super().__init__(plan, backend)
    regions = sorted(set(plan.network.worker_region))
    # unsent: updates applied at the LPS and not yet in a push (those applied while a push
    # is in flight stay unsent and go with the next one).
    self.lps = {region_server(r): {"region": r, "unsent": 0, "pushing": False,
                                   "running": 0} for r in regions}

  def server_of(self, worker: int) -> str:
    return region_server(self.plan.network.worker_region[worker])

  def server_region(self, server: str) -> int:
    return self.plan.server_region if server == GLOBAL else self.lps[server]["region"]

  def _dispatch(self, loop: EventLoop, worker: int) -> bool:
    started = super()._dispatch(loop, worker)
    if started:
      self.lps[self.server_of(worker)]["running"] += 1
    return started

  def handle(self, event: Event, loop: EventLoop) -> None:
    p = self.plan
    if event.kind == "arrive":
      job = Job(**event.data["job"])
      lps = self.lps[job.server]
      lps["running"] -= 1
      lps["unsent"] += 1
      self._arrive(loop, job)
      self._maybe_push(loop, job.server)
    elif event.kind == "push_arrive":  # at the GPS: apply, reply with its model
      self.backend.apply_push(GLOBAL, event.data["msg"])
      reply = self.new_id()
      self.backend.send_params(GLOBAL, reply)
      src = event.data["src"]
      self.acct.server_bytes_sent += p.param_bytes
      loop.schedule(loop.now + p.network.transfer_seconds(
          p.server_region, self.lps[src]["region"], p.param_bytes), "params_arrive",
          dst=src, msg=reply)
    elif event.kind == "params_arrive":  # back at the LPS
      dst = event.data["dst"]
      self.backend.merge(dst, event.data["msg"], p.merge_alpha)
      self.lps[dst]["pushing"] = False
      self._maybe_push(loop, dst)
    else:
      raise ValueError(f"unexpected event {event.kind!r}")

  def _maybe_push(self, loop: EventLoop, server: str) -> None:
    p, lps = self.plan, self.lps[server]
    finished = self.dispatched_steps >= p.total_steps and lps["running"] == 0
    due = lps["unsent"] >= p.sync_every or (finished and lps["unsent"] > 0)
    if lps["pushing"] or not due:
      return
    msg = self.new_id()
    self.backend.push_update(server, msg)
    lps["pushing"], lps["unsent"] = True, 0
    self.acct.server_bytes_sent += p.param_bytes
    loop.schedule(loop.now + p.network.transfer_seconds(lps["region"], p.server_region,
                                                        p.param_bytes),
                  "push_arrive", src=server, msg=msg)

  def state_dict(self) -> dict:
    return {**super().state_dict(), "lps": self.lps}

  def load_state(self, state: dict) -> None:
    super().load_state(state)
    self.lps = state["lps"]
