"""A replica's steps of a quantized reduce-scatter (compress.reduce='scatter';
programs/scatter_program.py has the programs, compress/sharded.py the shards): each member
sends shard k of its payload to shard k's owner, the owner reduces and re-encodes it, and
the reduced shards are all-gathered. A replica holds one (`Replica.scatter`) and lends it
its round state.

The shards are cut for every worker slot (S = num_workers), when the worker encodes, so
what it sent is the same whoever turns up; in a round of M < S members, member j owns the
shards k with k mod M = j."""

import jax
import jax.numpy as jnp
import numpy as np

from lowcomm_jax.programs import scatter_program


def owned(index: int, members: int, shards: int) -> list[int]:
  """The shards member `index` of `members` reduces."""
  return list(range(index, shards, members))


class ScatterShards:
  """`replica`'s (replica.Replica) part in a quantized reduce-scatter."""

  def __init__(self, replica, r, segments):
    self.replica, self.segments = replica, len(segments)
    self.shard_count = r.sync.codec.sharded.shards
    self._fragments = [s.sync for s in segments]
    layout = r.model.layout
    self._shard_reduces = [jax.jit(scatter_program.make_shard_reduce(
        r.sync, layout=layout, fragment=s.sync)) for s in segments]
    self._scatter_applies = [jax.jit(scatter_program.make_scatter_apply(
        r.sync, r.outer_rules[s.sync], layout=layout, fragment=s.sync, count=len(segments),
        last=k == len(segments) - 1), static_argnames="full")
        for k, s in enumerate(segments)]

  def pieces(self, version: int, members: int) -> list[dict]:
    """The payload computed from `version`, as one piece per member: {shard: its arrays}
    for the shards that member owns."""
    payload = self.replica.kept[version][0]
    return [{k: jax.tree.map(lambda x: x[k], payload)
             for k in owned(j, members, self.shard_count)} for j in range(members)]

  def reduce(self, round_version: int, index: int, members: list[int], tokens, keys,
             pieces: list[dict]) -> dict:
    """The shards member `index` owns, each reduced over the members' pieces of it (in
    member order) and encoded again: {shard: the reduced shard's payload}."""
    hidden = jnp.asarray(np.asarray(self.replica.r.topology.hidden_per_worker)[members])
    keys = jax.random.wrap_key_data(jnp.asarray(np.stack(keys)))
    round_index = self._round_index(round_version)
    out = {}
    for k in owned(index, len(members), self.shard_count):
      payloads = jax.tree.map(lambda *rows: jnp.asarray(np.stack(rows)),
                              *[piece[k] for piece in pieces])
      out[k] = jax.device_get(self._shard_reduces[round_version % self.segments](
          payloads, keys, hidden, jnp.asarray(tokens, jnp.float32), np.int32(k),
          np.int32(round_index)))
    return out

  def apply(self, round_version: int, members: list[int], tokens, losses,
            reduced: list[dict]) -> str:
    """Stages the outer step on the mean the reduced shards (every member's, all-gathered)
    decode to; its θ's hash."""
    shards = {k: payload for part in reduced for k, payload in part.items()}
    stacked = jax.tree.map(lambda *rows: jnp.asarray(np.stack(rows)),
                           *[shards[k] for k in range(self.shard_count)])
    replica = self.replica
    state = self._scatter_applies[round_version % self.segments](
        replica._state(round_version), stacked, replica._signals(members, tokens, losses),
        full=replica._full(members))
    return replica.last.note(round_version, "scatter", (members, tokens, losses, reduced),
                             replica._stage(round_version, state))

  def _round_index(self, round_version: int) -> int:
    """The sync's global index, round · segments + its fragment (the senders' and the
    owners' keys derive from it, as in the lockstep sync)."""
    return ((round_version // self.segments) * self.segments
            + self._fragments[round_version % self.segments])
