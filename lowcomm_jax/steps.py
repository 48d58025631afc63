"""Pure, jittable steps: one host's local round, the global outer step, and eval.

A round, for workers w stacked on the replica axis:

    local (per host, its own program — tier width m and H may differ between hosts):
      diloco: θ_w ← θ_global[:m]; H inner steps (lax.scan);  Δ_w = θ_global[:m] − θ_w
      ddp:    Δ_w = ∇L(θ_global[:m]; batch_w)
      then Δ_w is zero-padded back to full shape ([:m] cuts every FFN to m hidden units)
    outer (one global program, identical shapes everywhere):
      θ_global ← θ_global + outer_tx(Δ_w)      (aggregator, then the outer rule)

θ_global, Δ and DiLoCo's outer momentum are flat vectors (parallel/flat.py); the local
program unravels θ_global into the model's tree and ravels Δ back. (State of transforms that
need the tensors, e.g. a codec's error feedback or DDP's AdamW, stays tree-shaped.)

Workers are mapped with `jax.vmap(axis_name='replica', spmd_axis_name='replica')`: a stack
split over the mesh's replica devices, on which the aggregator's named-axis mean becomes an
all-reduce. θ_global and the rule's state are unmapped (`out_axes=None`): vmap accepts them
only if they derive from unmapped inputs and collectives' results, never from per-worker
state (so a codec's round key comes from the global round, not its stacked counter). Worker
parameters exist only inside a round — every round starts from θ_global — while inner
optimizer states persist.
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowcomm_jax.model.matformer import pad_tier, slice_tier, tier_mask
from lowcomm_jax.outer import pseudo_gradient
from lowcomm_jax.parallel.flat import ParamLayout

# vmap axes of the outer chain's state (aggregator, rule): per worker, global.
PER_WORKER_AGGREGATOR = (0, None)

LossFn = Callable[[Any, jax.Array, jax.Array | None], jax.Array]  # (params, windows, key)


class TrainState(NamedTuple):
  """The global state, identical on every process. Each process also keeps its own hosts'
  inner optimizer states ([workers, ...] per host; none for DDP) beside it."""
  round: jax.Array  # outer rounds completed
  rng: jax.Array  # raw key data of the run's base key; step keys fold in (round, worker, step)
  params: jax.Array  # θ_global, flat (parallel/flat.py: the run's ParamLayout views it)
  # optax.chain(aggregator, rule) state: (aggregator's [R, ...] per worker — a codec's
  # error-feedback buffer, sharded over 'replica' — , the rule's: DiLoCo's outer momentum
  # or DDP's per-step optimizer state, replicated)
  outer_opt_state: Any


def round_key(state: TrainState) -> jax.Array:
  return jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.round)


def make_local_round(loss_fn: LossFn, *, algorithm: str, inner_tx: optax.GradientTransformation,
                     hidden: int, d_ff: int, layout: ParamLayout, axis_name: str = "replica"):
  """`local_round(state, opt_state[G], batches[G, H, B, L+1], worker_ids[G])`
  -> (Δ[G, N] flat at full width, opt_state[G], losses[G, H]) for one host's G workers of
  width `hidden`.
  """
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

  def worker(global_flat, opt_state, batches, key):
    global_params = layout.unravel(global_flat)
    params = global_params if hidden == d_ff else slice_tier(global_params, hidden)
    delta, opt_state, losses = local(params, opt_state, batches, key)
    if hidden != d_ff:
      delta = pad_tier(delta, global_params)
    return layout.ravel(delta), opt_state, losses

  def local_round(state: TrainState, opt_state_G, batches_GxHxBxL1, worker_ids_G):
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(round_key(state), worker_ids_G)
    return jax.vmap(worker, in_axes=(None, 0, 0, 0), axis_name=axis_name,
                    spmd_axis_name=axis_name)(state.params, opt_state_G, batches_GxHxBxL1, keys)

  return local_round


def make_outer_step(outer_tx: optax.GradientTransformation, *, nested: bool,
                    layout: ParamLayout, axis_name: str = "replica"):
  """`outer_step(params, outer_state, Δ[R], hidden[R], weight[R], round_index, norms) ->
  (params, outer_state, metrics)`; metrics hold the parameter and update norms when `norms`.

  `outer_tx` is `optax.chain(aggregator, rule)`; the aggregator's state is per worker (mapped
  over the replica axis), the rule's is global. With `nested`, worker w's aggregation
  weights are its tier mask (first hidden[w] FFN units) times weight[w]; otherwise the
  aggregator is a plain mean and hidden/weight are unused. Parameters and Δ are flat; the
  tier weights are small broadcastable trees, which the nested aggregator (a tree view)
  applies to the unraveled Δ. `round_index` (the global round, unmapped) seeds the senders'
  keys of a compressed mean: receivers regenerate random draws (random-k's positions) from
  it, so it must be a value vmap knows is the same on every worker — not the per-worker
  aggregator state's own counter, or the decoded mean and θ_global would come out mapped.
  """

  def coordinate_weights(hidden, weight):
    return jax.tree.map(lambda m: m * weight, tier_mask(layout.abstract, hidden))

  def worker(params, outer_opt_state, delta, hidden, weight, all_weights, totals, round_index):
    extra = {"round_index": round_index}
    if nested:
      # Own weights (nested mean) and everyone's (compressed mean weighs after decoding).
      extra.update(coordinate_weights=coordinate_weights(hidden, weight),
                   sender_weights=all_weights, weight_totals=totals)
    updates, outer_opt_state = outer_tx.update(delta, outer_opt_state, params, **extra)
    return optax.apply_updates(params, updates), outer_opt_state

  def outer_step(params, outer_opt_state, deltas_R, hidden_R, weight_R, round_index,
                 norms: bool = True):
    # Σ_w weights from the replicated per-worker vectors: computed here, never communicated.
    all_weights = (jax.vmap(coordinate_weights)(hidden_R, weight_R) if nested else None)
    totals = jax.tree.map(lambda w: w.sum(0), all_weights) if nested else None
    new_params, outer_opt_state = jax.vmap(
        worker, in_axes=(None, PER_WORKER_AGGREGATOR, 0, 0, 0, None, None, None),
        out_axes=(None, PER_WORKER_AGGREGATOR), axis_name=axis_name,
        spmd_axis_name=axis_name)(params, outer_opt_state, deltas_R, hidden_R, weight_R,
                                  all_weights, totals, round_index)
    metrics = {}
    if norms:  # two more passes over θ: worth it on rounds that log or checkpoint
      metrics = {"param_norm": jnp.linalg.norm(new_params),
                 "outer_update_norm": jnp.linalg.norm(new_params - params)}
    return new_params, outer_opt_state, metrics

  return outer_step


def make_eval_step(loss_fn: LossFn, layout: ParamLayout):
  """`eval_step(flat params, windows[N, B, L+1]) -> mean loss` over N fixed batches."""

  def eval_step(flat_params, windows_NxBxL1):
    params = layout.unravel(flat_params)
    return jax.lax.map(lambda batch: loss_fn(params, batch, None), windows_NxBxL1).mean()

  return eval_step


def init_state(params, *, seed: int, outer_tx: optax.GradientTransformation,
               num_workers: int) -> TrainState:
  """Round-0 global state (the aggregator's state stacked once per worker)."""
  aggregator_state, rule_state = outer_tx.init(params)
  per_worker = jax.tree.map(lambda x: jnp.broadcast_to(x, (num_workers,) + x.shape),
                            aggregator_state)
  return TrainState(round=jnp.zeros((), jnp.int32),
                    rng=jax.random.key_data(jax.random.key(seed)),
                    params=params, outer_opt_state=(per_worker, rule_state))


def init_workers(flat_params, *, workers: int, hidden: int, d_ff: int, layout: ParamLayout,
                 inner_tx: optax.GradientTransformation):
  """A host's [workers, ...] inner optimizer states, fresh, for its tier's parameters."""
  params = layout.unravel(flat_params)
  one = inner_tx.init(params if hidden == d_ff else slice_tier(params, hidden))
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (workers,) + x.shape), one)
