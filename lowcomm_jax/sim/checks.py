"""The simulator's config problems (`runtime='simulator'`: `sim.*`, and what simulated
workers cannot have), each 'field=value: fix'. Which algorithms may read one stream in
lockstep, and the fields other runtimes ignore, are config/check.py's: they ask the
algorithms and the defaults."""

import math

import ml_collections

from lowcomm_jax.errors import Problems
from lowcomm_jax.sim.collectives import COLLECTIVES
from lowcomm_jax.sim.speeds import HETEROGENEITY


def _numbers(values) -> bool:
  return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def problems(c: ml_collections.ConfigDict, num_processes: int, algorithm) -> list[str]:
  """Problems of a config simulated in a run of `num_processes` with `algorithm` (None:
  an unknown name, reported elsewhere)."""
  out = Problems(c)
  check = out.check
  s, n = c.sim, c.sim.network
  check(num_processes == 1, "runtime", "the simulator runs in one process; launch it "
        "without jax.distributed")
  _check_algorithm(c, check, algorithm)
  _check_unwired(c, out)
  check(not list(c.hosts), "hosts", "the simulator's workers are full width; describe them "
        "with num_workers and sim.* (leave hosts empty)")
  check(c.mesh.data == 1, "mesh.data", "simulated workers are vmapped on one device; use 1")
  check(c.model.tp.size == 1, "model.tp.size", "simulated workers are vmapped on one device; "
        "use 1")
  check(s.heterogeneity in HETEROGENEITY, "sim.heterogeneity",
        f"use one of {list(HETEROGENEITY)}")
  check(c.aggregate.weighting == "uniform", "aggregate.weighting",
        "the simulator weights workers uniformly; use 'uniform'")
  speeds = list(s.speeds)
  if speeds:
    check(len(speeds) == c.num_workers and _numbers(speeds) and min(speeds) > 0, "sim.speeds",
          f"give {c.num_workers} positive relative speeds (one per worker), or () to use "
          "sim.heterogeneity")
  check(0 < s.step_seconds < math.inf, "sim.step_seconds", "must be a finite number > 0")
  check(0 < s.network.bytes_scale < math.inf, "sim.network.bytes_scale",
        "must be a finite number > 0 (1: payloads travel at their real size)")
  check(isinstance(s.jobs_per_call, int) and s.jobs_per_call >= 0, "sim.jobs_per_call",
        "use 0 (chosen from memory) or a number of jobs >= 1")
  check(s.jitter >= 0, "sim.jitter", "must be >= 0")
  check(0.0 <= s.straggler_prob <= 1.0, "sim.straggler_prob", "must be in [0, 1]")
  check(s.straggler_slowdown >= 1.0, "sim.straggler_slowdown", "must be >= 1")
  check(n.regions >= 1, "sim.network.regions", "need at least one region")
  placed = list(n.worker_regions)
  if placed:
    check(len(placed) == c.num_workers and all(0 <= r < n.regions for r in placed),
          "sim.network.worker_regions",
          f"give one region in [0, {n.regions}) per worker ({c.num_workers}), or ()")
  check(n.server_region == -1 or 0 <= n.server_region < n.regions, "sim.network.server_region",
        f"use -1 (a region of its own) or a region in [0, {n.regions})")
  check(n.region_gbps >= 0, "sim.network.region_gbps",
        "must be >= 0 (0: each region's fastest link)")
  check(n.collective in COLLECTIVES, "sim.network.collective", f"use one of {list(COLLECTIVES)}")
  check(n.intra_gbps > 0, "sim.network.intra_gbps", "must be > 0")
  check(n.intra_latency_s >= 0, "sim.network.intra_latency_s", "must be >= 0")
  check(n.inter_gbps > 0, "sim.network.inter_gbps", "must be > 0")
  check(n.inter_latency_s >= 0, "sim.network.inter_latency_s", "must be >= 0")
  for field, positive in (("inter_gbps_matrix", True), ("inter_latency_matrix", False)):
    if n[field]:
      rows = [r if isinstance(r, (list, tuple)) else [r] for r in n[field]]
      values = [v for r in rows for v in r]
      ok = (len(rows) == n.regions and all(len(r) == n.regions for r in rows)
            and _numbers(values) and all(v > 0 if positive else v >= 0 for v in values))
      check(ok, f"sim.network.{field}", f"give {n.regions} rows of {n.regions} "
            f"{'positive' if positive else 'non-negative'} numbers, or () for the scalar")
  return out


def _check_algorithm(c, check, algorithm) -> None:
  """What the chosen algorithm's schedule has in the simulator."""
  if algorithm is None:
    return
  check(c.sim.network.collective != "server" or algorithm.server_schedule,
        "sim.network.collective", f"{c.algorithm}'s simulator schedule has no parameter "
        "server's form; use auto, ring or hierarchical")
  if c.data.batch_mode == "same":
    check(not algorithm.simulated_only and not c.outer.dylu, "data.batch_mode",
          "workers that run at their own pace read their own streams; use 'different'")


def _check_unwired(c, out: Problems) -> None:
  """Features of the lockstep runtime the simulator does not have (yet)."""
  if c.lora.rank > 0:
    out.append(f"lora.rank={c.lora.rank}: not yet with runtime='simulator' (the simulator is "
               "not wired for a frozen base); set --config.lora.rank=0 or "
               "--config.runtime=spmd")
  if c.collab.target_batch_size > 0:
    out.append(f"collab.target_batch_size={c.collab.target_batch_size}: the simulator keeps "
               "its own clock; set --config.runtime=spmd (or ray), or "
               "--config.collab.target_batch_size=0")
