"""Device meshes with axes ('replica', 'data', 'model'), and moving arrays between the
process-local mesh (where each host runs its own local program) and the global mesh
(where the one outer step runs over every process's devices)."""

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

AXES = ("replica", "data", "model")


def replica_devices(num_workers: int, available: int) -> int:
  """The most devices that can hold `num_workers` workers evenly (workers per device >= 1)."""
  return max(d for d in range(1, min(num_workers, available) + 1) if num_workers % d == 0)


def _mesh(devices, replica: int, data: int, model: int) -> Mesh:
  grid = np.asarray(devices[:replica * data * model], dtype=object).reshape(replica, data, model)
  return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 3)


def make_mesh(replica: int, data: int = 1, model: int = 1) -> Mesh:
  """A mesh over the first replica*data*model devices, process-major, with Auto axes.

  Process-major order puts process p's devices (and so its workers) in one contiguous block
  of the replica axis, matching the host table's worker numbering.
  """
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  return _mesh(devices, replica, data, model)


def local_part(global_mesh: Mesh) -> Mesh:
  """This process's block of the global mesh: where its hosts' local programs run.

  Taken from the global mesh (not jax.local_devices()) so local and global device orders
  agree, which `to_global` relies on to stitch shards without a copy.
  """
  p = jax.process_index()
  rows = [row for row in global_mesh.devices if all(d.process_index == p for d in row.flat)]
  return Mesh(np.asarray(rows, dtype=object), AXES, axis_types=(AxisType.Auto,) * 3)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def replicated_from_host(tree, mesh: Mesh):
  """Host arrays every process holds alike, as replicated arrays on `mesh`, each process
  filling its own devices. (`jax.device_put` would first all-gather every process's copy
  to check they are equal: a whole frozen base over the network.)"""
  sharding = replicated(mesh)

  def place(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
  return jax.tree.map(place, tree)


def per_worker(mesh: Mesh) -> NamedSharding:
  """Leading axis = workers, split over 'replica'; the rest replicated."""
  return NamedSharding(mesh, P("replica"))


def round_batches(mesh: Mesh) -> NamedSharding:
  """[R, H, B, L] batches: workers over 'replica', each worker's batch over 'data'."""
  return NamedSharding(mesh, P("replica", None, "data"))


def local_view(tree, local_mesh: Mesh):
  """A globally replicated tree as arrays on this process's mesh (no copy)."""
  sharding = replicated(local_mesh)

  def view(x):
    if x.is_fully_addressable:
      return x
    shards = {s.device: s.data for s in x.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        x.shape, sharding, [shards[d] for d in sharding.addressable_devices])
  return jax.tree.map(view, tree)


def to_global(tree, global_mesh: Mesh, total_workers: int, spec: P = P("replica")):
  """Per-worker arrays [G, ...] of this process -> global arrays [R, ...] split over 'replica'
  (`spec`: how the rest is split, as on the local mesh).

  Each local device already holds its workers' rows; the global array is stitched from those
  shards without a copy (a single process's arrays are global already).
  """
  if jax.process_count() == 1:
    return tree
  sharding = NamedSharding(global_mesh, spec)

  def stitch(x):
    shape = (total_workers,) + x.shape[1:]
    shards = {s.device: s.data for s in x.addressable_shards}
    devices = sharding.addressable_devices_indices_map(shape)
    return jax.make_array_from_single_device_arrays(shape, sharding, [shards[d] for d in devices])
  return jax.tree.map(stitch, tree)


def to_local(tree, local_mesh: Mesh):
  """Global per-worker arrays [R, ...] -> this process's rows [G, ...] on its mesh (no copy):
  the inverse of `to_global`."""
  if jax.process_count() == 1:
    return tree
  sharding = per_worker(local_mesh)
  rows = local_mesh.shape["replica"]

  def local(x):
    shards = {s.device: s.data for s in x.addressable_shards}
    per_row = x.shape[0] // x.sharding.mesh.shape["replica"]  # workers per replica row
    shape = (per_row * rows,) + x.shape[1:]
    devices = sharding.addressable_devices_indices_map(shape)
    return jax.make_array_from_single_device_arrays(shape, sharding, [shards[d] for d in devices])
  return jax.tree.map(local, tree)
