"""The Ray runtime's records: a job in flight (`Job`) and the run's accounts (`Counts`,
checkpointed as JSON)."""

import dataclasses
import time

from lowcomm_jax.parallel.server_names import GLOBAL


@dataclasses.dataclass
class Job:
  worker: int
  order: int  # dispatch order (apply_order='dispatch' takes results in this order)
  lr_step: int
  steps: int
  version: object  # ObjectRef of the pulled version (an int); a micro-batch's: the int
  meta: object  # ObjectRef of the job's meta dict
  sent: object  # ObjectRef of what it sends (Δ, or the codec's payload); None: a micro-batch
  micro: bool = False  # a collaborative epoch's micro-batch (its θ is not the server's hold)
  server: str = GLOBAL  # the server it pulled from and pushes to
  dispatched_at: float = 0.0  # time.time() at its dispatch (the Timeline's)
  own: bool = False  # from its worker's own replica (the peer form): no server's pull

  def record(self, version: int) -> dict:
    """What a checkpoint keeps of a job in flight (a resumed run starts it again)."""
    out = {"worker": self.worker, "order": self.order, "lr_step": self.lr_step,
           "steps": self.steps, "version": version, "server": self.server}
    return {**out, "own": True} if self.own else out


@dataclasses.dataclass
class Counts:
  """The run's accounts (JSON: checkpointed in the meta)."""
  dispatched_steps: int = 0  # of jobs started and not lost
  applied_steps: int = 0  # of contributions applied (or in a closed round)
  pushes: int = 0  # contributions applied (asynchronous) or taken into a round (quorum)
  sent_bytes: int = 0  # what those contributions' payloads held (a fragment's, a codec's)
  rounds: int = 0  # quorum rounds closed
  late: int = 0  # quorum: contributions computed from an older round's θ
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
  global_pushes: int = 0  # HALoS: regional servers' pushes to the global server
  micro_batches: int = 0  # collaborative epochs: micro-batches counted
  samples: int = 0  # collaborative epochs: samples in closed epochs
  samples_lost: int = 0  # of peers lost mid-epoch, and micro-batches past the grace window
  server_restarts: int = 0
  pushes_replayed: int = 0
  next_order: int = 0
  next_worker: int = 0  # the id a new worker gets
  pushes_per_worker: dict = dataclasses.field(default_factory=dict)
  compute_seconds: dict = dataclasses.field(default_factory=dict)
  recoveries: list = dataclasses.field(default_factory=list)  # {"what", "seconds", ...}
  chaos_done: int = 0  # chaos events already fired
  collective_retries: int = 0  # peer form: rounds' collectives tried again among survivors
  collective_calls: int = 0  # peer form: the driver's calls to members for collectives
  # (an attempt's one message each, a commit each, an abort each: O(W) a round)
  wire_bytes: dict = dataclasses.field(default_factory=dict)  # peer form: worker -> [sent,
  # received] on its own link by rounds' collectives (the arrays it sent and took)

  def wire(self, worker: int, out: dict) -> None:
    """A collective member's outcome's bytes on its own link ({"sent", "received"})."""
    sent, received = self.wire_bytes.get(str(worker), [0, 0])
    self.wire_bytes[str(worker)] = [sent + out["sent"], received + out["received"]]

  def contributed(self, worker: int, meta: dict, staleness: int, drift,
                  weight: float = 1.0) -> None:
    """One contribution taken; its train loss counts `weight` times (an epoch's: its
    samples)."""
    w = str(worker)
    self.pushes += 1
    self.sent_bytes += meta.get("bytes", 0)
    self.staleness_sum += staleness
    self.staleness_histogram[str(staleness)] = self.staleness_histogram.get(str(staleness), 0) + 1
    if drift is not None:
      self.drift_sum += drift
      self.drift_count += 1
    self.loss_sum += weight * meta["loss"]
    self.loss_count += weight
    self.pushes_per_worker[w] = self.pushes_per_worker.get(w, 0) + 1
    self.compute_seconds[w] = self.compute_seconds.get(w, 0.0) + meta["compute_seconds"]

  def figures(self, tokens: int, num_workers: int, quorum: bool) -> dict:
    """The figures both a metrics row and the summary report (bytes: per worker, of the
    payloads as sent)."""
    out = {"total_inner_steps": self.applied_steps, "tokens": tokens, "pushes": self.pushes,
           "bytes_sent": self.sent_bytes // num_workers,
           "mean_staleness": self.staleness_sum / max(self.pushes, 1),
           "mean_drift": self.drift_sum / max(self.drift_count, 1),
           "workers_joined": self.workers_joined, "workers_lost": self.workers_lost,
           "pushes_dropped": self.pushes_dropped}
    if quorum:
      out["late_contributions"] = self.late
    return out

  def run_figures(self, plan, num_workers: int) -> dict:
    """What only the summary reports: per worker, staleness, recoveries and bytes."""
    return {
        "train_loss": self.last_train_loss, "pushes_per_worker": self.pushes_per_worker,
        "staleness_histogram": dict(sorted(self.staleness_histogram.items(),
                                           key=lambda kv: int(kv[0]))),
        "server_restarts": self.server_restarts, "pushes_replayed": self.pushes_replayed,
        "recoveries": self.recoveries, "compute_seconds_per_worker": self.compute_seconds,
        "bytes_sent_total": self.sent_bytes, "wire_bytes_per_worker": self.wire_bytes,
        "collective_retries": self.collective_retries,
        "collective_calls": self.collective_calls,
        "server_bytes_sent": self.pushes * plan.param_bytes,
        "bytes_sent_ddp_equivalent": plan.param_bytes * self.applied_steps // num_workers}


class Timeline:
  """This invocation's clock, which a replay in the simulator is held against
  (bench/real_vs_sim.py): when the applied inner steps changed, in seconds since the first
  job was dispatched; each worker's measured compute seconds per inner step, job by job
  (the first includes its compilation); and each job's moments, [worker, steps, dispatched,
  started (its θ fetched), finished (its contribution ready), taken (by the server)], in
  seconds on the same clock (every process reads the machine's time.time(): one machine, or
  clocks kept in sync). Not checkpointed: a resumed run starts a new one."""

  def __init__(self):
    self.start: float | None = None  # time.time() at the first dispatch
    self.points: list = []  # [seconds, applied inner steps]
    self.step_seconds: dict = {}  # worker -> [compute seconds per inner step of each job]
    self.losses: dict = {}  # worker -> [each job's mean train loss]
    self.jobs: list = []
    self.collectives: list = []

  def open(self, applied_steps: int) -> None:
    self.start, self.points = time.time(), [[0.0, applied_steps]]

  def applied(self, steps: int) -> None:
    if self.start is not None and steps != self.points[-1][1]:
      self.points.append([round(time.time() - self.start, 4), steps])

  def job(self, job: Job, meta: dict) -> None:
    """A contribution taken: `job` as dispatched, `meta` as its worker returned it."""
    if not meta.get("steps") or self.start is None:
      return
    self.step_seconds.setdefault(str(meta["worker"]), []).append(
        round(meta["compute_seconds"] / meta["steps"], 6))
    self.losses.setdefault(str(meta["worker"]), []).append(round(meta["loss"], 5))
    moments = (job.dispatched_at, meta.get("started_at"), meta.get("finished_at"), time.time())
    self.jobs.append([meta["worker"], meta["steps"]] + [
        None if t is None else round(t - self.start, 4) for t in moments])

  def collective(self, version: int, members: list[int], began: float, outcome: dict,
                 committed: float) -> None:
    """A round's collective among its members (the peer form): [version, members, began
    (the driver asked for the shards), scattered, reduced, staged (the last member's end of
    each phase), committed, {each moment a member told ("began": its part's start, ...):
    [the first member's, the last's]}], times on the same clock, from the run's start."""
    if self.start is None:
      return
    times = lambda key: [o["moments"][key] for o in outcome.values()
                         if key in o.get("moments", {})]
    last = lambda key: max(times(key), default=None)
    moments = (began, last("scattered"), last("reduced"), last("staged"), committed)
    keys = sorted({k for o in outcome.values() for k in o.get("moments", {})})
    spans = {k: [round(min(times(k)) - self.start, 4), round(max(times(k)) - self.start, 4)]
             for k in keys}
    self.collectives.append([version, len(members)] + [
        None if t is None else round(t - self.start, 4) for t in moments] + [spans])

  def figures(self) -> dict:
    return {"timeline": self.points, "timeline_started_at": self.start,
            "step_seconds_by_job": self.step_seconds,
            "loss_by_job": self.losses,
            "job_moments": self.jobs, "collective_moments": self.collectives}
