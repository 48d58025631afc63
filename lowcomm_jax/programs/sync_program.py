"""One fragment's sync: the global program of a round's segment (programs/steps.py has the local
programs and the state; its docstring draws the whole round). Also the probe a robust
combination's `probe_loss` signal reads: the loss of the model each worker's update
proposes."""

import jax
import jax.numpy as jnp
import optax

from lowcomm_jax.aggregate.robust import CombinedState, clip_step, row_statistics
from lowcomm_jax.aggregate.signal import effective_workers
from lowcomm_jax.model.matformer import tier_mask
from lowcomm_jax.parallel import weighted, workers
from lowcomm_jax.parallel.flat import ParamLayout
from lowcomm_jax.programs.steps import LossFn, OuterState, Signals, TrainState, round_key


def make_sync(aggregator: optax.GradientTransformationExtraArgs,
              rule: optax.GradientTransformation, *, nested: bool, weigh_tokens: bool,
              layout: ParamLayout, fragment: int, count: int, last: bool,
              map_workers=None, consensus=None, attack=None):
  """`sync(state, Δ[R, N_p], signals, metrics) -> (state, metrics)`: fragment p's global
  program. Aggregates the workers' Δ of the fragment, applies its outer rule to θ_p and,
  in the round's `last` sync, advances the round.

  With `nested`, worker w's aggregation weights are its tier mask (first hidden[w] FFN
  units) times its weight (tokens if `weigh_tokens`, else 1), computed here from the
  signals; otherwise the aggregator is a plain mean. `round_index` passed to the aggregator
  is round·count + fragment (the global value every worker agrees on): it seeds the
  senders' keys of a compressed mean, whose receivers regenerate random draws from it.

  `map_workers(fn, in_axes, out_axes)` maps one worker's part over the stacked workers
  (`Sync.map_workers`; by default vmap over 'replica', whose axis the aggregator names).
  With `consensus` (`Sync.consensus`: the workers keep their own outer weights in the
  aggregator's state) θ_p is set from the new per-worker state on rounds with `metrics`
  (the rounds that log, evaluate or checkpoint), and left as it was otherwise.

  With `metrics` (static; the runner asks on rounds that log, evaluate or checkpoint) it
  also returns every worker's train loss and the parameter and update norms. Without, the
  sync is one all-reduce of Δ and the update: the losses would be a second collective (XLA
  puts them in the same all-reduce op, but gloo still runs one transfer per operand) and
  the norms two more passes over θ.
  """
  part = layout.fragment(fragment)
  coordinate_weights = coordinate_weights_of(part)
  rule = optax.with_extra_args_support(rule)
  if map_workers is None:
    def map_workers(fn, in_axes, out_axes):
      return workers.map_workers(fn, in_axes, out_axes, per_device=False)

  def worker(params, agg_state, rule_state, delta, hidden, weight, all_weights, totals,
             round_index, losses_R, theta):
    extra = {"round_index": round_index}
    if nested:
      # Own weights (nested mean) and everyone's (compressed mean weighs after decoding).
      extra.update(coordinate_weights=coordinate_weights(hidden, weight),
                   sender_weights=all_weights, weight_totals=totals)
    mean, agg_state = aggregator.update(delta, agg_state, params, **extra)
    new_params, rule_state = _outer_update(rule, params, rule_state, mean, losses=losses_R,
                                           round_index=round_index, theta=theta)
    return new_params, agg_state, rule_state

  def sync(state: TrainState, deltas_R, signals: Signals, metrics: bool = True):
    deltas_R = _attacked(attack, state, deltas_R, fragment)
    weight_R = (signals.tokens if weigh_tokens
                else jnp.ones(signals.tokens.shape, jnp.float32))
    # Σ_w weights from the replicated signals: computed here, never communicated.
    all_weights = (jax.vmap(coordinate_weights)(signals.hidden, weight_R) if nested else None)
    totals = jax.tree.map(lambda w: w.sum(0), all_weights) if nested else None
    params = layout.fragment_slice(state.params, fragment)
    outer = state.outer
    new_part, agg_state, rule_state = map_workers(
        worker, (None, 0, None, 0, 0, 0, None, None, None, None, None), (None, 0, None))(
            params, outer.per_worker[fragment], outer.per_fragment[fragment], deltas_R,
            signals.hidden, weight_R, all_weights, totals, state.round * count + fragment,
            signals.loss, state.params)
    if consensus is not None and metrics:
      new_part = consensus(agg_state)
    new_params = layout.fragment_update(state.params, new_part, fragment)
    outer = OuterState(_replace(outer.per_worker, fragment, agg_state),
                       _replace(outer.per_fragment, fragment, rule_state))
    out = _sync_metrics(state.params, new_params, signals, rule_state) if metrics else {}
    round_ = state.round + 1 if last else state.round
    return TrainState(round_, state.rng, new_params, outer), out

  return sync


def _sync_metrics(old_params, new_params, signals: Signals, rule_state) -> dict:
  """What a sync reports on rounds that log: two more passes over θ (norms), every
  worker's train loss and a robust combination's weights."""
  out = {"param_norm": jnp.linalg.norm(new_params),
         "outer_update_norm": jnp.linalg.norm(new_params - old_params)}
  # Every worker's loss by a sum over workers, not an all-gather: XLA merges it into the
  # pseudo-gradient's all-reduce op. (`where`, not a product: one worker's NaN must not
  # spread to the others' entries.)
  losses_R = signals.loss
  per_worker = jnp.where(jnp.eye(losses_R.shape[0], dtype=bool), losses_R[:, None], 0).sum(0)
  out.update(train_loss=per_worker.mean(), train_loss_per_worker=per_worker)
  if isinstance(rule_state, CombinedState):  # a robust combination's weights
    weights = rule_state.combine.signals.weights
    out.update(worker_weights=weights, effective_workers=effective_workers(weights))
  return out


# The steps every sync is composed of, wherever its rows meet (the lockstep workers'
# collectives in `make_sync`, a server's or a round's members' rows in `make_server_sync`):
# the attack, each row's coordinate weights, and the outer rule on the combination.

def _attacked(attack, state: TrainState, deltas, fragment: int):
  """The rows with the adversaries' replaced (aggregate.make_attack; None: as they are).
  Every place that runs a sync draws the same attack from the round's key."""
  return deltas if attack is None else attack(deltas, _attack_key(state, fragment))


def coordinate_weights_of(part):
  """`weights(hidden, weight) -> tree`: a worker's weight per coordinate of fragment
  `part`, its tier mask (its first `hidden` FFN units) times its weight (tokens or 1)."""
  def coordinate_weights(hidden, weight):
    return jax.tree.map(lambda m: m * weight, tier_mask(part.abstract, hidden))

  return coordinate_weights


def _outer_update(rule, params, rule_state, update, *, losses, round_index, theta,
                  **extra):
  """(new θ_p, rule state): the outer rule (`with_extra_args_support`) on `update`, the
  combined Δ (or the rows a robust rule combines). Every worker's train loss and the
  whole θ go with it: a robust combination's signals read them (the loss EMA, the probe
  loss of each proposal); other rules ignore them."""
  updates, rule_state = rule.update(update, rule_state, params, worker_losses=losses,
                                    round_index=round_index, theta=theta, **extra)
  return optax.apply_updates(params, updates), rule_state


def make_server_sync(sync, rule: optax.GradientTransformation, *, layout: ParamLayout,
                     fragment: int, count: int, last: bool):
  """`sync(state, received, keys, signals, full) -> state`: fragment p's sync at a parameter
  server (the Ray runtime's quorum rounds and collaborative epochs), from the run's `Sync`
  (programs/sync.py) as `make_sync` is: the same codec, attack, weights, robust rule and
  outer `rule`. The server holds every worker's contribution at once, so it combines rows
  where the lockstep workers meet in collectives; the workers encoded their own Δ (their
  error buffers stay with them, their keys are the compressed mean's). In the Ray runtime's
  peer form, every member of a round runs this same program over the rows all-gathered.

  `received`: one row per worker slot (S = the server's num_workers): the codec's payloads
  stacked, or Δ [S, N_p]; an absent worker's row is zeros and its tokens in `signals` 0 (a
  quorum round closed without it). `keys` [S]: the senders' codec keys. `full` (static):
  every row is present; then each step is the lockstep sync's (the codec's own mean, the
  robust rule over all rows), so a full round equals the runner's up to float rounding.
  Otherwise the absent rows weigh 0 and a robust rule combines the present ones; FFN units
  that no present worker trained (every worker of a tier gone) keep their values.
  `state.outer.per_fragment` holds the outer rules' states; per-worker state has none here.
  """
  part = layout.fragment(fragment)
  codec, attack = sync.codec, sync.attack
  weights = _row_weights(sync, part)
  apply = _outer_step(sync, rule, layout=layout, fragment=fragment, count=count, last=last)

  def decode(payload, key):
    return part.ravel(codec.decode(payload, part.abstract, key))

  def server_sync(state: TrainState, received, keys, signals: Signals, full: bool = False):
    present = signals.tokens > 0
    extra = {}
    total = None
    if codec is not None and full and not (sync.robust or sync.nested or attack):
      combined = part.ravel(codec.average(received, part.abstract, keys))
    else:
      deltas = jax.vmap(decode)(received, keys) if codec is not None else received
      if not full:  # whatever an absent row decodes to counts for nothing
        deltas = jnp.where(present[:, None], deltas, 0.0)
      deltas = _attacked(attack, state, deltas, fragment)
      if sync.robust:
        combined = deltas  # the robust rule, inside `rule`, combines the rows
        if not full:
          extra["present"] = present
      else:
        a_SxN = weights(signals)
        total = a_SxN.sum(0)
        combined = weighted.divide_by_weight((a_SxN * deltas).sum(0), total)
    return apply(state, combined, signals, total, full, extra)

  return server_sync


def make_shard_mean(sync, *, layout: ParamLayout, fragment: int):
  """`mean(Δ[M, n], hidden[M], tokens[M], start) -> [n]`: the weighted mean of one shard
  (coordinates start..start+n of fragment p) over the M members of a round, as
  `make_server_sync` weighs whole rows (tier mask × tokens or 1): the reduce-scatter of the
  Ray runtime's peer form, where each member reduces its own shard. For syncs without a
  codec, a robust rule or an attack (`peer_reduces`)."""
  weights = _row_weights(sync, layout.fragment(fragment))

  def mean(deltas_MxN, hidden_M, tokens_M, start):
    a_MxN = jax.lax.dynamic_slice_in_dim(
        weights(Signals(hidden_M, tokens_M, jnp.zeros_like(tokens_M))), start,
        deltas_MxN.shape[1], axis=1)
    return weighted.weighted_mean(a_MxN, deltas_MxN)

  return mean


def make_shard_sum(sync, *, layout: ParamLayout, fragment: int):
  """`sum(Δ[M, n], hidden[M], tokens[M], start) -> [n]`: one shard's weighted sum Σ a_w Δ_w
  over M members, undivided: a region's part of a hierarchical reduce (the Ray runtime's
  peer form), the regions' parts then added and divided (`make_shard_divide`)."""
  weights = _row_weights(sync, layout.fragment(fragment))

  def total(deltas_MxN, hidden_M, tokens_M, start):
    a_MxN = jax.lax.dynamic_slice_in_dim(
        weights(Signals(hidden_M, tokens_M, jnp.zeros_like(tokens_M))), start,
        deltas_MxN.shape[1], axis=1)
    return (a_MxN * deltas_MxN).sum(0)

  return total


def make_shard_divide(sync, *, layout: ParamLayout, fragment: int):
  """`divide(sums[G, n], hidden[M], tokens[M], start) -> [n]`: G regions' sums of one shard
  (`make_shard_sum`) added and divided by the weight of all M members: the shard's mean, as
  `make_shard_mean` gives it up to the order of the sum."""
  weights = _row_weights(sync, layout.fragment(fragment))

  def divide(sums_GxN, hidden_M, tokens_M, start):
    total = jax.lax.dynamic_slice_in_dim(
        weights(Signals(hidden_M, tokens_M, jnp.zeros_like(tokens_M))), start,
        sums_GxN.shape[1], axis=1).sum(0)
    return weighted.divide_by_weight(sums_GxN.sum(0), total)

  return divide


def make_reduced_apply(sync, rule: optax.GradientTransformation, *, layout: ParamLayout,
                       fragment: int, count: int, last: bool):
  """`apply(state, combined[N_p], signals, full) -> state`: the outer step of fragment p
  from the reduced Δ (the shards of `make_shard_mean`, all-gathered): what
  `make_server_sync` does after its mean, on every member of a round (the outer state is
  replicated). `signals` has a row per worker slot, tokens 0 for the absent."""
  weights = _row_weights(sync, layout.fragment(fragment))
  apply = _outer_step(sync, rule, layout=layout, fragment=fragment, count=count, last=last)

  def reduced_apply(state: TrainState, combined, signals: Signals, full: bool = False):
    total = None if full else weights(signals).sum(0)
    return apply(state, combined, signals, total, full, {})

  return reduced_apply


def robust_statistics(rows_SxN, outer, start):
  """[3S + 1]: one shard's part of the row statistics a robust rule reads over the whole
  update (`aggregate.row_statistics`: norms, dots with and distances from the previous
  aggregate, its norm), for coordinates start..start+n of a fragment whose outer state
  (CombinedState) is `outer`. The Ray runtime's peer form (`robust_shards`): each member
  sums its shard of every row, and the members' sums are added."""
  center = jax.lax.dynamic_slice_in_dim(outer.combine.center, start, rows_SxN.shape[1])
  return row_statistics(rows_SxN, center)


def make_robust_shard(sync):
  """`shard(outer, rows[S, n], statistics[3S + 1], signals, start, full) -> (combined[n],
  weights[S], τ)`: one shard of the robust rule's result from every row's shard and the
  statistics over the whole update (summed over the members' shards): the coordinate-wise
  rules' result, or centered clipping's first iteration from the previous aggregate (any
  fragment's: `outer` is its CombinedState). As `make_server_sync` combines whole rows: a
  row per worker slot, the absent rows zeros (tokens 0) and, unless `full`, left out."""
  robust = sync.robust_rule()

  def shard(outer, rows_SxN, statistics, signals: Signals, start, full: bool = False):
    present = None if full else signals.tokens > 0
    seen = robust.observe(outer.combine, statistics, losses=signals.loss, present=present)
    w = seen.weights
    if robust.rule != "centered_clip":
      return robust.combine(rows_SxN, w, present), w, jnp.zeros((), jnp.float32)
    S = w.shape[0]
    center = jax.lax.dynamic_slice_in_dim(outer.combine.center, start, rows_SxN.shape[1])
    distances = jnp.sqrt(statistics[2 * S:3 * S])
    tau = robust.radius(distances, present)
    return clip_step(rows_SxN, center, w, distances, tau), w, tau

  return shard


def clip_distances(rows_SxN, v_N):
  """One shard's part of each row's squared distance from the centre (centered clipping's
  next iteration: the members' parts added)."""
  return jnp.sum((rows_SxN.astype(jnp.float32) - v_N[None].astype(jnp.float32)) ** 2, axis=1)


def clip_again(rows_SxN, v_N, weights_S, sq_distances_S, tau):
  """One more centered-clipping iteration on a shard, from the squared distances over the
  whole update."""
  return clip_step(rows_SxN, v_N, weights_S, jnp.sqrt(sq_distances_S), tau)


def make_robust_apply(sync, rule: optax.GradientTransformation, *, layout: ParamLayout,
                      fragment: int, count: int, last: bool):
  """`apply(state, combined[N_p], statistics, signals, full) -> state`: the outer step of
  fragment p on the robust rule's result, combined shard by shard (`make_robust_shard`,
  all-gathered), on every member of a round; the combination's state (its result, the
  signals this round) as the whole-row rule leaves it."""
  robust = sync.robust_rule()
  apply = _outer_step(sync, rule, layout=layout, fragment=fragment, count=count, last=last)

  def robust_apply(state: TrainState, combined, statistics, signals: Signals,
                   full: bool = False):
    present = None if full else signals.tokens > 0
    seen = robust.observe(state.outer.per_fragment[fragment].combine, statistics,
                          losses=signals.loss, present=present)
    return apply(state, combined, signals, None, full, {"combined": (combined, seen)})

  return robust_apply


def robust_shards(sync) -> bool:
  """Whether a round's robust rule may run shard by shard among the Ray runtime's peers
  (each member on its shard of every row: an all-to-all, a reduce-scatter's bytes): dense
  rows (no codec, no attack), and nothing that reads a whole row but its statistics (no
  probe loss, no buckets, which Ray refuses anyway)."""
  a = sync.config.aggregate
  return (sync.robust and sync.codec is None and sync.attack is None
          and a.signal != "probe_loss" and a.bucket <= 1)


def peer_reduces(sync) -> bool:
  """Whether a round's rows may be reduced shard by shard (a weighted mean of dense rows),
  or must be combined otherwise (a codec's payloads and an attack all-gathered whole, a
  robust rule shard by shard where `robust_shards`)."""
  return sync.codec is None and not sync.robust and sync.attack is None


def _row_weights(sync, part):
  """`weights(signals) -> a[S, N_p]`: each row's weight per coordinate, as the nested mean's
  (tier mask × tokens or 1), zero for absent rows (tokens 0)."""
  tree_weights = coordinate_weights_of(part)

  def coordinate_weights(hidden, weight):
    return part.ravel(jax.tree.map(lambda w, x: jnp.broadcast_to(w, x.shape),
                                   tree_weights(hidden, weight), part.abstract))

  def weights(signals: Signals):
    present = signals.tokens > 0
    weight_S = jnp.where(present, signals.tokens if sync.weigh_tokens else 1.0, 0.0)
    if sync.nested:
      return jax.vmap(coordinate_weights)(signals.hidden, weight_S)
    return jnp.broadcast_to(weight_S[:, None], (weight_S.shape[0], part.size))

  return weights


def _outer_step(sync, rule, *, layout: ParamLayout, fragment: int, count: int, last: bool):
  """`apply(state, combined, signals, total, full, extra) -> state`: fragment p's outer
  rule on the combined Δ (or, with a robust rule, the rows it combines); `total` (the
  weights' sum per coordinate, or None) keeps the units no present worker trained."""
  rule = optax.with_extra_args_support(rule)

  def apply(state: TrainState, combined, signals: Signals, total, full: bool, extra: dict):
    params = layout.fragment_slice(state.params, fragment)
    new_part, rule_state = _outer_update(
        rule, params, state.outer.per_fragment[fragment], combined, losses=signals.loss,
        round_index=state.round * count + fragment, theta=state.params, **extra)
    if not full and not sync.robust:  # units no present worker trained keep their values
      new_part = jnp.where(total > 0, new_part, params)
    new_params = layout.fragment_update(state.params, new_part, fragment)
    outer = state.outer._replace(per_fragment=_replace(state.outer.per_fragment, fragment,
                                                       rule_state))
    return TrainState(state.round + 1 if last else state.round, state.rng, new_params, outer)

  return apply


def make_probe(loss_fn: LossFn, layout: ParamLayout, fragment: int, windows_BxL1,
               step: float):
  """`probe(Δ[W, N_p], θ flat) -> [W]`: the loss on the fixed probe batch `windows` of the
  model each worker's update proposes, θ with fragment p moved to θ_p − step·Δ_w,p (step 1:
  a DiLoCo worker's own model; DDP: an SGD step of its gradient). One model at a time
  (lax.map), so memory holds one extra copy of θ, not W."""
  windows = jnp.asarray(windows_BxL1)

  def probe(deltas_WxN, theta):
    base = layout.fragment_slice(theta, fragment)

    def loss_of(delta):
      proposed = layout.fragment_update(theta, base - step * delta, fragment)
      return loss_fn(layout.unravel(proposed), windows, None, ())  # (refused with LoRA)

    return jax.lax.map(loss_of, deltas_WxN).astype(jnp.float32)

  return probe


def _replace(parts: tuple, i: int, value) -> tuple:
  return parts[:i] + (value,) + parts[i + 1:]


def _attack_key(state: TrainState, fragment: int) -> jax.Array:
  """A round's attack draws (a worker's sync and a server's draw the same)."""
  return jax.random.fold_in(round_key(state), 0xA77AC + fragment)
