"""A built run's programs jitted for its meshes (`jitted_steps`: output shardings, donation,
the frozen weights bound) and its initial state (`init_run`). Every runtime runs these: the
runner's rounds, the simulator's jobs and the Ray workers' jobs are the same executables.
"""

import logging

import jax

from lowcomm_jax.assemble.spec import Programs, Run
from lowcomm_jax.programs import steps
from lowcomm_jax.parallel import mesh as mesh_lib


class Bound:
  """A jitted program with its `frozen` argument bound (Run.frozen): called, or lowered, like
  the program without it. `func` is the jitted program (metrics.announce_compile)."""

  def __init__(self, func, frozen):
    self.func, self.frozen = func, frozen

  def __call__(self, *args, **kwargs):
    return self.func(*args, frozen=self.frozen, **kwargs)

  def lower(self, *args, **kwargs):
    return self.func.lower(*args, frozen=self.frozen, **kwargs)


def jitted_steps(r: Run, *, donate: bool | None = None) -> Programs:
  """The run's programs, jitted with their output shardings.

  A host's local program re-traces when its H changes (DyLU). Donation halves peak memory
  on accelerators; on CPU a host copy taken by an async checkpoint may alias device memory,
  so by default nothing is donated there. The simulator passes `donate=False`: it keeps
  the run's key, pulled snapshots and server states beside the arrays a program consumes.
  """
  if donate is None:
    donate = jax.default_backend() != "cpu"
  per_worker = mesh_lib.per_worker(r.topology.local_mesh)
  # The frozen weights (Run.frozen) are an argument of every program that runs the model,
  # bound here so no caller passes them: local programs read this process's view of them.
  local_frozen = mesh_lib.local_view(r.frozen, r.topology.local_mesh)
  local = [[Bound(jax.jit(f, donate_argnums=(1,) if donate else (),
                          out_shardings=(per_worker, per_worker, per_worker)), local_frozen)
            for f in host]
           for host in r.programs.local]
  syncs = [jax.jit(f, out_shardings=(r.state_spec.shardings,
                                    mesh_lib.replicated(r.topology.mesh)),
                   static_argnames="metrics", donate_argnums=(0,) if donate else ())
           for f in r.programs.syncs]
  init = [jax.jit(f, out_shardings=per_worker) for f in r.programs.init_workers]
  accumulate = [Bound(jax.jit(f, donate_argnums=(1,) if donate else (),
                             out_shardings=(per_worker, per_worker)), local_frozen)
                for f in r.programs.accumulate]
  state_sync = (jax.jit(r.programs.state_sync, static_argnames="parts",
                        out_shardings=mesh_lib.per_worker(r.topology.mesh),
                        donate_argnums=(0,) if donate else ())
                if r.programs.state_sync is not None else None)
  halves = [[None if pair is None else tuple(
                Bound(jax.jit(f, out_shardings=(per_worker, per_worker, per_worker)),
                      local_frozen) for f in pair) for pair in host]
            for host in r.programs.local_halves]
  return Programs(local, syncs, init, Bound(jax.jit(r.programs.eval), r.frozen), accumulate,
                  state_sync=state_sync, local_halves=halves)


def init_run(r: Run, fns: Programs) -> tuple[steps.TrainState, tuple]:
  """Round-0 global state and this process's fresh worker states."""
  logging.info("compiling the initial state…")
  with jax.set_mesh(r.topology.mesh):
    state = jax.jit(r.state_spec.init, out_shardings=r.state_spec.shardings)(
        r.state_spec.initial_params())
  view = mesh_lib.local_view(state.params, r.topology.local_mesh)
  with jax.set_mesh(r.topology.local_mesh):
    workers = tuple(init(view) for init in fns.init_workers)
  return state, workers
