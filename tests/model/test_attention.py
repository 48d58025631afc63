"""model.attention: which kernel runs, chosen per backend, refused where it cannot run; the
chunked cross-entropy equals the plain one (issue 28)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import load_config
from lowcomm_jax.assemble import build
from lowcomm_jax.config import check
from lowcomm_jax.config.check import ConfigError
from lowcomm_jax.model import GPT, attention, get_preset, next_token_loss
from lowcomm_jax.model.cross_entropy import chunk_of


@pytest.mark.parametrize("platform, dtype, head_dim, expected", [
    ("cpu", "bfloat16", 64, "xla"),  # no cuDNN off NVIDIA GPUs
    ("cuda", "bfloat16", 64, "cudnn"),  # GPT-2 124M's heads
    ("cuda", "float16", 128, "cudnn"),
    ("cuda", "float32", 64, "xla"),  # cuDNN's flash attention takes 16-bit inputs only
    ("cuda", "bfloat16", 12, "xla"),  # not a multiple of 8
    ("cuda", "bfloat16", 256, "xla"),  # beyond 128
    ("rocm", "bfloat16", 64, "xla"),
])
def test_auto_picks_cudnn_only_where_it_can_run(platform, dtype, head_dim, expected):
  implementation, why = attention.resolve("auto", dtype, head_dim, platform)
  assert implementation == expected and why.startswith("auto:")
  assert attention.resolve("xla", dtype, head_dim, platform)[0] == "xla"


def test_auto_picks_xla_on_this_cpu_and_says_so(caplog):
  assert attention.platform() == "cpu"
  config = load_config("smoke", **{"model.dtype": "bfloat16"})
  with caplog.at_level("INFO"):
    r = build.build(config)
  assert r.model.cfg.attention == "xla"
  assert "attention: auto: XLA attention" in caplog.text


def test_cudnn_is_refused_on_cpu_with_one_line_naming_the_field():
  config = load_config("smoke", **{"model.attention": "cudnn", "model.dtype": "bfloat16"})
  with pytest.raises(ConfigError) as e:
    check.validate(config, num_devices=8)
  [problem] = [p for p in e.value.problems if "attention" in p]
  assert problem.startswith("model.attention='cudnn': cuDNN attention runs on NVIDIA GPUs only")
  assert "\n" not in problem and "model.attention=auto" in problem
  config = load_config("smoke", **{"model.attention": "flash"})
  with pytest.raises(ConfigError, match=r"model.attention='flash': use one of"):
    check.validate(config, num_devices=8)


def test_xla_named_equals_left_to_jax_bit_for_bit():
  """'xla' is what jax.nn.dot_product_attention runs when no implementation is named, so
  every CPU result before this field stays bit-identical."""
  cfg = get_preset("tiny_llama", tokenizer_vocab=256)  # rotary, grouped-query attention
  x = jax.random.normal(jax.random.key(0), (2, 16, 4, 8))
  k, v = x[:, :, :2] * 0.5, x[:, :, :2] - 1.0
  named = jax.nn.dot_product_attention(x, k, v, is_causal=True, implementation="xla")
  left = jax.nn.dot_product_attention(x, k, v, is_causal=True)
  np.testing.assert_array_equal(named, left)
  model = GPT(cfg, rngs=nnx.Rngs(0))
  assert model.blocks[0].attn.implementation == "xla"


def _loss_and_grads(cfg, windows):
  graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)))
  return jax.jit(jax.value_and_grad(
      lambda p: next_token_loss(nnx.merge(graphdef, p), windows)))(params)


@pytest.mark.parametrize("name, dtype, chunk", [
    ("tiny", "float32", 16),  # 4 equal pieces of the 64 positions
    ("tiny", "float32", 24),  # two pieces and a shorter last one
    ("tiny_llama", "float32", 8),  # an untied head; rotary and grouped-query attention
    ("tiny", "bfloat16", 16),
])
def test_chunked_loss_equals_the_plain_loss(name, dtype, chunk):
  cfg = get_preset(name, tokenizer_vocab=256, dtype=dtype, tie_embeddings=name == "tiny")
  windows = jax.random.randint(jax.random.key(1), (3, 65), 0, 256)
  plain_loss, plain_grads = _loss_and_grads(cfg, windows)
  loss, grads = _loss_and_grads(dataclasses.replace(cfg, loss_chunk=chunk), windows)
  # The same per-position losses, summed in another order: float32 rounding.
  np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
  # Gradients: float32 rounding; in bfloat16 the pieces' matmuls round differently.
  rtol = 1e-5 if dtype == "float32" else 2e-2
  for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads)):
    np.testing.assert_allclose(g, p, rtol=rtol, atol=rtol * float(jnp.max(jnp.abs(p))))


def test_evaluation_with_pieces_equals_evaluation_without():
  """A run's eval program reads the same loss: a bfloat16 smoke run settles 256-position
  pieces, shorter than its sequences only when asked for; an explicit chunk gives the same
  eval loss to float32 rounding."""
  assert chunk_of(0, "float32") == 0 and chunk_of(0, "bfloat16") == 256
  assert chunk_of(8, "float32") == 8
  losses = {}
  for chunk in (0, 8):
    r = build.build(load_config("smoke", **{"model.loss_chunk": chunk}))
    assert r.model.cfg.loss_chunk == chunk
    params = r.state_spec.initial_params()
    losses[chunk] = float(jax.jit(r.programs.eval)(params, jnp.asarray(r.data.eval_windows),
                                                   frozen=r.frozen)[0])
  np.testing.assert_allclose(losses[8], losses[0], rtol=1e-6)
