"""How workers' decoded contributions combine: optax transforms over the replica axis."""

from lowcomm_jax.aggregate.attack import make_attack
from lowcomm_jax.aggregate.compressed import (CompressedMeanState, compressed_gather,
                                              compressed_mean, sender_keys)
from lowcomm_jax.aggregate.mean import replica_mean
from lowcomm_jax.aggregate.nested import nested_mean
from lowcomm_jax.aggregate.robust import (RULES, CombinedState, RobustRule, RobustState,
                                          combine_then, gather_all, robust_combine)
from lowcomm_jax.aggregate.signal import SIGNALS
