"""Joining a multi-process run through `jax.distributed` (the only networking we use).

Settings come from config fields `distributed.*` or, when those are unset, from the
environment: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (set by
launch/local.py), or SLURM's variables, which JAX detects itself. With none of them the
run stays single-process.
"""

import os

import jax
import ml_collections


def settings(config: ml_collections.ConfigDict) -> dict | None:
  """jax.distributed.initialize arguments, or None for a single-process run."""
  d = config.distributed
  address = d.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
  num = d.num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0"))
  pid = d.process_id if d.process_id >= 0 else int(os.environ.get("JAX_PROCESS_ID", "-1"))
  heartbeat = int(os.environ.get("LOWCOMM_HEARTBEAT_TIMEOUT", d.heartbeat_timeout_s))
  if address and num > 1:
    return {"coordinator_address": address, "num_processes": num, "process_id": pid,
            "heartbeat_timeout_seconds": heartbeat}
  if int(os.environ.get("SLURM_NTASKS", "1")) > 1:  # JAX reads the rest from SLURM
    return {"heartbeat_timeout_seconds": heartbeat}
  return None


def initialize(config: ml_collections.ConfigDict) -> None:
  """Joins the run's processes (call before any other JAX use); no-op when single-process."""
  args = settings(config)
  if args is None:
    return
  # Cross-process collectives on CPU devices (tests, laptops); GPUs use NCCL regardless.
  # Asking for the backend first would start it, which initialize() must precede.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**args)
