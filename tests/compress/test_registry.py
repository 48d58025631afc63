"""A codec is one module with its leaf codec and a `CodecSpec`, plus a registry line: the
config checks, the builder and the aggregators take it from there, and error feedback
composes with it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowcomm_jax import compress
from lowcomm_jax.config import check
from lowcomm_jax.aggregate import compressed_mean
from lowcomm_jax.compress import CodecSpec, LeafCodec

from conftest import load_config


class Bf16(LeafCodec):
  """Values rounded to bfloat16: 2 bytes an entry."""

  def encode(self, x, key):
    value = x.astype(jnp.bfloat16)
    return {"value": value}, value.astype(jnp.float32)

  def decode(self, payload, key):
    return payload["value"].astype(jnp.float32)


BF16 = CodecSpec("bf16", "values rounded to bfloat16", lambda z, k: Bf16)


@pytest.fixture
def registered(monkeypatch):
  monkeypatch.setitem(compress.REGISTRY, BF16.name, BF16)


def _section(**fields):
  base = load_config("smoke").compress
  base.update(fields)
  return base


def test_a_registered_codec_is_checked_built_and_averaged(registered):
  check.validate(load_config("smoke", **{"compress.codec": "bf16"}), num_devices=8)
  assert "bf16" in compress.names()
  codec = compress.make_codec(_section(codec="bf16"))  # error feedback on: the default
  tree = {"w": jnp.linspace(-1.0, 1.0, 48).reshape(6, 8) / 3, "b": jnp.ones((5,)) / 3}
  assert codec.payload_bytes(tree) == 2 * (48 + 5)
  # Two workers, one round: the mean of the bf16-rounded values; each keeps the rounding.
  updates = jax.tree.map(lambda x: jnp.stack([x, -3 * x]), tree)
  tx = compressed_mean(codec)
  state = jax.vmap(tx.init)(updates)
  mean, state = jax.jit(jax.vmap(tx.update, axis_name="replica"))(updates, state)
  for name, x in tree.items():
    rounded = np.stack([np.asarray(u.astype(jnp.bfloat16), np.float32)
                        for u in updates[name]])
    np.testing.assert_array_equal(mean[name][0], rounded.mean(0))
    np.testing.assert_array_equal(state.codec_state[name], updates[name] - rounded)


def test_what_a_codec_declares_is_what_the_checks_ask(registered):
  # bf16 reads no k, no value_bits and has no stochastic rounding: the last is refused,
  # by its field, naming the codecs that have it.
  with pytest.raises(check.ConfigError) as e:
    check.validate(load_config("smoke", **{"compress.codec": "bf16",
                                                  "compress.stochastic_rounding": True}),
                          num_devices=8)
  assert e.value.problems == [
      "compress.stochastic_rounding=True: bf16 has no stochastic rounding (only int8, int4); "
      "set it False"]
  unknown = load_config("smoke", **{"compress.codec": "zip"})
  with pytest.raises(check.ConfigError) as e:
    check.validate(unknown, num_devices=8)
  assert e.value.problems[0].startswith("compress.codec='zip': use one of ('none', 'int8'")
  assert "'bf16')" in e.value.problems[0]


def test_error_feedback_is_composed_and_off_leaves_no_state(registered):
  x = {"v": jnp.asarray([1 / 3, 2 / 3, 1.0 + 2 ** -10])}
  plain = compress.make_codec(_section(codec="bf16", error_feedback=False))
  assert isinstance(plain, compress.TreeCodec) and plain.init(x) == ()
  fed = compress.make_codec(_section(codec="bf16", beta=0.5))
  assert isinstance(fed, compress.ErrorFeedback) and fed.beta == 0.5
  key = jax.random.key(0)
  sent, buffer = fed.roundtrip(x, fed.init(x), key)
  np.testing.assert_array_equal(buffer["v"], x["v"] - sent["v"])
  # Round 2 sends bf16(x + β·e): the decayed rounding error is added back.
  again, _ = fed.roundtrip(x, buffer, key)
  expected = (x["v"] + 0.5 * buffer["v"]).astype(jnp.bfloat16).astype(jnp.float32)
  np.testing.assert_array_equal(again["v"], expected)
  assert not np.array_equal(again["v"], plain.roundtrip(x, (), key)[0]["v"])
