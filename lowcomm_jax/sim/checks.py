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
  check(c.collective_form in COLLECTIVES, "collective_form",
        f"use one of {list(COLLECTIVES)}")
  check(n.intra_gbps > 0, "sim.network.intra_gbps", "must be > 0")
  check(0 < n.exchange_efficiency <= 1, "sim.network.exchange_efficiency",
        "a fraction of the links' rate in (0, 1]")
  check(n.exchange_member_s >= 0, "sim.network.exchange_member_s", "must be >= 0")
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
  check(c.collective_form != "server" or algorithm.server_schedule,
        "collective_form", f"{c.algorithm}'s simulator schedule has no parameter "
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


def config_defaults() -> ml_collections.ConfigDict:
  """The `sim` section: the simulator's fields (`runtime='simulator'`), and the network both
  it and the Ray runtime read (config/defaults.py puts it in every config)."""
  s = ml_collections.ConfigDict()
  s.heterogeneity = "none"  # worker speeds: none | slight | moderate | very (sim/speeds.py)
  s.speeds = ()  # explicit relative speeds, one per worker (overrides heterogeneity)
  s.step_seconds = 0.1  # virtual seconds per inner step of the fastest worker
  s.jitter = 0.0  # per-step duration noise: x (1 + jitter * N(0, 1))
  s.straggler_prob = 0.0  # chance a job runs straggler_slowdown times slower
  s.straggler_slowdown = 3.0  # how much slower a straggling job runs
  s.jobs_per_call = 0  # synchronous jobs run in one vmapped call (their activations are
  # | held at once); 0: every worker if they fit in memory, else the widest power of two
  # The network: the simulator's links; under runtime='ray', the links its nodes sit on
  # (bench/real_links.py builds them; config.json keeps them for the simulator's replay).
  s.network = ml_collections.ConfigDict()
  s.network.regions = 1  # workers fill regions in contiguous blocks
  s.network.worker_regions = ()  # or: the region of each worker
  s.network.server_region = -1  # where the global parameter server sits: -1: a region
  # | of its own (linked to every region at inter_gbps, inter_latency_s); r: in region r,
  # | with its workers (the summary records which)
  s.network.region_gbps = 0.0  # each region's uplink and downlink, shared by all its
  # | inter-region transfers (sim/flows.py: max-min fair); 0: its fastest link's bandwidth
  s.network.intra_gbps = 100.0  # bandwidth inside a region: each node's NIC
  s.network.intra_latency_s = 1e-4  # seconds, inside a region
  s.network.inter_gbps = 1.0  # bandwidth between any two regions
  s.network.inter_latency_s = 0.05  # seconds, between any two regions
  s.network.inter_gbps_matrix = ()  # or per pair: regions x regions rows (diagonal unused)
  s.network.inter_latency_matrix = ()  # or per pair, like inter_gbps_matrix
  s.network.exchange_efficiency = 1.0  # the direct exchange (Ray's rounds among the
  # | workers): the fraction of a link's rate a member gets while it sends and receives at
  # | once (bench/exchange_rig.py measures it; 1: the bandwidth alone)
  s.network.exchange_member_s = 0.0  # ... and the seconds each of its steps adds per member
  s.network.bytes_scale = 1.0  # payloads take this many times their real bytes' time
  # | (a small CPU model standing in for a large one; bytes_sent stays real)
  return s
