"""Schedules decide *when*: which worker starts which job from which server version, when
its contribution arrives, when servers talk. The backend (the driver, lowcomm_jax/
runtimes/simulator/backend.py) does the math: inner steps, outer rules, merges. A schedule only sees
versions, virtual times and byte counts, so it is plain Python and checkpoints as JSON (the
device scalars the backend hands back are read in one transfer when metrics are due).

A `Job` is H inner steps of one worker from one server's current parameters. The backend
pulls the parameters when the job starts and computes the pseudo-gradient at the next
`flush` (jobs pulled from the same version with the same H are vmapped together); the
schedule later asks it to apply the contribution. New schedules (Streaming DiLoCo's
fragments, one-step-delay or eager overlap) are new subclasses that pull, flush and apply on
other events; the event loop, the backend and the accounting stay as they are. This module
holds what every schedule shares; the synchronous ones are sim/sync_schedules.py, the
asynchronous ones sim/async_schedules.py.
"""

import dataclasses
from typing import Any, Protocol

import jax

from lowcomm_jax.sim.events import Event, EventLoop
from lowcomm_jax.sim.network import Network
from lowcomm_jax.sim.speeds import SpeedModel

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
  # synchronous aggregation all-gathers payloads (a codec's, compress.reduce='gather')
  # instead of all-reducing (a dense mean, or a codec's quantized reduce-scatter)
  gathers: bool
  collective: str = "auto"  # synchronous rounds: ring | hierarchical | direct | auto
  # (sim/collectives.py)
  # regional servers' exchange with the global one (algorithms/base.ExchangeRule: HALoS's
  # declaration), None without regional servers
  exchange_rule: Any = None
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
  applied_steps_by_worker: list[int]  # inner steps applied at a server, per worker
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

  collective_used: str | None = None  # synchronous schedules: ring | hierarchical | direct

  def __init__(self, plan: Plan, backend: Backend):
    self.plan, self.backend = plan, backend
    w = plan.num_workers
    self.acct = Accounting([0.0] * w, [0] * w, [0] * w)
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
    a.applied_steps_by_worker[job.worker] += job.steps
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
