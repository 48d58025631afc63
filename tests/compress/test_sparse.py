"""Top-k, random-k and SparseLoCo: what is kept, error feedback, chunking, wire sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowcomm_jax.compress import TreeCodec, error_feedback, randomk_codec, topk_codec
from lowcomm_jax.compress.chunks import chunks_for

RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.standard_normal((130, 96)), jnp.float32)
KEY = jax.random.key(0)


def test_per_tensor_topk_keeps_exactly_the_k_largest():
  codec = topk_codec(X.shape, density=0.05, chunk=0, k=0)
  payload, sent = codec.encode(X, KEY)
  k = int(np.ceil(0.05 * X.size))
  out = np.asarray(codec.decode(payload, KEY))
  np.testing.assert_array_equal(out, sent)
  kept = np.flatnonzero(out)
  assert kept.size == k
  largest = np.argsort(-np.abs(np.asarray(X)).reshape(-1))[:k]
  assert set(kept) == set(largest)
  np.testing.assert_array_equal(out.reshape(-1)[kept], np.asarray(X).reshape(-1)[kept])
  assert payload["index"].dtype == np.uint16  # 12480 positions
  assert sum(x.nbytes for x in jax.tree.leaves(payload)) == k * (2 + 4)


def test_chunked_topk_keeps_the_k_largest_of_every_chunk():
  x = jnp.asarray(RNG.standard_normal((128, 192)), jnp.float32)
  codec = topk_codec(x.shape, density=1.0, chunk=64, k=10)
  out = np.asarray(codec.decode(codec.encode(x, KEY)[0], KEY))
  for i in range(2):
    for j in range(3):
      block, got = (np.asarray(x)[i * 64:(i + 1) * 64, j * 64:(j + 1) * 64],
                    out[i * 64:(i + 1) * 64, j * 64:(j + 1) * 64])
      top = np.sort(np.abs(block).reshape(-1))[-10:]
      np.testing.assert_array_equal(np.sort(np.abs(got[got != 0])), top)


def test_chunking_pads_awkward_lengths_instead_of_sending_everything():
  # 4099 is prime: its largest divisor <= 4096 is 1, which would make 1-entry chunks.
  c = chunks_for((4099,), 64, 4096)
  assert (c.s2, c.pad_cols, c.count) == (4096, 8192, 2)
  codec = topk_codec((4099,), density=1.0, chunk=64, k=64)
  x = jnp.asarray(RNG.standard_normal(4099), jnp.float32)
  payload, _ = codec.encode(x, KEY)
  assert sum(a.nbytes for a in jax.tree.leaves(payload)) < 4099 * 4 / 20
  np.testing.assert_array_equal(c.join(c.split(x)), x)
  # Small tensors: at most half of a chunk travels.
  small = topk_codec((6,), density=1.0, chunk=64, k=64)
  assert small.k == 3


@pytest.mark.parametrize("name", ["topk", "randomk", "sparseloco"])
def test_error_feedback_sum_sent_plus_residual_equals_sum_of_inputs(name):
  make = {"topk": lambda s: topk_codec(s, density=0.02, chunk=0, k=0),
          "randomk": lambda s: randomk_codec(s, density=0.02),
          "sparseloco": lambda s: topk_codec(s, density=1.0, chunk=64, k=16, value_bits=2)}[name]
  codec = error_feedback(TreeCodec(name, make), beta=1.0)
  tree = {"w": X, "b": X[0]}
  state = codec.init(tree)
  total_in = jax.tree.map(jnp.zeros_like, tree)
  total_sent = jax.tree.map(jnp.zeros_like, tree)
  encode = jax.jit(codec.encode)
  for step in range(6):
    x = jax.tree.map(lambda a: a * (step + 1) * 0.1, tree)
    key = jax.random.key(step)
    payload, state = encode(x, state, key)
    total_in = jax.tree.map(jnp.add, total_in, x)
    total_sent = jax.tree.map(jnp.add, total_sent, codec.decode(payload, x, key))
  jax.tree.map(lambda i, s, e: np.testing.assert_allclose(s + e, i, atol=1e-4),
               total_in, total_sent, state)


def test_randomk_receivers_regenerate_the_indices_from_the_key():
  codec = randomk_codec(X.shape, density=0.01)
  payload, sent = codec.encode(X, KEY)
  assert list(payload) == ["value"]  # only values travel
  np.testing.assert_array_equal(codec.decode(payload, KEY), sent)
  kept = np.flatnonzero(np.asarray(sent))
  assert kept.size == codec.k
  np.testing.assert_array_equal(np.asarray(sent).reshape(-1)[kept],
                                np.asarray(X).reshape(-1)[kept])
  other = codec.decode(payload, jax.random.key(1))
  assert not np.array_equal(np.flatnonzero(np.asarray(other)), kept)


def test_sparseloco_sends_64_of_4096_with_two_bit_values():
  x = jnp.asarray(RNG.standard_normal((256, 128)), jnp.float32)
  codec = topk_codec(x.shape, density=1.0, chunk=64, k=64, value_bits=2)
  payload, sent = codec.encode(x, KEY)
  chunks = 8
  assert payload["index"].dtype == np.uint16 and payload["index"].shape == (chunks, 64)
  # Per chunk: 64 uint16 indices, 64 2-bit codes, an fp32 scale, a uint8 nonzero count.
  assert sum(a.nbytes for a in jax.tree.leaves(payload)) == chunks * (64 * 2 + 64 // 4 + 4 + 1)
  # Values are within a third of the chunk's largest selected magnitude.
  out = np.asarray(codec.decode(payload, KEY))
  np.testing.assert_array_equal(out, sent)
  kept = out != 0
  err = np.abs(out[kept] - np.asarray(x)[kept])
  assert err.max() <= np.abs(np.asarray(x)).max() / 3 + 1e-6


@pytest.mark.parametrize("value_bits", [2, 32])
def test_zeros_stay_zero_in_masked_and_sparse_chunks(value_bits):
  # A tier-masked pseudo-gradient: the right half is exactly zero, and one chunk holds
  # only three nonzeros (fewer than k).
  x = np.zeros((128, 128), np.float32)
  x[:, :64] = RNG.standard_normal((128, 64))
  x[70, 100], x[71, 101], x[72, 102] = 1.0, -2.0, 0.5
  codec = topk_codec(x.shape, density=1.0, chunk=64, k=16, value_bits=value_bits)
  payload, sent = codec.encode(jnp.asarray(x), KEY)
  out = np.asarray(codec.decode(payload, KEY))
  np.testing.assert_array_equal(out, sent)
  assert np.all(out[x == 0] == 0)
  assert np.count_nonzero(out[64:, 64:]) == 3 and np.count_nonzero(out[:64, 64:]) == 0
