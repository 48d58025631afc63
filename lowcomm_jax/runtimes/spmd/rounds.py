"""Running a built run (assemble/build.py, jitted by assemble/jitted.py): one
synchronous round, segment by segment (the algorithm's, algorithms/base.py): each host
this process owns runs its local program on this process's devices, then all processes run
the segment's sync (one fragment's outer step) together.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from lowcomm_jax.programs import steps
from lowcomm_jax.assemble.spec import Programs, Run
from lowcomm_jax.assemble.jitted import Bound
from lowcomm_jax.run.metrics import announce_compile
from lowcomm_jax.parallel import mesh as mesh_lib


@dataclasses.dataclass
class HeldSync:
  """A round's sync held back to run inside the next round's program (`overlapped_round`):
  its inputs, and whether it reports metrics."""
  deltas_R: object
  signals: steps.Signals
  metrics: bool


def train_round(r: Run, fns: Programs, state: steps.TrainState, workers: tuple,
                batches_per_host, inner_steps_per_host, *, timed: bool = False,
                metrics: bool = True, completed_rounds: int | None = None):
  """One synchronous round: per segment, this process's hosts' local programs, then the
  segment's sync. `completed_rounds` (the rounds before this one; read from the state if
  not given, which waits for it) says which worker-state averages are due first (DES-LOC).

  Returns (state, workers, device metrics (empty without `metrics`), per-local-host compute
  seconds if `timed`). Timing blocks on each host's result: that is what measuring it means.
  """
  if fns.state_sync is not None:  # DES-LOC: the moments averaged first (it never holds)
    done = int(state.round) if completed_rounds is None else completed_rounds
    workers = average_worker_state(r, fns, workers, r.state_sync_due(done))
    if timed:  # the average is not the round's compute
      jax.block_until_ready(workers)
  state, workers, round_metrics, compute, _ = _round(
      r, fns, state, workers, batches_per_host, inner_steps_per_host, timed=timed,
      metrics=metrics, hold=False)
  return state, workers, round_metrics, compute


def held_round(r: Run, fns: Programs, state: steps.TrainState, workers: tuple,
               batches_per_host, inner_steps_per_host, *, timed: bool = False,
               metrics: bool = True):
  """A one-segment round's local programs, its sync held back: (workers, compute seconds,
  the `HeldSync`), for the next round's program (`overlapped_round`) or `run_held`."""
  _, workers, _, compute, held = _round(
      r, fns, state, workers, batches_per_host, inner_steps_per_host, timed=timed,
      metrics=metrics, hold=True)
  return workers, compute, held


def _round(r: Run, fns: Programs, state, workers, batches_per_host, inner_steps_per_host, *,
           timed: bool, metrics: bool, hold: bool):
  sharding = mesh_lib.round_batches(r.topology.local_mesh)
  segments = [r.segments(H) for H in inner_steps_per_host]  # per host (all hosts)
  count = len(segments[0])
  assert not hold or count == 1, "only a one-segment round's sync can be held"
  workers = list(workers)
  losses = [[] for _ in r.topology.local_hosts]
  compute = [0.0] * len(r.topology.local_hosts)
  round_metrics = {}
  for k_seg in range(count):
    view = r.local_view(state)
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
        announce_compile(fns.local[k][k_seg], f"the local program for host {i}")
        t0 = time.perf_counter()
        delta, workers[k], loss_GxS = fns.local[k][k_seg](r.host_view(view, k), workers[k],
                                                          batches, worker_ids(r, i))
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
    if hold:
      return state, tuple(workers), {}, compute, HeldSync(deltas_R, signals, metrics)
    announce_compile(fns.syncs[k_seg], "the outer step")
    with jax.set_mesh(r.topology.mesh):
      state, round_metrics = fns.syncs[k_seg](state, deltas_R, signals,
                                              metrics=metrics and last)
  return state, tuple(workers), round_metrics, compute, None


def run_held(r: Run, fns: Programs, state: steps.TrainState, held: HeldSync):
  """The held sync on its own (before a round that cannot take it): (state, its metrics)."""
  with jax.set_mesh(r.topology.mesh):
    return fns.syncs[0](state, held.deltas_R, held.signals, metrics=held.metrics)


def average_worker_state(r: Run, fns: Programs, workers: tuple, parts: tuple[str, ...]) -> tuple:
  """This process's worker states with `parts` of their inner-optimizer states averaged over
  every worker of the run (all processes join: DES-LOC's moments, before a round)."""
  if not parts:
    return workers
  opt_states = [w.opt_state for w in workers]
  sizes = [jax.tree.leaves(o)[0].shape[0] for o in opt_states]
  local = (opt_states[0] if len(opt_states) == 1 else
           jax.tree.map(lambda *xs: jnp.concatenate(xs), *opt_states))
  announce_compile(fns.state_sync, "the workers' state average")
  with jax.set_mesh(r.topology.mesh):
    averaged = fns.state_sync(mesh_lib.to_global(local, r.topology.mesh, r.config.num_workers),
                              parts=parts)
  averaged = mesh_lib.to_local(averaged, r.topology.local_mesh)
  out, start = [], 0
  for w, n in zip(workers, sizes):
    out.append(w._replace(opt_state=jax.tree.map(lambda x, a=start, b=start + n: x[a:b], averaged)
                          if len(workers) > 1 else averaged))
    start += n
  return tuple(out)


def worker_ids(r: Run, host: int) -> jax.Array:
  """Host `host`'s worker ids, placed per worker on its local mesh (keys fold them in)."""
  return jax.device_put(np.asarray(r.topology.hosts[host].worker_ids, np.int32),
                        mesh_lib.per_worker(r.topology.local_mesh))


# Overlap: a held sync and the next round's local steps in one program ------------------------

def can_overlap(r: Run, inner_steps_per_host) -> str | None:
  """Why the held sync of an algorithm with a delayed sync cannot run inside the next round's
  program with these H per host, or None when it can.

  One program over every device needs every process to run the same program: one host per
  process, all of the same tier, batch and H, one segment, no tensor parallelism. Otherwise
  the sync and the local programs stay separate programs (the same arithmetic, in sequence).
  """
  hosts = r.topology.hosts
  if not r.algorithm.delayed_sync:
    return f"{r.config.algorithm}'s local steps wait for the sync's aggregate"
  if len(r.topology.local_hosts) != 1 or len(hosts) != jax.process_count():
    return "a process runs several hosts"
  if len({(h.hidden, h.batch_size) for h in hosts}) > 1 or len(set(inner_steps_per_host)) > 1:
    return "the hosts differ in tier, batch or H"
  if len(r.segments(inner_steps_per_host[0])) != 1:
    return "a round has several segments"
  if r.config.model.tp.size > 1:
    return "tensor parallelism"
  return None


def jitted_overlapped(r: Run, *, donate: bool | None = None):
  """`overlapped(state, held Δ_R, held signals, workers_R, batches_R, ids_R, metrics=)` ->
  (state, the held sync's metrics, Δ_R, workers_R, mean train loss_R): the previous round's sync and
  this round's local steps in one program over the global mesh.

  With a delayed sync the new θ does not depend on the aggregate (algorithms.base), so the
  local steps read nothing the sync's collective produces and XLA is free to run that
  collective while they compute (tests/test_overlap_program.py checks the compiled HLO).
  """
  if donate is None:
    donate = jax.default_backend() != "cpu"
  per_worker = mesh_lib.per_worker(r.topology.mesh)
  return Bound(
      jax.jit(r.programs.overlapped, static_argnames="metrics",
              donate_argnums=(0, 1, 3) if donate else (),
              out_shardings=(r.state_spec.shardings, mesh_lib.replicated(r.topology.mesh),
                             per_worker, per_worker, per_worker)),
      r.frozen)


def overlapped_round(r: Run, fns: Programs, overlapped, state: steps.TrainState, workers: tuple,
                     held: HeldSync, batches, inner_steps: int, *, timed: bool = False,
                     metrics: bool = True, hold: bool = False):
  """A round whose local steps run in one program with the previous round's held sync
  (`can_overlap` holds). Returns (state, workers, the held sync's metrics, this round's
  metrics, compute seconds, this round's held sync or None)."""
  topo = r.topology
  R = r.config.num_workers
  host = topo.local_hosts[0]
  batches = jax.device_put(batches, mesh_lib.round_batches(topo.local_mesh))
  batches_R = mesh_lib.to_global(batches, topo.mesh, R, mesh_lib.round_batches(topo.mesh).spec)
  workers_R = mesh_lib.to_global(workers[0], topo.mesh, R)
  ids_R = mesh_lib.to_global(worker_ids(r, host), topo.mesh, R)
  announce_compile(overlapped, "the overlapped round (held sync + local steps)")
  t0 = time.perf_counter()
  with jax.set_mesh(topo.mesh):
    state, held_metrics, deltas_R, workers_R, losses_R = overlapped(
        state, held.deltas_R, held.signals, workers_R, batches_R, ids_R,
        metrics=True)  # always: one program to compile, whether or not the held round logs
  compute = [0.0]  # timed: the local steps *and* the held sync that ran beside them
  if timed:
    jax.block_until_ready(deltas_R)
    compute[0] = time.perf_counter() - t0
  workers = (mesh_lib.to_local(workers_R, topo.local_mesh),)
  signals = r.signals([inner_steps] * len(topo.hosts), losses_R)
  if hold:
    return state, workers, held_metrics, {}, compute, HeldSync(deltas_R, signals, metrics)
  with jax.set_mesh(topo.mesh):
    state, round_metrics = fns.syncs[0](state, deltas_R, signals, metrics=metrics)
  return state, workers, held_metrics, round_metrics, compute, None
