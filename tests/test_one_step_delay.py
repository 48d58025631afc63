"""One-step-delay DiLoCo: the delayed rule by hand, a hand-computed trajectory through the
real programs, the runner against DiLoCo one round earlier, and the simulator (same
numbers as the runner; the transfer hidden behind the next round)."""

import jax.numpy as jnp
import numpy as np
import optax

import toy_problem as toy
from conftest import (assert_simulation_resumes_exactly, sim_and_runner_config,
                      train_rounds)
from lowcomm_jax import outer
from lowcomm_jax.runtimes.simulator import simulate

LR, BETA = toy.LR, toy.BETA


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


# --- the toy problem (tests/toy_problem.py), by hand ----------------------------------


def _by_hand(rounds):
  theta = toy.THETA0.astype(np.float64)
  previous, m, thetas = None, 0.0, []
  for _ in range(rounds):
    own = [toy.sgd_steps(theta, toy.TARGETS[w]) for w in range(2)]  # each from θ
    mean_delta = np.mean([theta - o for o in own], axis=0)
    if previous is not None:  # the previous round's average arrives and is applied
      m = BETA * m + previous
      theta = theta - LR * (BETA * m + previous)
    previous = mean_delta
    thetas.append(theta.copy())
  return np.asarray(thetas)


def test_three_rounds_follow_the_hand_computed_trajectory():
  (got, _), want = toy.run("one_step_delay", 3), _by_hand(3)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[0], toy.THETA0)  # round 1 applies nothing


def _config(algorithm):
  """The simulations' config (below), also the runner's (conftest.sim_and_runner_config):
  four equal workers on a link slow enough that one ring all-reduce of the model takes
  about a round's compute."""
  return sim_and_runner_config(algorithm, **{"sim.speeds": (1.0, 1.0, 1.0, 1.0),
                                             "sim.jitter": 0.0, "sim.step_seconds": 1.0,
                                             "sim.network.intra_gbps": 0.002})


def test_the_runner_after_two_rounds_is_diloco_after_one():
  r, osd, _, _ = train_rounds(_config("one_step_delay"), 2)
  _, diloco, _, _ = train_rounds(_config("diloco"), 1)
  # θ^2 = θ^1 + rule(Δ̄^1) with θ^1 = θ^0: DiLoCo's first outer step, bit for bit.
  np.testing.assert_array_equal(osd.params, diloco.params)
  assert r.algorithm.keeps_worker_params(r.config) is False  # θ_w ← θ every round


def _sim(algorithm, workdir):
  config = _config(algorithm)
  return config, simulate.run(config, workdir)


def test_the_simulator_equals_the_runner_and_hides_each_transfer_behind_the_next_round(
    tmp_path):
  config, summary = _sim("one_step_delay", tmp_path / "osd")
  _, diloco = _sim("diloco", tmp_path / "diloco")
  _, state, _, _ = train_rounds(config, 3)
  np.testing.assert_array_equal(np.asarray(simulate.final_global_params(config, tmp_path / "osd")),
                                np.asarray(state.params))
  # Stopped after round 1 with its transfer in flight, resumed: the same simulation.
  assert_simulation_resumes_exactly(config, tmp_path / "osd", summary, tmp_path / "split")
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
