import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowcomm_jax.model import GPT, NestedMLP, count_params, get_preset, hidden_units, next_token_loss


def _abstract_count(name: str) -> int:
  model = nnx.eval_shape(lambda: GPT(get_preset(name), rngs=nnx.Rngs(0)))  # allocates nothing
  return count_params(nnx.state(model, nnx.Param))


def test_gpt2_124m_has_124m_parameters():
  n = _abstract_count("gpt2_124m")
  assert abs(n - 124e6) / 124e6 < 0.01, n


def test_pythia_14m_has_14m_parameters():
  n = _abstract_count("pythia_14m")
  assert abs(n - 14.07e6) / 14.07e6 < 0.01, n


def test_matformer_slice_equals_full_ffn_with_units_beyond_m_zeroed():
  mlp = NestedMLP(16, 64, out_std=0.02, bias=True, dtype=jnp.float32, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 5, 16))
  m = hidden_units(64, 0.25)
  assert m == 16
  sliced = mlp(x, fraction=0.25)
  # Zero every weight that touches hidden units m.. and run the full width.
  mlp.fc_kernel[...] = mlp.fc_kernel[...].at[:, m:].set(0.0)
  mlp.fc_bias[...] = mlp.fc_bias[...].at[m:].set(0.0)
  mlp.proj_kernel[...] = mlp.proj_kernel[...].at[m:].set(0.0)
  full = mlp(x, fraction=1.0)
  np.testing.assert_allclose(sliced, full, atol=1e-6)
  assert not np.allclose(sliced, 0.0)


def _dot_types(fn, x):
  """'(lhs, rhs) -> out' tensor types of every dot_general in fn's lowered program."""
  hlo = jax.jit(fn).lower(x).as_text()
  return [re.search(r": \((.*)\) -> (.*)$", line).groups()
          for line in hlo.splitlines() if "dot_general" in line]


def test_narrow_tier_really_computes_less():
  # d_model (24) differs from every hidden width, so each shape below names one quantity.
  mlp = NestedMLP(24, 64, out_std=0.02, bias=True, dtype=jnp.float32, rngs=nnx.Rngs(0))
  x = jnp.ones((1, 4, 24))
  # The 25% tier multiplies by 24x16 and 16x24 slices: 16 of the 64 hidden units.
  assert _dot_types(lambda x: mlp(x, fraction=0.25), x) == [
      ("tensor<1x4x24xf32>, tensor<24x16xf32>", "tensor<1x4x16xf32>"),
      ("tensor<1x4x16xf32>, tensor<16x24xf32>", "tensor<1x4x24xf32>")]
  assert _dot_types(lambda x: mlp(x, fraction=1.0), x) == [
      ("tensor<1x4x24xf32>, tensor<24x64xf32>", "tensor<1x4x64xf32>"),
      ("tensor<1x4x64xf32>, tensor<64x24xf32>", "tensor<1x4x24xf32>")]


@pytest.mark.parametrize("name,overrides", [
    ("tiny", {}),
    ("tiny", {"position": "rotary", "rotary_fraction": 0.25, "parallel_residual": True,
              "tie_embeddings": False, "dropout": 0.1}),
    ("tiny", {"dtype": "bfloat16", "bias": False}),
])
def test_forward_shapes_and_finite_loss(name, overrides):
  cfg = get_preset(name, tokenizer_vocab=256, **overrides)
  model = GPT(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(0), (2, 17), 0, 256)
  logits = model(tokens[:, :-1])
  assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32
  loss = next_token_loss(model, tokens, dropout_key=jax.random.key(3))
  assert np.isfinite(loss) and abs(float(loss) - np.log(256)) < 0.5
  params = nnx.state(model, nnx.Param)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))  # fp32 params under bf16


def test_causal_model_does_not_see_the_future():
  for position in ("learned", "rotary"):
    model = GPT(get_preset("tiny", tokenizer_vocab=256, position=position), rngs=nnx.Rngs(0))
    tokens = jnp.arange(16)[None] % 256
    changed = tokens.at[0, 10].set(7)
    a, b = model(tokens), model(changed)
    np.testing.assert_allclose(a[0, :10], b[0, :10], atol=1e-5)
    assert not np.allclose(a[0, 10:], b[0, 10:])


def test_dropout_path_attention_equals_fused_attention_at_rate_zero():
  cfg = get_preset("tiny", tokenizer_vocab=256, position="rotary", rotary_fraction=0.5)
  model = GPT(cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 9, cfg.d_model))
  fused = model.blocks[0].attn(x)
  materialized = model.blocks[0].attn(x, dropout=1e-9, key=jax.random.key(1))
  np.testing.assert_allclose(fused, materialized, atol=1e-5)
  dropped = model.blocks[0].attn(x, dropout=0.5, key=jax.random.key(1))
  assert not np.allclose(fused, dropped)
