"""Where a worker that is behind, or new, takes the run's state from: torchft's heal, peer
to peer. It adopts a current peer's replica (θ, the outer state, the
version; NoLoCo's replica holds the peer's own row of the sync's state, φ and δ, which the
joiner takes as its own); a worker whose process starts fresh also takes what its algorithm
keeps per worker across rounds (`WorkerProcess.heal_state`): the peer's inner optimizer
state, every algorithm with local steps, and its local model where θ_w outlives a round
(`Algorithm.keeps_worker_params`: Streaming, eager), from a peer of its width. A worker one
round behind takes that round's inputs instead and runs its last step itself (catch_up.py).
Sources are spread by load: the current peer that served the fewest adopts. In the server
form a joiner takes θ from the server and only its per-worker state from a peer
(`Heals.state_for`)."""

import collections


def heal_source(currents: list[int], served, hidden, fresh: int | None) -> int | None:
  """Of the `currents` (ids, ascending), the one that served the fewest adopts (the lowest
  id on a tie); for a `fresh` worker one of its own width first (`hidden(w)`: worker w's
  FFN units), whose state has its shapes."""
  if fresh is not None:
    currents = [w for w in currents if hidden(w) == hidden(fresh)] or currents
  return min(currents, key=lambda w: (served[w], w), default=None)


class Heals:
  """The driver's side: which peer each adopt takes from, and whether it heals."""

  def __init__(self, d):
    self.d = d
    self.enabled = d.r.algorithm.local_steps  # (DDP's workers keep nothing)
    self.served = collections.Counter()  # worker -> the adopts it was the source of
    self.taken = collections.Counter()  # what the adopts carried (told in the jobs' metas)

  def _hidden(self, worker: int) -> int:
    return self.d.pool.rows.host_of[worker].hidden  # (a joiner's row too)

  def source(self, currents: list[int], worker: int, fresh: bool) -> int | None:
    return heal_source(currents, self.served, self._hidden,
                       worker if fresh and self.enabled else None)

  def adopt(self, worker: int, source: int, fresh: bool, version: int, behind: int | None):
    """`worker`'s adopt of `source`'s replica at `version` (the reference): with the
    source's per-worker state where `worker` starts fresh and has its width; from version
    `behind`, one round back, that round's inputs where the source has them."""
    actors = self.d.pool.actors
    heal = (actors[source].heal_state.remote(version) if fresh and self.enabled
            and self._hidden(source) == self._hidden(worker) else None)
    self.served[source] += 1
    share = actors[source].share.remote(None if fresh or behind != version - 1 else behind)
    return actors[worker].adopt.remote(share, heal)

  def state_for(self, worker: int):
    """A worker that joins in the server form, where no replica comes with it: the state
    (`heal_state`, a reference) of the live peer of its width that `source` picks, as it
    was before the peer's job in flight, the one whose push the driver has not taken (so
    the same run joins the same state, however far that job got); or None (nothing kept
    per worker, or no peer of its width up)."""
    pool = self.d.pool
    source = self.source([w for w in pool.up() if w != worker], worker, fresh=True)
    if not self.enabled or source is None or self._hidden(source) != self._hidden(worker):
      return None
    self.served[source] += 1
    in_flight = pool.jobs.get(source)
    ref = pool.actors[source].heal_state.remote(
        order=in_flight.order if in_flight is not None else -1)
    # Taken before the driver hands the source anything more (it waits here; the state goes
    # from peer to joiner, not through the driver): then it is the state before the job in
    # flight, whatever the order of the source's threads.
    pool.ray.wait([ref], timeout=self.d.c.ray.recover_timeout_s, fetch_local=False)
    return ref

  def count(self, meta: dict) -> None:
    """A contribution's meta: the adopt or heal its worker took before it, if any."""
    healed = meta.get("healed")
    if healed:
      how = HOW[healed["how"]]
      self.taken[how] += 1
      self.taken[f"{how}_bytes"] += healed["bytes"]

  def summary(self) -> dict:
    return {k: self.taken[k] for how in HOW.values() for k in (how, f"{how}_bytes")}


# What a worker took, as its contribution's meta names it -> the summary's count of it: a
# round's inputs (catch_up.py), a whole replica (with its state where it starts fresh), a
# peer's state alone (a joiner of the server form, which takes θ from the server).
HOW = {"round": "rounds_caught_up", "replica": "replicas_adopted", "state": "joiners_healed"}
