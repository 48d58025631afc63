"""DeMo / DisTrO compression: chunked orthonormal DCT-II, top-k per chunk, sign-friendly.

Peng et al., "DeMo: Decoupled Momentum Optimization" (2024). Each worker keeps a momentum
Δ = β·Δ + lr·g (the `TreeCodec` error-feedback buffer with scale = lr), transforms each
chunk with a 2-D orthonormal DCT-II (chunk 64 per dimension: the largest divisor <= 64, or
padding when that divisor is small), sends the k largest-magnitude coefficients of each
chunk as (index, value), and subtracts what it selected from Δ. Receivers scatter every
worker's coefficients into the DCT domain, average them, invert the DCT once, and the outer
rule takes the sign.

Averaging: over all R workers (a coefficient nobody else sent counts as 0 from them), or
over the workers that sent each coefficient (`mean_over_senders`, DeMo's scatter-mean).
With `sign_only`, values travel as one bit each (the sign); receivers reconstruct ±1 and
the sender still subtracts its selected coefficients at full precision.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lowcomm_jax.compress.chunks import chunks_for
from lowcomm_jax.compress.codec import LeafCodec
from lowcomm_jax.compress.packing import index_dtype, pack_bits, unpack_bits
from lowcomm_jax.compress.quantize import valid_count, valid_mask
from lowcomm_jax.compress.sparse import kept_per_chunk
from lowcomm_jax.compress.spec import CodecSpec


HIGHEST = jax.lax.Precision.HIGHEST  # full fp32 matmuls (not TF32/bf16 passes on GPUs)


@functools.lru_cache(maxsize=None)
def dct_matrix(n: int) -> np.ndarray:
  """Orthonormal DCT-II: D[k, i] = sqrt(2/n)·c_k·cos(π(2i+1)k / 2n), c_0 = 1/√2 (D Dᵀ = I)."""
  i = np.arange(n)
  d = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * i[None, :] + 1) * i[:, None] / (2 * n))
  d[0] /= np.sqrt(2.0)
  return d.astype(np.float32)


class DCTTopK(LeafCodec):

  def __init__(self, shape, *, chunk: int = 64, k: int = 32, sign_only: bool = False,
               mean_over_senders: bool = False):
    super().__init__(shape)
    self.chunks = chunks_for(shape, chunk, chunk)
    self.k = kept_per_chunk(k, self.chunks.size)
    self.sign_only, self.mean_over_senders = sign_only, mean_over_senders
    self.index_dtype = index_dtype(self.chunks.size)
    self.count_dtype = index_dtype(self.k + 1)
    self.d1 = dct_matrix(self.chunks.s1)  # numpy: constants, never tracers
    self.d2 = dct_matrix(self.chunks.s2)

  def to_coefficients(self, x):
    """Tensor -> [chunks, s1·s2] DCT coefficients."""
    c = self.chunks.split(x)
    y = jnp.einsum("ij,cjk,lk->cil", self.d1, c, self.d2, precision=HIGHEST)
    return y.reshape(self.chunks.count, self.chunks.size)

  def from_coefficients(self, y):
    y = y.reshape(self.chunks.count, self.chunks.s1, self.chunks.s2)
    return self.chunks.join(jnp.einsum("ji,cjk,kl->cil", self.d1, y, self.d2,
                                       precision=HIGHEST))

  def _scatter(self, idx, values, R: int | None = None):
    rows = jnp.arange(self.chunks.count)[:, None]
    zeros = jnp.zeros((self.chunks.count, self.chunks.size), jnp.float32)
    if R is None:
      return zeros.at[rows, idx.astype(jnp.int32)].set(values)
    return zeros.at[rows[None], idx.astype(jnp.int32)].add(values)  # every sender's

  def encode(self, x, key):
    y = self.to_coefficients(x)
    _, idx = jax.lax.top_k(jnp.abs(y), self.k)
    selected = jnp.take_along_axis(y, idx, axis=1)
    payload = {"index": idx.astype(self.index_dtype)}
    if self.sign_only:
      payload["sign"] = pack_bits((selected >= 0).astype(jnp.uint8), 1)
      payload["valid"] = valid_count(selected, self.count_dtype)  # signs cannot say 0
    else:
      payload["value"] = selected
    return payload, self.from_coefficients(self._scatter(idx, selected))

  def _values(self, payload, leading=()):
    if not self.sign_only:
      return payload["value"]
    n = self.chunks.count * self.k
    unpack = lambda packed: unpack_bits(packed, 1, n)
    if leading:
      bits = jax.vmap(unpack)(payload["sign"])
      mask = jax.vmap(lambda v: valid_mask(v, self.k))(payload["valid"])
    else:
      bits, mask = unpack(payload["sign"]), valid_mask(payload["valid"], self.k)
    signs = (bits.astype(jnp.float32) * 2 - 1).reshape(leading + (self.chunks.count, self.k))
    return signs * mask

  def decode(self, payload, key):
    return self.from_coefficients(self._scatter(payload["index"], self._values(payload)))

  def _summed(self, payloads_R):
    R = payloads_R["index"].shape[0]
    values = self._values(payloads_R, (R,))
    total = self._scatter(payloads_R["index"], values, R)
    count = self._scatter(payloads_R["index"], (values != 0).astype(jnp.float32), R)
    return total, count, R

  def decode_sum(self, payloads_R, keys_R):
    total, _, _ = self._summed(payloads_R)
    return self.from_coefficients(total)

  def average(self, payloads_R, keys_R):
    total, count, R = self._summed(payloads_R)
    denominator = jnp.maximum(count, 1.0) if self.mean_over_senders else R
    return self.from_coefficients(total / denominator)



DEMO = CodecSpec(
    "demo", "DeMo/DisTrO: momentum (beta, scale lr), chunked DCT, top-k per chunk, sign descent",
    lambda z, k: lambda shape: DCTTopK(shape, chunk=z.chunk, k=k, sign_only=z.value_bits == 1,
                                       mean_over_senders=z.mean_over_senders),
    default_beta=0.999, default_k=32, always_error_feedback=True, scale_by_lr=True,
    chunked=True, reads_k=True, value_bits=(32, 1), sign_descent=True)
