"""Quorum rounds on the Ray runtime (`Algorithm.progress` 'rounds': the synchronous
algorithms). Each worker computes from round t's θ and contributes; round t closes once
`ray.min_quorum` workers (0: every live one) have contributed from its θ and `ray.grace_s`
has passed since, or once every live worker has; the workers that contributed then start
from the new θ. Late contributions (from an older round's θ) fold into the open round,
weighted by tokens like the others, without counting toward its quorum; their staleness
(rounds) is recorded. A mark per round."""

import time

from lowcomm_jax.runtimes.ray.accounts import Counts
from lowcomm_jax.runtimes.ray.progress import Progress


class QuorumRounds(Progress):

  late_figures = True

  def __init__(self, d):
    super().__init__(d)
    self.round = QuorumRound(d.counts, d.c.ray.min_quorum, d.c.ray.grace_s)

  def start_next(self, worker: int, clock: int | None = None) -> None:
    """`worker`'s next job, from the open round's θ (every worker, every round); its inner
    lr schedule at the rounds' steps of its own H (its host's schedule spans rounds × H)."""
    del clock
    d = self.d
    if d.counts.rounds < d.c.rounds:
      d.pool.dispatch(worker, d.counts.rounds * d.pool.configured_inner_steps(worker),
                      d.pool.inner_steps_of(worker))

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
    info = d.pool.call("contribute", meta, job.sent, changes=True)
    n.late += info["staleness"] > 0
    self.round.steps += job.steps
    n.contributed(job.worker, meta, info["staleness"], None)
    d.pool.chaos()

  def _close_round(self) -> None:
    d, n = self.d, self.d.counts
    d.pool.call("close_round", changes=True)
    n.rounds += 1
    n.applied_steps += self.round.steps
    self.round.open()
    d.idle_start()  # every worker that contributed starts from the new θ

  def work_to_mark(self) -> bool:
    pool = self.d.pool
    while not self._budget_spent():
      if self.round.due(set(pool.up()), bool(pool.joining), pool.jobs):
        self._close_round()
        break
      job = pool.next_done(self.round.wait_s())
      if job is not None:
        self._take(job)
    return self._budget_spent()

  def opened(self) -> None:
    """The run (re)started: the open round starts counting now."""
    self.round.open()

  def summary(self) -> dict:
    return {"rounds_closed": self.d.counts.rounds}


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
