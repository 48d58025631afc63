"""Joining a multi-process run through `jax.distributed` (the only networking we use).

Settings come from config fields `distributed.*` or, when those are unset, from the
environment: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (set by
launch/local.py), or SLURM's variables. With none of them the run stays single-process.

Process 0's coordinator listens on the coordinator address's host only (not every
interface, JAX's default) unless `distributed.coordinator_bind_address` says otherwise.
It is unauthenticated: see docs/trust-model.md.

Before JAX joins, the processes take a roll call (roll_call.py) on the coordinator's port,
so a process that never starts is named instead of JAX aborting every process.
"""

import ipaddress
import logging
import os
import socket

import jax
import ml_collections

from lowcomm_jax.errors import ConfigError
from lowcomm_jax.parallel.roll_call import DistributedError, roll_call, split_address

__all__ = ["DistributedError", "initialize", "settings"]


def settings(config: ml_collections.ConfigDict) -> dict | None:
  """jax.distributed.initialize arguments, or None for a single-process run."""
  d = config.distributed
  address = d.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
  num = d.num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0"))
  pid = d.process_id if d.process_id >= 0 else int(os.environ.get("JAX_PROCESS_ID", "-1"))
  heartbeat = int(os.environ.get("LOWCOMM_HEARTBEAT_TIMEOUT", d.heartbeat_timeout_s))
  common = {"heartbeat_timeout_seconds": heartbeat, "initialization_timeout": d.join_timeout_s}
  if not (address and num > 1 and pid >= 0) and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
    found = _from_cluster(d.join_timeout_s)
    if not found[0]:  # JAX reads the rest from SLURM itself; it binds every interface
      return common
    address, num, pid = address or found[0], num or found[1], pid if pid >= 0 else found[2]
  if address and num > 1:
    bind = d.coordinator_bind_address or os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", "")
    return {"coordinator_address": address, "num_processes": num, "process_id": pid,
            "coordinator_bind_address": bind or _own_address(address), **common}
  return None


def _from_cluster(timeout: int) -> tuple[str, int, int]:
  """(address, processes, id) as JAX would detect them (SLURM, Open MPI), or ('', 0, -1)."""
  try:  # private, but the same detection initialize() runs; without it JAX decides alone
    from jax._src import clusters
    address, num, pid, _ = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        None, None, None, None, None, timeout)
    return address or "", int(num or 0), int(pid if pid is not None else -1)
  except Exception as e:  # noqa: BLE001 - any failure: let JAX detect it as before
    logging.warning("could not read the cluster's distributed settings (%s); JAX's "
                    "coordinator will listen on every interface", e)
    return "", 0, -1


def _own_address(address: str) -> str:
  """The bind address for coordinator `address`: its own host and port.

  A host name that resolves to a loopback address on process 0 (Debian's 127.0.1.1 entry
  for the machine's own name) would shut out the other hosts: bind everywhere then, and
  say so."""
  host, port = split_address(address)
  try:
    ipaddress.ip_address(host)
    return address
  except ValueError:
    pass
  if host == "localhost":
    return address
  try:
    ips = {info[4][0] for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)}
  except OSError:
    return address  # unresolvable here: the join reports it
  if ips and all(ipaddress.ip_address(ip.split("%")[0]).is_loopback for ip in ips):
    logging.warning("coordinator host %r resolves to loopback %s here; listening on every "
                    "interface. Set --config.distributed.coordinator_bind_address=IP:%d to "
                    "restrict it", host, sorted(ips), port)
    return f"[::]:{port}"
  return address


def _host_port(value: str) -> tuple[str, int] | None:
  """('host', port) of 'host:port' ('[v6]:port' too), or None when it is not that."""
  host, sep, port = value.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    return None
  return host.strip("[]"), int(port)


def problems(c: ml_collections.ConfigDict, environ: dict | None = None) -> list[str]:
  """The `distributed.*` fields' problems (config/check.validate lists them too); checked
  here before joining, where nothing has validated the config yet."""
  env = os.environ if environ is None else environ
  d = c.distributed
  out = []
  if d.num_processes < 0:
    out.append(f"distributed.num_processes={d.num_processes}: must be >= 0 "
               "(0: from the environment)")
  if d.process_id < -1 or (d.num_processes > 0 and d.process_id >= d.num_processes):
    out.append(f"distributed.process_id={d.process_id}: must be in "
               f"[0, {max(d.num_processes, 1)}) or -1 (from the environment)")
  for field in ("coordinator_address", "coordinator_bind_address"):
    if d[field] and _host_port(d[field]) is None:
      out.append(f"distributed.{field}={d[field]!r}: use 'host:port' (e.g. "
                 "'10.0.0.1:1234'; '[::1]:1234' for IPv6), or '' "
                 + ("for the environment's" if field == "coordinator_address"
                    else "to bind to the coordinator_address host"))
  if (d.num_processes > 1 and not d.coordinator_address
      and not env.get("JAX_COORDINATOR_ADDRESS") and int(env.get("SLURM_NTASKS", "1")) <= 1):
    out.append(f"distributed.num_processes={d.num_processes}: no coordinator to join "
               "(the run would silently stay single-process); set "
               "--config.distributed.coordinator_address=HOST:PORT of process 0 (or "
               "JAX_COORDINATOR_ADDRESS, or launch under SLURM / launch/local.py)")
  for field in ("heartbeat_timeout_s", "join_timeout_s"):
    if d[field] < 1:
      out.append(f"distributed.{field}={d[field]}: must be >= 1 second")
  return out


def initialize(config: ml_collections.ConfigDict) -> None:
  """Joins the run's processes (call before any other JAX use); no-op when single-process.

  Raises ConfigError for bad `distributed.*` fields and DistributedError when the processes
  do not all join within distributed.join_timeout_s.
  """
  found = problems(config)
  if found:
    raise ConfigError(found)
  args = settings(config)
  if args is None:
    return
  if "coordinator_address" in args:
    roll_call(args["coordinator_address"], args["coordinator_bind_address"],
              args["num_processes"], args["process_id"], config.distributed.join_timeout_s)
  # Cross-process collectives on CPU devices (tests, laptops); GPUs use NCCL regardless.
  # Asking for the backend first would start it, which initialize() must precede.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**args)


def config_defaults() -> ml_collections.ConfigDict:
  """The `distributed` section: how the processes join (jax.distributed); unset fields
  fall back to JAX's and SLURM's environment variables (config/defaults.py puts it in every
  config)."""
  s = ml_collections.ConfigDict()
  s.coordinator_address = ""  # 'host:port' of process 0 ('' = env / single)
  s.num_processes = 0  # 0: from the environment, else 1
  s.process_id = -1  # -1: from the environment
  s.heartbeat_timeout_s = 60  # a silent process is declared dead after this
  s.join_timeout_s = 300  # wait this long for all processes, then name the missing
  # Where process 0's coordinator listens. '' = the coordinator_address host only (its port);
  # '0.0.0.0:PORT' listens on every interface. Unauthenticated: keep it on a private network.
  s.coordinator_bind_address = ""  # 'host:port' ('' = coordinator_address's host)
  return s
