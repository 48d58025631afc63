"""A quorum round on the Ray runtime (synchronous algorithms): what the open round has
taken, and when it closes. It closes once `ray.min_quorum` workers (0: every live one) have
contributed from its θ and `ray.grace_s` has passed since, or once every live worker has.
Late contributions (from an older round's θ) fold into it without counting toward its
quorum."""

import time

from lowcomm_jax.runtimes.ray.accounts import Counts


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
