"""Named-axis collectives over workers that also report their payload to the byte ledger.

Valid wherever the axis name is bound: `jax.vmap(axis_name=...)` over stacked workers (the
runner also sets `spmd_axis_name` so the stack is split over mesh devices and processes,
turning these into cross-device all-reduces), or `jax.shard_map` over a mesh axis.
"""

import jax
from jax.flatten_util import ravel_pytree

from lowcomm_jax.parallel import ledger


def _as_one_buffer(reduce, tree):
  """Applies an all-reduce to the whole tree as one flat buffer per dtype.

  Many small collectives each pay the fabric's latency (milliseconds over gloo/TCP); one
  buffer pays it once, like DDP's gradient buckets. The ravel/unravel copies are local.
  """
  leaves = jax.tree.leaves(tree)
  if len(leaves) <= 1 or len({x.dtype for x in leaves}) > 1:
    return jax.tree.map(reduce, tree)
  flat, unravel = ravel_pytree(tree)
  return unravel(reduce(flat))


def mean(tree, axis_name: str = "replica"):
  """Mean of `tree` over all workers on `axis_name` (an all-reduce)."""
  ledger.record("all_reduce", tree, jax.lax.axis_size(axis_name))
  return _as_one_buffer(lambda x: jax.lax.pmean(x, axis_name), tree)


def all_gather(tree, axis_name: str | tuple[str, ...] = "replica"):
  """Every worker's `tree`, stacked on a new leading axis (an all-gather). Over several
  axes (`parallel.workers.PER_DEVICE`: devices, then each device's workers) the workers are
  stacked major axis first, the order `axis_index` numbers them in. (jax 0.10.2's
  all_gather takes no tuple that mixes a vmap axis with a mesh axis: one gather per axis.)"""
  ledger.record("all_gather", tree, jax.lax.axis_size(axis_name))
  if isinstance(axis_name, str):
    return jax.lax.all_gather(tree, axis_name)
  for name in reversed(axis_name):  # minor first: [n_major, ..., n_minor, ...]
    tree = jax.lax.all_gather(tree, name)
  k = len(axis_name)
  return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[k:]), tree)


def all_to_all(tree, axis_name: str | tuple[str, ...] = "replica"):
  """Each worker's [R, ...] leaves cut along the first axis, row k to worker k: what
  arrives is stacked [R, ...], row i from worker i (a reduce-scatter's first half). Over
  several axes (`PER_DEVICE`) rows are exchanged across devices first, then among each
  device's workers, so that row k still reaches the worker `axis_index` numbers k."""
  ledger.record("all_to_all", tree, jax.lax.axis_size(axis_name))
  if isinstance(axis_name, str):
    return jax.tree.map(lambda x: jax.lax.all_to_all(x, axis_name, 0, 0), tree)
  major, minor = axis_name
  outer, inner = jax.lax.axis_size(major), jax.lax.axis_size(minor)

  def exchange(x):
    x = x.reshape((outer, inner) + x.shape[1:])  # [to device, to worker, ...]
    x = jax.lax.all_to_all(x, major, 0, 0)  # [from device, to worker, ...]
    x = jax.lax.all_to_all(x, minor, 1, 1)  # [from device, from worker, ...]
    return x.reshape((outer * inner,) + x.shape[2:])

  return jax.tree.map(exchange, tree)


def sum(tree, axis_name: str = "replica"):  # noqa: A001 - mirrors lax.psum
  """Sum of `tree` over all workers on `axis_name` (an all-reduce)."""
  ledger.record("all_reduce", tree, jax.lax.axis_size(axis_name))
  return _as_one_buffer(lambda x: jax.lax.psum(x, axis_name), tree)


def permute(tree, axis_name: str | tuple[str, ...], pool, choice) -> object:
  """Each worker's `tree` sent to one peer and one peer's received (a collective-permute),
  by pairing `pool[choice]`: `pool` lists pairings, each (source, destination) worker
  indices with every worker at most once on each side (fixed when the program compiles);
  `choice` (traced, the same on every worker) picks this call's. A worker that receives
  nothing gets zeros. Over `PER_DEVICE`'s two axes one of them must hold a single worker:
  jax 0.10.2's ppermute takes no tuple that mixes a vmap axis with a mesh axis."""
  ledger.record("permute", tree, jax.lax.axis_size(axis_name))  # once, whichever is chosen
  if not isinstance(axis_name, str):
    spread = [name for name in axis_name if jax.lax.axis_size(name) > 1]
    if len(spread) > 1:
      raise ValueError(f"a permute over {axis_name} needs one worker per device or every "
                       "worker on one device")
    axis_name = spread[0] if spread else axis_name[-1]
  branches = [lambda x, pairs=tuple(pairs): jax.lax.ppermute(x, axis_name, pairs)
              for pairs in pool]
  return jax.lax.switch(choice, branches, tree) if len(branches) > 1 else branches[0](tree)
