"""How processes are joined and driven: `spmd` (lockstep, jax.distributed), `simulator`
(a virtual clock on one process) and `ray` (actors that may crash, leave and join).
No runtime imports another; what two share lives in assemble/ or programs/.

RUNTIMES is the one place a runtime's name is looked up (config field `runtime`): what
starts it, what it checks of a config, which config sections it reads, and how a finished
run's global θ is read back (export, reports). Adding a runtime is its folder here and one
entry below (ARCHITECTURE.md, "Adding a runtime").
"""

import dataclasses
from typing import Any, Callable

import ml_collections


class Unavailable(RuntimeError):
  """A runtime cannot start here (Ray not installed, its cluster not reachable): one line
  that names the cause and what to do."""


@dataclasses.dataclass(frozen=True)
class Runtime:
  """One runtime, as the rest of the code sees it.

  `load()` imports it (heavy modules and Ray only then) and gives its `run(config, workdir)
  -> summary` with the errors it ends a run with (printed as one line each); it raises
  Unavailable when the runtime cannot start here. `problems(c, num_processes, algorithm)`
  is its config check (plain Python, seconds; `algorithm` None for an unknown name).
  `sections`: the config sections it reads that not every runtime does (changed under a
  runtime that reads none of them: named as ignored). `one_device`: it builds each run on
  one device, a row per worker (plan.one_device), so the mesh's replica axis is not checked
  against the devices.
  `own_devices`: each worker's devices are its own process's (mesh.data × model.tp.size).
  `finished()`: a module with `run_of(config)` (the run as the one that saved it) and
  `global_params(ckpt, r, round)` (θ, flat); None where its runs keep no checkpoint of θ,
  with `no_checkpoint` saying why."""
  name: str
  summary: str
  load: Callable[[], tuple[Callable, tuple[type[Exception], ...]]]
  problems: Callable[[ml_collections.ConfigDict, int, Any], list[str]]
  sections: tuple[str, ...] = ()
  one_device: bool = False
  own_devices: bool = False
  finished: Callable[[], Any] | None = None
  no_checkpoint: str = ""


def _load_spmd():
  from lowcomm_jax.runtimes.spmd import train
  from lowcomm_jax.runtimes.spmd.collab import CollabTimeout
  return train.run, (CollabTimeout,)


def _spmd_problems(c, num_processes, algorithm) -> list[str]:
  from lowcomm_jax.runtimes.spmd import checks
  return checks.problems(c, num_processes, algorithm)


def _spmd_finished():
  from lowcomm_jax.runtimes.spmd import train
  return train


def _load_simulator():
  from lowcomm_jax.runtimes.simulator import simulate
  return simulate.run, ()


def _simulator_problems(c, num_processes, algorithm) -> list[str]:
  from lowcomm_jax.sim import checks
  return checks.problems(c, num_processes, algorithm)


def _load_ray():
  from lowcomm_jax.runtimes.ray import cluster
  try:
    from lowcomm_jax.runtimes.ray import driver
    cluster.import_ray()
  except cluster.RayUnavailable as e:
    raise Unavailable(str(e)) from e
  return driver.run, (cluster.RayUnavailable,)  # its cluster gone mid-run


def _ray_problems(c, num_processes, algorithm) -> list[str]:
  from lowcomm_jax.runtimes.ray import checks
  return checks.problems(c, num_processes, algorithm)


def _ray_finished():
  from lowcomm_jax.runtimes.ray import checkpoints
  return checkpoints


RUNTIMES: dict[str, Runtime] = {r.name: r for r in (
    Runtime("spmd", "lockstep processes joined by jax.distributed (or one machine's devices)",
            _load_spmd, _spmd_problems, finished=_spmd_finished),
    Runtime("simulator", "virtual workers on a virtual clock, vmapped on one device",
            _load_simulator, _simulator_problems, sections=("sim",), one_device=True,
            no_checkpoint="a simulator run: export reads the lockstep and Ray runtimes' "
            "checkpoints; train the config with --config.runtime=spmd"),
    Runtime("ray", "a process per worker and server (Ray actors) that may crash, leave and "
            "join", _load_ray, _ray_problems, sections=("ray", "sim.network"),
            one_device=True, own_devices=True, finished=_ray_finished),
)}
NAMES = tuple(RUNTIMES)


def get(name: str) -> Runtime:
  """The runtime called `name` (validated configs only: config/check.py names the choices)."""
  return RUNTIMES[name]
