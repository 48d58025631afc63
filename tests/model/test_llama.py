"""The Llama family (RMSNorm, SwiGLU, grouped-query attention, rotary base) against a NumPy
forward written from the architecture's definition, on the model's own random weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowcomm_jax.model import GPT, count_params, get_preset
from lowcomm_jax.model.flops import matmul_params


def _rms(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x_LxNxH, base):
  seq, _, hd = x_LxNxH.shape
  inv = 1.0 / base ** (np.arange(0, hd, 2) / hd)
  freqs = np.arange(seq)[:, None] * inv[None]
  cos = np.cos(np.concatenate([freqs, freqs], -1))[:, None]
  sin = np.sin(np.concatenate([freqs, freqs], -1))[:, None]
  rotated = np.concatenate([-x_LxNxH[..., hd // 2:], x_LxNxH[..., :hd // 2]], -1)
  return x_LxNxH * cos + rotated * sin


def numpy_llama(p, tokens, cfg):
  """One sequence's logits [L, V] (float64), following Hugging Face's LlamaModel."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  hd, nq, nkv = cfg.head_dim, cfg.n_head, cfg.kv_heads
  x = p["wte"]["embedding"][tokens]
  seq = len(tokens)
  for i in range(cfg.n_layer):
    b = p["blocks"][i]
    h = _rms(x, b["ln1"]["scale"], cfg.norm_eps)
    w = b["attn"]["qkv"]["kernel"]
    q = (h @ w[:, :nq * hd]).reshape(seq, nq, hd)
    k = (h @ w[:, nq * hd:(nq + nkv) * hd]).reshape(seq, nkv, hd)
    v = (h @ w[:, (nq + nkv) * hd:]).reshape(seq, nkv, hd)
    q, k = _rope(q, cfg.rope_base), _rope(k, cfg.rope_base)
    heads = []
    for n in range(nq):
      j = n // (nq // nkv)  # the kv head this query head shares
      s = q[:, n] @ k[:, j].T / np.sqrt(hd)
      s = np.where(np.tril(np.ones((seq, seq), bool)), s, -np.inf)
      e = np.exp(s - s.max(-1, keepdims=True))
      heads.append((e / e.sum(-1, keepdims=True)) @ v[:, j])
    x = x + np.concatenate(heads, -1) @ b["attn"]["proj"]["kernel"]
    h = _rms(x, b["ln2"]["scale"], cfg.norm_eps)
    gate = h @ b["mlp"]["gate_kernel"]
    x = x + (gate / (1 + np.exp(-gate)) * (h @ b["mlp"]["fc_kernel"])) @ b["mlp"]["proj_kernel"]
  x = _rms(x, p["ln_f"]["scale"], cfg.norm_eps)
  return x @ p["wte"]["embedding"].T


def _model(cfg, seed=0):
  model = GPT(cfg, rngs=nnx.Rngs(seed))
  # RMSNorm scales start at 1; perturb them so a wrong norm weight would show.
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  key = jax.random.key(seed + 1)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.1 * jax.random.normal(jax.random.fold_in(key, len(str(path))),
                                                  x.shape)
      if "scale" in str(path) else x, params)
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  return model, params


def test_llama_logits_equal_a_numpy_reference_forward():
  cfg = get_preset("tiny_llama", vocab_size=61, rope_base=500.0)
  model, params = _model(cfg)
  tokens = np.random.default_rng(0).integers(0, 61, (2, 12))
  logits = np.asarray(model(jnp.asarray(tokens)))
  for b in range(2):
    np.testing.assert_allclose(logits[b], numpy_llama(params, tokens[b], cfg),
                               rtol=2e-4, atol=2e-4)


def test_grouped_query_attention_sizes_its_qkv_and_refuses_uneven_groups():
  """(Which kv head each query head reads is checked by the NumPy reference above.)"""
  gqa = get_preset("tiny_llama", vocab_size=61)
  mha = get_preset("tiny_llama", vocab_size=61, n_kv_head=None)
  q_kv = lambda c: GPT(c, rngs=nnx.Rngs(0)).blocks[0].attn.qkv.kernel.shape
  assert q_kv(gqa) == (32, (4 + 2 * 2) * 8) and q_kv(mha) == (32, 3 * 32)
  with pytest.raises(ValueError, match="n_kv_head=3"):
    GPT(get_preset("tiny_llama", vocab_size=61, n_kv_head=3), rngs=nnx.Rngs(0))


def test_smollm2_135m_shape_and_flops_count():
  cfg = get_preset("smollm2_135m")
  abstract = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
  # SmolLM2-135M: 134,515,008 parameters (tied embeddings).
  assert count_params(nnx.state(abstract, nnx.Param)) == 134_515_008
  per_block = 576 * (9 + 6) * 64 + 576 * 576 + 3 * 576 * 1536
  assert matmul_params(cfg) == 30 * per_block + 576 * 49152


def test_dropout_path_equals_fused_attention_with_grouped_heads():
  cfg = get_preset("tiny_llama", vocab_size=61)
  model = GPT(cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 10, 32))
  attn = model.blocks[0].attn
  fused = attn(x)
  materialized = attn(x, dropout=1e-9, key=jax.random.key(1))
  np.testing.assert_allclose(fused, materialized, rtol=1e-4, atol=1e-5)
