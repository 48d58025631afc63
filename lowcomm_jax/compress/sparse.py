"""Sparsifiers: top-k (per tensor or per chunk), random-k, and SparseLoCo's chunked top-k
with 2-bit values. Error feedback (what was not sent is kept and re-sent later) lives in
`TreeCodec`; these codecs only choose what travels.

Payload per tensor: indices within their chunk in the narrowest unsigned type (uint16 for
a 64x64 chunk), values as fp32 or 2-bit codes packed four per byte plus one fp32 scale per
chunk. Random-k sends values only: sender and receivers draw the same indices from the
sender's round key.
"""

import math

import jax
import jax.numpy as jnp

from lowcomm_jax.compress.chunks import Chunks, chunks_for
from lowcomm_jax.compress.codec import LeafCodec
from lowcomm_jax.compress.packing import index_dtype, pack_bits, unpack_bits
from lowcomm_jax.compress.spec import CodecSpec
from lowcomm_jax.compress.quantize import (two_bit_decode, two_bit_values, valid_count,
                                           valid_mask)


def whole_tensor(shape) -> Chunks:
  """One chunk holding the whole (flattened) tensor."""
  n = math.prod(shape)
  return Chunks(tuple(shape), 1, n, 1, n, 1, n)


def kept_per_chunk(k: int, chunk_size: int) -> int:
  """k, capped at half a chunk: sending more than half (plus indices) costs more than the
  dense chunk. At least one entry per chunk."""
  return max(1, min(k, chunk_size // 2))


class TopK(LeafCodec):
  """The k largest-magnitude entries of each chunk; values fp32 (value_bits=32) or 2-bit."""

  def __init__(self, shape, chunks: Chunks, k: int, value_bits: int = 32):
    super().__init__(shape)
    assert value_bits in (2, 32), value_bits
    self.chunks, self.k, self.value_bits = chunks, k, value_bits
    self.index_dtype = index_dtype(chunks.size)
    self.count_dtype = index_dtype(k + 1)

  def _flat_chunks(self, x):
    return self.chunks.split(x).reshape(self.chunks.count, self.chunks.size)

  def _scatter(self, idx, values):
    dense = jnp.zeros((self.chunks.count, self.chunks.size), jnp.float32)
    rows = jnp.arange(self.chunks.count)[:, None]
    dense = dense.at[rows, idx.astype(jnp.int32)].set(values)
    return self.chunks.join(dense.reshape(self.chunks.count, self.chunks.s1, self.chunks.s2))

  def encode(self, x, key):
    c = self._flat_chunks(x)
    _, idx = jax.lax.top_k(jnp.abs(c), self.k)
    values = jnp.take_along_axis(c, idx, axis=1)
    payload = {"index": idx.astype(self.index_dtype)}
    if self.value_bits == 2:
      codes, s = two_bit_values(values)
      valid = valid_count(values, self.count_dtype)
      payload.update(codes=pack_bits(codes, 2), scale=s.reshape(-1), valid=valid)
      values = two_bit_decode(codes, s) * valid_mask(valid, self.k)
    else:
      payload["value"] = values
    return payload, self._scatter(idx, values)

  def _values(self, payload):
    if self.value_bits == 2:
      codes = unpack_bits(payload["codes"], 2, self.chunks.count * self.k)
      values = two_bit_decode(codes.reshape(self.chunks.count, self.k), payload["scale"][:, None])
      return values * valid_mask(payload["valid"], self.k)
    return payload["value"]

  def decode(self, payload, key):
    return self._scatter(payload["index"], self._values(payload))


class RandomK(LeafCodec):
  """k entries drawn without replacement from the sender's key; only their values travel."""

  def __init__(self, shape, k: int):
    super().__init__(shape)
    self.k = k

  def _indices(self, key):
    # Top-k of i.i.d. uniforms: k distinct positions, uniformly, in O(n).
    return jax.lax.top_k(jax.random.uniform(key, (self.size,)), self.k)[1]

  def _scatter(self, idx, values):
    return jnp.zeros((self.size,), jnp.float32).at[idx].set(values).reshape(self.shape)

  def encode(self, x, key):
    idx = self._indices(key)  # reused for `sent`: every draw is a threefry program
    values = x.reshape(-1)[idx]
    return {"value": values}, self._scatter(idx, values)

  def decode(self, payload, key):
    return self._scatter(self._indices(key), payload["value"])


def topk_codec(shape, *, density: float, chunk: int, k: int, value_bits: int = 32) -> TopK:
  """Per tensor (chunk=0: k = ceil(density·n)) or per chunk×chunk block (k per chunk)."""
  if chunk > 0:
    chunks = chunks_for(shape, chunk, chunk * chunk)
    return TopK(shape, chunks, kept_per_chunk(k, chunks.size), value_bits)
  n = math.prod(shape)
  return TopK(shape, whole_tensor(shape), max(1, min(n, math.ceil(density * n))), value_bits)


def randomk_codec(shape, *, density: float) -> RandomK:
  n = math.prod(shape)
  return RandomK(shape, max(1, min(n, math.ceil(density * n))))


def _topk_problems(z) -> list[str]:
  if z.chunk == 0 and z.k != 0:
    return [f"compress.k={z.k}: topk with chunk=0 keeps compress.density of each tensor; set "
            "k=0 (or a chunk side to send k per chunk)"]
  return []


TOPK = CodecSpec(
    "topk", "k largest per tensor (density) or per chunk x chunk block (k)",
    lambda z, k: lambda shape: topk_codec(shape, density=z.density, chunk=z.chunk, k=k,
                                          value_bits=z.value_bits),
    reads_k=True, value_bits=(32, 2), problems=_topk_problems)
RANDOMK = CodecSpec(
    "randomk", "density of the entries at positions from a shared seed (values only)",
    lambda z, k: lambda shape: randomk_codec(shape, density=z.density))
SPARSELOCO = CodecSpec(
    "sparseloco", "decayed error buffer, chunked top-k, 2-bit values (64 of 4096 per chunk)",
    lambda z, k: lambda shape: topk_codec(shape, density=1.0, chunk=z.chunk, k=k,
                                          value_bits=2),
    default_beta=0.95, always_error_feedback=True, chunked=True, reads_k=True)
