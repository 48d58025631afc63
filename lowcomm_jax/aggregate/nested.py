"""Tier-aware (nested) mean: every coordinate averaged over the workers that trained it.

MatFormer workers of tier width m_w only train the first m_w hidden units of each FFN; their
pseudo-gradients arrive zero-padded. A plain mean would dilute the full-width worker's
update of the outer units by the narrow workers' zeros. Here each worker passes
`coordinate_weights` (its tier mask, optionally times its token count) and the result is

    Σ_w a_w ⊙ Δ_w / Σ_w a_w       (coordinates no worker trained get 0)

With all weights 1 this is the plain mean. The weights are small broadcastable arrays (a
mask over the hidden axis, a scalar elsewhere), so summing them costs a few KiB.
"""

import jax
import jax.numpy as jnp
import optax

from lowcomm_jax.parallel import collectives


def nested_mean(axis_name: str = "replica") -> optax.GradientTransformationExtraArgs:
  """Weighted mean over workers; extra arg `coordinate_weights` (tree broadcastable to updates)."""

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, coordinate_weights, **extra_args):
    del params, extra_args
    weighted = jax.tree.map(lambda a, u: a * u, coordinate_weights, updates)
    numerator = collectives.sum(weighted, axis_name)
    denominator = collectives.sum(coordinate_weights, axis_name)
    mean = jax.tree.map(lambda n, d: n / jnp.where(d > 0, d, 1.0), numerator, denominator)
    return mean, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
