"""Robust combinations of the workers' updates, on updates stacked over workers ([W, ...]
leaves). Each takes per-worker weights w (Σw = 1; uniform for the plain rules) where the rule
defines them.

  mean            Σ_w w_w·u_w
  median          coordinate-wise median (weights ignored)
  trimmed_mean    coordinate-wise: drop the `trim` largest and `trim` smallest values, mean
                  of the rest (weights ignored)
  centered_clip   Karimireddy, He & Jaggi 2021 ("Learning from History for Byzantine Robust
                  Optimization"): from a centre v (the previous aggregate), `iters` times
                  v ← v + Σ_w w_w·(u_w − v)·min(1, τ/‖u_w − v‖), τ by default the median
                  distance ‖u_w − v₀‖
  bucketed(rule)  Karimireddy, He & Jaggi 2022 (bucketing): workers shuffled by a key, the
                  means of buckets of `bucket` workers combined by `rule`

Norms are over the whole update (every leaf), as the papers define them per worker.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowcomm_jax.aggregate import signal as signal_lib
from lowcomm_jax.parallel import collectives


def _norms(tree_WxN) -> jax.Array:
  """‖u_w‖ over all leaves: [W]."""
  sq = [jnp.sum(jnp.reshape(x, (x.shape[0], -1)).astype(jnp.float32) ** 2, axis=1)
        for x in jax.tree.leaves(tree_WxN)]
  return jnp.sqrt(sum(sq))


def weighted_mean(tree_WxN, weights_W):
  return jax.tree.map(lambda x: jnp.tensordot(weights_W.astype(x.dtype), x, axes=1), tree_WxN)


def median(tree_WxN):
  return jax.tree.map(lambda x: jnp.median(x, axis=0), tree_WxN)


def trimmed_mean(tree_WxN, trim: int):
  def one(x):
    if 2 * trim >= x.shape[0]:
      raise ValueError(f"trimmed_mean: trim={trim} per side leaves nothing of {x.shape[0]}")
    return jnp.mean(jnp.sort(x, axis=0)[trim:x.shape[0] - trim], axis=0)
  return jax.tree.map(one, tree_WxN)


def present_median(tree_WxN, present_W):
  """The coordinate-wise median of the present workers' updates."""
  return jax.tree.map(lambda x: jnp.nanmedian(jnp.where(_rows(present_W, x), x, jnp.nan),
                                              axis=0), tree_WxN)


def present_trimmed_mean(tree_WxN, present_W, trim: int):
  """`trimmed_mean` of the present workers' updates (k of W): their values sorted, ranks
  trim..k − trim − 1 averaged; with k ≤ 2·trim nothing would be left, so their median."""
  k = present_W.sum()

  def one(x):
    ranks = jnp.arange(x.shape[0]).reshape((-1,) + (1,) * (x.ndim - 1))
    ordered = jnp.sort(jnp.where(_rows(present_W, x), x, jnp.inf), axis=0)
    kept = (ranks >= trim) & (ranks < k - trim)
    mean = jnp.where(kept, ordered, 0.0).sum(0) / jnp.maximum(k - 2 * trim, 1)
    middle = jnp.nanmedian(jnp.where(_rows(present_W, x), x, jnp.nan), axis=0)
    return jnp.where(k > 2 * trim, mean, middle)
  return jax.tree.map(one, tree_WxN)


def _rows(present_W, x):
  return present_W.reshape((-1,) + (1,) * (x.ndim - 1))


def centered_clip(tree_WxN, center, weights_W, *, iters: int, tau: float | None = None,
                  present_W=None):
  """Returns (the clipped aggregate, τ used). `tau` None or ≤ 0: the median distance of the
  updates from `center` (of the present workers', where `present_W` is given; the absent
  weigh 0)."""
  if tau is None or tau <= 0:
    tau = clip_radius(_norms(jax.tree.map(lambda x, c: x - c[None], tree_WxN, center)),
                      present_W)
  v = center
  for _ in range(iters):
    v = clip_step(tree_WxN, v, weights_W, _norms(jax.tree.map(lambda x, c: x - c[None],
                                                              tree_WxN, v)), tau)
  return v, tau


def clip_radius(distances_W, present_W=None) -> jax.Array:
  """Centered clipping's default τ: the median of the (present) updates' distances from the
  centre."""
  if present_W is None:
    return jnp.median(distances_W)
  return jnp.nanmedian(jnp.where(present_W, distances_W, jnp.nan))


def clip_step(tree_WxN, v, weights_W, distances_W, tau):
  """One centered-clipping iteration from centre `v`, given each update's distance
  ‖u_w − v‖ over the whole update (`distances_W`: where v is cut in shards, the shards'
  squared distances are added first)."""
  scale = weights_W * jnp.minimum(1.0, tau / jnp.maximum(distances_W, 1e-12))
  return jax.tree.map(lambda c, x: c + jnp.tensordot(scale.astype(x.dtype), x - c[None],
                                                     axes=1), v, tree_WxN)


def buckets(tree_WxN, weights_W, key, bucket: int):
  """Workers shuffled by `key`, then averaged in consecutive groups of `bucket` (the last
  group may be smaller): (bucket means [B, ...], bucket weights [B] summing to 1)."""
  W = weights_W.shape[0]
  order = jax.random.permutation(key, W)
  groups = [order[i:i + bucket] for i in range(0, W, bucket)]

  def mean_of(x, g):
    wg = weights_W[g]
    return jnp.tensordot(wg / jnp.maximum(wg.sum(), 1e-12), x[g], axes=1)

  means = jax.tree.map(lambda x: jnp.stack([mean_of(x, g) for g in groups]), tree_WxN)
  return means, jnp.stack([weights_W[g].sum() for g in groups])


class RobustState(NamedTuple):
  center: Any  # the previous aggregate (centered clipping's start; the cosine signal's reference)
  signals: signal_lib.SignalState


RULES = ("mean", "median", "trimmed_mean", "centered_clip")


def gather_all(axis_name: str = "replica") -> optax.GradientTransformationExtraArgs:
  """The sync's communication when a robust rule combines the updates: every worker
  all-gathers everyone's update ([W, ...]; the ledger counts W − 1 received)."""

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    return collectives.all_gather(updates, axis_name), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)


def row_statistics(rows_WxN, center_N) -> jax.Array:
  """What the signals and centered clipping read of each row over the whole update, as sums
  over these coordinates: [Σu², Σu·c, Σ(u − c)²] per row and Σc², one vector [3W + 1].
  Sums over disjoint shards add up to the whole update's (`RobustRule.observe` takes the
  total)."""
  rows = rows_WxN.astype(jnp.float32)
  center = center_N.astype(jnp.float32)
  return jnp.concatenate([jnp.sum(rows ** 2, axis=1), rows @ center,
                          jnp.sum((rows - center[None]) ** 2, axis=1),
                          jnp.sum(center ** 2)[None]])


class RobustRule:
  """A robust combination's choices, and its steps as functions of the whole update's
  row statistics: `transform` runs them on the whole update at once (the lockstep sync, a
  parameter server); the Ray runtime's peer form runs them shard by shard, each member on
  its shard of every row, the statistics added across shards first (`row_statistics`).

  The steps: `observe` (signals and this round's weights, from the statistics, the
  workers' losses and probes); `combine` (mean, median or trimmed mean, coordinate by
  coordinate); centered clipping's `clip_radius` and `clip_step` (each iteration needs
  every row's distance from the centre over the whole update)."""

  def __init__(self, *, rule: str, signal: str, num_workers: int, trim: int = 1,
               clip_iters: int = 1, clip_tau: float = 0.0, bucket: int = 0,
               temperature: float = 1.0, floor: float = 0.2, weight_ema: float = 0.5,
               warmup_rounds: int = 2, signal_ema: float = 0.9, seed: int = 0,
               noise_sigmas: float = 0.0, probe=None):
    if rule not in RULES:
      raise ValueError(f"unknown rule {rule!r}; choose one of {RULES}")
    if signal == "probe_loss" and probe is None:
      raise ValueError("signal 'probe_loss' needs a probe (sync_program.make_probe)")
    self.rule, self.signal, self.num_workers, self.trim = rule, signal, num_workers, trim
    self.clip_iters, self.clip_tau, self.bucket = clip_iters, clip_tau, bucket
    self.temperature, self.floor, self.weight_ema = temperature, floor, weight_ema
    self.warmup_rounds, self.signal_ema, self.seed = warmup_rounds, signal_ema, seed
    self.noise_sigmas, self.probe = noise_sigmas, probe

  def init(self, params) -> RobustState:
    return RobustState(jax.tree.map(jnp.zeros_like, params), signal_lib.init(self.num_workers))

  def observe(self, state: RobustState, statistics, *, losses=None, probes=None,
              present=None) -> signal_lib.SignalState:
    """The signals after this round, with its weights, from the rows' statistics over the
    whole update (`row_statistics`, summed over shards)."""
    W = self.num_workers
    sq_norms, dots = statistics[:W], statistics[W:2 * W]
    norms, center_norm = jnp.sqrt(sq_norms), jnp.sqrt(statistics[3 * W])
    cosines = jnp.where(center_norm > 0, dots / jnp.maximum(norms * center_norm, 1e-12), 0.0)
    losses = (jnp.zeros((W,), jnp.float32) if losses is None else losses.astype(jnp.float32))
    probes = jnp.zeros((W,), jnp.float32) if probes is None else probes
    seen = signal_lib.observe(state.signals, losses=losses, norms=norms, cosines=cosines,
                              probes=probes, ema=self.signal_ema, present=present)
    if self.signal == "none":  # uniform (over the present workers, in a round some missed)
      weights = (jnp.full((W,), 1.0 / W, jnp.float32) if present is None
                 else jnp.where(present, 1.0, 0.0) / jnp.maximum(present.sum(), 1))
    else:
      weights = signal_lib.weights_from(
          signal_lib.signal_of(seen, self.signal), state.signals.weights,
          temperature=self.temperature, floor=self.floor, weight_ema=self.weight_ema,
          warm=seen.rounds > self.warmup_rounds,
          noise=signal_lib.noise_of(seen, self.signal, self.signal_ema),
          noise_sigmas=self.noise_sigmas, present=present)
    return seen._replace(weights=weights)

  def combine(self, stacked, w, present=None):
    """The coordinate-wise rules (mean, median, trimmed mean) on rows `stacked` [W, ...]."""
    if self.rule == "mean":
      # Uniform weights (no signal, or still warming up) give the plain mean exactly; with
      # absent workers (weight 0) they are never uniform: their mean is the weighted one.
      uniform = jnp.all(w == w[0])
      return jax.tree.map(lambda m, x: jnp.where(uniform, jnp.mean(x, axis=0), m),
                          weighted_mean(stacked, w), stacked)
    if self.rule == "median":
      return median(stacked) if present is None else present_median(stacked, present)
    if self.rule == "trimmed_mean":
      return (trimmed_mean(stacked, self.trim) if present is None
              else present_trimmed_mean(stacked, present, self.trim))
    raise ValueError(f"{self.rule!r} is not coordinate-wise: centered clipping needs each "
                     "row's distance over the whole update (clip_step)")

  def radius(self, distances_W, present=None):
    """τ: `clip_tau`, or by default the median distance from the previous aggregate."""
    return (jnp.asarray(self.clip_tau, jnp.float32) if self.clip_tau > 0
            else clip_radius(distances_W, present))

  def transform(self) -> optax.GradientTransformationExtraArgs:
    """The combination as one transform over updates stacked over workers ([W, ...], from
    `gather_all`). Extra args: `worker_losses` [W] (every worker's train loss),
    `round_index` (seeds the buckets' shuffle), `theta` (the global model, flat: what
    `probe` perturbs); `present` [W] bool (a parameter server's round, where some workers
    may have sent nothing: their rows are zeros): the rule combines the present workers'
    updates only, and an absent worker's signals stay as they were. `combined` (the result
    and its signals, made shard by shard elsewhere: the Ray runtime's peer form): taken as
    this round's, the rows unread."""

    def update_fn(all_u, state, params=None, *, worker_losses=None, round_index=0,
                  theta=None, present=None, combined=None, **extra_args):
      del params, extra_args
      if combined is not None:
        out, seen = combined
        return out, RobustState(out, seen)
      if present is not None and self.bucket > 1:
        raise ValueError("buckets of a round some workers missed are not defined; "
                         "use aggregate.bucket=0")
      leaves = jax.tree.leaves(all_u)
      statistics = sum(row_statistics(jnp.reshape(u, (u.shape[0], -1)), jnp.reshape(c, (-1,)))
                       for u, c in zip(leaves, jax.tree.leaves(state.center)))
      # Computed by every receiver from the updates it received (W forward passes).
      probes = probe_of(all_u, theta) if self.signal == "probe_loss" else None
      seen = self.observe(state, statistics, losses=worker_losses, probes=probes,
                          present=present)
      stacked, w = all_u, seen.weights
      if self.bucket > 1:  # (never with `present`: refused above)
        key = jax.random.fold_in(jax.random.key(self.seed), round_index)
        stacked, w = buckets(all_u, seen.weights, key, self.bucket)
      if self.rule == "centered_clip":
        out, _ = centered_clip(stacked, state.center, w, iters=self.clip_iters,
                               tau=self.clip_tau if self.clip_tau > 0 else None,
                               present_W=present)
      else:
        out = self.combine(stacked, w, present)
      return out, RobustState(out, seen)

    probe_of = self.probe
    return optax.GradientTransformationExtraArgs(self.init, update_fn)


def robust_combine(**choices) -> optax.GradientTransformationExtraArgs:
  """`RobustRule(**choices)` as one transform (its `transform`): updates stacked over
  workers ([W, ...]) combined into one by `rule` with weights from `signal` (module
  docstring; aggregate/signal.py). Every worker computes the same result from the same
  state (previous aggregate, signal EMAs, weights)."""
  return RobustRule(**choices).transform()


class CombinedState(NamedTuple):
  """A fragment's outer state when a robust rule combines the updates before the outer rule."""
  combine: RobustState
  rule: Any


def combine_then(combine: optax.GradientTransformationExtraArgs,
                 rule: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """`combine` (stacked updates -> one) followed by the outer `rule`; extra args go to
  `combine`."""

  def init_fn(params):
    return CombinedState(combine.init(params), rule.init(params))

  def update_fn(all_u, state, params=None, **extra_args):
    one, combine_state = combine.update(all_u, state.combine, params, **extra_args)
    updates, rule_state = rule.update(one, state.rule, params)
    return updates, CombinedState(combine_state, rule_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
