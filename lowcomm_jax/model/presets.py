"""Model shapes by name. A preset fixes the architecture; the run config picks one."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  n_layer: int
  n_head: int
  d_model: int
  d_ff: int
  block_size: int  # longest sequence the position table / rotary cache supports
  vocab_size: int | None = None  # None: taken from the tokenizer (see with_vocab)
  bias: bool = True
  dropout: float = 0.0
  position: str = "learned"  # 'learned' (GPT-2) | 'rotary' (GPT-NeoX)
  rotary_fraction: float = 1.0  # share of each head's dims that rotary rotates
  parallel_residual: bool = False  # x + attn(ln1 x) + mlp(ln2 x) (GPT-NeoX) vs sequential
  tie_embeddings: bool = True
  dtype: str = "float32"  # compute dtype; parameters are always float32
  # Runtime choices, not shapes (assemble/build.py settles them from the run config):
  attention: str = "xla"  # 'xla' | 'cudnn': the kernel of attention without dropout
  loss_chunk: int = 0  # positions per piece of the cross-entropy; 0: the whole sequence
  # Llama family: RMSNorm, SwiGLU, grouped-query attention, rotary on every head dim.
  norm: str = "layernorm"  # 'layernorm' | 'rmsnorm'
  norm_eps: float = 1e-5
  # 'gelu' (exact, nanoGPT) | 'gelu_tanh' (GPT-2's released weights) | 'swiglu' (Llama)
  mlp: str = "gelu"
  n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: n_head
  rope_base: float = 10000.0

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_head

  @property
  def kv_heads(self) -> int:
    return self.n_kv_head or self.n_head

  @property
  def family(self) -> str:
    """'llama' where any of the Llama family's options is on (RMSNorm, SwiGLU, grouped
    query attention), else 'gpt'. Tensor parallelism shards 'gpt' with exact GELU only."""
    gpt = self.norm == "layernorm" and self.mlp != "swiglu" and self.kv_heads == self.n_head
    return "gpt" if gpt else "llama"


PRESETS: dict[str, GPTConfig] = {
    # Unit tests: compiles in about a second.
    "tiny": GPTConfig(n_layer=2, n_head=2, d_model=32, d_ff=128, block_size=64),
    # CPU-sized character-level model used by the example configs and benchmarks.
    "small": GPTConfig(n_layer=4, n_head=4, d_model=128, d_ff=512, block_size=256),
    # 12 layers of `small`'s width: the tensor-parallel sync-plan sweep (24 syncs standard).
    "small12": GPTConfig(n_layer=12, n_head=8, d_model=128, d_ff=512, block_size=256),
    # Pythia-14M shape: GPT-NeoX rotary on 25% of head dims, parallel attention + MLP,
    # untied embeddings (14.07M parameters).
    "pythia_14m": GPTConfig(
        n_layer=6, n_head=4, d_model=128, d_ff=512, block_size=2048, vocab_size=50304,
        position="rotary", rotary_fraction=0.25, parallel_residual=True,
        tie_embeddings=False),
    # GPT-2 small as in nanoGPT (vocab padded to 50304): 124M parameters.
    "gpt2_124m": GPTConfig(
        n_layer=12, n_head=12, d_model=768, d_ff=3072, block_size=1024, vocab_size=50304),
    # Unit tests of the Llama family: 4 query heads sharing 2 key/value heads.
    "tiny_llama": GPTConfig(
        n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, block_size=64, bias=False,
        position="rotary", norm="rmsnorm", mlp="swiglu"),
    # SmolLM2-135M (Llama architecture, tied embeddings): 134.5M parameters.
    "smollm2_135m": GPTConfig(
        n_layer=30, n_head=9, n_kv_head=3, d_model=576, d_ff=1536, block_size=8192,
        vocab_size=49152, bias=False, position="rotary", norm="rmsnorm", mlp="swiglu",
        rope_base=100000.0),
}


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def get_preset(name: str, *, vocab_size: int = 0, tokenizer_vocab: int | None = None,
               **overrides) -> GPTConfig:
  """The named preset with its vocabulary resolved and fields overridden."""
  if name not in PRESETS:
    raise KeyError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
  cfg = PRESETS[name]
  if vocab_size:
    cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
  elif cfg.vocab_size is None:
    if tokenizer_vocab is None:
      raise ValueError(f"preset {name!r} takes its vocabulary from the tokenizer; pass one")
    cfg = dataclasses.replace(cfg, vocab_size=round_up(tokenizer_vocab, 64))
  return dataclasses.replace(cfg, **overrides)
