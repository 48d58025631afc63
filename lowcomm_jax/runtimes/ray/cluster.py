"""Joining or starting Ray, and the options the runtime's actors get.

Ray is an extra (`pip install -e ".[ray]"`): it is imported only here (`import_ray`, which
pool.py and driver.py call), so every other runtime works without it."""

import hashlib
import logging
import os
import pathlib
import socket
import uuid
import warnings

import ml_collections


class RayUnavailable(RuntimeError):
  """Ray cannot run this run here: not installed, not started, not reachable. One line that
  names the cause and what to do."""


# Ray starts its worker processes at niceness 15 (its `worker_niceness`), as if they were
# background work: on a host with anything else busy at niceness 0 (a data prep, a second
# job, a test suite) they get a few percent of a core and the run crawls. Here the actors
# are the training, so a Ray this process starts runs them at the driver's priority. A
# cluster started by `ray start` takes it from RAY_worker_niceness=0 (docs/ray.md, "Priority").
SYSTEM_CONFIG = {"worker_niceness": 0}


def import_ray():
  try:
    import ray
    import xxhash  # noqa: F401 - the replicas' fingerprints (replica.params_hash)
  except ImportError as e:
    raise RayUnavailable(f"runtime='ray' needs {e.name}: pip install -e \".[ray]\" (or "
                         "pip install 'ray>=2.40' xxhash)") from e
  return ray


def detached(c: ml_collections.ConfigDict) -> bool:
  """Whether the run's actors outlive its driver: on a cluster started apart from it
  (`ray.address`), each is one of Ray's detached actors, named, in the run's namespace
  (`namespace`), so that the same command run again finds them (driver.py). A Ray this
  process starts ends with it, and its actors with it."""
  return bool(c.ray.address)


def namespace(workdir: str | pathlib.Path) -> str:
  """The run's Ray namespace: one per workdir (a workdir holds one run)."""
  path = str(pathlib.Path(workdir).absolute())
  return "lowcomm_" + hashlib.sha1(path.encode()).hexdigest()[:16]


def connect(c: ml_collections.ConfigDict, workdir: str | pathlib.Path = "") -> bool:
  """Connects this process to Ray, in the namespace of the run in `workdir`: a running
  cluster at `ray.address`, or a new one inside this process. Returns whether this process
  started it (and so shuts it down)."""
  ray = import_ray()
  if ray.is_initialized():
    return False
  y = c.ray
  kwargs = dict(include_dashboard=False, configure_logging=False, log_to_driver=True,
                namespace=namespace(workdir) if workdir else "lowcomm_jax")
  if y.address:
    _answers(y.address)
    ray.init(address=y.address, **kwargs)
    logging.info("joined the Ray cluster at %s: %s", y.address, ray.cluster_resources())
    _enough_gpus(c, ray)
    _nodes_present(c, ray)
    return False
  if y.bind_address:
    kwargs["_node_ip_address"] = y.bind_address
  try:
    with warnings.catch_warnings():  # Ray spawns its services; this process runs no JAX there
      warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
      # address="local": a Ray of its own, even where another runs on this machine (without
      # it ray.init joins the newest one `ray start` made, and refuses num_cpus there).
      ray.init(address="local", num_cpus=y.num_cpus or os.cpu_count(),
               _system_config=SYSTEM_CONFIG, **kwargs)
  except Exception as e:  # Ray's own start: its services timed out, a port was taken, ...
    ray.shutdown()
    cause = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise RayUnavailable(
        f"ray: the local Ray did not start ({cause}); if another run is starting Ray on "
        "this machine, let it finish, or start Ray once with `RAY_worker_niceness=0 ray "
        "start --head` and pass --config.ray.address=auto") from None
  logging.info("started a local Ray: %s", ray.cluster_resources())
  try:
    _enough_gpus(c, ray)
    _nodes_present(c, ray)  # a local Ray has none of them
  except RayUnavailable:
    ray.shutdown()
    raise
  return True


def _answers(address: str, timeout_s: float = 10.0) -> None:
  """A cluster address ('host:port') must answer before Ray is asked to join it: Ray itself
  retries a dead address for minutes."""
  host, _, port = address.rpartition(":")
  if address in ("auto", "local") or "://" in address or not port.isdigit():
    return  # Ray resolves these itself
  try:
    socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
  except OSError as e:
    raise RayUnavailable(
        f"ray.address={address!r}: nothing answers there ({e.strerror or e}); start the head "
        "with `RAY_worker_niceness=0 ray start --head` and pass its host:port (6379 by "
        "default), or leave ray.address empty for a Ray inside this run") from None


def _enough_gpus(c: ml_collections.ConfigDict, ray) -> None:
  """Workers that each ask for GPUs Ray does not have would wait for them forever."""
  per_worker = c.ray.gpus_per_worker
  if not per_worker:
    return
  seen = ray.cluster_resources().get("GPU", 0)
  needed = per_worker * c.num_workers
  if seen < needed:
    raise RayUnavailable(
        f"ray.gpus_per_worker={per_worker:g}: {c.num_workers} workers need {needed:g} "
        f"GPUs and Ray sees {seen:g}; set --config.ray.gpus_per_worker=0 to run on CPUs, or "
        "join a cluster with GPUs (--config.ray.address)")


def warn_if_niced(what: str) -> None:
  """Says so when this actor's process runs below normal priority (a cluster started
  without RAY_worker_niceness=0)."""
  niceness = os.nice(0)
  if niceness > 0:
    logging.warning("ray: %s runs at niceness %d, so other work on this host starves it; "
                    "start Ray with RAY_worker_niceness=0 ray start ...", what, niceness)


def _nodes_present(c: ml_collections.ConfigDict, ray) -> None:
  """Refuses (one line) a `ray.worker_nodes` / `ray.server_node` resource no node offers:
  an actor asking for it would wait for it forever."""
  have = ray.cluster_resources()
  named = [("ray.worker_nodes", n) for n in c.ray.worker_nodes if n]
  named += [("ray.server_node", c.ray.server_node)] if c.ray.server_node else []
  for field, node in named:
    if node not in have:
      raise RayUnavailable(f"{field}: {node!r} is not a resource of this Ray cluster; start "
                           f"that node with ray start --resources='{{\"{node}\": 1}}'")


def actor_options(c: ml_collections.ConfigDict, *, worker: bool,
                  index: int | None = None) -> dict:
  """Scheduling and environment of a server or worker actor (`index`: which worker): the
  driver's JAX_*, LOWCOMM_* and TIKTOKEN_* variables (data, caches, the CPU platform of a
  test). Workers may hold a GPU (or a share: several JAX processes on one GPU must not
  preallocate its memory), or several (`mesh.data` × `model.tp.size` devices each). The
  driver's forced host device count is not theirs: a worker of several devices on CPUs
  gets its own count, everyone else runs on one device. `ray.worker_nodes` and
  `ray.server_node` pin actors to nodes by a custom resource (a sliver of it, so a node's
  standby server and a restarted worker still fit). On a cluster started apart from the
  driver the actors are detached and named (`detached`)."""
  env = {k: v for k, v in os.environ.items()
         if k.startswith(("JAX_", "LOWCOMM_", "TIKTOKEN_"))}
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  devices = c.mesh.data * c.model.tp.size
  if worker and devices > 1 and not c.ray.gpus_per_worker:
    flags.append(f"--xla_force_host_platform_device_count={devices}")
  env["XLA_FLAGS"] = " ".join(flags)
  options = {"num_cpus": 0, "max_restarts": 0, "runtime_env": {"env_vars": env}}
  if detached(c):  # found by a driver run again (names unique: a rejoin's is a new one)
    kind = "worker" if worker else "server"
    options.update(lifetime="detached", name=f"{kind}_{uuid.uuid4().hex[:12]}")
  if worker and c.ray.gpus_per_worker:
    options["num_gpus"] = c.ray.gpus_per_worker
    env.pop("JAX_PLATFORMS", None)  # the driver's (a CPU-only head's 'cpu') is not theirs
  if worker:
    nodes = list(c.ray.worker_nodes)
    node = nodes[index] if index is not None and index < len(nodes) else ""
  else:
    node = c.ray.server_node
  if node:
    options["resources"] = {node: 0.01}
  return options
