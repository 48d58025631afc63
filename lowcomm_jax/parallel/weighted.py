"""The masked weighted mean over workers, written once: every sync that weighs its workers'
rows per coordinate (MatFormer tiers × tokens, a partial quorum's absent rows at 0) divides
by the weight it summed, and a coordinate no worker weighs comes out 0 rather than 0/0. The
callers then keep θ there (programs/sync_program.py's outer step); here it is only the
division."""

import jax.numpy as jnp


def divide_by_weight(numerator, total):
  """`numerator` / `total`, 0 where `total` is 0 (the numerator is 0 there too: nothing
  weighed it). Broadcasts as `/` does."""
  return numerator / jnp.where(total > 0, total, 1.0)


def weighted_mean(weights_MxN, values_MxN):
  """Σ_m a_m·x_m / Σ_m a_m over the leading axis, per coordinate, 0 where Σ a_m is 0."""
  return divide_by_weight((weights_MxN * values_MxN).sum(0), weights_MxN.sum(0))
