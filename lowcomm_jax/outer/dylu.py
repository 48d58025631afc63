"""Dynamic Local Updates (synchronous form): faster workers take more inner steps per round.

Each worker's H is scaled by its speed relative to the fastest, so all finish a round at
about the same time instead of the fast ones idling at the barrier:

    H_w = max(1, ceil(H · speed_w / max_v speed_v))
"""

import math
from collections.abc import Sequence


def dylu_inner_steps(base_inner_steps: int, speeds: Sequence[float]) -> list[int]:
  """Per-worker H from speeds (steps per second, any common unit)."""
  if not speeds or min(speeds) <= 0:
    raise ValueError(f"speeds must be positive, got {list(speeds)}")
  fastest = max(speeds)
  # Round before ceil so float noise (e.g. 20 * 0.3/0.3 = 20.000000000000004) is not a step.
  return [max(1, math.ceil(round(base_inner_steps * s / fastest, 9))) for s in speeds]
