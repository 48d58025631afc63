"""The codec interface: per-tensor codecs, lifted to parameter trees with error feedback.

A `LeafCodec` compresses one tensor of a fixed shape:

    encode(x, key) -> (payload, sent)   payload: dict of wire arrays (packed, narrow types);
                                        sent: what the receivers will reconstruct, in x-space
                                        (the sender subtracts it for error feedback)
    decode(payload, key) -> x̂           fp32
    average(payloads[R], keys[R]) -> mean of the R decoded payloads, accumulated in fp32

`key` is the sender's round key: random codecs draw from it and receivers regenerate the same
draws (random-k sends no indices). `TreeCodec` applies leaf codecs to every leaf of a tree
and has no state; the only state codecs have, the error-feedback buffer, is composed on top
of it (error_feedback.py).
"""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from lowcomm_jax.parallel.ledger import tree_bytes


class LeafCodec:
  """Base: one tensor of `shape`. Subclasses implement `encode` and `decode`."""

  def __init__(self, shape):
    self.shape = tuple(shape)
    self.size = math.prod(self.shape)

  def encode(self, x, key):
    raise NotImplementedError

  def decode(self, payload, key):
    raise NotImplementedError

  def decode_sum(self, payloads_R, keys_R):
    """Σ_w decode(payload_w), one sender at a time (memory of one tensor, not R)."""
    def add(total, payload_and_key):
      payload, key = payload_and_key
      return total + self.decode(payload, key), None
    total, _ = jax.lax.scan(add, jnp.zeros(self.shape, jnp.float32), (payloads_R, keys_R))
    return total

  def average(self, payloads_R, keys_R):
    return self.decode_sum(payloads_R, keys_R) / keys_R.shape[0]

  def weighted_sum(self, payloads_R, keys_R, weights_R):
    """Σ_w a_w ⊙ decode(payload_w) for weights broadcastable to the tensor ([R, ...])."""
    def add(total, inputs):
      payload, key, weight = inputs
      return total + weight * self.decode(payload, key), None
    total, _ = jax.lax.scan(add, jnp.zeros(self.shape, jnp.float32),
                            (payloads_R, keys_R, weights_R))
    return total


class Codec:
  """What the aggregators, the simulator and the ledger call: a codec for parameter trees.

      init(like) -> state                       per worker (an error buffer, or ())
      encode(tree, state, key) -> (payload, state)
      decode(payload, like, key) -> tree
      average / decode_sum / weighted_sum (payloads[R], like, keys[R], ...) -> tree
  """
  name = ""
  sharded = None  # compress/sharded.py's codec, where the sync reduce-scatters payloads

  def roundtrip(self, tree, state, key):
    """decode(encode(tree)) without a collective (simulator, asynchronous updates)."""
    payload, state = self.encode(tree, state, key)
    return self.decode(payload, tree, key), state

  def payload_bytes(self, like) -> int:
    """Exact wire bytes of one worker's payload for trees shaped like `like`."""
    abstract = jax.eval_shape(
        lambda t: self.encode(t, self.init(t), jax.random.key(0))[0], like)
    return tree_bytes(abstract)


class TreeCodec(Codec):
  """`make_leaf(shape)`'s codec on every tensor of a tree; no state (compose
  `error_feedback.ErrorFeedback` for a buffer).

  Leaves of one shape share a leaf codec and are coded together, stacked and vmapped: a
  program holds one copy of each shape's codec, not one per leaf (a 12-layer model has 12
  of every block tensor), which keeps tracing and compiling short. Leaf i's key is still
  fold_in(key, i), so the result is the per-leaf one. The payload is a list with one dict
  per shape (arrays stacked over that shape's leaves): the same wire bytes."""

  def __init__(self, name: str, make_leaf: Callable[[tuple], LeafCodec]):
    self.name = name
    self.make_leaf = make_leaf

  def leaves(self, like) -> list[LeafCodec]:
    """The leaf codec of each leaf of `like`."""
    return [self.make_leaf(tuple(x.shape)) for x in jax.tree.leaves(like)]

  def groups(self, like) -> list[tuple[LeafCodec, list[int]]]:
    """(the leaf codec, the indices of the leaves it codes) per distinct leaf shape, in the
    order of first appearance."""
    order: dict[tuple, list[int]] = {}
    for i, x in enumerate(jax.tree.leaves(like)):
      order.setdefault(tuple(x.shape), []).append(i)
    return [(self.make_leaf(shape), idx) for shape, idx in order.items()]

  @staticmethod
  def _keys(key, idx: list[int]):
    """Leaf i's key fold_in(key, i), stacked over the leaves `idx`."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.asarray(idx, jnp.uint32))

  @staticmethod
  def _stack(xs, idx):
    return jnp.stack([xs[i] for i in idx])

  @staticmethod
  def _scatter(like, groups, stacked_per_group):
    out = [None] * len(jax.tree.leaves(like))
    for (_, idx), stacked in zip(groups, stacked_per_group):
      for j, i in enumerate(idx):
        out[i] = stacked[j]
    return jax.tree.unflatten(jax.tree.structure(like), out)

  def init(self, like):
    return ()

  def send(self, tree, key):
    """(payload: list of per-shape dicts, what the receivers will decode: a tree like
    `tree` in fp32)."""
    xs = [x.astype(jnp.float32) for x in jax.tree.leaves(tree)]
    groups = self.groups(tree)
    payload, sent = [], []
    for codec, idx in groups:
      p, s = jax.vmap(codec.encode)(self._stack(xs, idx), self._keys(key, idx))
      payload.append(p)
      sent.append(s)
    return payload, self._scatter(tree, groups, sent)

  def encode(self, tree, state, key):
    return self.send(tree, key)[0], state

  def decode(self, payload, like, key):
    groups = self.groups(like)
    return self._scatter(like, groups, [jax.vmap(codec.decode)(p, self._keys(key, idx))
                                        for (codec, idx), p in zip(groups, payload)])

  def _over_senders(self, method: str, payloads_R, like, keys_R, *per_leaf_trees):
    """`method` of each leaf codec over the R senders ([R, leaves, ...] payloads), vmapped
    over the leaves of a shape. Per-leaf extra trees ([R, ...] weights, each broadcastable
    to its leaf) are brought to a shape common to the group's leaves, then stacked alike."""
    groups = self.groups(like)
    extra = [jax.tree.structure(like).flatten_up_to(t) for t in per_leaf_trees]
    out = []
    for (codec, idx), payloads in zip(groups, payloads_R):
      keys = jax.vmap(lambda i: jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_R, i))(
          jnp.asarray(idx, jnp.uint32))  # [leaves, R]
      ndim = 1 + len(codec.shape)  # [R, *shape]
      stacked_extra = []
      for leaves in extra:
        # [R, *s] with s broadcastable to the leaf: leading 1s after R, then one shape
        ws = [jnp.reshape(leaves[i], leaves[i].shape[:1] + (1,) * (ndim - leaves[i].ndim)
                          + leaves[i].shape[1:]) for i in idx]
        common = jnp.broadcast_shapes(*(w.shape for w in ws))
        stacked_extra.append(jnp.stack([jnp.broadcast_to(w, common) for w in ws]))
      out.append(jax.vmap(getattr(codec, method), in_axes=(1, 0) + (0,) * len(extra))(
          payloads, keys, *stacked_extra))
    return self._scatter(like, groups, out)

  def average(self, payloads_R, like, keys_R):
    """Mean over the R senders of their decoded payloads ([R, ...] payload leaves)."""
    return self._over_senders("average", payloads_R, like, keys_R)

  def decode_sum(self, payloads_R, like, keys_R):
    """Sum over the R senders of their decoded payloads."""
    return self._over_senders("decode_sum", payloads_R, like, keys_R)

  def weighted_sum(self, payloads_R, like, keys_R, weights_R):
    """Σ_w a_w ⊙ decode(payload_w): `weights_R` a tree like `like` of [R, ...] weights."""
    return self._over_senders("weighted_sum", payloads_R, like, keys_R, weights_R)


class Identity(LeafCodec):
  """No compression: the fp32 tensor itself (for tests and as a reference)."""

  def encode(self, x, key):
    return {"value": x.astype(jnp.float32)}, x.astype(jnp.float32)

  def decode(self, payload, key):
    return payload["value"]
