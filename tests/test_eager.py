"""Eager updates: a hand-computed trajectory through the real programs (the proxy step, the
late true average), one worker is DiLoCo, the simulator equals the runner, exact resume,
and the configs it refuses."""

import jax
import numpy as np
import pytest

import toy_problem as toy
from conftest import (assert_simulator_equals_runner, checkpointed_state, sim_and_runner_config,
                      train_rounds)
from lowcomm_jax.config import check
from lowcomm_jax.runtimes.spmd import train
from lowcomm_jax.assemble.hosts import host

LR, BETA = toy.LR, toy.BETA


def _by_hand(rounds):
  theta, m = toy.THETA0.astype(np.float64), np.zeros(2)
  in_flight, applied = None, np.zeros(2)
  last, before = np.zeros((2, 2)), np.zeros((2, 2))
  thetas = []
  for _ in range(rounds):
    deltas = []
    for w in range(2):
      proxy = applied + (last[w] - before[w]) / 2
      m_tentative = BETA * m + proxy  # the outer state itself does not move
      x = theta - LR * (BETA * m_tentative + proxy)
      deltas.append(x - toy.sgd_steps(x, toy.TARGETS[w]))  # the worker's own drift
    before, last = last.copy(), np.asarray(deltas)
    if in_flight is not None:  # the previous round's true average arrives: the correction
      m = BETA * m + in_flight
      theta = theta - LR * (BETA * m + in_flight)
      applied = in_flight
    in_flight = np.mean(deltas, axis=0)
    thetas.append(theta.copy())
  return np.asarray(thetas), last, before


def test_three_rounds_follow_the_hand_computed_trajectory():
  got, workers = toy.run("eager", 3)
  want, last, before = _by_hand(3)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(workers.memory.last, last, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(workers.memory.before, before, rtol=1e-5, atol=1e-6)
  # The workers' proxies differ (each puts in its own fresh Δ), so their starts did.
  assert not np.allclose(last[0], last[1])


def test_one_worker_is_diloco(smoke_config):
  common = {"num_workers": 1, "inner_steps": 3, "rounds": 4, "mesh.replica": 1}
  _, eager, _, _ = train_rounds(smoke_config(algorithm="eager", **common), 4)
  _, diloco, _, _ = train_rounds(smoke_config(**common), 3)
  # With one worker the proxy is the true average (up to Δ̄ + (Δ − Δ̄) round-off), so each
  # round starts where DiLoCo's does; eager's committed θ trails by the round in flight.
  np.testing.assert_allclose(eager.params, diloco.params, rtol=0, atol=2e-5)


def _config():
  """Four workers of very unequal speeds (conftest.sim_and_runner_config)."""
  return sim_and_runner_config("eager", **{"sim.heterogeneity": "very"})


def test_the_simulator_equals_the_runner(tmp_path):
  # Also: stopped after round 1 with its average in flight, resumed, the same simulation.
  assert_simulator_equals_runner(_config(), tmp_path)


def test_resume_with_an_average_in_flight_is_exact(tmp_path):
  config = _config()
  _, state, workers, _ = train_rounds(config, 3)  # uninterrupted
  assert train.run(config, tmp_path / "resumed", stop_after_rounds=2) == {"stopped_at_round": 2}
  train.run(config, tmp_path / "resumed")
  resumed, _ = checkpointed_state(config, tmp_path / "resumed")
  # θ, outer state, worker memories
  jax.tree.map(np.testing.assert_array_equal, (state, workers), resumed)


@pytest.mark.parametrize("overrides,field", [
    ({"hosts": [host(1.0), host(0.5)], "num_workers": 2}, "algorithm"),
    ({"aggregate.weighting": "tokens"}, "aggregate.weighting")])
def test_unequal_workers_are_refused(smoke_config, overrides, field):
  with pytest.raises(check.ConfigError, match=field):
    check.validate(smoke_config(algorithm="eager", **overrides), num_devices=8,
                          num_processes=1, local_devices=8)
