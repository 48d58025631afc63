"""Mapping one worker's function over a run's stacked workers [R, ...], split over the
mesh's 'replica' devices.

`jax.vmap(..., spmd_axis_name='replica')` leaves the split to XLA's partitioner, which is
right for element-wise maths and all-reduces. It does not split every op along the worker
axis, though: top-k, a random-k gather or a DCT's chunking run replicated, so each worker's
dense tensor is all-gathered first, and a codec's payload is no longer all that crosses the
network. `per_device` maps the workers by hand instead: `jax.shard_map` over 'replica' (each
device sees only its own workers), a plain vmap over those. The only cross-device traffic is
then the collectives the function names, over `PER_DEVICE`'s two axes.

`map_host_workers` maps a host's local program, which names no collective: a worker alone
on its device runs unbatched there.
"""

import jax
from jax.sharding import PartitionSpec as P

REPLICA = "replica"  # the mesh axis the workers are split over (and vmap's name for them)
PER_DEVICE = (REPLICA, "worker")  # the axes a per-device function's collectives span


def map_workers(fn, in_axes: tuple, out_axes: tuple, *, per_device: bool):
  """`fn` over the workers: `in_axes`/`out_axes` are vmap's, one 0 (stacked [R, ...]) or None
  (the same on every worker) per argument and result. Collectives inside `fn` name
  `REPLICA`, or `PER_DEVICE` when `per_device`. Runs under the run's mesh (`jax.set_mesh`)."""
  if not per_device:
    return jax.vmap(fn, in_axes=in_axes, out_axes=out_axes, axis_name=REPLICA,
                    spmd_axis_name=REPLICA)
  body = jax.vmap(fn, in_axes=in_axes, out_axes=out_axes, axis_name=PER_DEVICE[1])

  def spec(axis):
    return P(REPLICA) if axis == 0 else P()

  # check_vma=False: the per-device check cannot follow a vmap axis and a mesh axis named
  # together in one collective; the results declared replicated are equal on every device
  # because they come out of collectives over both axes (vmap's out_axes=None checks that).
  return jax.shard_map(body, in_specs=tuple(map(spec, in_axes)),
                       out_specs=tuple(map(spec, out_axes)), axis_names={REPLICA},
                       check_vma=False)


def map_host_workers(fn, in_axes: tuple, count: int, mesh, axis_name: str = REPLICA):
  """`fn` (no collectives) over a host's stack of `count` workers, split over `mesh`'s
  `axis_name` devices (mesh None: left to XLA's partitioner).

  A worker alone on its device runs unbatched: a size-1 batch dimension in every matmul made
  XLA transpose the weights at each step (the runner's inner loop had 65 transposes and 44
  copies more than a bare step's on CPU; now the same ops). One worker: called directly;
  one per device: `shard_map` each device calls it in; otherwise vmap, split by XLA."""
  def one(*args):
    own = [jax.tree.map(lambda x: x[0], a) if axis == 0 else a for a, axis in zip(args, in_axes)]
    return jax.tree.map(lambda x: x[None], fn(*own))

  if count == 1:
    return one
  if mesh is not None and count == mesh.shape[axis_name] > 1:
    return jax.shard_map(one, mesh=mesh, in_specs=tuple(P(axis_name) if axis == 0 else P()
                                                         for axis in in_axes),
                         out_specs=P(axis_name), axis_names={axis_name}, check_vma=False)
  return jax.vmap(fn, in_axes=in_axes, axis_name=axis_name, spmd_axis_name=axis_name)
