"""How workers' decoded contributions combine: optax transforms over the replica axis."""

from lowcomm_jax.aggregate.compressed import CompressedMeanState, compressed_mean
from lowcomm_jax.aggregate.mean import replica_mean
from lowcomm_jax.aggregate.nested import nested_mean
