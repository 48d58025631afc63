"""The simulator's asynchronous and HALoS servers (runtimes/simulator/backend.SimBackend) against numbers
computed by hand: stale pulls, per-arrival outer rules, LPS pushes, GPS merges.

The backend is driven directly (no schedule, no model): a stand-in local round takes one
step θ ← θ − ½(θ − t_w) toward worker w's target t_w, so a job's Δ = ½(θ_pulled − t_w)
shows which parameters it pulled.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np

from conftest import load_config
from lowcomm_jax import algorithms
from lowcomm_jax.programs import steps
from lowcomm_jax.parallel import mesh as mesh_lib
from lowcomm_jax.parallel.server_names import GLOBAL
from lowcomm_jax.sim import Job, Network, Plan, SpeedModel
from lowcomm_jax.runtimes.simulator.backend import SimBackend

THETA0 = np.array([1.0, -2.0, 0.5], np.float32)
TARGETS = np.array([[0.0, 0.0, 0.0], [2.0, 1.0, -1.0], [4.0, -4.0, 3.0]], np.float32)


def _local_round(state, workers, batches_GxHxN, ids, steps_G=None):
  """Δ_w = ½(θ − t_w) with t_w = the worker's 'batch'; `steps` counts jobs (`steps_G`, the
  steps each job takes of the padded batches, is read by the real program only)."""
  delta = 0.5 * (state.params[None] - batches_GxHxN[:, 0])
  return delta, workers._replace(steps=workers.steps + 1), jnp.zeros(batches_GxHxN.shape[:2])


def _backend(algorithm, workers=2, regions=(0, 0), **overrides):
  config = load_config("smoke", algorithm=algorithm, num_workers=workers,
                       **{"runtime": "simulator", **overrides})
  plan = Plan(inner_steps=[1] * workers, rounds=1, total_steps=99,
              speeds=SpeedModel.build(num_workers=workers, level="none", explicit=(),
                                      step_seconds=1.0, jitter=0.0, straggler_prob=0.0,
                                      straggler_slowdown=1.0, seed=0),
              network=Network.build(num_workers=workers, regions=max(regions) + 1,
                                    worker_regions=regions, intra_gbps=1.0,
                                    intra_latency_s=0.0, inter_gbps=1.0, inter_latency_s=0.0),
              delta_bytes=12, param_bytes=12, gathers=False)
  # The simulator's layout: its virtual workers vmapped on one device.
  topology = types.SimpleNamespace(local_mesh=mesh_lib.make_mesh(1))
  algo = algorithms.get(algorithm)
  run = types.SimpleNamespace(config=config, algorithm=algo,
                              local_input=lambda state: state._replace(outer=()),
                              topology=topology, sync=algo.sync(config, hosts=(), d_ff=1))
  state = steps.TrainState(jnp.zeros((), jnp.int32), jax.random.key_data(jax.random.key(0)),
                           jnp.asarray(THETA0), ())
  programs = types.SimpleNamespace(local=[[_local_round]], syncs=[None], state_sync=None)
  # No schedule in the opt state: the backend's lr-clock placement leaves it as it is.
  pool = steps.WorkerState((), (), jnp.zeros((workers,), jnp.int32))
  return SimBackend(run, programs, plan, state, pool)


class _Driver:
  """Starts jobs and flushes them as the schedule would."""

  def __init__(self, backend):
    self.b, self.next_id = backend, 0

  def start(self, worker, server):
    self.next_id += 1
    job = Job(self.next_id, worker, server, self.b.version(server), 1, 0.0, 1.0)
    self.b.start_job(job)
    return job

  def flush(self):
    self.b.flush(lambda ids, steps_: jnp.asarray(TARGETS[ids][:, None]))


def _nesterov(lr, beta):
  """optax.sgd(nesterov=True) by hand: m ← g + βm; θ ← θ − lr(g + βm)."""
  m = np.zeros_like(THETA0)

  def step(theta, g):
    nonlocal m
    m = g + beta * m
    return theta - lr * (g + beta * m)
  return step


def _delayed_nesterov(lr, beta, n):
  """Delayed Nesterov with c = 0 by hand: momentum refreshed every n-th arrival."""
  m, buf, count = np.zeros_like(THETA0), np.zeros_like(THETA0), 0

  def step(theta, g):
    nonlocal m, buf, count
    count, buf = count + 1, buf + g
    if count % n == 0:
      m, buf = beta * m + buf / n, np.zeros_like(buf)
      return theta - lr * (beta * m + g / n)
    return theta - lr * g / n
  return step


def test_async_server_applies_stale_deltas_with_nesterov_at_lr_over_w():
  b = _backend("async", **{"outer.lr": 0.8, "outer.momentum": 0.9})
  d = _Driver(b)
  a, c = d.start(0, GLOBAL), d.start(1, GLOBAL)  # both pull θ0
  d.flush()
  drift_a, _ = b.apply_job(a)
  e = d.start(0, GLOBAL)  # worker 0 pulls θ1 while worker 1's job (from θ0) is out
  drift_c, _ = b.apply_job(c)  # at the same instant, before the flush computes e
  d.flush()
  drift_e, _ = b.apply_job(e)
  rule = _nesterov(0.8 / 2, 0.9)
  theta1 = rule(THETA0, 0.5 * (THETA0 - TARGETS[0]))
  theta2 = rule(theta1, 0.5 * (THETA0 - TARGETS[1]))  # stale: computed from θ0
  theta3 = rule(theta2, 0.5 * (theta1 - TARGETS[0]))  # pulled θ1, applied to θ2
  np.testing.assert_allclose(b.global_params(), theta3, rtol=1e-6)
  assert b.version(GLOBAL) == 3 and int(b.workers.steps[0]) == 2 and int(b.workers.steps[1]) == 1
  # Drift: how far the server moved while the job was out, relative to where it is.
  assert float(drift_a) == 0.0
  np.testing.assert_allclose(float(drift_c),
                             np.linalg.norm(theta1 - THETA0) / np.linalg.norm(theta1), rtol=1e-5)
  np.testing.assert_allclose(float(drift_e),
                             np.linalg.norm(theta2 - theta1) / np.linalg.norm(theta2), rtol=1e-5)
  assert not b.snapshots and not b.messages  # released once every job that pulled is in


def test_async_dn_server_refreshes_momentum_every_w_arrivals():
  b = _backend("async_dn", workers=3, regions=(0, 0, 0),
               **{"outer.lr": 0.6, "outer.momentum": 0.5})
  d = _Driver(b)
  jobs = [d.start(w, GLOBAL) for w in range(3)]
  d.flush()
  for job in jobs:
    b.apply_job(job)
  again = d.start(2, GLOBAL)
  d.flush()
  b.apply_job(again)
  rule = _delayed_nesterov(0.6, 0.5, 3)
  theta = THETA0
  for w in range(3):
    theta = rule(theta, 0.5 * (THETA0 - TARGETS[w]))
  pulled = theta
  theta = rule(theta, 0.5 * (pulled - TARGETS[2]))
  np.testing.assert_allclose(b.global_params(), theta, rtol=1e-6)


def test_halos_lps_push_gps_step_and_merge_by_hand():
  b = _backend("halos", **{"outer.lr": 0.8, "outer.momentum": 0.9,
                           "outer.halos.global_lr": 0.3, "outer.halos.global_momentum": 0.5,
                           "outer.halos.global_buffer": 2})
  d = _Driver(b)
  lps, alpha = "region0", 0.25
  a, c = d.start(0, lps), d.start(1, lps)
  d.flush()
  b.apply_job(a)
  b.apply_job(c)
  b.push_update(lps, 100)  # sends θ_ref − θ_LPS = θ0 − θ2
  e = d.start(0, lps)  # a job pulled and applied while the push is in flight
  d.flush()
  b.apply_job(e)
  b.apply_push(GLOBAL, 100)
  b.send_params(GLOBAL, 101)
  b.merge(lps, 101, alpha)
  # By hand. LPS: Delayed Nesterov with N = 2 (its two workers).
  local = _delayed_nesterov(0.8, 0.9, 2)
  theta1 = local(THETA0, 0.5 * (THETA0 - TARGETS[0]))
  theta2 = local(theta1, 0.5 * (THETA0 - TARGETS[1]))
  theta3 = local(theta2, 0.5 * (theta2 - TARGETS[0]))
  # GPS: its own Delayed Nesterov (N = 2: this first push only moves θ by lr·g/N).
  big_theta1 = _delayed_nesterov(0.3, 0.5, 2)(THETA0, THETA0 - theta2)
  np.testing.assert_allclose(b.global_params(), big_theta1, rtol=1e-6)
  # Merge: θ ← (1 − α)θ_LPS + αΘ; the update applied during the push (θ2 → θ3) is kept
  # with weight 1 − α in the reference, so the next push carries it.
  merged = (1 - alpha) * theta3 + alpha * big_theta1
  server = b.servers[lps]
  np.testing.assert_allclose(server["params"], merged, rtol=1e-6)
  np.testing.assert_allclose(server["reference"], merged + (1 - alpha) * (theta2 - theta3),
                             rtol=1e-6, atol=1e-7)
  b.push_update(lps, 102)
  np.testing.assert_allclose(b.messages[102]["delta"], (1 - alpha) * (theta2 - theta3),
                             rtol=1e-5, atol=1e-7)
  # Merges change the model (revision) but are not updates (version: staleness).
  assert b.version(lps) == 3 and b.revisions[lps] == 4 and b.version(GLOBAL) == 1
