"""The eval program: every MatFormer width of the model on the same fixed batches, in one
program (`Run.evaluation` names the losses)."""

import jax
import jax.numpy as jnp

from lowcomm_jax.model.matformer import slice_tier
from lowcomm_jax.parallel.flat import ParamLayout
from lowcomm_jax.programs.steps import LossFn


def make_eval_step(widths: tuple[tuple[int, LossFn], ...], d_ff: int, layout: ParamLayout):
  """`eval_step(flat params, windows[N, B, L+1]) -> losses[W]`: the mean loss over N fixed
  batches of each MatFormer width in `widths` ((hidden units, its loss fn), full width
  first), the first m FFN units of every block, as a tier's worker trains them. One
  program for all widths: they read the same batches."""

  def eval_step(flat_params, windows_NxBxL1, *, frozen=()):
    params = layout.unravel(flat_params)

    def losses(batch):
      return jnp.stack([loss_fn(params if m == d_ff else slice_tier(params, m), batch, None,
                                frozen) for m, loss_fn in widths])
    return jax.lax.map(losses, windows_NxBxL1).mean(axis=0)

  return eval_step
