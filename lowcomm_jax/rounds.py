"""Running a built run (build.py): its jitted programs, its initial state, and one
synchronous round, segment by segment (the algorithm's, algorithms/base.py): each host
this process owns runs its local program on this process's devices, then all processes run
the segment's sync (one fragment's outer step) together.
"""

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from lowcomm_jax import steps
from lowcomm_jax.build import Programs, Run
from lowcomm_jax.metrics import announce_compile
from lowcomm_jax.parallel import mesh as mesh_lib


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
  local = [[jax.jit(f, donate_argnums=(1,) if donate else (),
                    out_shardings=(per_worker, per_worker, per_worker)) for f in host]
           for host in r.programs.local]
  syncs = [jax.jit(f, out_shardings=(r.state_spec.shardings,
                                    mesh_lib.replicated(r.topology.mesh)),
                   static_argnames="metrics", donate_argnums=(0,) if donate else ())
           for f in r.programs.syncs]
  init = [jax.jit(f, out_shardings=per_worker) for f in r.programs.init_workers]
  return Programs(local, syncs, init, jax.jit(r.programs.eval))


def init_run(r: Run, fns: Programs) -> tuple[steps.TrainState, tuple]:
  """Round-0 global state and this process's fresh worker states."""
  logging.info("compiling the initial state…")
  with jax.set_mesh(r.topology.mesh):
    state = jax.jit(r.state_spec.init, out_shardings=r.state_spec.shardings)()
  view = mesh_lib.local_view(state.params, r.topology.local_mesh)
  with jax.set_mesh(r.topology.local_mesh):
    workers = tuple(init(view) for init in fns.init_workers)
  return state, workers


def train_round(r: Run, fns: Programs, state: steps.TrainState, workers: tuple,
                batches_per_host, inner_steps_per_host, *, timed: bool = False,
                metrics: bool = True):
  """One synchronous round: per segment, this process's hosts' local programs, then the
  segment's sync.

  Returns (state, workers, device metrics (empty without `metrics`), per-local-host compute
  seconds if `timed`). Timing blocks on each host's result: that is what measuring it means.
  """
  sharding = mesh_lib.round_batches(r.topology.local_mesh)
  segments = [r.segments(H) for H in inner_steps_per_host]  # per host (all hosts)
  count = len(segments[0])
  workers = list(workers)
  losses = [[] for _ in r.topology.local_hosts]
  compute = [0.0] * len(r.topology.local_hosts)
  round_metrics = {}
  for k_seg in range(count):
    view = mesh_lib.local_view(r.local_input(state), r.topology.local_mesh)
    if timed:  # the previous sync must not count as this segment's compute
      jax.block_until_ready(view)
    deltas = []
    with jax.set_mesh(r.topology.local_mesh):
      for k, i in enumerate(r.topology.local_hosts):
        seg = segments[i][k_seg]
        part = batches_per_host[k]
        if count > 1:
          part = part[:, seg.start:seg.start + seg.steps]
        batches = jax.device_put(part, sharding)
        ids = jax.device_put(np.asarray(r.topology.hosts[i].worker_ids, np.int32),
                             mesh_lib.per_worker(r.topology.local_mesh))
        announce_compile(fns.local[k][k_seg], f"the local program for host {i}")
        t0 = time.perf_counter()
        delta, workers[k], loss_GxS = fns.local[k][k_seg](view, workers[k], batches, ids)
        if timed:
          jax.block_until_ready(delta)
          compute[k] += time.perf_counter() - t0
        deltas.append(delta)
        losses[k].append(loss_GxS)
      cat = lambda *xs: jnp.concatenate(xs) if len(xs) > 1 else xs[0]
      deltas_local = cat(*deltas)
      last = k_seg == count - 1
      if last:  # the round's mean train loss per worker, over all its steps
        losses_local = cat(*[(jnp.concatenate(ls, axis=1) if len(ls) > 1 else ls[0]).mean(axis=1)
                             for ls in losses])
    deltas_R = mesh_lib.to_global(deltas_local, r.topology.mesh, r.config.num_workers)
    losses_R = (mesh_lib.to_global(losses_local, r.topology.mesh, r.config.num_workers) if last
                else None)
    signals = r.signals([seg[k_seg].steps for seg in segments], losses_R)
    announce_compile(fns.syncs[k_seg], "the outer step")
    with jax.set_mesh(r.topology.mesh):
      state, round_metrics = fns.syncs[k_seg](state, deltas_R, signals,
                                              metrics=metrics and last)
  return state, tuple(workers), round_metrics, compute
