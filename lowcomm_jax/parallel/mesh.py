"""Device meshes with axes ('replica', 'data', 'model') and the shardings the runner uses."""

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

AXES = ("replica", "data", "model")


def replica_devices(num_workers: int, available: int) -> int:
  """The most devices that can hold `num_workers` workers evenly (workers per device >= 1)."""
  return max(d for d in range(1, min(num_workers, available) + 1) if num_workers % d == 0)


def make_mesh(replica: int, data: int = 1, model: int = 1) -> Mesh:
  """A mesh over the first replica*data*model devices, with Auto axis types."""
  n = replica * data * model
  return jax.make_mesh((replica, data, model), AXES, axis_types=(AxisType.Auto,) * 3,
                       devices=jax.devices()[:n])


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def per_worker(mesh: Mesh) -> NamedSharding:
  """Leading axis = workers, split over 'replica'; the rest replicated."""
  return NamedSharding(mesh, P("replica"))


def round_batches(mesh: Mesh) -> NamedSharding:
  """[R, H, B, L] batches: workers over 'replica', each worker's batch over 'data'."""
  return NamedSharding(mesh, P("replica", None, "data"))
