"""Every algorithm, one module each; `get(name)` is the only way the rest of the code picks
one (config field `algorithm`). To add one: a module with a subclass of base.Algorithm
(ARCHITECTURE.md, "Adding an algorithm") and a line in REGISTRY."""

from lowcomm_jax.algorithms import (async_dn, async_local_sgd, ddp, desloc, diloco, eager, halos,
                                    noloco, one_step_delay, overlap, pier, streaming)
from lowcomm_jax.algorithms.base import Algorithm, Segment, StateSync

REGISTRY: dict[str, Algorithm] = {a.name: a for a in (
    ddp.ALGORITHM, diloco.ALGORITHM, streaming.ALGORITHM, one_step_delay.ALGORITHM,
    eager.ALGORITHM, overlap.ALGORITHM, noloco.ALGORITHM, pier.ALGORITHM, desloc.ALGORITHM,
    async_local_sgd.ALGORITHM,
    async_dn.ALGORITHM, halos.ALGORITHM)}
NAMES = tuple(REGISTRY)
__all__ = ["Algorithm", "NAMES", "REGISTRY", "Segment", "StateSync", "get"]


def get(name: str) -> Algorithm:
  """The algorithm called `name` (validated configs only: config/check.py names the choices)."""
  return REGISTRY[name]
