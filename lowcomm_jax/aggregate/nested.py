"""Tier-aware (nested) mean: every coordinate averaged over the workers that trained it.

MatFormer workers of tier width m_w only train the first m_w hidden units of each FFN; their
pseudo-gradients arrive zero-padded. A plain mean would dilute the full-width worker's
update of the outer units by the narrow workers' zeros. Each worker passes
`coordinate_weights` a_w (its tier mask, optionally times its token count) and
`weight_totals` Σ_w a_w, and the result is

    Σ_w a_w ⊙ Δ_w / Σ_w a_w       (coordinates no worker trained get 0)

With all weights 1 this is the plain mean. The totals follow from the host table, which
every process knows, so the caller computes them locally: only the numerator crosses the
network. Weights are small broadcastable arrays (a mask over the hidden axis, a scalar
elsewhere).
"""

import jax
import optax

from lowcomm_jax.parallel import collectives, weighted


def nested_mean(axis_name: str = "replica") -> optax.GradientTransformationExtraArgs:
  """Weighted mean over workers; extra args `coordinate_weights` and `weight_totals` (trees
  broadcastable to the updates: this worker's weights and their sum over all workers)."""

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, coordinate_weights, weight_totals,
                **extra_args):
    del params, extra_args
    weighted_updates = jax.tree.map(lambda a, u: a * u, coordinate_weights, updates)
    numerator = collectives.sum(weighted_updates, axis_name)
    mean = jax.tree.map(weighted.divide_by_weight, numerator, weight_totals)
    return mean, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
