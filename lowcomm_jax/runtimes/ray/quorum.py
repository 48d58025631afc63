"""Quorum rounds on the Ray runtime (`Algorithm.progress` 'rounds': the synchronous
algorithms). A round is the algorithm's segments (one for most; Streaming DiLoCo's P
fragments are P), each a quorum of its own: every worker computes the segment from θ as the
last sync left it and contributes; the segment closes (the server runs its fragment's sync)
once `ray.min_quorum` workers (0: every live one) have contributed from its θ and
`ray.grace_s` has passed since, or once every live worker has; the workers that contributed
then start the next segment. Late contributions (from an older θ) fold into the open round
in their worker's row, without counting toward its quorum; their staleness (in syncs) is
recorded. Algorithms of several segments close only with every live worker
(`Algorithm.partial_rounds`). A mark per round.

Where the contributions go and how a segment closes is the policy's form (progress.py):
the server's sync (forms/server.py), or a collective among the segment's members
(replicas.py)."""

import logging
import time

from lowcomm_jax.runtimes.ray import records
from lowcomm_jax.runtimes.ray.accounts import Counts
from lowcomm_jax.runtimes.ray.progress import Progress


class QuorumRounds(Progress):

  late_figures = True

  def __init__(self, d, form):
    super().__init__(d, form)
    self.round = QuorumRound(d.counts, d.c.ray.min_quorum, d.c.ray.grace_s)
    self.segment = 0  # the open segment of the open round (marks are at round ends)
    self.segments = len(d.r.algorithm.segments(d.c, d.c.inner_steps))
    self.states_averaged = None  # the round whose workers' state average is done

  def start_next(self, worker: int, clock: int | None = None) -> None:
    """`worker`'s next job, the open segment from its θ (every worker, every segment); its
    inner lr schedule at the round's steps of its own H (its host's schedule spans
    rounds × H), plus the segment's start."""
    del clock
    d = self.d
    if d.counts.rounds < d.c.rounds:
      if self.segment == 0:
        self._average_states()
        if worker not in d.pool.actors:  # it died in the average
          return
      configured = d.pool.rows.configured_inner_steps(worker)
      start = d.r.algorithm.segments(d.c, configured)[self.segment].start
      steps = d.r.algorithm.segments(d.c, d.pool.rows.inner_steps_of(worker))[self.segment].steps
      self.form.dispatch(worker, d.counts.rounds * configured + start, steps)

  def _average_states(self) -> None:
    """Before a round whose average of the workers' optimizer states is due
    (`Algorithm.state_sync`: DES-LOC's moments), once: every live worker's parts, their mean
    back to each (the form's `state_average`: a Ray task through the server, reduced among
    the workers in the peer form; the driver holds references only). A worker that dies before
    every part is in is lost and the rest average again without it; one that dies taking
    the mean is lost, the others keep theirs."""
    d, n, pool = self.d, self.d.counts, self.d.pool
    parts = d.r.state_sync_due(n.rounds)
    if not parts or self.states_averaged == n.rounds:
      return
    self.states_averaged = n.rounds
    while workers := [w for w in pool.up() if w not in pool.jobs]:
      sent = self.form.state_average(workers, parts)
      if sent is None:  # some worker died before every part was in: again without it
        continue
      n.sent_bytes += sent
      logging.info("ray: round %d starts from %s averaged over workers %s", n.rounds,
                   "/".join(parts), workers)
      return

  def mark(self) -> int:
    return self.d.counts.rounds

  def _budget_spent(self) -> bool:
    return self.d.counts.rounds >= self.d.c.rounds

  def _take(self, job) -> None:
    """A finished job's contribution, added to the open round (nothing if the job failed)."""
    d = self.d
    meta = d.pool.result(job)
    if meta is None:
      return
    n = d.counts
    staleness = self.form.contribute(job.worker, meta, job.sent, self.segments)
    if staleness is None:  # another segment's: nothing to join (a joiner's first job)
      n.pushes_dropped += 1
      d.pool.chaos()
      return
    n.late += staleness > 0
    self.round.steps += job.steps
    n.contributed(job.worker, meta, staleness, None)
    d.timeline.job(job, meta)
    d.pool.chaos()

  def _close_segment(self) -> bool:
    """The open segment's sync; whether it ended the round."""
    d, n = self.d, self.d.counts
    self.form.close_segment(self.round.steps)
    self.segment = (self.segment + 1) % self.segments
    n.rounds += self.segment == 0
    self.round.open()
    if self.segment == 0 and d.journals:  # before any next job starts
      records.send(d)
    d.idle_start()  # every worker that contributed starts the next segment from the new θ
    self.form.after_start()
    return self.segment == 0

  def work_to_mark(self) -> bool:
    pool = self.d.pool
    while not self._budget_spent():
      if self.round.due(set(pool.up()), bool(pool.joining), pool.jobs):
        if self._close_segment():
          break
        continue
      job = pool.next_done(self.round.wait_s())
      if job is not None:
        self._take(job)
    if self._budget_spent():  # the last round's collective, before the run's end reads θ
      self.form.finish()
    return self._budget_spent()

  def opened(self) -> None:
    """The run (re)started (at a round's end: marks are): the open round starts counting
    now, at its first segment."""
    self.segment = 0
    self.round.open()
    self.form.opened()

  def summary(self) -> dict:
    return {"rounds_closed": self.d.counts.rounds, **self.form.summary()}


class QuorumRound:

  def __init__(self, counts: Counts, min_quorum: int, grace_s: float):
    self.n, self.min_quorum, self.grace_s = counts, min_quorum, grace_s
    self.open()

  def open(self) -> None:
    """A new round, with no contribution yet."""
    self.opened_at_push, self.opened_late = self.n.pushes, self.n.late
    self.steps = 0  # the inner steps of its contributions
    self.quorum_at = None  # when it reached its quorum (time.monotonic)

  def due(self, live: set, joining: bool, in_flight) -> bool:
    """Whether it closes now: `live`, the workers that are up (one still starting is not
    waited for); `joining`, whether some are starting; `in_flight`, the workers with a
    job out."""
    if not live and joining:  # nobody is up yet: a round of nothing would be empty
      return False
    if not live & set(in_flight):  # every live worker has contributed (or none is left)
      return True
    fresh = (self.n.pushes - self.opened_at_push) - (self.n.late - self.opened_late)
    if fresh < min(self.min_quorum or len(live), len(live)):
      return False
    self.quorum_at = self.quorum_at or time.monotonic()
    return time.monotonic() - self.quorum_at >= self.grace_s

  def wait_s(self) -> float | None:
    """How long to wait for the next result: without limit before the quorum is in, the
    grace left after."""
    if self.quorum_at is None:
      return None
    return max(self.grace_s - (time.monotonic() - self.quorum_at), 0.0)
