"""Overlap Local-SGD: a hand-computed trajectory through the real programs (persistent
workers, the pull-back, the anchor trailing the average), the simulator equals the runner,
exact resume with an average in flight, and its config limits."""

import jax
import numpy as np
import pytest

import toy_problem as toy
from conftest import (assert_simulation_resumes_exactly, checkpointed_state,
                      sim_and_runner_config, train_rounds)
from lowcomm_jax.config import check
from lowcomm_jax.runtimes.simulator import simulate
from lowcomm_jax.runtimes.spmd import train

ALPHA, MOMENTUM = 0.2, 0.5


def _by_hand(rounds):
  z, v = toy.THETA0.astype(np.float64), np.zeros(2)
  x = [z.copy(), z.copy()]  # the workers' own models, never reset
  average, anchors = None, []
  for _ in range(rounds):
    x = [toy.sgd_steps(x[w], toy.TARGETS[w]) for w in range(2)]
    x = [(1 - ALPHA) * xw + ALPHA * z for xw in x]  # pull back toward the anchor
    if average is not None:  # the average launched a period ago arrives
      v = MOMENTUM * v + (z - average)
      z = z - v
    average = np.mean(x, axis=0)  # launched now, of the pulled-back models
    anchors.append(z.copy())
  return np.asarray(anchors), x


def test_three_periods_follow_the_hand_computed_trajectory():
  got, workers = toy.run("overlap", 3, **{"overlap.alpha": ALPHA,
                                          "overlap.anchor_momentum": MOMENTUM})
  want, x = _by_hand(3)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(workers.params, np.asarray(x), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[0], toy.THETA0)  # nothing arrived at the first sync


def _config():
  """Four workers of very unequal speeds (conftest.sim_and_runner_config)."""
  return sim_and_runner_config("overlap", **{"overlap.anchor_momentum": MOMENTUM,
                                             "sim.heterogeneity": "very"})


def test_the_simulator_equals_the_runner(tmp_path):
  config = _config()
  summary = simulate.run(config, tmp_path / "whole")
  assert summary["total_inner_steps"] == 3 * 4 * 2
  _, state, _, _ = train_rounds(config, 3)
  np.testing.assert_array_equal(
      np.asarray(simulate.final_global_params(config, tmp_path / "whole")),
      np.asarray(state.params))
  # Stopped after round 1 with its average in flight, resumed: the same simulation.
  assert_simulation_resumes_exactly(config, tmp_path / "whole", summary, tmp_path / "split")


def test_resume_with_an_average_in_flight_is_exact(tmp_path):
  config = _config()
  _, state, workers, _ = train_rounds(config, 3)  # uninterrupted
  assert train.run(config, tmp_path / "resumed", stop_after_rounds=2) == {"stopped_at_round": 2}
  train.run(config, tmp_path / "resumed")
  resumed, _ = checkpointed_state(config, tmp_path / "resumed")
  # anchor, its state, workers' models
  jax.tree.map(np.testing.assert_array_equal, (state, workers), resumed)


@pytest.mark.parametrize("field,value", [("overlap.alpha", 0.0), ("overlap.alpha", 1.5),
                                         ("overlap.anchor_momentum", 1.0)])
def test_bad_overlap_configs_name_the_field(smoke_config, field, value):
  with pytest.raises(check.ConfigError, match=field):
    check.validate(smoke_config(algorithm="overlap", **{field: value}), num_devices=8,
                          num_processes=1, local_devices=8)
