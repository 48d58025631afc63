"""DES-LOC (algorithms/desloc.py): Local AdamW with the parameters and each Adam moment
averaged over the workers on periods of their own."""

import json

import jax
import numpy as np
import optax
import pytest

import toy_problem as toy
from conftest import (assert_simulator_equals_runner, checkpointed_state, sim_and_runner_config,
                      train_rounds)
from lowcomm_jax.config import check
from lowcomm_jax.runtimes.simulator import simulate
from lowcomm_jax.runtimes.spmd import train
from lowcomm_jax.algorithms.desloc import MomentSync
from lowcomm_jax.assemble.hosts import host
from lowcomm_jax.sim import collectives as sim_collectives

ADAM = {"optimizer.name": "adamw", "optimizer.lr": 0.1, "optimizer.b1": 0.9,
        "optimizer.b2": 0.95, "optimizer.weight_decay": 0.0}
NESTEROV = {"desloc.plain_average": False}  # the outer rule outer.lr / outer.momentum


def test_which_moments_are_due():
  sync = MomentSync(first_moment_rounds=3, second_moment_rounds=6)
  assert [sync.due(k) for k in range(8)] == [
      (), (), (), ("first_moment",), (), (), ("first_moment", "second_moment"), ()]
  assert MomentSync(0, 2).due(4) == ("second_moment",)


def _is_adam(x):
  return isinstance(x, optax.ScaleByAdamState)


def _by_hand(rounds: int, first: int, second: int):
  """θ after every round in float64: each worker's H AdamW steps from θ on its own moments
  (averaged over the workers before the rounds they are due), θ ← mean θ_w."""
  lr, b1, b2, eps = 0.1, 0.9, 0.95, 1e-8
  theta = toy.THETA0.astype(np.float64)
  mu, nu, count, out = np.zeros((2, 2)), np.zeros((2, 2)), 0, []
  for r in range(rounds):
    if r and first and r % first == 0:
      mu[:] = mu.mean(axis=0)
    if r and second and r % second == 0:
      nu[:] = nu.mean(axis=0)
    trained = []
    for w, target in enumerate(toy.TARGETS):
      x, c = theta.copy(), count
      for _ in range(toy.H):
        g = x - target
        mu[w] = b1 * mu[w] + (1 - b1) * g
        nu[w] = b2 * nu[w] + (1 - b2) * g * g
        c += 1
        x = x - lr * (mu[w] / (1 - b1 ** c)) / (np.sqrt(nu[w] / (1 - b2 ** c)) + eps)
      trained.append(x)
    count += toy.H
    theta = np.mean(trained, axis=0)
    out.append(theta)
  return np.asarray(out)


@pytest.mark.parametrize("first,second", [(1, 2), (0, 0), (2, 3)])
def test_the_moments_follow_the_hand_computed_trajectory(first, second):
  got, workers = toy.run("desloc", 6, **ADAM, **{
      "desloc.first_moment_rounds": first, "desloc.second_moment_rounds": second})
  np.testing.assert_allclose(got, _by_hand(6, first, second), rtol=2e-5, atol=2e-6)
  # It differs from Local Adam without averages (DiLoCo at a plain average) exactly from
  # the first round that follows an average.
  apart, _ = toy.run("desloc", 6, **ADAM, **{"desloc.first_moment_rounds": 0,
                                             "desloc.second_moment_rounds": 0})
  first_average = min([k for k in (first, second) if k], default=6)
  np.testing.assert_array_equal(got[:first_average], apart[:first_average])
  assert first_average == 6 or not np.allclose(got[first_average], apart[first_average])
  # After round 6 no average is due yet: the workers' moments differ again.
  (adam,) = [s for s in jax.tree.leaves(workers.opt_state, is_leaf=_is_adam) if _is_adam(s)]
  assert not np.allclose(adam.mu["w"][0], adam.mu["w"][1])


def test_without_moment_averages_it_is_diloco_bit_for_bit(smoke_config):
  common = {"num_workers": 2, "inner_steps": 2, "mesh.replica": 1}
  _, s_diloco, w_diloco, _ = train_rounds(smoke_config(**common), 3)
  _, s_desloc, w_desloc, _ = train_rounds(smoke_config(
      algorithm="desloc", **common, **NESTEROV, **{"desloc.first_moment_rounds": 0,
                                                   "desloc.second_moment_rounds": 0}), 3)
  np.testing.assert_array_equal(s_desloc.params, s_diloco.params)
  jax.tree.map(np.testing.assert_array_equal, (s_desloc.outer, w_desloc), (s_diloco.outer, w_diloco))


def test_one_worker_averaging_every_round_is_diloco_bit_for_bit(smoke_config):
  # All periods equal to H: with one worker every average is the worker's own state.
  common = {"num_workers": 1, "inner_steps": 2}
  _, s_diloco, w_diloco, _ = train_rounds(smoke_config(**common), 3)
  _, s_desloc, w_desloc, _ = train_rounds(smoke_config(
      algorithm="desloc", **common, **NESTEROV, **{"desloc.first_moment_rounds": 1,
                                                   "desloc.second_moment_rounds": 1}), 3)
  np.testing.assert_array_equal(s_desloc.params, s_diloco.params)
  jax.tree.map(np.testing.assert_array_equal, w_desloc, w_diloco)


def test_two_hosts_in_one_process_average_across_both(smoke_config):
  # The average gathers every local host's workers into one stack and hands each its rows.
  moments = {"desloc.first_moment_rounds": 1, "desloc.second_moment_rounds": 1,
             "mesh.replica": 1}
  _, s_one, w_one, _ = train_rounds(smoke_config(algorithm="desloc", **moments), 3)
  _, s_two, w_two, _ = train_rounds(smoke_config(
      algorithm="desloc", hosts=[host(1.0), host(1.0)], **moments), 3)
  np.testing.assert_allclose(s_two.params, s_one.params, rtol=1e-5, atol=1e-6)
  adam = lambda w: [s for s in jax.tree.leaves(w.opt_state, is_leaf=_is_adam) if _is_adam(s)][0]
  # Averaged before round 3, then each worker's own round-3 steps: not equal, but equal to
  # the one-host run's workers.
  nu = lambda w, row: jax.tree.leaves(adam(w).nu)[0][row]
  for k in range(2):
    np.testing.assert_allclose(nu(w_two[k], 0), nu(w_one[0], k), rtol=1e-4, atol=1e-9)
  # ... and not the states the two hosts reach without averaging.
  _, _, w_apart, _ = train_rounds(smoke_config(
      algorithm="desloc", hosts=[host(1.0), host(1.0)], **{
          **moments, "desloc.first_moment_rounds": 0, "desloc.second_moment_rounds": 0}), 3)
  assert not np.allclose(nu(w_apart[0], 0), nu(w_two[0], 0), rtol=1e-3)


def test_a_moment_average_costs_a_model_of_bytes(smoke_config, tmp_path):
  config = smoke_config(algorithm="desloc", rounds=5, **{"desloc.first_moment_rounds": 1,
                                                         "desloc.second_moment_rounds": 2})
  summary = train.run(config, tmp_path)
  dense = summary["params"] * 4
  # 5 rounds of Δ; the first moment before rounds 2-5, the second before rounds 3 and 5.
  assert summary["bytes_sent"] == (5 + 4 + 2) * dense
  rows = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
          if "bytes_sent" in r]
  assert rows[-1]["bytes_sent"] == summary["bytes_sent"]


def test_resume_between_moment_averages_is_exact(smoke_config, tmp_path):
  config = smoke_config(algorithm="desloc", rounds=6, inner_steps=1, checkpoint_every=1,
                        eval_every=3, **{"desloc.first_moment_rounds": 2,
                                         "desloc.second_moment_rounds": 3})
  straight = train.run(config, tmp_path / "straight")
  assert train.run(config, tmp_path / "resumed", stop_after_rounds=3) == {"stopped_at_round": 3}
  resumed = train.run(config, tmp_path / "resumed")
  assert resumed["eval_loss"] == straight["eval_loss"]
  assert resumed["bytes_sent"] == straight["bytes_sent"]
  jax.tree.map(np.testing.assert_array_equal, checkpointed_state(config, tmp_path / "straight"),
               checkpointed_state(config, tmp_path / "resumed"))


def test_the_simulator_equals_the_runner_and_times_the_moments(tmp_path):
  moments = {"desloc.first_moment_rounds": 1, "desloc.second_moment_rounds": 2}
  config = sim_and_runner_config("desloc", **moments)
  summary = assert_simulator_equals_runner(config, tmp_path)
  r = train.build(config)
  dense = r.model.param_bytes
  assert summary["bytes_sent"] == (3 + 2 + 1) * dense  # as the runner counts it
  # The clock: DiLoCo's, plus one all-reduce of one moment before round 2 and of two before
  # round 3 (sim/collectives.py's ring or hierarchical, whichever the plan chose).
  plain = simulate.run(sim_and_runner_config(
      "desloc", **{"desloc.first_moment_rounds": 0, "desloc.second_moment_rounds": 0}),
      tmp_path / "plain")
  plan = simulate.make_plan(config, r)
  allreduce = lambda n: sim_collectives.seconds(plan.network, "allreduce", range(4), n,
                                                plan.collective)[0]
  assert summary["virtual_seconds"] == pytest.approx(
      plain["virtual_seconds"] + allreduce(dense) + allreduce(2 * dense), rel=1e-9)


@pytest.mark.parametrize("overrides,message", [
    ({"desloc.first_moment_rounds": -1}, "desloc.first_moment_rounds=-1: rounds between"),
    ({"optimizer.name": "sgd"}, "optimizer.name='sgd': DES-LOC averages Adam's moments"),
    ({"hosts": [host(1.0), host(0.5)]}, "need one shape: give every host tier 1.0"),
])
def test_bad_desloc_configs_name_the_field(smoke_config, overrides, message):
  config = smoke_config(algorithm="desloc", **overrides)
  with pytest.raises(check.ConfigError, match=message):
    check.validate(config, num_devices=8)
