"""The codec interface: per-tensor codecs, lifted to parameter trees with error feedback.

A `LeafCodec` compresses one tensor of a fixed shape:

    encode(x, key) -> (payload, sent)   payload: dict of wire arrays (packed, narrow types);
                                        sent: what the receivers will reconstruct, in x-space
                                        (the sender subtracts it for error feedback)
    decode(payload, key) -> x̂           fp32
    average(payloads[R], keys[R]) -> mean of the R decoded payloads, accumulated in fp32

`key` is the sender's round key: random codecs draw from it and receivers regenerate the same
draws (random-k sends no indices). `TreeCodec` applies leaf codecs to every leaf of a tree
and owns the only state codecs have: the error-feedback buffer e (per worker),

    a = β·e + scale·x;   payload = encode(a);   e ← a − sent

β = 1 is classic error feedback, β < 1 SparseLoCo's decayed buffer; DeMo's momentum
Δ = βΔ + lr·g is the same recurrence with scale = lr.
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


class TreeCodec:
  """A codec for parameter trees: `make_leaf(shape)` per tensor, optional error feedback."""

  def __init__(self, name: str, make_leaf: Callable[[tuple], LeafCodec], *,
               error_feedback: bool = False, beta: float = 1.0, scale: float = 1.0):
    self.name = name
    self.make_leaf = make_leaf
    self.error_feedback = error_feedback
    self.beta = beta
    self.scale = scale
    self._cache = {}

  def leaves(self, like) -> list[LeafCodec]:
    out = []
    for x in jax.tree.leaves(like):
      shape = tuple(x.shape)
      if shape not in self._cache:
        self._cache[shape] = self.make_leaf(shape)
      out.append(self._cache[shape])
    return out

  @staticmethod
  def _keys(key, n: int):
    return [jax.random.fold_in(key, i) for i in range(n)]

  def init(self, like):
    """Per-worker state: the error-feedback buffer (zeros), or nothing."""
    if not self.error_feedback:
      return ()
    return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), like)

  def encode(self, tree, state, key):
    """(payload: list of per-leaf dicts, new state)."""
    xs, treedef = jax.tree.flatten(tree)
    codecs, keys = self.leaves(tree), self._keys(key, len(xs))
    if self.error_feedback:
      errors = treedef.flatten_up_to(state)
      xs = [self.beta * e + self.scale * x.astype(jnp.float32) for e, x in zip(errors, xs)]
    else:
      xs = [self.scale * x.astype(jnp.float32) for x in xs]
    payload, new_errors = [], []
    for codec, x, k in zip(codecs, xs, keys):
      p, sent = codec.encode(x, k)
      payload.append(p)
      new_errors.append(x - sent)
    state = jax.tree.unflatten(treedef, new_errors) if self.error_feedback else ()
    return payload, state

  def decode(self, payload, like, key):
    codecs = self.leaves(like)
    keys = self._keys(key, len(codecs))
    return jax.tree.unflatten(jax.tree.structure(like),
                              [c.decode(p, k) for c, p, k in zip(codecs, payload, keys)])

  def _over_senders(self, method: str, payloads_R, like, keys_R, *per_leaf_trees):
    codecs = self.leaves(like)
    leaf_keys = [jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_R, i)
                 for i in range(len(codecs))]
    extra = [jax.tree.structure(like).flatten_up_to(t) for t in per_leaf_trees]
    return jax.tree.unflatten(jax.tree.structure(like),
                              [getattr(c, method)(p, k, *(e[i] for e in extra))
                               for i, (c, p, k) in enumerate(zip(codecs, payloads_R, leaf_keys))])

  def average(self, payloads_R, like, keys_R):
    """Mean over the R senders of their decoded payloads ([R, ...] payload leaves)."""
    return self._over_senders("average", payloads_R, like, keys_R)

  def decode_sum(self, payloads_R, like, keys_R):
    """Sum over the R senders of their decoded payloads."""
    return self._over_senders("decode_sum", payloads_R, like, keys_R)

  def weighted_sum(self, payloads_R, like, keys_R, weights_R):
    """Σ_w a_w ⊙ decode(payload_w): `weights_R` a tree like `like` of [R, ...] weights."""
    return self._over_senders("weighted_sum", payloads_R, like, keys_R, weights_R)

  def roundtrip(self, tree, state, key):
    """decode(encode(tree)) without a collective (simulator, asynchronous updates)."""
    payload, state = self.encode(tree, state, key)
    return self.decode(payload, tree, key), state

  def payload_bytes(self, like) -> int:
    """Exact wire bytes of one worker's payload for trees shaped like `like`."""
    abstract = jax.eval_shape(
        lambda t: self.encode(t, self.init(t), jax.random.key(0))[0], like)
    return tree_bytes(abstract)


class Identity(LeafCodec):
  """No compression: the fp32 tensor itself (for tests and as a reference)."""

  def encode(self, x, key):
    return {"value": x.astype(jnp.float32)}, x.astype(jnp.float32)

  def decode(self, payload, key):
    return payload["value"]
