"""LoRA adapters (Hu et al. 2021) on a frozen base's projection kernels.

A targeted kernel W [in, out] gets a pair A [in, r], B [r, out]; the model computes with
W + (α / r)·A·B. A starts random (N(0, 1/in), so A·x keeps x's scale), B at zero, so
training starts exactly at the base model. Flax's `nnx.LoRA` applies no α/r scale; this
module keeps the scale explicit so `lora.alpha` means what it means in the papers.

The adapters are a parameter tree of their own, mirroring the base's paths down to each
targeted kernel ({"blocks": {0: {"attn": {"qkv": {"kernel": {"a": A, "b": B}}}}}}), so the
flat layout, the codecs and the checkpoints see only adapters.
"""

import jax
import jax.numpy as jnp

# lora.targets -> the kernels each name covers (the model's leaf names)
TARGETS = {
    "attn": (("attn", "qkv", "kernel"), ("attn", "proj", "kernel")),
    "mlp": (("mlp", "gate_kernel"), ("mlp", "fc_kernel"), ("mlp", "proj_kernel")),
}


def _names(path) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def is_target(path, targets) -> bool:
  names = _names(path)
  return any(names[-len(t):] == t for name in targets for t in TARGETS[name])


def init_adapters(key: jax.Array, base, *, rank: int, targets) -> dict:
  """Adapters for every kernel of `base` that `targets` names (float32)."""
  unknown = set(targets) - set(TARGETS)
  if unknown or not targets:
    raise ValueError(f"LoRA targets {tuple(targets)}: choose from {tuple(TARGETS)}")
  flat = jax.tree_util.tree_flatten_with_path(base)[0]
  out: dict = {}
  for i, (path, w) in enumerate(flat):
    if not is_target(path, targets):
      continue
    d_in, d_out = w.shape
    a = jax.random.normal(jax.random.fold_in(key, i), (d_in, rank), jnp.float32) / d_in ** 0.5
    node = out
    for name in _names(path)[:-1]:
      node = node.setdefault(name, {})
    node[_names(path)[-1]] = {"a": a, "b": jnp.zeros((rank, d_out), jnp.float32)}
  if not out:
    raise ValueError(f"LoRA targets {tuple(targets)}: the model has none of these kernels")
  return out


def merge(base, adapters, *, scale: float, dtype=None):
  """The base with every adapted kernel replaced by W + scale·A·B (in `dtype`, default
  the kernel's own; a bfloat16 base is merged in float32 and cast back)."""
  def walk(node, ad):
    if ad is None:
      return node
    if isinstance(ad, dict) and set(ad) == {"a", "b"}:
      w = node.astype(jnp.float32) + scale * (ad["a"] @ ad["b"])
      return w.astype(dtype or node.dtype)
    return {k: walk(v, ad.get(k)) for k, v in node.items()}
  return walk(base, adapters)


def count(adapters) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(adapters))
