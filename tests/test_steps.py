"""The runner's round step: DDP/DiLoCo equivalence, and devices vs vmap give the same run."""

import re

import jax
import numpy as np

from conftest import train_rounds
from lowcomm_jax.runtimes.spmd import train
from lowcomm_jax.run.checkpoint import abstract_with_shardings
from lowcomm_jax.parallel import ledger, mesh as mesh_lib


def _embedding(layout):
  """flat θ -> its token embedding, as one program (op by op, every leaf's slice would
  compile on its own)."""
  return jax.jit(lambda flat: layout.unravel(flat)["wte"]["embedding"])


def test_diloco_h1_sgd_outer_lr1_equals_ddp_with_sgd(smoke_config):
  common = {"inner_steps": 1, "optimizer.name": "sgd", "optimizer.lr": 0.5,
            "optimizer.grad_clip": 0.0, "num_workers": 4}
  diloco = smoke_config(algorithm="diloco", **{"outer.lr": 1.0, "outer.momentum": 0.0}, **common)
  ddp = smoke_config(algorithm="ddp", **common)
  _, s_diloco, _, m_diloco = train_rounds(diloco, 4)
  r_ddp, s_ddp, _, m_ddp = train_rounds(ddp, 4)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5),
               s_diloco.params, s_ddp.params)
  np.testing.assert_allclose(m_diloco["train_loss_per_worker"], m_ddp["train_loss_per_worker"],
                             rtol=1e-5)
  # ...and training moved the parameters (the equivalence is not between two no-ops).
  init = jax.jit(r_ddp.state_spec.init)(r_ddp.state_spec.initial_params())
  embedding = _embedding(r_ddp.model.layout)
  assert not np.allclose(embedding(init.params), embedding(s_ddp.params))


def _four_on_four(smoke_config, **overrides):
  """Four workers on four replica devices: the run test_workers_split..., the HLO test's
  DiLoCo case, the NaN test and the runner-state test share (built once in this process)."""
  return smoke_config(num_workers=4, **{"mesh.replica": 4}, **overrides)


def test_workers_split_over_devices_match_workers_vmapped_on_one(smoke_config):
  assert jax.device_count() >= 4
  config = lambda replica: (_four_on_four(smoke_config) if replica == 4 else
                            smoke_config(num_workers=4, **{"mesh.replica": replica}))
  r4, s4, w4, m4 = train_rounds(config(4), 2)
  r1, s1, _, m1 = train_rounds(config(1), 2)
  assert dict(r4.topology.mesh.shape)["replica"] == 4
  assert dict(r1.topology.mesh.shape)["replica"] == 1
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4),
               s4.params, s1.params)
  np.testing.assert_allclose(m4["train_loss_per_worker"], m1["train_loss_per_worker"], rtol=1e-5)
  # 'different' batches: every worker saw its own data.
  assert len(set(np.round(np.asarray(m4["train_loss_per_worker"]), 6))) == 4
  # Worker optimizer states live on their own devices, split over 'replica'.
  for leaf in jax.tree.leaves(w4):
    assert leaf.shape[0] == 4 and len(leaf.sharding.device_set) == 4
    assert leaf.sharding.spec[0] == "replica"


def _all_reduced_elements(hlo: str) -> int:
  """Elements moved by all-reduce ops in compiled HLO (XLA combines many into one tuple op)."""
  total = 0
  for line in hlo.splitlines():
    if " all-reduce(" in line or " all-reduce-start(" in line:
      result_types = line.split("=", 1)[1].split("all-reduce", 1)[0]
      for dims in re.findall(r"f32\[([\d,]*)\]", result_types):
        total += int(np.prod([int(d) for d in dims.split(",") if d]))
  return total


def test_inner_steps_communicate_nothing_and_the_outer_step_moves_the_params_once(
    smoke_config):
  # DiLoCo at the smoke config's H = 2 (> 1 step: the run the tests above built); DDP at 1.
  for algorithm, h in (("diloco", 2), ("ddp", 1)):
    config = _four_on_four(smoke_config, algorithm=algorithm, inner_steps=h)
    r = train.build(config)
    nbytes = r.model.param_bytes
    assert r.outer_bytes() == ledger.CommBytes(sent=nbytes, received=nbytes)
    fns = train.jitted_steps(r)
    local_fns, finish_fn = fns.local, fns.syncs[0]
    batches = jax.ShapeDtypeStruct((4, h, config.data.batch_size, config.data.seq_len + 1),
                                   np.int32, sharding=mesh_lib.round_batches(r.topology.mesh))
    opt = r.abstract_workers()[0]
    ids = jax.ShapeDtypeStruct((4,), np.int32, sharding=mesh_lib.per_worker(r.topology.mesh))
    deltas, signals = r.abstract_sync_inputs(0)
    # The global state as the runner passes it (placed: its shardings), and of it what a
    # local program reads: the programs the runner compiled (for DiLoCo, by the tests above).
    state = abstract_with_shardings(r.state_spec.abstract, r.state_spec.shardings)
    with jax.set_mesh(r.topology.mesh):
      local_hlo = local_fns[0][0].lower(r.local_input(state), opt, batches,
                                        ids).compile().as_text()
      outer_hlo = finish_fn.lower(state, deltas, signals).compile().as_text()
      quiet_hlo = finish_fn.lower(state, deltas, signals, metrics=False).compile().as_text()
    assert _all_reduced_elements(local_hlo) == 0  # H inner steps: no communication
    # The outer mean moves every parameter once (plus a few scalars for the metrics).
    moved = _all_reduced_elements(outer_hlo)
    count = r.model.param_count
    assert count <= moved <= count + 16, (algorithm, moved, count)
    # ...in one collective: the workers' losses ride in that all-reduce, not an all-gather.
    assert " all-gather" not in outer_hlo
    assert outer_hlo.count(" all-reduce(") + outer_hlo.count(" all-reduce-start(") == 1
    # A round without metrics moves exactly the flat pseudo-gradient, nothing else.
    assert _all_reduced_elements(quiet_hlo) == r.model.param_count
    assert " all-gather" not in quiet_hlo


def test_a_workers_nan_loss_is_reported_as_its_own(smoke_config):
  r = train.build(_four_on_four(smoke_config))
  fns = train.jitted_steps(r)
  state, _ = train.init_run(r, fns)
  deltas, signals = r.abstract_sync_inputs(0)
  deltas = jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), a.sharding), deltas)
  losses = jax.device_put(np.array([1.0, np.nan, 2.0, 3.0], np.float32), signals.loss.sharding)
  with jax.set_mesh(r.topology.mesh):
    _, metrics = fns.syncs[0](state, deltas, r.signals([1], losses))
  np.testing.assert_array_equal(metrics["train_loss_per_worker"], [1.0, np.nan, 2.0, 3.0])
  assert np.isnan(metrics["train_loss"])


def test_runner_keeps_inner_adam_state_and_outer_momentum_across_rounds(smoke_config):
  # The four-worker run above (AdamW inner, H = 2; outer Nesterov, lr 0.7, momentum 0.9).
  config = _four_on_four(smoke_config)
  h, lr, m = config.inner_steps, config.outer.lr, config.outer.momentum
  assert h > 1 and config.optimizer.name == "adamw" and config.outer.nesterov
  assert lr != 1.0 and m > 0
  r = train.build(config)
  fns = train.jitted_steps(r)
  view = _embedding(r.model.layout)  # θ and the outer momentum are flat
  # Read each round's θ and trace before the next round: its sync consumes the state it is
  # given where it donates (off the CPU).
  seen = lambda s: (np.asarray(view(s.outer.per_fragment[0][0].trace)), np.asarray(view(s.params)))
  state, workers = train.init_run(r, fns)
  history = [seen(state)]
  for _ in range(3):
    state, workers, _, _ = train.train_round(r, fns, state, workers,
                                             [r.data.streams[0].next_round(h)], [h])
    history.append(seen(state))
  # Every worker's AdamW has taken rounds * H steps: its state was never reset.
  counts = [x for x in jax.tree.leaves(workers) if x.dtype == np.int32]
  assert counts and all(np.all(c == 3 * h) for c in counts)
  # Nesterov: θ_r+1 - θ_r = -lr (Δ̄_r + m·trace_r) with trace_r = Δ̄_r + m·trace_r-1.
  # Recover Δ̄_r from the parameters and check the carried trace against it.
  traces, thetas = zip(*history)
  for t in (1, 2, 3):
    delta = -(thetas[t] - thetas[t - 1]) / lr - m * traces[t]
    np.testing.assert_allclose(traces[t], delta + m * traces[t - 1], atol=2e-5)
  assert not np.allclose(traces[3], 0.0)
