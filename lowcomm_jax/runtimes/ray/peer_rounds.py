"""Quorum rounds in the peer form (replicas.py: the driver's side of the workers' replicas,
and what differs from the server form): the quorum's control plane of quorum.py, each
round closed by its members' collective; a delayed sync's collective beside the next jobs."""

import time

from lowcomm_jax.runtimes.ray.quorum import QuorumRounds
from lowcomm_jax.runtimes.ray.replicas import Replicas


class PeerRounds(Replicas, QuorumRounds):
  """Quorum rounds whose contributions stay with their workers until the round's collective.

  Streaming's τ > 0 (a mix inside every segment): a segment's close starts its collective
  and the next segment's jobs at once; each job runs its τ steps before the mix (which read
  nothing of θ: `Programs.local_halves`), then waits for its replica to commit the round and
  mixes the new fragment in, as the lockstep runtime's τ defines it. The driver settles the
  collective meanwhile.

  A delayed sync (`Algorithm.delayed_sync`: one-step delay, eager), a dense mean and one
  segment: the round's close takes θ' on every member at once (`advance`: θ', and what a
  worker rule reads of the outer state, do not depend on the round's own mean), the next
  jobs start from it,
  and the round's collective runs while they compute, as the lockstep runtime runs it in the
  next round's program. It is settled (waited for, tried again without members lost,
  committed) before the next round closes, and before anything reads or copies a replica
  (evaluation, a checkpoint, a heal)."""

  def __init__(self, d):
    super().__init__(d)
    r = d.r
    self.overlaps = r.algorithm.delayed_sync and self.reduces and self.segments == 1
    # A mix inside every segment (Streaming's τ > 0): a segment's collective runs while the
    # next segment's first τ steps compute (`Programs.local_halves`: they read nothing of θ)
    halves = r.programs.local_halves
    self.streams = (self.segments > 1 and bool(halves)
                    and all(pair is not None for pair in halves[0]))
    # the round whose collective runs meanwhile: (version, {worker: (meta, sent)}, its
    # members, their staged references, when it began)
    self.pending = None

  def _rows_of(self, v: int) -> dict:
    if self.pending is not None and self.pending[0] == v:
      return self.pending[1]
    return self.rows

  def _settle(self) -> None:
    """The round in flight's collective, waited for (tried again among its members left)
    and committed."""
    if self.pending is None:
      return
    d, n = self.d, self.d.counts
    v, rows, members, staged, began = self.pending
    while members:
      outcome, attempt = self._collective(v, members, staged)
      if outcome is not None:
        self._commit(v, members, outcome, attempt.form)
        d.timeline.collective(v, members, began, outcome, time.time())
        break
      n.collective_retries += 1
      members, staged = [w for w in members if w in d.pool.actors], None
    self.pending = None
    self._applied(rows[w] for w in members)

  def _applied(self, rows) -> None:
    """Counts the inner steps of the contributions a round's collective applied."""
    d, n = self.d, self.d.counts
    n.applied_steps += sum(meta["steps"] for meta, _ in rows)
    d.timeline.applied(n.applied_steps)

  def global_call(self, method: str):
    self._settle()
    return super().global_call(method)

  def global_states(self, in_flight) -> dict:
    self._settle()
    return super().global_states(in_flight)

  def _bring_up(self, worker: int):
    if self.held.get(worker) != self.version and worker not in self.adopting:
      self._settle()  # (a peer's replica is copied whole: with the round in flight applied)
    return super()._bring_up(worker)

  def _advance(self) -> None:
    """The open round's θ' on each of its members (`advance`), its collective started. A
    member that dies taking θ' is lost with its contribution."""
    d, pool = self.d, self.d.pool
    v = self.version
    self._settle_adopts([w for w in self.rows if w in self.adopting])
    members = [w for w in sorted(self.rows) if w in pool.actors]
    tokens = [float(self.rows[w][0]["tokens"]) for w in members]
    losses = [float(self.rows[w][0].get("loss", 0.0)) for w in members]
    refs = {w: pool.actors[w].advance.remote(v, members, tokens, losses) for w in members}
    d.counts.collective_calls += len(members)
    hashes = {}
    for w, ref in refs.items():
      try:
        hashes[w] = d.ray.get(ref)
      except d.ray.exceptions.RayActorError as e:
        pool.lose(w, f"{type(e).__name__} taking round {v}'s θ'")
    if len(set(hashes.values())) > 1:
      raise RuntimeError(f"round {v}: the members' θ' differ ({hashes}); the replicas have "
                         "diverged")
    self._start_pending(v, [w for w in members if w in hashes and w in pool.actors])

  def _start_pending(self, v: int, members: list[int]) -> None:
    """Round `v`'s collective among `members` started, not waited for (`_settle` does); the
    version moves on."""
    d, pool = self.d, self.d.pool
    rows, self.rows = self.rows, {}
    for w in members:
      self.held[w] = v + 1
    if members:
      began = time.time()
      self.pending = (v, rows, members, None, began)  # (_rows_of(v) finds its rows now)
      self.pending = (v, rows, members, self._start_collective(v, members), began)
    else:  # nobody contributed: θ stays, every current replica moves on
      for w in [w for w, h in self.held.items() if h == v and w in pool.actors]:
        d.ray.get(pool.actors[w].skip.remote(v))
        self.held[w] = v + 1
    self.version = v + 1

  def resume_job(self, job: dict) -> None:
    """A checkpoint's job in flight, started again (from the restored θ: a job that had
    started from an older one starts from it too)."""
    self.d.pool.dispatch_own(job["worker"], self.version, job["lr_step"], job["steps"],
                             job["order"])

  # --- jobs -------------------------------------------------------------------------------

  def _dispatch(self, worker: int, lr_step: int, steps: int) -> None:
    """A job from the worker's own replica, brought up to the open round first."""
    self.d.pool.dispatch_own(worker, self._bring_up(worker), lr_step, steps)

  def _contribute(self, job, meta: dict) -> int | None:
    """Keeps the contribution's reference in the open round (the bytes stay with its
    worker); a late one's replica is brought to the open round's θ before it closes."""
    self.adopting.pop(job.worker, None)  # (its job waited for its adopt)
    staleness = self.version - meta["version"]
    if staleness % self.segments:  # another segment's fragment: no round of it is open
      return None
    if staleness:
      self._bring_up(job.worker)
    self.rows[job.worker] = (meta, job.sent)
    return staleness

  # --- a state average between rounds (DES-LOC's moments), among the workers ------------

  def _state_average(self, workers: list[int], parts) -> int | None:
    """Each worker's parts in M shards, member j's mean of shard j, all-gathered into each
    (forms.mean_of): no link carries every worker's parts. The bytes of the parts."""
    outcome = self._mean_among("a state average", workers, "mean_state", parts=parts)
    if outcome is None:
      return None
    for w, out in outcome.items():
      self._count_wire(w, out)
    return sum(out["bytes"] for out in outcome.values())

  def work_to_mark(self) -> bool:
    done = super().work_to_mark()
    if done:  # the last round's collective, before the run's end reads a replica
      self._settle()
    return done

  def _close_segment(self) -> bool:
    d, n = self.d, self.d.counts
    self._settle()
    if self.overlaps:  # (its steps are counted when its collective is settled)
      self._advance()
    elif self.streams:  # the next jobs start now; their first τ steps read nothing of θ
      self._settle_adopts([w for w in self.rows if w in self.adopting])
      self._start_pending(self.version, [w for w in sorted(self.rows) if w in d.pool.actors])
    else:
      self._applied(self._close_collective().values())
    self.segment = (self.segment + 1) % self.segments
    n.rounds += self.segment == 0
    self.round.open()
    d.idle_start()
    if self.streams:  # meanwhile: each job waits for its replica's commit to mix it in
      self._settle()
    return self.segment == 0
