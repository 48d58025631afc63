"""Collaborative epochs in the peer form (`forms.among_workers`): epochs.py's epoch
(micro-batches to the target, the grace window, each peer's mean gradient), with no server.

Every peer holds a replica of θ and DDP's rule state (replica.py). A micro-batch starts from
its peer's own replica, brought to the open epoch's version first (a peer that joined, or
one that sent nothing last epoch, adopts a current peer's replica). At the epoch's end each
peer that counted samples keeps its mean gradient, and the epoch's step is the quorum
rounds' collective among those peers (replicas.Replicas): shards reduced weighted by
samples (the tokens of the peer's meta) and all-gathered, or payloads all-gathered for a
codec, each member staging DDP's step, the hashes compared, then committed. A peer that
dies in it is lost with its samples and the collective runs again among the others."""

from lowcomm_jax.runtimes.ray.epochs import Epochs
from lowcomm_jax.runtimes.ray.replicas import Replicas


class PeerEpochs(Replicas, Epochs):

  def _open_theta(self) -> tuple[int, None]:
    return self.version, None  # (each peer's own replica)

  def _dispatch_micro(self, worker: int) -> None:
    """A micro-batch from the peer's own replica (its adopt first, where it is behind)."""
    self.pool.dispatch_micro(worker, self.version, self._bring_up(worker))

  def _contribute_epoch(self, worker: int, meta: dict, sent) -> int:
    """Its mean gradient stays with it (the replica kept it) until the epoch's collective."""
    self.adopting.pop(worker, None)  # (its micro-batches waited for its adopt)
    self.rows[worker] = (meta, sent)
    return 0

  def _apply_epoch(self, by_peer: dict[int, int]) -> set:
    del by_peer  # (the rows are the contributions)
    return set(self._close_collective())
