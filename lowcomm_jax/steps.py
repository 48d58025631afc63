"""Pure, jittable steps: a whole round (all workers' inner steps + the outer step) and eval.

A round, for workers w = 0..R-1 stacked on the replica axis:

    diloco: θ_w ← θ_global; H inner steps (lax.scan) on worker w's batches;
            Δ_w = θ_global − θ_w;  θ_global ← θ_global + outer_tx(Δ_w)
    ddp:    Δ_w = ∇L(θ_global; batch_w);  θ_global ← θ_global + outer_tx(Δ_w)

Workers are mapped with `jax.vmap(axis_name='replica', spmd_axis_name='replica')`, so the
stack is split over the mesh's replica devices and the outer transform's named-axis mean
becomes an all-reduce. Global parameters and the outer state are unmapped (`out_axes=None`):
JAX verifies they come out identical on every worker. Worker parameters exist only inside
the round — every round starts from θ_global — while inner optimizer states persist.
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowcomm_jax.outer import pseudo_gradient

LossFn = Callable[[Any, jax.Array, jax.Array | None], jax.Array]  # (params, windows, key)


class TrainState(NamedTuple):
  round: jax.Array  # outer rounds completed
  rng: jax.Array  # raw key data of the run's base key; per-step keys fold in (round, worker, step)
  params: Any  # θ_global
  outer_opt_state: Any  # DiLoCo: outer momentum; DDP: the per-step optimizer's state
  worker_opt_state: Any  # [R, ...] inner optimizer state per worker (DiLoCo); () for DDP


def make_round_step(loss_fn: LossFn, *, algorithm: str, inner_tx: optax.GradientTransformation,
                    outer_tx: optax.GradientTransformation, axis_name: str = "replica"):
  """`round_step(state, batches[R, H, B, L+1]) -> (state, metrics)`, ready to jit."""
  grad_fn = jax.value_and_grad(loss_fn)

  def diloco_local(params, opt_state, batches_HxBxL1, key):
    def inner_step(carry, batch_and_key):
      local_params, opt_state = carry
      batch, step_key = batch_and_key
      loss, grads = grad_fn(local_params, batch, step_key)
      updates, opt_state = inner_tx.update(grads, opt_state, local_params)
      return (optax.apply_updates(local_params, updates), opt_state), loss

    step_keys = jax.random.split(key, batches_HxBxL1.shape[0])
    (local_params, opt_state), losses_H = jax.lax.scan(
        inner_step, (params, opt_state), (batches_HxBxL1, step_keys))
    return pseudo_gradient(params, local_params), opt_state, losses_H

  def ddp_local(params, opt_state, batches_1xBxL1, key):
    loss, grads = grad_fn(params, batches_1xBxL1[0], key)
    return grads, opt_state, loss[None]

  local = {"diloco": diloco_local, "ddp": ddp_local}[algorithm]

  def worker_round(params, outer_opt_state, opt_state, batches, round_key):
    key = jax.random.fold_in(round_key, jax.lax.axis_index(axis_name))
    delta, opt_state, losses_H = local(params, opt_state, batches, key)
    updates, outer_opt_state = outer_tx.update(delta, outer_opt_state, params)
    return optax.apply_updates(params, updates), outer_opt_state, opt_state, losses_H

  all_workers = jax.vmap(worker_round, in_axes=(None, None, 0, 0, None),
                         out_axes=(None, None, 0, 0), axis_name=axis_name,
                         spmd_axis_name=axis_name)

  def round_step(state: TrainState, batches_RxHxBxL1: jax.Array):
    round_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.round)
    params, outer_opt_state, worker_opt_state, losses_RxH = all_workers(
        state.params, state.outer_opt_state, state.worker_opt_state, batches_RxHxBxL1,
        round_key)
    update_norm = optax.tree.norm(jax.tree.map(jnp.subtract, params, state.params))
    metrics = {
        "train_loss": losses_RxH.mean(),
        "train_loss_per_worker": losses_RxH.mean(axis=1),
        "param_norm": optax.tree.norm(params),
        "outer_update_norm": update_norm,
    }
    return TrainState(state.round + 1, state.rng, params, outer_opt_state,
                      worker_opt_state), metrics

  return round_step


def make_eval_step(loss_fn: LossFn):
  """`eval_step(params, windows[N, B, L+1]) -> mean loss` over N fixed batches."""

  def eval_step(params, windows_NxBxL1):
    return jax.lax.map(lambda batch: loss_fn(params, batch, None), windows_NxBxL1).mean()

  return eval_step


def init_state(params, *, seed: int, num_workers: int, algorithm: str,
               inner_tx: optax.GradientTransformation,
               outer_tx: optax.GradientTransformation) -> TrainState:
  """Round-0 state: every worker's inner optimizer starts fresh at θ_global = params."""
  if algorithm == "diloco":
    one = inner_tx.init(params)
    worker_opt_state = jax.tree.map(
        lambda x: jnp.broadcast_to(x, (num_workers,) + x.shape), one)
  else:
    worker_opt_state = ()
  return TrainState(round=jnp.zeros((), jnp.int32),
                    rng=jax.random.key_data(jax.random.key(seed)),
                    params=params, outer_opt_state=outer_tx.init(params),
                    worker_opt_state=worker_opt_state)
