"""NoLoCo's rounds in the peer form: each member swaps with its round's peer alone
(forms/pairs.py); θ, the workers' mean φ, where a read needs it. The form quorum rounds
are given where the sync swaps with a peer (driver.py)."""

import jax
import numpy as np

from lowcomm_jax.runtimes.ray import checkpoints
from lowcomm_jax.runtimes.ray.actors import initial_rule_state
from lowcomm_jax.runtimes.ray.replicas import Replicas
from lowcomm_jax.runtimes.ray.replica import own_rows
from lowcomm_jax.parallel.server_names import GLOBAL


class PairReplicas(Replicas):
  """The peer form of a sync of pair swaps (`Sync.partners`: NoLoCo). Each worker's replica
  holds its own row of the sync's state (φ_i, δ_i); at a round's close each member sends
  its payload (θ_i) to its round's peer alone and stages its own new row: the ledger's N
  bytes each way per worker, no all-reduce. A member whose peer is not in the round keeps
  its own model (`Sync.fill_absent`'s rule), and a lost worker's row is its last
  checkpoint's. θ, the workers' mean φ, is reduced among the live workers only when
  evaluation, a norm or a checkpoint reads it (as the runner computes it only on rounds that
  read it): its bytes are counted apart (`consensus_bytes`), outside the training ledger."""

  def __init__(self, d):
    super().__init__(d)
    self.consensus_at = None  # the version whose θ the live replicas hold
    # every worker slot's rows (a joiner's too) as a checkpoint last saw them (θ₀'s, until
    # one)
    slots = d.server_run
    self.slots = initial_rule_state(slots, GLOBAL, slots.state_spec.initial_params())
    self.consensus_bytes = 0

  def restore_global(self, state: dict | None) -> None:
    """A checkpoint's θ and every slot's rows (read here: the driver hands each worker its
    own rows): each worker adopts θ and its own rows."""
    if state is not None:
      state = checkpoints.read_server(state["part"], self.d.server_run, GLOBAL)
      self.version = int(state["version"])
      self.restored, self.slots = state["params"], state["opt_state"]

  def _restored_for(self, worker: int):
    return {"params": self.restored, "opt_state": own_rows(self.slots, worker),
            "version": self.version}

  def _consensus(self) -> None:
    """θ of the open version, the live replicas' mean φ, reduced among them (once)."""
    d = self.d
    while self.consensus_at != self.version:
      workers = [w for w in sorted(d.pool.actors) if self.held.get(w) == self.version
                 and w not in self.adopting and w not in d.pool.joining]
      if not workers:
        raise RuntimeError(f"no live worker holds the rows of version {self.version}")
      outcome = self._mean_among("a consensus", workers, "consensus")
      if outcome is not None:
        self.consensus_bytes += sum(out["sent"] for out in outcome.values())
        self.consensus_at = self.version

  def global_call(self, method: str):
    self._consensus()
    return super().global_call(method)

  def global_parts(self, where: dict, in_flight) -> dict:
    """The checkpoint's global state in the server's layout, written by the driver: θ (the
    consensus) and every slot's rows, gathered from each live worker's replica (a lost
    worker's: the last checkpoint's)."""
    del in_flight
    d = self.d
    self._consensus()
    shares = {}
    for w in sorted(d.pool.actors):
      if self.held.get(w) == self.version and w not in self.adopting:
        try:
          shares[w] = d.ray.get(d.pool.actors[w].share.remote())
        except d.ray.exceptions.RayActorError as e:
          d.pool.lose(w, f"{type(e).__name__} sharing its rows")
    if not shares:
      raise RuntimeError(f"no live worker holds the rows of version {self.version}")
    first = next(iter(shares.values()))
    rows = [shares[w]["opt_state"].per_worker if w in shares else
            jax.tree.map(lambda x: x[w:w + 1], self.slots.per_worker)
            for w in range(d.server_run.config.num_workers)]
    self.slots = first["opt_state"]._replace(per_worker=jax.tree.map(
        lambda *xs: np.concatenate(xs), *rows))
    return {GLOBAL: checkpoints.write_server(where, GLOBAL, {
        "params": first["params"], "opt_state": self.slots, "version": self.version})}

  def summary(self) -> dict:
    return {**super().summary(), "consensus_bytes": self.consensus_bytes}
