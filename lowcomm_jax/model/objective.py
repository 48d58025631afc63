"""The training objective every program runs: `(params, windows, key, frozen) -> loss`.

The NNX model's next-token loss; its tensor-parallel form under a sync plan; or, for LoRA,
the loss of the frozen base with the adapters merged in (W + (α/r)·A·B), the base cut to a
narrow MatFormer tier's width first.
"""

import jax.numpy as jnp
from flax import nnx

from lowcomm_jax.model import lora
from lowcomm_jax.model.gpt import next_token_loss
from lowcomm_jax.model.matformer import slice_tier
from lowcomm_jax.model.presets import GPTConfig
from lowcomm_jax.model.tp import SyncPlan, tp_loss


def loss_fn_of(graphdef, model_cfg: GPTConfig, plan: SyncPlan | None, mesh,
               lora_scale: float | None = None, narrow: bool = False):
  """(params, windows, key, frozen) -> loss: the NNX model of `graphdef`, or its
  tensor-parallel form under `plan` over `mesh`'s 'model' axis (no dropout there;
  validation requires model.dropout = 0). With `lora_scale`, `params` are LoRA adapters on
  the frozen base `frozen`, which a `narrow` tier (model_cfg.d_ff hidden units) cuts to its
  width first."""
  if plan is not None:
    return lambda params, windows, key, frozen: tp_loss(params, windows, model_cfg, plan, mesh)

  def loss_fn(params, windows, key, frozen):
    if lora_scale is not None:  # W + scale·A·B in float32; untargeted leaves as stored
      if narrow:
        frozen = slice_tier(frozen, model_cfg.d_ff)
      params = lora.merge(frozen, params, scale=lora_scale, dtype=jnp.float32)
    return next_token_loss(nnx.merge(graphdef, params), windows, dropout_key=key)
  return loss_fn
