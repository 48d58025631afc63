"""nanoGPT-compatible GPT in Flax NNX, with GPT-NeoX options (rotary, parallel residual) and
the Llama family's (RMSNorm, SwiGLU, grouped-query attention, rotary base).

Learned positions, pre-LayerNorm, exact-GELU MLP (MatFormer-nested), tied input/output
embeddings, optional biases and dropout. One module serves both families, so every
algorithm, tier and codec works on either. Parameters are float32; `dtype` sets the compute
dtype (bfloat16 for speed on GPUs); logits and the loss are computed in float32 (in pieces of
the sequence: `loss_chunk`).
"""

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from lowcomm_jax.model.cross_entropy import chunked_token_losses
from lowcomm_jax.model.matformer import NestedMLP
from lowcomm_jax.model.presets import GPTConfig

_normal = jax.nn.initializers.normal


def _dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
  if key is None or rate == 0.0:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def _rotary(x_BxLxNxH: jax.Array, rot_dims: int, base: float = 10000.0) -> jax.Array:
  """GPT-NeoX rotary embedding on the first `rot_dims` dims of every head (the halves
  layout Hugging Face's Llama uses too)."""
  seq_len = x_BxLxNxH.shape[1]
  inv_freq = 1.0 / (base ** (jnp.arange(0, rot_dims, 2, dtype=jnp.float32) / rot_dims))
  angles_LxR2 = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  angles_LxR = jnp.concatenate([angles_LxR2, angles_LxR2], axis=-1)[None, :, None, :]
  cos, sin = jnp.cos(angles_LxR), jnp.sin(angles_LxR)
  x_rot, x_pass = x_BxLxNxH[..., :rot_dims], x_BxLxNxH[..., rot_dims:]
  half = rot_dims // 2
  rotated_half = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
  x_rot = (x_rot.astype(jnp.float32) * cos + rotated_half.astype(jnp.float32) * sin)
  return jnp.concatenate([x_rot.astype(x_BxLxNxH.dtype), x_pass], axis=-1)


class CausalSelfAttention(nnx.Module):

  def __init__(self, cfg: GPTConfig, *, out_std: float, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    if cfg.n_head % cfg.kv_heads:
      raise ValueError(f"n_head={cfg.n_head} is not a multiple of n_kv_head={cfg.kv_heads}")
    # q, k, v in one matmul: n_head query heads, then kv_heads key and kv_heads value heads.
    self.qkv = nnx.Linear(cfg.d_model, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim,
                          use_bias=cfg.bias, dtype=dtype, kernel_init=_normal(0.02),
                          rngs=rngs)
    self.proj = nnx.Linear(cfg.d_model, cfg.d_model, use_bias=cfg.bias, dtype=dtype,
                           kernel_init=_normal(out_std), rngs=rngs)
    self.n_head = cfg.n_head
    self.kv_heads = cfg.kv_heads
    self.rope_base = cfg.rope_base
    self.implementation = cfg.attention  # model/attention.py
    # Rotary needs an even number of dims; round the configured share down to one.
    self.rot_dims = (2 * int(cfg.head_dim * cfg.rotary_fraction / 2)
                     if cfg.position == "rotary" else 0)

  def __call__(self, x_BxLxD: jax.Array, *, dropout: float = 0.0,
               key: jax.Array | None = None) -> jax.Array:
    b, l, d = x_BxLxD.shape
    hd = d // self.n_head
    qkv = self.qkv(x_BxLxD).reshape(b, l, self.n_head + 2 * self.kv_heads, hd)
    q, k, v = jnp.split(qkv, [self.n_head, self.n_head + self.kv_heads], axis=2)
    if self.rot_dims:
      q = _rotary(q, self.rot_dims, self.rope_base)
      k = _rotary(k, self.rot_dims, self.rope_base)
    if key is None or dropout == 0.0:  # XLA's, or cuDNN's flash attention (attention.py)
      # Grouped-query attention when kv_heads < n_head: query head n reads kv head
      # n // (n_head / kv_heads), as Hugging Face's repeat_kv does.
      y_BxLxNxH = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                               implementation=self.implementation)
    else:  # nanoGPT's dropout on the attention probabilities needs them materialized
      group = self.n_head // self.kv_heads
      k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
      scores_BxNxLxL = jnp.einsum("blnh,bmnh->bnlm", q, k).astype(jnp.float32)
      scores_BxNxLxL = scores_BxNxLxL / math.sqrt(q.shape[-1])
      causal = jnp.tril(jnp.ones((l, l), bool))
      probs = jax.nn.softmax(jnp.where(causal, scores_BxNxLxL, -jnp.inf), axis=-1)
      probs = _dropout(probs, dropout, key).astype(v.dtype)
      y_BxLxNxH = jnp.einsum("bnlm,bmnh->blnh", probs, v)
    return self.proj(y_BxLxNxH.reshape(b, l, d))


def _norm(cfg: GPTConfig, rngs: nnx.Rngs) -> nnx.Module:
  dtype = jnp.dtype(cfg.dtype)
  if cfg.norm == "rmsnorm":
    return nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=dtype, rngs=rngs)
  if cfg.norm == "layernorm":
    return nnx.LayerNorm(cfg.d_model, epsilon=cfg.norm_eps, use_bias=cfg.bias, dtype=dtype,
                         rngs=rngs)
  raise ValueError(f"norm={cfg.norm!r}: use 'layernorm' or 'rmsnorm'")


class Block(nnx.Module):

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    out_std = 0.02 / math.sqrt(2 * cfg.n_layer)  # GPT-2's scaled residual projections
    dtype = jnp.dtype(cfg.dtype)
    self.ln1 = _norm(cfg, rngs)
    self.attn = CausalSelfAttention(cfg, out_std=out_std, rngs=rngs)
    self.ln2 = _norm(cfg, rngs)
    self.mlp = NestedMLP(cfg.d_model, cfg.d_ff, out_std=out_std, bias=cfg.bias, dtype=dtype,
                         gated=cfg.mlp == "swiglu", approximate_gelu=cfg.mlp == "gelu_tanh",
                         rngs=rngs)
    self.parallel_residual = cfg.parallel_residual
    self.dropout = cfg.dropout

  def __call__(self, x: jax.Array, ffn_fraction: float, key: jax.Array | None) -> jax.Array:
    probs_key, attn_key, mlp_key = (jax.random.split(key, 3) if key is not None
                                    else (None, None, None))
    attn_out = self.attn(self.ln1(x), dropout=self.dropout, key=probs_key)
    attn_out = _dropout(attn_out, self.dropout, attn_key)
    if self.parallel_residual:
      return x + attn_out + _dropout(self.mlp(self.ln2(x), ffn_fraction), self.dropout, mlp_key)
    x = x + attn_out
    return x + _dropout(self.mlp(self.ln2(x), ffn_fraction), self.dropout, mlp_key)


class GPT(nnx.Module):

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    if cfg.vocab_size is None:
      raise ValueError("GPTConfig.vocab_size is unset; resolve it with presets.get_preset")
    if cfg.mlp not in ("gelu", "gelu_tanh", "swiglu"):
      raise ValueError(f"mlp={cfg.mlp!r}: use 'gelu', 'gelu_tanh' or 'swiglu'")
    if cfg.d_model % cfg.n_head:
      raise ValueError(f"d_model={cfg.d_model} is not divisible by n_head={cfg.n_head}")
    self.cfg = cfg
    dtype = jnp.dtype(cfg.dtype)
    self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype,
                         embedding_init=_normal(0.02), rngs=rngs)
    self.wpe = (nnx.Embed(cfg.block_size, cfg.d_model, dtype=dtype,
                          embedding_init=_normal(0.02), rngs=rngs)
                if cfg.position == "learned" else None)
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layer)])
    self.ln_f = _norm(cfg, rngs)
    self.lm_head = (None if cfg.tie_embeddings else
                    nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dtype,
                               kernel_init=_normal(0.02), rngs=rngs))

  def __call__(self, tokens_BxL: jax.Array, *, ffn_fraction: float = 1.0,
               dropout_key: jax.Array | None = None) -> jax.Array:
    """Float32 logits [B, L, V]. `dropout_key=None` means evaluation (no dropout)."""
    return self.head(self.features(tokens_BxL, ffn_fraction=ffn_fraction,
                                   dropout_key=dropout_key)).astype(jnp.float32)

  def features(self, tokens_BxL: jax.Array, *, ffn_fraction: float = 1.0,
               dropout_key: jax.Array | None = None) -> jax.Array:
    """The final normalized hidden states [B, L, D], in the compute dtype."""
    b, l = tokens_BxL.shape
    x_BxLxD = self.wte(tokens_BxL)
    if self.wpe is not None:
      x_BxLxD = x_BxLxD + self.wpe(jnp.arange(l))[None]
    keys = (jax.random.split(dropout_key, self.cfg.n_layer + 1) if dropout_key is not None
            else [None] * (self.cfg.n_layer + 1))
    x_BxLxD = _dropout(x_BxLxD, self.cfg.dropout, keys[-1])
    for block, key in zip(self.blocks, keys[:-1]):
      x_BxLxD = block(x_BxLxD, ffn_fraction, key)
    return self.ln_f(x_BxLxD)

  def head(self, x_BxLxD: jax.Array) -> jax.Array:
    """Logits of hidden states, in the compute dtype."""
    return self.wte.attend(x_BxLxD) if self.lm_head is None else self.lm_head(x_BxLxD)


def next_token_loss(model: GPT, windows_BxL1: jax.Array, *, ffn_fraction: float = 1.0,
                    dropout_key: jax.Array | None = None) -> jax.Array:
  """Mean cross-entropy of predicting windows[:, 1:] from windows[:, :-1]; in pieces of
  `cfg.loss_chunk` positions when the sequence is longer (the float32 logits of one piece
  at a time: model/cross_entropy.py)."""
  tokens_BxL, labels_BxL = windows_BxL1[:, :-1], windows_BxL1[:, 1:]
  chunk = model.cfg.loss_chunk
  if not chunk or chunk >= tokens_BxL.shape[1]:
    logits = model(tokens_BxL, ffn_fraction=ffn_fraction, dropout_key=dropout_key)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels_BxL).mean()
  x_BxLxD = model.features(tokens_BxL, ffn_fraction=ffn_fraction, dropout_key=dropout_key)
  return chunked_token_losses(x_BxLxD, labels_BxL, model.head, chunk).mean()


def count_params(params) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params))
