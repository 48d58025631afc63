"""A quantizer on S equal shards of the whole update: the codec of the quantized
reduce-scatter (`compress.reduce='scatter'`).

The tree's leaves are raveled in tree order into one vector of n coordinates, zero-padded
to S·L (L = ⌈n/S⌉ rounded up to the codec's scale block) and cut into S shards of L. A
worker encodes every shard with its own key fold_in(key, k); shard k goes to its owner
only. The owner decodes shard k of every sender, weighs and averages them (`reduce_shard`),
encodes the result once more (`encode_reduced`, with a key every worker can derive) and
all-gathers it; everyone decodes the S reduced shards (`decode_reduced`). Per link that is
2·(S−1)/S payloads, where the all-gather of whole payloads is (S−1).

Rows do not survive the flat cut, so scales are per `block` entries (compress.quant_block,
or `DEFAULT_BLOCK` where that is 0, per row). Error feedback (error_feedback.py) wraps this
codec as any other: a sender's buffer keeps its own first quantization's error. The
owner's second quantization is not fed back: it adds at most half a level of the reduced
shard's block scale (int8: max|mean|/254) to every coordinate of the mean, once, unbiased
with stochastic rounding; BENCHMARKS measures what it does to the loss.
"""

import math

import jax
import jax.numpy as jnp

from lowcomm_jax.compress.codec import Codec
from lowcomm_jax.parallel import weighted

DEFAULT_BLOCK = 256  # scale block of a shard when compress.quant_block is 0 (per row)
_REDUCED_TAG = 0x5CA7  # the owners' keys for the second quantization: apart from senders'


class Sharded(Codec):
  """`make_leaf((L,))` (a block-scaled quantizer) on each of `shards` shards of a tree."""

  def __init__(self, name: str, make_leaf, shards: int, block: int):
    self.name, self.make_leaf, self.shards, self.block = name, make_leaf, shards, block

  @property
  def sharded(self) -> "Sharded":
    return self

  def shard_size(self, like) -> int:
    """L: coordinates per shard (a multiple of the scale block)."""
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(like))
    per_shard = math.ceil(n / self.shards)
    return math.ceil(per_shard / self.block) * self.block

  def leaf(self, like):
    return self.make_leaf((self.shard_size(like),))

  def split(self, tree) -> jax.Array:
    """[S, L]: the tree raveled in leaf order, zero-padded, cut into shards (fp32)."""
    flat = jnp.concatenate([x.astype(jnp.float32).reshape(-1) for x in jax.tree.leaves(tree)])
    size = self.shard_size(tree)
    return jnp.pad(flat, (0, self.shards * size - flat.shape[0])).reshape(self.shards, size)

  @staticmethod
  def join(shards_SxL, like):
    """`split`'s inverse: the shards' coordinates in the shapes of `like`'s leaves (fp32)."""
    flat, out, start = shards_SxL.reshape(-1), [], 0
    for x in jax.tree.leaves(like):
      out.append(flat[start:start + math.prod(x.shape)].reshape(x.shape))
      start += math.prod(x.shape)
    return jax.tree.unflatten(jax.tree.structure(like), out)

  def shard_weights(self, weights_R, like) -> jax.Array:
    """[R, S, L]: per-leaf weights ([R, ...] broadcastable to each leaf, as the nested mean
    gives them) laid out as `split` lays the coordinates out (padding weighs 0)."""
    full = jax.tree.map(lambda w, x: jnp.broadcast_to(
        w.reshape(w.shape[:1] + (1,) * (x.ndim - w.ndim + 1) + w.shape[1:]),
        w.shape[:1] + x.shape), weights_R, like)
    return jax.vmap(self.split)(full)

  def _keys(self, key):
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(self.shards))

  def init(self, like):
    return ()

  def send(self, tree, key):
    """(payload: the leaf codec's arrays stacked [S, ...], what receivers decode: a tree)."""
    payload, sent = jax.vmap(self.leaf(tree).encode)(self.split(tree), self._keys(key))
    return payload, self.join(sent, tree)

  def encode(self, tree, state, key):
    return self.send(tree, key)[0], state

  def decode(self, payload, like, key):
    return self.join(jax.vmap(self.leaf(like).decode)(payload, self._keys(key)), like)

  # (No average / decode_sum / weighted_sum over whole payloads: nothing that combines
  # gathered payloads runs a scatter; the config refuses those paths.)

  # --- the reduce-scatter's steps (aggregate/compressed.py, the Ray runtime's members) ----

  def reduce_shard(self, payloads_M, like, keys_M, shard, weights_MxL=None) -> jax.Array:
    """[L]: shard `shard` of the mean over M senders, from their payloads of that shard
    ([M, ...]) and their keys ([M], the senders' round keys): Σ a_w·x̂_w / Σ a_w with
    `weights_MxL` (coordinates no sender weighs come out 0), else the plain mean."""
    leaf = self.leaf(like)
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_M, shard)
    decoded = jax.vmap(leaf.decode)(payloads_M, keys)
    if weights_MxL is None:
      return decoded.sum(0) / decoded.shape[0]
    return weighted.weighted_mean(weights_MxL, decoded)

  def reduced_key(self, seed: int, round_index, shard):
    """The key of the owner's second quantization of `shard` in `round_index`: anyone can
    derive it, so receivers decode without it being sent."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), round_index), _REDUCED_TAG)
    return jax.random.fold_in(key, shard)

  def encode_reduced(self, mean_L, like, key):
    """The reduced shard's payload (its second quantization)."""
    return self.leaf(like).encode(mean_L, key)[0]

  def decode_reduced(self, payloads_S, like, seed: int, round_index):
    """The mean as a tree like `like`, from the S reduced shards' payloads ([S, ...])."""
    keys = jax.vmap(lambda k: self.reduced_key(seed, round_index, k))(jnp.arange(self.shards))
    return self.join(jax.vmap(self.leaf(like).decode)(payloads_S, keys), like)
