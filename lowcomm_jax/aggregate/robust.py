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

import jax
import jax.numpy as jnp


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


def centered_clip(tree_WxN, center, weights_W, *, iters: int, tau: float | None = None):
  """Returns (the clipped aggregate, τ used). `tau` None or ≤ 0: the median distance of the
  updates from `center`."""
  if tau is None or tau <= 0:
    tau = jnp.median(_norms(jax.tree.map(lambda x, c: x - c[None], tree_WxN, center)))
  v = center
  for _ in range(iters):
    diff = jax.tree.map(lambda x, c: x - c[None], tree_WxN, v)
    dist = _norms(diff)
    scale = weights_W * jnp.minimum(1.0, tau / jnp.maximum(dist, 1e-12))
    v = jax.tree.map(lambda c, d: c + jnp.tensordot(scale.astype(d.dtype), d, axes=1), v, diff)
  return v, tau


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
