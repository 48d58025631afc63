"""Error feedback, composed with any tree codec: what was not sent is kept and sent later.

Each worker keeps a buffer e (fp32, shaped like the parameters):

    a = β·e + scale·x;   payload = encode(a);   e ← a − sent

β = 1 is classic error feedback, β < 1 SparseLoCo's decayed buffer; DeMo's momentum
Δ = βΔ + lr·g is the same recurrence with scale = lr.
"""

import jax
import jax.numpy as jnp

from lowcomm_jax.compress.codec import Codec, TreeCodec


class ErrorFeedback(Codec):
  """`codec` (a stateless `TreeCodec`, or compress/sharded.py's `Sharded`) sending the
  buffered a instead of x."""

  def __init__(self, codec: TreeCodec, *, beta: float = 1.0, scale: float = 1.0):
    self.codec, self.beta, self.scale = codec, beta, scale
    self.name = codec.name

  @property
  def sharded(self):
    """The wrapped codec's shards, where it is sharded (compress/sharded.py)."""
    return self.codec.sharded

  def init(self, like):
    """Per worker: the buffer, zeros."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), like)

  def encode(self, tree, state, key):
    buffered = jax.tree.map(lambda e, x: self.beta * e + self.scale * x.astype(jnp.float32),
                            state, tree)
    payload, sent = self.codec.send(buffered, key)
    return payload, jax.tree.map(jnp.subtract, buffered, sent)

  # Receivers see only payloads: decoding is the wrapped codec's.
  def decode(self, payload, like, key):
    return self.codec.decode(payload, like, key)

  def average(self, payloads_R, like, keys_R):
    return self.codec.average(payloads_R, like, keys_R)

  def decode_sum(self, payloads_R, like, keys_R):
    return self.codec.decode_sum(payloads_R, like, keys_R)

  def weighted_sum(self, payloads_R, like, keys_R, weights_R):
    return self.codec.weighted_sum(payloads_R, like, keys_R, weights_R)


def error_feedback(codec: TreeCodec, *, beta: float = 1.0, scale: float = 1.0) -> ErrorFeedback:
  """`codec` with an error-feedback buffer decaying by `beta`, inputs scaled by `scale`."""
  return ErrorFeedback(codec, beta=beta, scale=scale)
