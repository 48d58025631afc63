"""Quantizers: error within the analytic bound, exact packed sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowcomm_jax.compress import Fp8, Statistical, Uniform
from lowcomm_jax.compress.packing import index_dtype, pack_bits, unpack_bits
from lowcomm_jax.compress.quantize import fp8_bound

X = jnp.asarray(np.random.default_rng(0).standard_normal((37, 50)) * 3, jnp.float32)
KEY = jax.random.key(0)


def _groups_scale(x, levels, block):
  flat = np.asarray(x).reshape(-1)
  if block:
    flat = np.pad(flat, (0, (-flat.size) % block)).reshape(-1, block)
  else:
    flat = flat.reshape(-1, x.shape[-1])
  return np.abs(flat).max(1, keepdims=True) / levels, flat


@pytest.mark.parametrize("bits,block,stochastic", [(8, 0, False), (8, 64, False), (4, 0, False),
                                                   (4, 32, False), (8, 0, True), (4, 0, True)])
def test_uniform_error_within_half_a_step(bits, block, stochastic):
  codec = Uniform(X.shape, bits, block, stochastic)
  payload, sent = codec.encode(X, KEY)
  out = codec.decode(payload, KEY)
  np.testing.assert_array_equal(out, sent)  # the sender knows exactly what arrives
  levels = 2 ** (bits - 1) - 1
  scale, groups = _groups_scale(X, levels, block)
  decoded = np.pad(np.asarray(out).reshape(-1), (0, groups.size - X.size)).reshape(groups.shape)
  bound = scale * (1.0 if stochastic else 0.5) * (1 + 1e-5)
  assert np.all(np.abs(decoded - groups) <= bound)
  # Wire size: 1 byte (int8) or half a byte (4-bit) per entry + one fp32 scale per group.
  entries = groups.size
  expected = (entries if bits == 8 else -(-entries // 2)) + 4 * scale.size
  assert sum(x.nbytes for x in jax.tree.leaves(payload)) == expected


def test_stochastic_rounding_is_unbiased():
  x = jnp.full((1, 4000), 0.3, jnp.float32).at[0, 0].set(1.0)  # scale 1/127
  codec = Uniform(x.shape, 8, 0, stochastic=True)
  means = np.mean([np.asarray(codec.encode(x, jax.random.key(i))[1])[0, 1:].mean()
                   for i in range(20)])
  assert abs(means - 0.3) < 2e-4  # deterministic rounding gives 38/127 = 0.2992


@pytest.mark.parametrize("block", [0, 128])
def test_fp8_error_within_its_bound(block):
  codec = Fp8(X.shape, block)
  payload, sent = codec.encode(X, KEY)
  assert payload["codes"].dtype == jnp.float8_e4m3fn
  out = np.asarray(codec.decode(payload, KEY))
  np.testing.assert_array_equal(out, sent)
  scale, groups = _groups_scale(X, 448.0, block)
  decoded = np.pad(out.reshape(-1), (0, groups.size - X.size)).reshape(groups.shape)
  assert np.all(np.abs(decoded - groups) <= np.asarray(fp8_bound(groups, scale)) * (1 + 1e-5))
  assert sum(x.nbytes for x in jax.tree.leaves(payload)) == groups.size + 4 * scale.size


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_bit_packing_round_trips(bits):
  codes = jnp.asarray(np.random.default_rng(bits).integers(0, 2 ** bits, 1001), jnp.uint8)
  packed = pack_bits(codes, bits)
  assert packed.dtype == jnp.uint8 and packed.size == -(-1001 * bits // 8)
  np.testing.assert_array_equal(unpack_bits(packed, bits, 1001), codes)


def test_index_dtype_is_the_narrowest_that_fits():
  assert index_dtype(256) == np.uint8 and index_dtype(257) == np.uint16
  assert index_dtype(4096) == np.uint16 and index_dtype(70000) == np.uint32


@pytest.mark.parametrize("block", [0, 64])
def test_statistical_bins_decode_to_their_members_mean(block):
  codec = Statistical(X.shape, 2, block)
  payload, sent = codec.encode(X, KEY)
  out = codec.decode(payload, KEY)
  np.testing.assert_array_equal(out, sent)  # the sender knows exactly what arrives
  _, groups = _groups_scale(X, 1, block)
  valid = np.arange(groups.size).reshape(groups.shape) < X.size
  decoded = np.pad(np.asarray(out).reshape(-1), (0, groups.size - X.size)).reshape(groups.shape)
  for g, d, v in zip(groups, decoded, valid):  # by hand, one group at a time
    x = g[v].astype(np.float64)
    width = 6 * x.std() / 4
    codes = np.clip(np.round((x - x.mean()) / width + 2), 0, 3)
    want = np.array([x[codes == c].mean() for c in codes])
    np.testing.assert_allclose(d[v], want, rtol=1e-5, atol=1e-5)
  # A group's decoded values have its mean (each bin keeps its members' sum).
  np.testing.assert_allclose(np.where(valid, decoded, 0).sum(1), np.where(valid, groups, 0).sum(1),
                             rtol=1e-4, atol=1e-3)
  # Wire size: 2 bits per entry (packed) + 4 fp32 bin means per group.
  assert sum(x.nbytes for x in jax.tree.leaves(payload)) == -(-groups.size // 4) + 16 * len(groups)


def test_statistical_constant_group_is_exact():
  x = jnp.full((3, 8), 2.5, jnp.float32)
  codec = Statistical(x.shape, 2)
  payload, _ = codec.encode(x, KEY)
  np.testing.assert_array_equal(codec.decode(payload, KEY), x)
