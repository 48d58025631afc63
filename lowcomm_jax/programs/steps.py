"""Pure, jittable steps: one host's local segment, a collaborative micro-batch, a held sync
with the next local steps; the state they share. One fragment's sync (the global
program) is sync_program.py, the eval program evaluation.py, the workers' state average
state_average.py.

A round is the algorithm's segments (algorithms/base.py). For workers w stacked on the
replica axis, a segment is

    local (per host, its own program — tier width m and H may differ between hosts):
      θ_w keeps its parameters across rounds; the fragment `mix` updated by the last sync
      lands `mix_at` steps in:  θ_w,q ← θ_q + α·(θ_w,q − θ_q)
      S inner steps (lax.scan) on θ_w[:m];   Δ_w,p = θ_p − θ_w,p   for the synced fragment p
      (DDP instead: Δ_w = ∇L(θ[:m]; batch_w); no local parameters)
    sync (one global program per fragment, identical shapes everywhere):
      θ_p ← θ_p + rule_p(aggregate(Δ_w,p))     (each fragment has its own outer state)

θ, θ_w, Δ and DiLoCo's outer momentum are flat vectors, grouped by fragment
(parallel/flat.py); the local program unravels θ_w into the model's tree and ravels it
back. (State of transforms that need the tensors, e.g. a codec's error feedback or DDP's
AdamW, stays tree-shaped.) A narrow tier's θ_w is stored at full width: it trains the
first m hidden units, the rest follow θ, so Δ is zero there.

Workers are mapped with `jax.vmap(axis_name='replica', spmd_axis_name='replica')`: a stack
split over the mesh's replica devices, on which the aggregator's named-axis mean becomes an
all-reduce. θ and the rule's state are unmapped (`out_axes=None`): vmap accepts them only
if they derive from unmapped inputs and collectives' results, never from per-worker state
(so a codec's round key comes from the global round, not its stacked counter). A sync with
a codec maps its workers per device instead (`map_workers`, parallel/workers.py), so each
device encodes its own and only payloads cross devices. A local program with one worker
runs it unbatched (`workers.map_host_workers`).
"""

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowcomm_jax.model.matformer import pad_tier, slice_tier, unslice_tier
from lowcomm_jax.parallel.workers import map_host_workers
from lowcomm_jax.parallel.flat import ParamLayout

# (params, windows, key, frozen) -> loss. `frozen`: weights the loss reads but nothing trains
# (a LoRA run's base model; () otherwise), passed to every program as an argument.
LossFn = Callable[[Any, jax.Array, jax.Array | None, Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class Segment:
  """`steps` local steps (the round's steps [start, start + steps)), then fragment `sync`'s
  sync. Fragment `mix`'s newest global value is mixed into θ_w after `mix_at` of the
  steps; it is in flight from the previous segment (in a run's first segment nothing is,
  so the mix is skipped unless `mix_at` is 0, where it is a no-op: θ_w = θ at the start)."""
  start: int
  steps: int
  sync: int
  mix: int
  mix_at: int = 0
  # Mix in the run's first segment too: the global value is an anchor to pull toward, not
  # an update in flight (Overlap Local-SGD).
  mix_in_first_round: bool = False


class OuterState(NamedTuple):
  """The outer step's state by role; one entry per fragment in each."""
  # The aggregator's state, [R, ...] per worker (a codec's error-feedback buffer), split
  # over 'replica'.
  per_worker: tuple
  # The outer rule's state (DiLoCo's momentum, DDP's per-step optimizer), replicated.
  per_fragment: tuple


class TrainState(NamedTuple):
  """The global state, identical on every process. Each process also keeps its own hosts'
  worker states (WorkerState, [workers, ...] per host) beside it."""
  round: jax.Array  # outer rounds completed
  rng: jax.Array  # raw key data of the run's base key; step keys fold in (round, worker, step)
  params: jax.Array  # θ, flat (parallel/flat.py: the run's ParamLayout views it)
  outer: OuterState | tuple  # () in the view local programs get


class WorkerState(NamedTuple):
  """One host's workers, stacked [G, ...]; survives rounds (checkpointed per process)."""
  # θ_w, flat at full width; () where no round reads it (DiLoCo: θ_w ← θ as a round starts).
  params: jax.Array | tuple
  opt_state: Any  # the inner optimizer's state for the tier's parameters
  steps: jax.Array  # local steps taken
  # What the algorithm's worker rule keeps per worker (eager updates: its last two Δ_w);
  # () without one.
  memory: Any = ()


class Signals(NamedTuple):
  """What every worker reports beside its Δ, [R] each (replicated: the host table and the
  round's schedule give every process the same values, only `loss` is computed)."""
  hidden: jax.Array  # int32: FFN hidden units its tier trains
  tokens: jax.Array  # float32: tokens it processed in the segment
  loss: jax.Array  # float32: its mean train loss (per-worker, from the local programs)


def round_key(state: TrainState) -> jax.Array:
  return jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.round)


def _mix_fragment(own, global_, layout: ParamLayout, fragment: int, alpha: float):
  """`own` with fragment's leaves moved to θ + α(θ_w − θ) (replaced when α = 0)."""
  leaf_fragment = layout.leaf_fragment or (0,) * len(layout.shapes)
  own_leaves = layout.treedef.flatten_up_to(own)
  global_leaves = layout.treedef.flatten_up_to(global_)
  mixed = [o if f != fragment else (g if alpha == 0.0 else g + alpha * (o - g))
           for o, g, f in zip(own_leaves, global_leaves, leaf_fragment)]
  return layout.treedef.unflatten(mixed)


def _gradient_at(grad_fn, global_params, hidden: int, narrow: bool, batch, key, frozen):
  """(loss, ∇L at θ, zero-padded to full width) on one batch, for a worker training the
  first `hidden` FFN units: DDP's contribution and a collaborative micro-batch."""
  params = slice_tier(global_params, hidden) if narrow else global_params
  loss, grads = grad_fn(params, batch, key, frozen)
  return loss, (pad_tier(grads, global_params) if narrow else grads)


def make_local_segment(loss_fn: LossFn, *, inner_tx: optax.GradientTransformation,
                       hidden: int, d_ff: int, layout: ParamLayout, segment: Segment,
                       index: int, count: int, alpha: float, local_steps: bool,
                       keeps_params: bool = True, worker_rule=None,
                       axis_name: str = "replica", mesh=None, part: str = "whole"):
  """`local(state, workers[G], batches[G, S, B, L+1], worker_ids[G])`
  -> (Δ[G, N_p] of the synced fragment, flat at full width, workers[G], losses[G, S]) for
  one host's G workers of width `hidden`: segment `index` of `count` equal ones (S from the
  batches: the round has H = S·count steps, this segment its steps [index·S, (index+1)·S)).
  Without `keeps_params` the workers start from θ and keep no parameters (DiLoCo). With a
  `worker_rule` (algorithms.base.WorkerRule; one segment, full width) each worker starts
  from the rule's point, computed from θ, the outer rule's state (`state.outer` is then
  OuterState((), per_fragment)) and the worker's memory, and the rule makes its Δ.

  `part` (a segment with a mix inside it, whose workers keep their parameters): 'head' runs
  the `mix_at` steps before the mix alone and returns (), the workers after them and their
  losses: it reads nothing of θ, so it may run while the last sync's collective does (the
  Ray runtime's peer form); 'tail', from the head's workers, the mix of the new θ and the
  rest. Both take the whole segment's batches. 'whole': both in one program.
  """
  _check_part(part, segment, keeps_params, local_steps, worker_rule)
  grad_fn = jax.value_and_grad(loss_fn)
  narrow = hidden != d_ff
  sync, mix_at = segment.sync, segment.mix_at
  inner_steps = _make_inner_steps(grad_fn, inner_tx)
  landed = _make_landing(layout, segment, index, alpha, hidden, narrow)

  def worker(global_flat, round_, rule_state, sync_state, own_flat, opt_state, steps, memory,
             batches, key, taken, frozen):
    global_params = layout.unravel(global_flat)
    if not local_steps:  # DDP: the gradient at θ is the contribution
      loss, grads = _gradient_at(grad_fn, global_params, hidden, narrow, batches[0], key, frozen)
      return layout.fragment_slice(layout.ravel(grads), sync), (), loss[None]
    s = batches.shape[0]
    # (Keys are counter-based: the first n of a split of S are those of a split of n, so a
    # job of `taken` < S steps draws the keys it would draw alone.)
    step_keys = jax.random.split(key, s * count)[index * s:(index + 1) * s]
    s = s if taken is None else taken
    if worker_rule is not None:
      start_flat = worker_rule.start(global_flat, rule_state, memory, sync_state)
      (trained, opt_state), losses_s = inner_steps(layout.unravel(start_flat), opt_state,
                                                   batches, step_keys, frozen, taken)
      delta, memory = worker_rule.finish(start_flat, layout.ravel(trained), memory)
      return delta, WorkerState((), opt_state, steps + s, memory), losses_s
    own = layout.unravel(own_flat) if keeps_params else global_params

    def tier(full):
      return slice_tier(full, hidden) if narrow else full

    def full(tier_params, base):
      return unslice_tier(base, tier_params) if narrow else tier_params

    losses = []
    if mix_at > 0 and part != "tail":  # (the tail's workers have run these already)
      (trained, opt_state), first = inner_steps(tier(own), opt_state, batches[:mix_at],
                                                step_keys[:mix_at], frozen)
      own = full(trained, own)
      losses.append(first)
      if part == "head":
        return (), WorkerState(layout.ravel(own), opt_state, steps + mix_at, memory), first
    own = landed(own, global_params, round_)
    (trained, opt_state), rest = inner_steps(tier(own), opt_state, batches[mix_at:],
                                             step_keys[mix_at:], frozen, taken)
    own_flat = layout.ravel(full(trained, own))
    losses.append(rest)
    delta = (layout.fragment_slice(global_flat, sync) - layout.fragment_slice(own_flat, sync))
    losses_s = jnp.concatenate(losses) if len(losses) > 1 else losses[0]
    done = s - mix_at if part == "tail" else s
    return (delta, WorkerState(own_flat if keeps_params else (), opt_state, steps + done,
                               memory), losses_s)

  return _over_host_workers(worker, worker_rule=worker_rule, count=count, mix_at=mix_at,
                            local_steps=local_steps, keeps_params=keeps_params, mesh=mesh,
                            axis_name=axis_name)


def _over_host_workers(worker, *, worker_rule, count: int, mix_at: int, local_steps: bool,
                       keeps_params: bool, mesh, axis_name: str):
  """`local(state, workers, batches, worker_ids, steps_G=None, *, frozen=())`: one
  worker's segment (`worker`) mapped over a host's G workers, each with its own key, and
  what of the state it reads."""
  def local(state: TrainState, workers: WorkerState | tuple, batches_GxSxBxL1, worker_ids_G,
            steps_G=None, *, frozen=()):
    """`steps_G` (optional, [G] int32): worker g takes only its first steps_G[g] of the S
    batches (the rest are padding, and their losses 0), so one program serves every H up
    to S (the simulator's jobs). One segment without a mix inside it only."""
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(round_key(state), worker_ids_G)
    rule_state = state.outer.per_fragment[0] if worker_rule is not None else ()
    # The host's own rows [G] of the sync's per-worker state (NoLoCo's φ_w).
    reads_own = worker_rule is not None and worker_rule.reads_sync_state
    sync_state = state.outer.per_worker[0] if reads_own else ()
    if steps_G is not None and (count > 1 or mix_at > 0):
      raise ValueError("steps_G: one segment without a mix inside it only")
    taken_axis = None if steps_G is None else 0
    if not local_steps:
      own, opt_state, steps, memory = (), (), (), ()
      in_axes = (None, None, None, None, None, None, None, None, 0, 0, taken_axis, None)
    else:
      own, opt_state, steps, memory = workers
      in_axes = (None, None, None, 0 if reads_own else None, 0 if keeps_params else None,
                 0, 0, 0, 0, 0, taken_axis, None)
    mapped = map_host_workers(worker, in_axes, batches_GxSxBxL1.shape[0], mesh,
                                      axis_name)
    delta, workers, losses = mapped(
        state.params, state.round, rule_state, sync_state, own, opt_state, steps, memory,
        batches_GxSxBxL1, keys, steps_G, frozen)
    return delta, workers, losses

  return local


def _check_part(part: str, segment: Segment, keeps_params: bool, local_steps: bool,
                worker_rule) -> None:
  if part not in ("whole", "head", "tail"):
    raise ValueError(f"part={part!r}: use 'whole', 'head' or 'tail'")
  if part != "whole" and not (segment.mix_at > 0 and keeps_params and local_steps
                              and worker_rule is None):
    raise ValueError("a segment runs in a head and a tail only with a mix inside it "
                     "(mix_at > 0) and workers that keep their parameters")


def _make_inner_steps(grad_fn, inner_tx: optax.GradientTransformation):
  """`inner_steps(params, opt_state, batches, keys, frozen, taken=None)`: the scan of steps
  over `batches`; with `taken` (a traced count), steps from `taken` on are skipped: they
  leave the carry as it was, bit for bit, and their loss is 0."""
  def inner_steps(params, opt_state, batches, keys, frozen, taken=None):
    def inner_step(carry, batch_and_key):
      local_params, opt_state = carry
      batch, step_key = batch_and_key
      loss, grads = grad_fn(local_params, batch, step_key, frozen)
      updates, opt_state = inner_tx.update(grads, opt_state, local_params)
      return (optax.apply_updates(local_params, updates), opt_state), loss
    if taken is None:
      return jax.lax.scan(inner_step, (params, opt_state), (batches, keys))

    def step_or_skip(carry, indexed):
      k, batch_and_key = indexed
      loss_shape = jax.eval_shape(inner_step, carry, batch_and_key)[1]
      skip = lambda carry, _: (carry, jnp.zeros(loss_shape.shape, loss_shape.dtype))
      return jax.lax.cond(k < taken, inner_step, skip, carry, batch_and_key)
    return jax.lax.scan(step_or_skip, (params, opt_state),
                        (jnp.arange(batches.shape[0]), (batches, keys)))

  return inner_steps


def _make_landing(layout: ParamLayout, segment: Segment, index: int, alpha: float,
                  hidden: int, narrow: bool):
  """`landed(own_full, global_params, round_)`: the synced fragment's new global value,
  mixed into θ_w. In the first segment of a run nothing is in flight: skipped (at step 0
  it is a no-op, θ_w = θ, and stays unconditional so DiLoCo's program is what it always
  was)."""
  mix, mix_at = segment.mix, segment.mix_at

  def landed(own_full, global_params, round_):
    mixed = _mix_fragment(own_full, global_params, layout, mix, alpha)
    if narrow and alpha != 0.0:  # units the tier does not train follow θ: their Δ stays 0
      mixed = unslice_tier(global_params, slice_tier(mixed, hidden))
    if index == 0 and mix_at > 0 and not segment.mix_in_first_round:
      return jax.tree.map(lambda m, o: jnp.where(round_ > 0, m, o), mixed, own_full)
    return mixed

  return landed


def make_accumulate(loss_fn: LossFn, *, hidden: int, d_ff: int, layout: ParamLayout,
                    axis_name: str = "replica", mesh=None):
  """`accumulate(state, acc[G, N], batches[G, B, L+1], worker_ids[G], micro)`
  -> (acc + B·∇L(θ; batch_w) [G, N], losses[G]): one micro-batch of a collaborative epoch
  (runtimes/spmd/collab.py) for one host's G workers of width `hidden`, every gradient at the
  epoch's θ. `acc` sums gradients times samples, so a host's mean gradient is acc / its samples
  whatever its batch size. Micro-batch `micro`'s keys fold it into the round's."""
  grad_fn = jax.value_and_grad(loss_fn)
  narrow = hidden != d_ff

  def worker(global_flat, acc, batch, key, frozen):
    loss, grads = _gradient_at(grad_fn, layout.unravel(global_flat), hidden, narrow, batch, key,
                               frozen)
    return acc + batch.shape[0] * layout.ravel(grads), loss

  def accumulate(state: TrainState, acc_GxN, batches_GxBxL1, worker_ids_G, micro, *,
                 frozen=()):
    key = jax.random.fold_in(round_key(state), micro)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, worker_ids_G)
    return map_host_workers(worker, (None, 0, 0, 0, None), batches_GxBxL1.shape[0],
                                    mesh, axis_name)(
        state.params, acc_GxN, batches_GxBxL1, keys, frozen)

  return accumulate


def local_input(state: TrainState, reads_rules: bool, reads_own: bool = False) -> TrainState:
  """What a local program reads of the global state: θ and the round key, and the outer
  rules' (replicated) state where the algorithm's workers start from it (`reads_rules`:
  eager updates), and the per-worker outer state where they start from their own row of it
  (`reads_own`: NoLoCo; every worker's here, the runner gives each host its rows)."""
  if not (reads_rules or reads_own):
    return state._replace(outer=())
  return state._replace(outer=OuterState(state.outer.per_worker if reads_own else (),
                                         state.outer.per_fragment))


def make_overlapped(sync, local, *, reads_rules: bool, reads_own: bool = False):
  """`overlapped(state, held Δ_R, held signals, workers_R, batches_R, ids_R, metrics, frozen)`
  -> (state, the held sync's metrics, Δ_R, workers_R, mean train loss_R): a held sync and
  the next round's local steps in one program (rounds.jitted_overlapped jits it)."""
  def overlapped(state, deltas_R, signals, workers, batches, ids, metrics, frozen):
    state, sync_metrics = sync(state, deltas_R, signals, metrics=metrics)
    delta, workers, losses_RxS = local(local_input(state, reads_rules, reads_own), workers,
                                       batches, ids,
                                       frozen=frozen)
    return state, sync_metrics, delta, workers, losses_RxS.mean(axis=1)
  return overlapped


def run_key(seed: int) -> jax.Array:
  """The run's key (as key data): every round key and random draw of the run folds it."""
  return jax.random.key_data(jax.random.key(seed))


def init_state(params, *, seed: int, layout: ParamLayout, aggregators, rules,
               num_workers: int) -> TrainState:
  """Round-0 global state (each fragment's aggregator state stacked once per worker)."""
  per_worker, per_fragment = [], []
  for p, (aggregator, rule) in enumerate(zip(aggregators, rules)):
    part = layout.fragment_slice(params, p)
    per_worker.append(jax.tree.map(lambda x: jnp.broadcast_to(x, (num_workers,) + x.shape),
                                   aggregator.init(part)))
    per_fragment.append(rule.init(part))
  return TrainState(round=jnp.zeros((), jnp.int32),
                    rng=run_key(seed),
                    params=params, outer=OuterState(tuple(per_worker), tuple(per_fragment)))


def init_workers(flat_params, *, workers: int, hidden: int, d_ff: int, layout: ParamLayout,
                 inner_tx: optax.GradientTransformation, local_steps: bool,
                 keeps_params: bool = True, worker_rule=None):
  """A host's fresh [workers, ...] states: θ_w = θ (if kept), the inner optimizer's initial
  state for its tier's parameters, the worker rule's memory. () for an algorithm without
  local steps."""
  if not local_steps:
    return ()
  params = layout.unravel(flat_params)
  one = WorkerState(flat_params if keeps_params else (),
                    inner_tx.init(params if hidden == d_ff else slice_tier(params, hidden)),
                    jnp.zeros((), jnp.int32),
                    worker_rule.init(flat_params) if worker_rule is not None else ())
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (workers,) + x.shape), one)
