"""A replica's steps of a robust rule run shard by shard (`sync_program.robust_shards`; the
data flow is replica.py's docstring): each member's statistics of its shard of every row,
its shard of the rule's result, centered clipping's further iterations, the outer step on
the all-gathered result. A mixin of `replica.Replica`, whose round state it reads."""

import jax
import jax.numpy as jnp
import numpy as np

from lowcomm_jax.programs import sync_program


def added(parts) -> np.ndarray:
  """The members' parts of a sum over shards, added in member order (one after another,
  so that every member gets the same bits)."""
  total = np.array(parts[0], np.float32)
  for part in parts[1:]:
    total += part
  return total


class RobustShards:
  """`Replica`'s part in a robust rule shard by shard."""

  def _init_robust(self, r, segments) -> None:
    self.robust_shards = sync_program.robust_shards(r.sync)
    if self.robust_shards:
      self.fragments = [s.sync for s in segments]
      self.clip_iters = (r.config.aggregate.clip_iters
                         if r.config.aggregate.rule == "centered_clip" else 1)
      self._statistics = jax.jit(sync_program.robust_statistics)
      self._robust_shard = jax.jit(sync_program.make_robust_shard(r.sync),
                                   static_argnames="full")
      self._robust_applies = [jax.jit(sync_program.make_robust_apply(
          r.sync, r.outer_rules[s.sync], layout=r.model.layout, fragment=s.sync,
          count=len(segments), last=k == len(segments) - 1), static_argnames="full")
          for k, s in enumerate(segments)]
      self._distances = jax.jit(sync_program.clip_distances)
      self._clip_again = jax.jit(sync_program.clip_again)
    # the open round's robust rule, per shard this member combines: [its rows of every
    # member, their weights, τ, the centre so far]
    self.combining = {}

  def robust_statistics(self, round_version: int, index: int, members: list[int],
                        shards) -> np.ndarray:
    """Takes shard `index` of every member's contribution (a row per worker slot, zeros for
    the absent) and returns its part of the rows' statistics over the whole update
    (`sync_program.robust_statistics`; every member's parts are added)."""
    rows = np.zeros((self.r.config.num_workers, shards[0].shape[0]), np.float32)
    rows[members] = np.stack(shards)
    self.combining = {index: [jnp.asarray(rows)]}  # (an earlier attempt's are let go)
    return np.asarray(self._statistics(self.combining[index][0],
                                       self._rule_state(round_version),
                                       np.int32(self._start(round_version, index,
                                                            len(members)))))

  def robust_shard(self, round_version: int, index: int, members: list[int], tokens, losses,
                   statistics) -> np.ndarray:
    """Shard `index` of the robust rule's result (`make_robust_shard`), or, where centered
    clipping iterates again, this shard's part of each row's squared distance from the
    new centre (`robust_clip` takes every member's)."""
    rows = self.combining[index][0]
    out, w, tau = self._robust_shard(
        self._rule_state(round_version), rows, jnp.asarray(added(statistics)), self._signals(members, tokens, losses),
        np.int32(self._start(round_version, index, len(members))), full=self._full(members))
    self.combining[index] = [rows, w, tau, out, self.clip_iters - 1]
    return self._next_or_done(index)

  def robust_clip(self, index: int, distances) -> np.ndarray:
    """One more centered-clipping iteration on shard `index`, from every member's part of
    the distances; as `robust_shard` returns."""
    rows, w, tau, v, left = self.combining[index]
    v = self._clip_again(rows, v, w, jnp.asarray(added(distances)), tau)
    self.combining[index] = [rows, w, tau, v, left - 1]
    return self._next_or_done(index)

  def _next_or_done(self, index: int) -> np.ndarray:
    rows, _, _, v, left = self.combining[index]
    if left > 0:
      return np.asarray(self._distances(rows, v))
    self.combining.pop(index)
    return np.asarray(v)

  def apply_robust(self, round_version: int, members: list[int], tokens, losses, statistics,
                   combined) -> str:
    """Stages the outer step on the robust rule's result, all-gathered (`combined`: every
    member's shard); its θ's hash."""
    state = self._robust_applies[round_version % self.segments](
        self._state(round_version), jnp.asarray(np.concatenate(combined)),
        jnp.asarray(added(statistics)), self._signals(members, tokens, losses),
        full=self._full(members))
    self.combining = {}
    return self.last.note(round_version, "apply_robust",
                          (members, tokens, losses, statistics, combined),
                          self._stage(round_version, state))

  def _rule_state(self, round_version: int):
    """The outer state (CombinedState) of the fragment round `round_version` syncs."""
    return self._state(round_version).outer.per_fragment[
        self.fragments[round_version % self.segments]]
