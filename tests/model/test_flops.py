import pytest
from flax import nnx

from lowcomm_jax.model import GPT, get_preset
from lowcomm_jax.model.flops import forward_flops_per_token, matmul_params, train_flops_per_token


def _matmul_leaf_count(cfg) -> int:
  """Parameters of the real model that multiply activations: every kernel (Linear and
  NestedMLP's fc/proj) and, when the head is tied, the embedding table it reuses."""
  model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))  # allocates nothing
  n = 0
  for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if str(path[-1]).endswith("kernel") or (cfg.tie_embeddings and path == ("wte", "embedding")):
      n += leaf.get_value().size
  return n


def test_tiny_by_hand():
  cfg = get_preset("tiny", tokenizer_vocab=256)  # byte tokenizer: vocab 256
  assert (cfg.n_layer, cfg.d_model, cfg.d_ff, cfg.vocab_size) == (2, 32, 128, 256)
  per_layer = 32 * 96 + 32 * 32 + 32 * 128 + 128 * 32  # qkv, attn proj, fc, mlp proj = 12288
  head = 32 * 256  # tied to wte, still a matmul
  assert matmul_params(cfg) == 2 * per_layer + head == 32768
  attention = 2 * 2 * 2 * 64 * 32  # QK^T + probs @ V, 2 layers, seq 64, full (unmasked) = 16384
  assert forward_flops_per_token(cfg, 64) == 2 * 32768 + attention == 81920
  assert train_flops_per_token(cfg, 64) == 3 * 81920


@pytest.mark.parametrize("name", ["tiny", "pythia_14m", "gpt2_124m"])  # tied / untied head
def test_matmul_part_is_6x_the_models_matmul_parameters(name):
  cfg = get_preset(name, tokenizer_vocab=256)
  n = _matmul_leaf_count(cfg)
  assert matmul_params(cfg) == n
  assert train_flops_per_token(cfg, 0) == 6 * n
  # The attention term is the rest, linear in seq_len: 12 * n_layer * d_model per position.
  assert (train_flops_per_token(cfg, 128) - 6 * n) == 12 * cfg.n_layer * cfg.d_model * 128


def test_gpt2_124m_matches_nanogpt():
  # nanoGPT's estimate_mfu: 6N + 12 L d T with N the non-position-embedding parameters
  # (about 6 * 85M block/head weights per token dominate at T = 1024).
  cfg = get_preset("gpt2_124m")
  assert train_flops_per_token(cfg, 1024) == pytest.approx(
      6 * (12 * 12 * 768**2 + 768 * 50304) + 12 * 12 * 768 * 1024)
