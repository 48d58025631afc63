"""Model FLOPs per token, counted from the model's shapes (for MFU).

The usual convention (PaLM appendix B, nanoGPT's `estimate_mfu`): a multiply-add is 2
FLOPs; a token's forward pass costs 2 FLOPs per parameter of every matmul it goes through
(attention q/k/v and output projections, the FFN's two matrices, the LM head; embedding
lookups, norms and biases are not matmuls) plus attention itself: scores q·kᵀ and the
weighted sum of values, 2·T·d each per layer for a token attending T positions. The
causal mask is not discounted (the kernels compute the full T×T product). Training is
3× the forward: the backward pass costs two forwards.

    train FLOPs / token = 6·N_matmul + 12·n_layer·T·d_model
"""

from lowcomm_jax.model.presets import GPTConfig


def matmul_params(cfg: GPTConfig) -> int:
  """Weights a token multiplies through: per block qkv, attention out, FFN in and out;
  then the LM head (tied to the embedding or not, it is one d × vocab matmul)."""
  d = cfg.d_model
  qkv = d * (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim
  ffn_in = (2 if cfg.mlp == "swiglu" else 1) * d * cfg.d_ff  # gate and up for SwiGLU
  per_block = qkv + d * d + ffn_in + cfg.d_ff * d
  return cfg.n_layer * per_block + d * cfg.vocab_size


def forward_flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
  return 2.0 * matmul_params(cfg) + 4.0 * cfg.n_layer * seq_len * cfg.d_model


def train_flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
  return 3.0 * forward_flops_per_token(cfg, seq_len)
