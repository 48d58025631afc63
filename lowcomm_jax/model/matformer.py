"""MatFormer nested FFN: one weight matrix pair, any prefix of its hidden units is a model.

A worker of tier fraction f uses only the first m = round(f * F) hidden units. The weights
are sliced, not masked, so a narrow tier really computes (and stores gradients for) less.
"""

import jax
import jax.numpy as jnp
from flax import nnx


def hidden_units(d_ff: int, fraction: float) -> int:
  """Number of FFN hidden units a tier of this fraction trains."""
  if not 0.0 < fraction <= 1.0:
    raise ValueError(f"FFN fraction must be in (0, 1], got {fraction}")
  return max(1, int(round(d_ff * fraction)))


class NestedMLP(nnx.Module):
  """MLP d -> F -> d whose width is chosen per call: GELU (exact, or GPT-2's tanh
  approximation when `approximate_gelu`), or SwiGLU when `gated` (silu(x W_gate) * (x W_fc),
  Llama's gate and up projections)."""

  def __init__(self, d_model: int, d_ff: int, *, out_std: float, bias: bool,
               dtype: jnp.dtype, rngs: nnx.Rngs, gated: bool = False,
               approximate_gelu: bool = False):
    if gated and bias:
      raise ValueError("a SwiGLU MLP has no biases here (Llama's have none); set bias=False")
    init = jax.nn.initializers.normal(0.02)
    self.gate_kernel = nnx.Param(init(rngs.params(), (d_model, d_ff))) if gated else None
    self.fc_kernel = nnx.Param(init(rngs.params(), (d_model, d_ff)))
    self.proj_kernel = nnx.Param(jax.nn.initializers.normal(out_std)(rngs.params(), (d_ff, d_model)))
    self.fc_bias = nnx.Param(jnp.zeros((d_ff,))) if bias else None
    self.proj_bias = nnx.Param(jnp.zeros((d_model,))) if bias else None
    self.d_ff = d_ff
    self.dtype = dtype
    self.approximate_gelu = approximate_gelu

  def __call__(self, x_BxLxD: jax.Array, fraction: float = 1.0) -> jax.Array:
    m = hidden_units(self.d_ff, fraction)
    h_BxLxM = x_BxLxD @ self.fc_kernel[:, :m].astype(self.dtype)
    if self.fc_bias is not None:
      h_BxLxM = h_BxLxM + self.fc_bias[:m].astype(self.dtype)
    if self.gate_kernel is not None:
      h_BxLxM = jax.nn.silu(x_BxLxD @ self.gate_kernel[:, :m].astype(self.dtype)) * h_BxLxM
    else:
      # nanoGPT uses exact GELU; GPT-2's released weights were trained with the tanh form
      h_BxLxM = jax.nn.gelu(h_BxLxM, approximate=self.approximate_gelu)
    y_BxLxD = h_BxLxM @ self.proj_kernel[:m].astype(self.dtype)
    if self.proj_bias is not None:
      y_BxLxD = y_BxLxD + self.proj_bias[...].astype(self.dtype)
    return y_BxLxD


def width_problems(field: str, widths, d_ff: int, tp: int = 1) -> list[str]:
  """One line per width in `widths` (config field `field`) that is no model of this FFN:
  outside (0, 1], not a whole number of its d_ff units (the FFN's granularity: 1/d_ff), or a
  number of units that tensor parallelism over `tp` devices cannot split."""
  out = []
  for w in widths:
    try:
      units = float(w) * d_ff
    except (TypeError, ValueError):
      out.append(f"{field}: {w!r} is not a number; give FFN fractions such as 0.25")
      continue
    if not 0.0 < float(w) <= 1.0:
      out.append(f"{field}: {w} is not an FFN fraction; use values in (0, 1]")
    elif abs(units - round(units)) > 0.01:  # a width printed to 6 digits still passes
      out.append(f"{field}: {w} of {d_ff} FFN units is {units:g}, not a whole number; use a "
                 f"multiple of 1/{d_ff} (e.g. {max(1, round(units)) / d_ff:.10g})")
    elif round(units) % tp:
      out.append(f"{field}: {w} keeps {round(units)} FFN units, not divisible by "
                 f"model.tp.size={tp}; pick a width whose units tp divides")
  return out


def eval_widths(tiers, extra=()) -> tuple[float, ...]:
  """The FFN fractions a run evaluates, widest first: the full width, every host's tier and
  each of `extra` (Mix'n'Match widths no host trains); (1.0,) when nothing is narrower."""
  return tuple(sorted({1.0, *map(float, tiers), *map(float, extra)}, reverse=True))


# --- Tiers as parameter trees ------------------------------------------------------------
# A tier of width m holds only the first m hidden units of every NestedMLP: its parameters
# are the full tree with these leaves cut along their hidden axis. The outer step works on
# full shapes, so tier-shaped pseudo-gradients are zero-padded back and weighted by a mask.

_HIDDEN_AXIS = {"gate_kernel": 1, "fc_kernel": 1, "fc_bias": 0, "proj_kernel": 0}
# LoRA adapters of FFN kernels (model/lora.py: kernel -> {"a": [in, r], "b": [r, out]}): the
# hidden axis is B's columns for fc and gate, A's rows for proj.
_ADAPTER_HIDDEN_AXIS = {("gate_kernel", "b"): 1, ("fc_kernel", "b"): 1, ("proj_kernel", "a"): 0}


def _hidden_axis(path) -> int | None:
  names = tuple(getattr(k, "key", None) for k in path[-2:])
  if names[-1] in ("a", "b"):
    return _ADAPTER_HIDDEN_AXIS.get(names)
  return _HIDDEN_AXIS.get(names[-1])


def slice_tier(params, m: int):
  """The tier-m parameters: every FFN leaf cut to its first m hidden units (static m)."""
  def cut(path, x):
    axis = _hidden_axis(path)
    return x if axis is None else jax.lax.slice_in_dim(x, 0, m, axis=axis)
  return jax.tree_util.tree_map_with_path(cut, params)


def pad_tier(tier_tree, full_like):
  """Zero-pads a tier-shaped tree (e.g. a pseudo-gradient) back to the full shapes."""
  def pad(path, x, full):
    axis = _hidden_axis(path)
    if axis is None:
      return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, full.shape[axis] - x.shape[axis])
    return jnp.pad(x, widths)
  return jax.tree_util.tree_map_with_path(pad, tier_tree, full_like)


def unslice_tier(full, tier_tree):
  """`full` with its first hidden units replaced by the tier-shaped `tier_tree` (a narrow
  worker's trained parameters written back into its full-width copy)."""
  def put(path, f, t):
    axis = _hidden_axis(path)
    if axis is None:
      return t
    return jax.lax.dynamic_update_slice_in_dim(f, t.astype(f.dtype), 0, axis=axis)
  return jax.tree_util.tree_map_with_path(put, full, tier_tree)


def tier_mask(full_like, m: jax.Array):
  """Per-coordinate 1/0 weights of a tier-m worker, as small broadcastable arrays.

  `m` may be traced (different per vmapped worker). FFN leaves get a mask over the hidden
  axis (shape (1, F), (F,) or (F, 1)); every other leaf a scalar 1: all tiers train it.
  """
  def mask(path, x):
    axis = _hidden_axis(path)
    if axis is None:
      return jnp.ones((), jnp.float32)
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    return (jnp.arange(x.shape[axis]) < m).astype(jnp.float32).reshape(shape)
  return jax.tree_util.tree_map_with_path(mask, full_like)
