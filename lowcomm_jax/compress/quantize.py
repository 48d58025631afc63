"""Scaled quantizers: int8, 4-bit uniform, fp8 e4m3 — one fp32 scale per row or per block —
and MuLoCo's statistical 2-bit quantizer (`Statistical`: levels 1.5σ apart around each
group's mean, each decoded as its members' mean).

Values are divided by their group's scale s = max|x| / L (L the largest level), rounded to
the nearest level (or stochastically: floor(y + u), unbiased), and sent as int8 / packed
4-bit codes / float8_e4m3fn. The receiver multiplies back in fp32. Error bounds per entry:
uniform levels |x − x̂| <= s/2 (deterministic) or < s (stochastic); fp8 e4m3
|x − x̂| <= 2⁻⁴·|x| + 2⁻¹⁰·s (3 mantissa bits; subnormal step 2⁻⁹ of the scaled range).
"""

import jax
import jax.numpy as jnp

from lowcomm_jax.compress.codec import LeafCodec
from lowcomm_jax.compress.packing import pack_bits, unpack_bits
from lowcomm_jax.compress.spec import CodecSpec

FP8_MAX = 448.0  # largest finite float8_e4m3fn


class _Grouped(LeafCodec):
  """Shared scale groups: `block` > 0 cuts the flat tensor into blocks of that many
  entries (the last zero-padded); 0 uses rows (last axis) of the tensor."""

  def __init__(self, shape, block: int = 0):
    super().__init__(shape)
    if block > 0:
      self.groups, self.group_size = -(-self.size // block), block
    else:
      self.group_size = self.shape[-1] if self.shape else 1
      self.groups = self.size // self.group_size

  def _split(self, x):
    flat = x.reshape(-1)
    flat = jnp.pad(flat, (0, self.groups * self.group_size - self.size))
    return flat.reshape(self.groups, self.group_size)

  def _join(self, g):
    return g.reshape(-1)[:self.size].reshape(self.shape)

  def _scale(self, groups, top: float):
    s = jnp.max(jnp.abs(groups), axis=1, keepdims=True) / top
    return jnp.where(s > 0, s, 1.0)


class Uniform(_Grouped):
  """Symmetric uniform levels −L..L with L = 2^(bits−1) − 1: int8 (L=127) or 4-bit (L=7,
  two codes per byte)."""

  def __init__(self, shape, bits: int, block: int = 0, stochastic: bool = False):
    super().__init__(shape, block)
    assert bits in (4, 8), bits
    self.bits, self.stochastic = bits, stochastic
    self.levels = 2 ** (bits - 1) - 1

  def _quantize(self, x, key):
    g = self._split(x)
    s = self._scale(g, self.levels)
    y = g / s
    if self.stochastic:
      y = jnp.floor(y + jax.random.uniform(key, y.shape))
    else:
      y = jnp.round(y)
    return jnp.clip(y, -self.levels, self.levels), s

  def encode(self, x, key):
    q, s = self._quantize(x, key)
    if self.bits == 8:
      codes = q.astype(jnp.int8).reshape(-1)
    else:
      codes = pack_bits((q + self.levels + 1).astype(jnp.uint8), 4)
    payload = {"codes": codes, "scale": s.reshape(-1)}
    return payload, self._join(q * s)

  def decode(self, payload, key):
    n = self.groups * self.group_size
    if self.bits == 8:
      q = payload["codes"].astype(jnp.float32)
    else:
      q = unpack_bits(payload["codes"], 4, n).astype(jnp.float32) - (self.levels + 1)
    return self._join(q.reshape(self.groups, self.group_size) * payload["scale"][:, None])


class Fp8(_Grouped):
  """float8 e4m3 codes, each group scaled so its largest entry maps to 448."""

  def encode(self, x, key):
    g = self._split(x)
    s = self._scale(g, FP8_MAX)
    codes = (g / s).astype(jnp.float8_e4m3fn)
    payload = {"codes": codes.reshape(-1), "scale": s.reshape(-1)}
    return payload, self._join(codes.astype(jnp.float32) * s)

  def decode(self, payload, key):
    q = payload["codes"].astype(jnp.float32).reshape(self.groups, self.group_size)
    return self._join(q * payload["scale"][:, None])


class Statistical(_Grouped):
  """MuLoCo's statistical quantizer (Thérien et al. 2025; BUILD_NOTES.md), per group (row, or
  `block` entries): with n = 2^bits levels of width 6σ/n (σ the group's population sd),
  code = clip(round((x − mean)·n/(6σ)) + n/2, 0, n − 1), so code k is centred at
  (k − n/2)·6σ/n from the mean and the top code takes the upper tail (at 2 bits: −3σ,
  −1.5σ, 0, +1.5σ). Each code decodes to the mean of the entries that fell in it (a table of
  n fp32 per group travels with the codes), so every level is unbiased for its members.
  MuLoCo's reference code does the same per tensor or per row; rows here."""

  def __init__(self, shape, bits: int, block: int = 0):
    super().__init__(shape, block)
    assert bits in (1, 2, 4), bits
    self.bits, self.bins = bits, 2 ** bits

  def _codes_and_table(self, x):
    g = self._split(x)
    valid = (jnp.arange(self.groups * self.group_size) < self.size).reshape(g.shape)
    count = jnp.sum(valid, axis=1, keepdims=True)
    mean = jnp.sum(g, axis=1, keepdims=True) / count
    sd = jnp.sqrt(jnp.sum(jnp.where(valid, (g - mean) ** 2, 0.0), axis=1, keepdims=True) / count)
    width = jnp.where(sd > 0, 6.0 * sd / self.bins, 1.0)
    codes = jnp.clip(jnp.round((g - mean) / width + self.bins / 2), 0, self.bins - 1)
    codes = codes.astype(jnp.int32)
    one_hot = (codes[..., None] == jnp.arange(self.bins)) & valid[..., None]  # [G, S, n]
    members = jnp.sum(one_hot, axis=1)
    table = jnp.sum(jnp.where(one_hot, g[..., None], 0.0), axis=1) / jnp.maximum(members, 1)
    return codes, table

  def _lookup(self, codes, table):
    return self._join(jnp.take_along_axis(table, codes, axis=1))

  def encode(self, x, key):
    codes, table = self._codes_and_table(x)
    payload = {"codes": pack_bits(codes.astype(jnp.uint8), self.bits),
               "table": table.reshape(-1)}
    return payload, self._lookup(codes, table)

  def decode(self, payload, key):
    n = self.groups * self.group_size
    codes = unpack_bits(payload["codes"], self.bits, n).astype(jnp.int32)
    return self._lookup(codes.reshape(self.groups, self.group_size),
                        payload["table"].reshape(self.groups, self.bins))


def two_bit_values(v, axis=-1):
  """Sparse values -> (uint8 codes 0..3, fp32 scale per row of `axis`): levels ±s, ±s/3
  with s = max|v|; |v − v̂| <= s/3. There is no zero level (top-k values are the large
  ones): callers mark selected zeros with `valid_mask`, and an all-zero row has s = 0."""
  s = jnp.max(jnp.abs(v), axis=axis, keepdims=True)
  codes = jnp.clip(jnp.round(v / jnp.where(s > 0, s, 1.0) * 1.5 + 1.5), 0, 3)
  return codes.astype(jnp.uint8), s


def two_bit_decode(codes, s):
  return (codes.astype(jnp.float32) - 1.5) / 1.5 * s


def valid_count(selected, dtype):
  """Per row of top-k `selected` (sorted by falling magnitude): how many are nonzero.

  Sent beside 2-bit or 1-bit values, which cannot express 0: without it a chunk with fewer
  than k nonzeros (a tier-masked or all-zero chunk) would decode its zeros as ±levels."""
  return jnp.sum(selected != 0, axis=1).astype(dtype)


def valid_mask(count, k: int):
  """[rows, k] mask of the entries `valid_count` says are real."""
  return jnp.arange(k)[None, :] < count.astype(jnp.int32)[:, None]


def fp8_bound(x, scale):
  """The analytic per-entry error bound of `Fp8` for entries x with group scale `scale`."""
  return 2.0 ** -4 * jnp.abs(x) + 2.0 ** -10 * scale



def _uniform(bits: int):
  return lambda z, k: lambda shape: Uniform(shape, bits, z.quant_block, z.stochastic_rounding)


INT8 = CodecSpec("int8", "uniform int8, one fp32 scale per row (or per quant_block entries)",
                 _uniform(8), stochastic_rounding=True, scatters=True)
INT4 = CodecSpec("int4", "uniform 4-bit (levels -7..7), two per byte, row/block scaled",
                 _uniform(4), stochastic_rounding=True, scatters=True)
FP8 = CodecSpec("fp8", "float8 e4m3, row/block scaled",
                lambda z, k: lambda shape: Fp8(shape, z.quant_block), scatters=True)
# MuLoCo's 2-bit recipe: the statistical quantizer per row, on a decayed error buffer (β 0.9).
MULOCO = CodecSpec("muloco", "MuLoCo's 2-bit: 4 levels 1.5σ apart around each row's mean "
                   "(or quant_block's), each decoded as its members' mean; error buffer β 0.9",
                   lambda z, k: lambda shape: Statistical(shape, 2, z.quant_block),
                   default_beta=0.9, always_error_feedback=True, scatters=True)
