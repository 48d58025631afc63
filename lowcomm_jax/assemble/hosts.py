"""The host table: which workers exist, and each one's tier, batch size, H and speed.

`config.hosts` has one entry per process (one host, or one GPU of a multi-GPU host):
  tier        FFN fraction this host's workers train (1.0 = full width, MatFormer tier 0)
  workers     number of workers on this host
  batch_size  per-worker batch (0: data.batch_size)
  inner_steps H for this host (0: the config's inner_steps; DyLU may change it)
  speed       relative speed for DyLU (0: measure it, in round 2 after compilation)
Without a host table, `num_workers` full-width workers are split evenly over the processes
(one entry per process). Workers are numbered host by host: host 0's workers first. In a
multi-process run, process p runs host p; in a single process, every host runs locally.
"""

import dataclasses
import math
from collections.abc import Sequence

import ml_collections

from lowcomm_jax.model.matformer import hidden_units


@dataclasses.dataclass(frozen=True)
class HostSpec:
  index: int  # row of the host table (= process id in multi-process runs)
  worker_ids: tuple[int, ...]
  tier: float
  hidden: int  # FFN hidden units the tier trains
  batch_size: int
  inner_steps: int
  speed: float  # 0: measured


def host_table(config: ml_collections.ConfigDict, d_ff: int,
               num_processes: int = 1) -> list[HostSpec]:
  rows = list(config.hosts) or [host(1.0, workers=config.num_workers // num_processes)
                                for _ in range(num_processes)]
  table, next_id = [], 0
  for i, row in enumerate(rows):
    ids = tuple(range(next_id, next_id + row.workers))
    next_id += row.workers
    table.append(HostSpec(
        index=i, worker_ids=ids, tier=float(row.tier), hidden=hidden_units(d_ff, row.tier),
        batch_size=row.get("batch_size", 0) or config.data.batch_size,
        inner_steps=row.get("inner_steps", 0) or config.inner_steps,
        speed=float(row.get("speed", 0.0))))
  return table


def host(tier: float, workers: int = 1, batch_size: int = 0, inner_steps: int = 0,
         speed: float = 0.0) -> ml_collections.ConfigDict:
  """A host-table row for config files: `c.hosts = [host(1.0), host(0.25), ...]`."""
  return ml_collections.ConfigDict({"tier": tier, "workers": workers, "batch_size": batch_size,
                                    "inner_steps": inner_steps, "speed": speed})


def dylu_inner_steps(base_inner_steps: int, speeds: Sequence[float]) -> list[int]:
  """Dynamic Local Updates (synchronous form): faster workers take more inner steps per
  round. Each H is scaled by the speed (steps per second, any common unit) relative to the
  fastest, so all finish a round at about the same time instead of the fast ones idling at
  the barrier: H_w = max(1, ceil(H · speed_w / max_v speed_v))."""
  if not speeds or min(speeds) <= 0:
    raise ValueError(f"speeds must be positive, got {list(speeds)}")
  fastest = max(speeds)
  # Round before ceil so float noise (e.g. 20 * 0.3/0.3 = 20.000000000000004) is not a step.
  return [max(1, math.ceil(round(base_inner_steps * s / fastest, 9))) for s in speeds]


def settle_inner_steps(config: ml_collections.ConfigDict, configured: Sequence[int],
                       speeds: Sequence[float] | None = None) -> list[int]:
  """The one place H is settled, per host (runner) or per simulated worker: DyLU's
  (`outer.dylu`) from `speeds` when every one is known (> 0), else `configured` (the host
  table's, or the config's inner_steps)."""
  if config.outer.dylu and speeds and all(s > 0 for s in speeds):
    return dylu_inner_steps(config.inner_steps, speeds)
  return list(configured)
