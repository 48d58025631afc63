"""Where a worker that is behind, or new, takes the run's state from (the peer form):
torchft's heal, peer to peer. It adopts a current peer's replica (θ, the outer state, the
version); a worker whose process starts fresh also takes what its algorithm keeps per
worker across rounds, the peer's local model and inner optimizer (`WorkerProcess.heal_state`),
where θ_w outlives a round (`Algorithm.keeps_worker_params`: Streaming, eager; NoLoCo's own
rows are its sync's, which its replica holds). Sources are spread by load: the current peer
that served the fewest adopts."""

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
    self.enabled = d.r.algorithm.keeps_worker_params(d.c) and d.r.sync.partners is None
    self.served = collections.Counter()  # worker -> the adopts it was the source of

  def _hidden(self, worker: int) -> int:
    return self.d.pool.rows.host_of[worker].hidden  # (a joiner's row too)

  def source(self, currents: list[int], worker: int, fresh: bool) -> int | None:
    return heal_source(currents, self.served, self._hidden,
                       worker if fresh and self.enabled else None)

  def adopt(self, worker: int, source: int, fresh: bool, version: int):
    """`worker`'s adopt of `source`'s replica at `version` (the reference): with the
    source's per-worker state where `worker` starts fresh and has its width."""
    actors = self.d.pool.actors
    heal = (actors[source].heal_state.remote(version) if fresh and self.enabled
            and self._hidden(source) == self._hidden(worker) else None)
    self.served[source] += 1
    return actors[worker].adopt.remote(actors[source].share.remote(), heal)
