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
  """GELU MLP d -> F -> d whose width is chosen per call."""

  def __init__(self, d_model: int, d_ff: int, *, out_std: float, bias: bool,
               dtype: jnp.dtype, rngs: nnx.Rngs):
    init = jax.nn.initializers.normal(0.02)
    self.fc_kernel = nnx.Param(init(rngs.params(), (d_model, d_ff)))
    self.proj_kernel = nnx.Param(jax.nn.initializers.normal(out_std)(rngs.params(), (d_ff, d_model)))
    self.fc_bias = nnx.Param(jnp.zeros((d_ff,))) if bias else None
    self.proj_bias = nnx.Param(jnp.zeros((d_model,))) if bias else None
    self.d_ff = d_ff
    self.dtype = dtype

  def __call__(self, x_BxLxD: jax.Array, fraction: float = 1.0) -> jax.Array:
    m = hidden_units(self.d_ff, fraction)
    h_BxLxM = x_BxLxD @ self.fc_kernel[:, :m].astype(self.dtype)
    if self.fc_bias is not None:
      h_BxLxM = h_BxLxM + self.fc_bias[:m].astype(self.dtype)
    h_BxLxM = jax.nn.gelu(h_BxLxM, approximate=False)  # nanoGPT uses exact GELU
    y_BxLxD = h_BxLxM @ self.proj_kernel[:m].astype(self.dtype)
    if self.proj_bias is not None:
      y_BxLxD = y_BxLxD + self.proj_bias[...].astype(self.dtype)
    return y_BxLxD
