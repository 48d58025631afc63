"""Which kernel runs causal self-attention (`model.attention`).

'xla' is XLA's own attention (the scores materialized); 'cudnn' is cuDNN's fused flash
attention (NVIDIA GPUs, 16-bit inputs), about twice the training speed of GPT-2 124M on an
H200 (BENCHMARKS.md). 'auto' picks cuDNN wherever it can run the model's attention and XLA
elsewhere; jax.nn.dot_product_attention left to itself runs XLA's on GPUs too.
"""

import jax
import jax.extend

CHOICES = ("auto", "cudnn", "xla")
# cuDNN's flash attention (jax/_src/cudnn/fused_attention_stablehlo.py): fp16/bf16 inputs, a
# head dim that is a multiple of 8 and at most 128 (256 from Hopper on; 128 holds on all).
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 128


def platform() -> str:
  """'cuda' on an NVIDIA GPU, else JAX's backend name ('cpu', 'rocm', 'tpu', ...)."""
  backend = jax.default_backend()
  if backend == "gpu":
    version = jax.extend.backend.get_backend().platform_version.lower()
    return "cuda" if "cuda" in version else "rocm"
  return backend


def cudnn_problem(dtype: str, head_dim: int, platform_name: str) -> str | None:
  """Why cuDNN's fused attention cannot run this model's attention here, or None."""
  if platform_name != "cuda":
    return f"cuDNN attention runs on NVIDIA GPUs only, and this backend is {platform_name!r}"
  if dtype not in CUDNN_DTYPES:
    return f"cuDNN attention needs a 16-bit compute dtype, not model.dtype={dtype!r}"
  if head_dim > CUDNN_MAX_HEAD_DIM or head_dim % 8:
    return (f"cuDNN attention needs a head dim that is a multiple of 8 and at most "
            f"{CUDNN_MAX_HEAD_DIM}, not {head_dim}")
  return None


def resolve(choice: str, dtype: str, head_dim: int, platform_name: str) -> tuple[str, str]:
  """(implementation, why) for `model.attention=choice`: 'cudnn' or 'xla'. Naming 'cudnn'
  where it cannot run is a config problem (`problems`), not resolved here."""
  if choice == "xla":
    return "xla", "model.attention='xla'"
  problem = cudnn_problem(dtype, head_dim, platform_name)
  if choice == "cudnn":
    if problem:
      raise ValueError(f"model.attention='cudnn': {problem}")
    return "cudnn", "model.attention='cudnn'"
  if problem is None:
    return "cudnn", f"auto: cuDNN flash attention ({platform_name}, {dtype}, head dim {head_dim})"
  return "xla", f"auto: XLA attention ({problem})"


def problems(choice: str, dtype: str, head_dim: int | None, platform_name: str) -> list[str]:
  """`model.attention`'s problems in the 'field=value: fix' form (config/check.py)."""
  if choice not in CHOICES:
    return [f"model.attention={choice!r}: use one of {CHOICES}"]
  if choice == "cudnn" and head_dim is not None:
    problem = cudnn_problem(dtype, head_dim, platform_name)
    if problem:
      return [f"model.attention='cudnn': {problem}; set --config.model.attention=auto"]
  return []
