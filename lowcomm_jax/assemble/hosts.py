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

from lowcomm_jax.errors import Problems
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


def problems(c: ml_collections.ConfigDict, num_devices: int, num_processes: int,
             local_devices: int | None) -> list[str]:
  """The host table's problems ('field=value: fix'), and with several processes, whether
  process p can run host p on all of its devices (config/check.py asks them at start)."""
  out = Problems(c)
  m = c.mesh
  rows = list(c.hosts)
  for i, row in enumerate(rows):
    where = f"hosts[{i}]"
    for key, ok, fix in (
        ("tier", lambda v: 0.0 < v <= 1.0, "the FFN fraction must be in (0, 1]"),
        ("workers", lambda v: v >= 1, "need at least one worker per host"),
        ("batch_size", lambda v: v >= 0, "must be >= 0 (0: data.batch_size)"),
        ("inner_steps", lambda v: v >= 0, "must be >= 0 (0: the config's inner_steps)"),
        ("speed", lambda v: v >= 0, "must be >= 0 (0: measure it)")):
      if key in row and not ok(row[key]):
        out.append(f"{where}.{key}={row[key]!r}: {fix}")
    if "tier" not in row or "workers" not in row:
      out.append(f"{where}: needs at least 'tier' and 'workers' (use hosts.host(...))")
    if c.outer.dylu and row.get("inner_steps", 0):
      out.append(f"{where}.inner_steps={row['inner_steps']}: with outer.dylu the hosts' H "
                      "come from their speeds; leave it 0 (or set outer.dylu=False)")
    if m.data >= 1 and row.get("batch_size", 0) % m.data:
      out.append(f"{where}.batch_size={row['batch_size']}: must be divisible by "
                      f"mesh.data={m.data}")
  if rows:
    total = sum(row.get("workers", 0) for row in rows)
    if total != c.num_workers:
      out.append(f"num_workers={c.num_workers}: the host table has {total} workers; set "
                      f"--config.num_workers={total}")
    sizes = {row.get("batch_size", 0) or c.data.batch_size for row in rows}
    steps = {row.get("inner_steps", 0) or c.inner_steps for row in rows}
    if c.data.batch_mode == "same" and (len(sizes) > 1 or len(steps) > 1 or c.outer.dylu):
      out.append(f"data.batch_mode='same': hosts use batch sizes {sorted(sizes)} and H "
                      f"{sorted(steps)}{' with DyLU' if c.outer.dylu else ''}; the same batch "
                      "at the same step needs one batch size and one fixed H (or use "
                      "'different')")
    if len(rows) > 1 and m.replica > 1:
      out.append(f"mesh.replica={m.replica}: several hosts in one process share one "
                      "replica device; set --config.mesh.replica=-1 (or launch one process "
                      "per host)")
  if num_processes > 1:  # process p runs host p on all of its devices
    tp = c.model.tp.size
    if local_devices and local_devices % max(m.data * tp, 1):
      out.append(f"mesh.data*model.tp.size={m.data * tp}: must divide this process's "
                      f"{local_devices} device(s); a worker's data and model shards stay "
                      "inside one process")
    local = max((local_devices or 1) // max(m.data * tp, 1), 1)
    if local_devices and num_devices != local_devices * num_processes:
      out.append(f"processes expose {num_devices} devices in all but this one has "
                      f"{local_devices}: every process must expose the same number of devices "
                      "(run one process per GPU)")
    if rows and len(rows) != num_processes:
      out.append(f"hosts: the host table has {len(rows)} rows but {num_processes} "
                      "processes joined; give one row per process")
    per_process = ({row.get("workers", 0) for row in rows} if rows
                   else {c.num_workers // num_processes})
    if not rows and c.num_workers % num_processes:
      out.append(f"num_workers={c.num_workers}: not divisible by the {num_processes} "
                      "processes; use a multiple or give a host table")
    if len(per_process) > 1:
      out.append(f"hosts: workers per process {sorted(per_process)} differ; every "
                      "process must run the same number of workers (one per device is usual)")
    if any(w % local for w in per_process if w):
      out.append(f"hosts: each process has {local} replica device(s); its workers must be "
                      "a multiple of that")
  return list(out)
