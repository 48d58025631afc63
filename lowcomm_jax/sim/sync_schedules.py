"""Synchronous schedules: DiLoCo's rounds, Streaming DiLoCo's segments, NoLoCo's gossip.
Their collectives are timed by sim/collectives.py (alone on the wire: a synchronous round's
transfers are the only ones); gossip's pairwise exchanges share links through sim/flows.py."""

import dataclasses

from lowcomm_jax.sim import collectives
from lowcomm_jax.sim.collectives import SERVER, node
from lowcomm_jax.sim.events import Event, EventLoop
from lowcomm_jax.sim.flows import deliveries
from lowcomm_jax.parallel.server_names import GLOBAL
from lowcomm_jax.sim.schedules import Backend, Job, Plan, Schedule


def collective_seconds(plan: Plan, nbytes: float) -> tuple[float, str]:
  """(seconds, the collective used) of one synchronous aggregation of `nbytes` per worker:
  a dense mean is all-reduced, a codec's payloads all-gathered, or reduce-scattered and
  all-gathered as a dense mean is (compress.reduce='scatter': 2·(W−1)/W payloads a link)."""
  op = "allgather" if plan.gathers else "allreduce"
  return collectives.seconds(plan.network, op, range(plan.num_workers), nbytes,
                             plan.collective)


class SyncRounds(Schedule):
  """Synchronous DiLoCo: every worker starts a round from the same global version; the
  round ends when the slowest finishes plus one all-reduce (all-gather where a codec's payloads are gathered whole).
  With `collective='server'` the round is the Ray runtime's instead: each worker pulls θ
  from the parameter server, computes, and sends its contribution back; the round ends at
  the last arrival (`_server_round_seconds`)."""

  def __init__(self, plan: Plan, backend: Backend, *, state_due=None,
               state_part_bytes: int = 0):
    super().__init__(plan, backend)
    if plan.collective == SERVER:
      self.comm_seconds, self.collective_used = 0.0, SERVER
    else:
      self.comm_seconds, self.collective_used = collective_seconds(plan, plan.delta_bytes)
    # Workers' own state averaged before some rounds (DES-LOC's moments): which parts before
    # the round after `completed` rounds, and each part's bytes per worker (a dense
    # all-reduce ahead of the round's compute).
    self.state_due, self.state_part_bytes = state_due, state_part_bytes

  def start(self, loop: EventLoop) -> None:
    self._begin_round(loop)

  def _state_seconds(self) -> float:
    p = self.plan
    parts = self.state_due(self.backend.version(GLOBAL)) if self.state_due else ()
    nbytes = len(parts) * self.state_part_bytes
    if not nbytes or p.num_workers < 2:
      return 0.0
    self.acct.bytes_sent += p.num_workers * nbytes
    how = "auto" if p.collective == SERVER else p.collective  # timed as the all-reduce it is
    return collectives.seconds(p.network, "allreduce", range(p.num_workers), nbytes, how)[0]

  def _begin_round(self, loop: EventLoop) -> None:
    p = self.plan
    state_seconds = self._state_seconds()
    jobs = [self._new_job(loop, w, GLOBAL, p.inner_steps[w]) for w in range(p.num_workers)]
    if p.collective == SERVER:
      self.acct.bytes_sent += p.num_workers * p.delta_bytes
      self.acct.server_bytes_sent += p.num_workers * p.param_bytes
      end = loop.now + state_seconds + self._server_round_seconds(jobs)
    else:
      if p.num_workers > 1:  # a lone worker talks to nobody
        self.acct.bytes_sent += p.num_workers * p.delta_bytes
      end = (loop.now + state_seconds + max(j.compute_seconds for j in jobs)
             + self.comm_seconds)
    loop.schedule(end, "round_end", jobs=[dataclasses.asdict(j) for j in jobs])

  def _server_round_seconds(self, jobs: list[Job]) -> float:
    """A parameter server's round: every worker pulls θ (dense) at its start and computes
    once it has arrived; the server then takes the contributions (the codec's payloads) one
    at a time, in the order they are ready. The pulls share the server's way out; the
    contributions go the other way (links are full duplex), each alone on its path."""
    p, net = self.plan, self.plan.network
    server = (GLOBAL, net.server_region)
    ends = [(node(j.worker), net.worker_region[j.worker]) for j in jobs]
    pulled = deliveries(net, [(0.0, *server, *end, p.param_bytes) for end in ends])
    taken = 0.0
    for ready, end in sorted((t + j.compute_seconds, end)
                             for t, j, end in zip(pulled, jobs, ends)):
      start = max(ready, taken)
      taken = deliveries(net, [(start, *end, *server, p.delta_bytes)])[0]
    return taken

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
  `delta_bytes` with its round's peer (`peers(t)[w]`), both ways at once, and starts round
  t+1 when the peer's message has arrived. A pair waits for its own slower member only,
  not for the slowest worker. With r_w the time worker w starts round t, c_w its compute
  and p its peer, p's message leaves at max(r_w + c_w, r_p + c_p) and r'_w is its arrival.
  A round's exchanges share the links (sim/flows.py) with each other, not with the
  neighbouring rounds' (those overlap only where pairs drift apart).

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
    sends = [(max(finish[w], finish[peer[w]]), collectives.node(peer[w]), region[peer[w]],
              collectives.node(w), region[w], p.delta_bytes) for w in range(p.num_workers)]
    self.ready = deliveries(net, sends)
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
    timed = [collective_seconds(plan, b) for b in plan.fragment_bytes]
    self.transfer_seconds = [t for t, _ in timed]
    self.collective_used = timed[0][1]
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
