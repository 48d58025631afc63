"""One-step-delay DiLoCo: the delayed rule by hand, a hand-computed trajectory through the
real programs, the runner against DiLoCo one round earlier, and the simulator (same
numbers as the runner; the transfer hidden behind the next round)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from conftest import load_config, train_rounds
from lowcomm_jax import algorithms, optimizers, outer, simulate, steps
from lowcomm_jax.parallel import mesh as mesh_lib
from lowcomm_jax.parallel.flat import ParamLayout

LR, BETA = 0.7, 0.9


def _nesterov_by_hand(grads):
  """optax.sgd(LR, momentum=BETA, nesterov=True) on a list of gradients: the updates."""
  m, out = 0.0, []
  for g in grads:
    m = BETA * m + g
    out.append(-LR * (BETA * m + g))
  return out


def test_the_rule_applies_each_aggregate_one_call_late_and_nothing_first():
  tx = outer.one_step_delay(outer.diloco_outer(LR, BETA))
  params = jnp.zeros(3)
  state = tx.init(params)
  aggregates = [jnp.array([1.0, -2.0, 0.5]), jnp.array([0.25, 1.0, -1.0]),
                jnp.array([3.0, 0.0, 2.0])]
  got = []
  for a in aggregates:
    u, state = tx.update(a, state, params)
    got.append(np.asarray(u))
  want = [np.zeros(3)] + _nesterov_by_hand([np.asarray(a) for a in aggregates[:2]])
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_array_equal(state.previous, aggregates[2])  # in flight at the end
  # Before anything arrived the wrapped rule's state did not move (Adam would count steps).
  adam = outer.one_step_delay(optax.adam(0.1))
  s = adam.init(params)
  _, s = adam.update(aggregates[0], s, params)
  assert int(s.rule[0].count) == 0 and bool(s.arrived)


# --- a toy problem, by hand ---------------------------------------------------------------
# One 2-vector; worker w's loss ½‖θ − t_w‖², so an SGD step at lr η is θ ← θ − η(θ − t_w).
TARGETS = np.array([[1.0, -1.0], [-3.0, 2.0]], np.float32)
THETA0 = {"w": np.array([0.5, 0.25], np.float32)}
ETA, H = 0.25, 3


def _toy_run(rounds):
  config = load_config("smoke", algorithm="one_step_delay", num_workers=2, inner_steps=H, **{
      "optimizer.name": "sgd", "optimizer.lr": ETA, "optimizer.warmup_steps": 0,
      "optimizer.min_lr_ratio": 1.0, "optimizer.grad_clip": 0.0,
      "outer.lr": LR, "outer.momentum": BETA})
  algorithm = algorithms.get("one_step_delay")
  layout = ParamLayout.of(THETA0)
  inner_tx = optimizers.inner_optimizer(config.optimizer, 1000)
  loss_fn = lambda params, target, key: 0.5 * jnp.sum((params["w"] - target) ** 2)
  aggregator = optimizers.aggregator(config, layout.fragment(0))
  rule = algorithm.outer_rule(config, inner_tx, layout.fragment(0))
  segment = algorithm.segments(config, H)[0]
  local = jax.jit(steps.make_local_segment(
      loss_fn, inner_tx=inner_tx, hidden=1, d_ff=1, layout=layout, segment=segment, index=0,
      count=1, alpha=0.0, local_steps=True, keeps_params=algorithm.keeps_worker_params(config)))
  sync = jax.jit(steps.make_sync(aggregator, rule, nested=False, weigh_tokens=False,
                                 layout=layout, fragment=0, count=1, last=True),
                 static_argnames="metrics")
  with jax.set_mesh(mesh_lib.make_mesh(1, 1, 1)):
    state = steps.init_state(layout.ravel(THETA0), seed=0, layout=layout,
                             aggregators=[aggregator], rules=[rule], num_workers=2)
    workers = steps.init_workers(state.params, workers=2, hidden=1, d_ff=1, layout=layout,
                                 inner_tx=inner_tx, local_steps=True, keeps_params=False)
    signals = steps.Signals(jnp.ones(2, jnp.int32), jnp.ones(2, jnp.float32),
                            jnp.zeros(2, jnp.float32))
    batches = jnp.broadcast_to(jnp.asarray(TARGETS)[:, None], (2, H, 2))
    thetas = []
    for _ in range(rounds):
      delta, workers, _ = local(state._replace(outer=()), workers, batches,
                                jnp.arange(2, dtype=jnp.int32))
      state, _ = sync(state, delta, signals, metrics=False)
      thetas.append(np.asarray(state.params))
  return np.asarray(thetas)


def _by_hand(rounds):
  theta = THETA0["w"].astype(np.float64)
  previous, m, thetas = None, 0.0, []
  for _ in range(rounds):
    own = [theta.copy() for _ in range(2)]  # every round starts from θ
    for _ in range(H):
      own = [o - ETA * (o - TARGETS[w]) for w, o in enumerate(own)]
    mean_delta = np.mean([theta - o for o in own], axis=0)
    if previous is not None:  # the previous round's average arrives and is applied
      m = BETA * m + previous
      theta = theta - LR * (BETA * m + previous)
    previous = mean_delta
    thetas.append(theta.copy())
  return np.asarray(thetas)


def test_three_rounds_follow_the_hand_computed_trajectory():
  got, want = _toy_run(3), _by_hand(3)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[0], THETA0["w"])  # round 1 applies nothing


def test_the_runner_after_two_rounds_is_diloco_after_one(smoke_config):
  common = {"num_workers": 2, "inner_steps": 3, "mesh.replica": 1}
  r, osd, _, _ = train_rounds(smoke_config(algorithm="one_step_delay", **common), 2)
  _, diloco, _, _ = train_rounds(smoke_config(**common), 1)
  # θ^2 = θ^1 + rule(Δ̄^1) with θ^1 = θ^0: DiLoCo's first outer step, bit for bit.
  np.testing.assert_array_equal(osd.params, diloco.params)
  assert r.algorithm.keeps_worker_params(r.config) is False  # θ_w ← θ every round


def _sim(algorithm, workdir, **overrides):
  config = load_config("smoke", algorithm=algorithm, rounds=3, inner_steps=2, num_workers=4,
                       **{"sim.enabled": True, "eval_every": 3, "checkpoint_every": 1,
                          "sim.speeds": (1.0, 1.0, 1.0, 1.0), "sim.jitter": 0.0,
                          "sim.step_seconds": 1.0, **overrides})
  return config, simulate.run(config, workdir)


def test_the_simulator_equals_the_runner_and_hides_each_transfer_behind_the_next_round(
    tmp_path):
  # A link slow enough that one ring all-reduce of the model takes about a round's compute.
  slow = {"sim.network.intra_gbps": 0.002}
  config, summary = _sim("one_step_delay", tmp_path / "osd", **slow)
  _, diloco = _sim("diloco", tmp_path / "diloco", **slow)
  runner = load_config("smoke", algorithm="one_step_delay", num_workers=4, rounds=3,
                       inner_steps=2, **{"mesh.replica": 1})
  _, state, _, _ = train_rounds(runner, 3)
  np.testing.assert_array_equal(np.asarray(simulate.final_global_params(config, tmp_path / "osd")),
                                np.asarray(state.params))
  # DiLoCo: every round is compute then its transfer, R·(c + T). One-step-delay: the
  # transfers run behind the next rounds' compute, so only what they exceed it by (and the
  # last one) shows: R·max(c, T) + min(c, T)... at most R·c + R·T, and here much less.
  c = 2 * 1.0  # 2 steps of 1 s per round
  transfer = diloco["virtual_seconds"] / 3 - c
  assert transfer > 0.5  # the link matters at all
  expected = 3 * max(c, transfer) + min(c, transfer)
  assert abs(summary["virtual_seconds"] - expected) < 1e-6 * expected, (summary, expected)
  assert summary["virtual_seconds"] < diloco["virtual_seconds"]
  assert summary["bytes_sent"] == diloco["bytes_sent"]
