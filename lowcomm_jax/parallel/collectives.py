"""Named-axis collectives over workers that also report their payload to the byte ledger.

Valid wherever the axis name is bound: `jax.vmap(axis_name=...)` over stacked workers (the
runner also sets `spmd_axis_name` so the stack is split over mesh devices and processes,
turning these into cross-device all-reduces), or `jax.shard_map` over a mesh axis.
"""

import jax

from lowcomm_jax.parallel import ledger


def mean(tree, axis_name: str = "replica"):
  """Mean of `tree` over all workers on `axis_name` (an all-reduce)."""
  ledger.record("all_reduce", tree, jax.lax.axis_size(axis_name))
  return jax.lax.pmean(tree, axis_name)


def all_gather(tree, axis_name: str = "replica"):
  """Every worker's `tree`, stacked on a new leading axis (an all-gather)."""
  ledger.record("all_gather", tree, jax.lax.axis_size(axis_name))
  return jax.lax.all_gather(tree, axis_name)


def sum(tree, axis_name: str = "replica"):  # noqa: A001 - mirrors lax.psum
  """Sum of `tree` over all workers on `axis_name` (an all-reduce)."""
  ledger.record("all_reduce", tree, jax.lax.axis_size(axis_name))
  return jax.lax.psum(tree, axis_name)
