"""DiLoCo's outer step and DDP as its one-step special case, written as optax chains.

A round ends with every worker holding a pseudo-gradient Δ_w = θ_global − θ_w (DiLoCo) or
its gradient at θ_global (DDP). The outer transform turns Δ_w into the update of θ_global:

    diloco:  chain(replica_mean, sgd(lr, momentum, nesterov))   # Douillard et al. 2023
    ddp:     chain(replica_mean, <the inner optimizer>)           # average, then AdamW

`replica_mean` is where communication happens: an all-reduce over the named worker axis.
After it every worker holds the same value, so the rest of the chain (and the new global
parameters) are identical on all workers — the runner maps workers with `jax.vmap(...,
out_axes=None)` and JAX checks that this holds.
"""

import jax
import optax

from lowcomm_jax.parallel import collectives


def pseudo_gradient(global_params, local_params):
  """Δ = θ_global − θ_local: a descent direction, so the outer step *subtracts* lr·Δ."""
  return jax.tree.map(lambda g, l: g - l, global_params, local_params)


def replica_mean(axis_name: str = "replica") -> optax.GradientTransformation:
  """Stateless transform: the mean of the updates over all workers on `axis_name`."""

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    return collectives.mean(updates, axis_name), state

  return optax.GradientTransformation(init_fn, update_fn)


def diloco_outer(lr: float, momentum: float, nesterov: bool = True,
                 axis_name: str = "replica") -> optax.GradientTransformation:
  """Mean pseudo-gradient, then SGD with (Nesterov) momentum: DiLoCo's outer optimizer."""
  return optax.chain(
      replica_mean(axis_name),
      optax.sgd(lr, momentum=momentum or None, nesterov=nesterov and bool(momentum)))


def ddp_outer(step_optimizer: optax.GradientTransformation,
              axis_name: str = "replica") -> optax.GradientTransformation:
  """Mean gradient, then the per-step optimizer (clipping happens after the mean)."""
  return optax.chain(replica_mean(axis_name), step_optimizer)
