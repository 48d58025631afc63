"""Pier (algorithms/pier.py, outer/pier.py): DiLoCo with the outer momentum produced, then
decayed, and a scheduled outer lr."""

import jax
import numpy as np
import pytest

import toy_problem as toy
from conftest import (assert_simulator_equals_runner, checkpointed_state, sim_and_runner_config,
                      train_rounds)
from lowcomm_jax.config import check
from lowcomm_jax.runtimes.spmd import train
from lowcomm_jax.outer.pier import boundaries

# 10 rounds: 2 of momentum production, 2 of decay (0.99, then 0.95) with the lr ramp
# (η/2, then η), 4 at η and β, the last 2 at η/2.
SCHEDULE = {"pier.warmup": 0.2, "pier.decay_momenta": (0.99, 0.95), "pier.final": 0.8,
            "pier.final_lr_ratio": 0.5}
OFF = {"pier.warmup": 0.0, "pier.decay_momenta": (), "pier.final": 1.0}


def _by_hand(rounds: int):
  """θ after every round in float64: each worker's H SGD steps from θ, Δ̄ = θ − mean θ_w,
  then the round's rule."""
  theta, m, out = toy.THETA0.astype(np.float64), np.zeros(2), []
  mu = [toy.BETA, toy.BETA, 0.99, 0.95] + [toy.BETA] * 6  # production uses β
  eta = [None, None, toy.LR / 2, toy.LR] + [toy.LR] * 4 + [toy.LR * 0.5] * 2
  for r in range(rounds):
    delta = np.mean([theta - toy.sgd_steps(theta, t) for t in toy.TARGETS], axis=0)
    m = mu[r] * m + delta
    if r < 2:  # production: θ becomes the workers' mean, the momentum only fills
      theta = theta - delta
    else:
      theta = theta - eta[r] * (delta + mu[r] * m)
    out.append(theta)
  return np.asarray(out)


def test_the_schedule_follows_the_hand_computed_trajectory():
  assert boundaries(10, 0.2, (0.99, 0.95), 0.8) == (2, 2, 8)
  got, _ = toy.run("pier", 10, **SCHEDULE)
  want = _by_hand(10)
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
  # It differs from DiLoCo exactly where it should: production rounds are plain averages.
  diloco, _ = toy.run("diloco", 2)
  assert not np.allclose(got[0], diloco[0])
  np.testing.assert_allclose(got[0], np.mean([toy.sgd_steps(toy.THETA0, t)
                                              for t in toy.TARGETS], axis=0), rtol=1e-6)


def test_without_its_schedules_it_is_diloco(smoke_config):
  # The same arithmetic; μ and η are traced values here and constants in DiLoCo's program,
  # which XLA may fuse differently: equal to float32 rounding, not bit for bit.
  common = {"num_workers": 2, "inner_steps": 2, "mesh.replica": 1}
  _, s_diloco, _, _ = train_rounds(smoke_config(**common), 3)
  _, s_pier, _, _ = train_rounds(smoke_config(algorithm="pier", **common, **OFF), 3)
  np.testing.assert_allclose(s_pier.params, s_diloco.params, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(s_pier.outer.per_fragment[0].momentum,
                             s_diloco.outer.per_fragment[0][0].trace, rtol=1e-4, atol=1e-6)


def test_resume_mid_schedule_is_exact(smoke_config, tmp_path):
  # 10 rounds of H = 1: production in rounds 0-1, the decay in 2-3; stopped in the decay.
  config = smoke_config(algorithm="pier", rounds=10, inner_steps=1, checkpoint_every=1,
                        eval_every=5, **SCHEDULE)
  straight = train.run(config, tmp_path / "straight")
  assert train.run(config, tmp_path / "resumed", stop_after_rounds=3) == {"stopped_at_round": 3}
  resumed = train.run(config, tmp_path / "resumed")
  assert resumed["eval_loss"] == straight["eval_loss"]
  jax.tree.map(np.testing.assert_array_equal, checkpointed_state(config, tmp_path / "straight"),
               checkpointed_state(config, tmp_path / "resumed"))


def test_the_simulator_equals_the_runner(tmp_path):
  # 3 rounds: one of production, one of decay at μ 0.99 and lr η, one at β.
  assert_simulator_equals_runner(sim_and_runner_config(
      "pier", **{"pier.warmup": 0.34, "pier.decay_momenta": (0.99,), "pier.final": 1.0}),
      tmp_path)


@pytest.mark.parametrize("overrides,message", [
    ({"pier.warmup": 0.6}, "pier.warmup=0.6: the fraction of rounds"),
    ({"pier.decay_momenta": (1.2,)}, "pier.decay_momenta=(1.2,): each momentum"),
    ({"pier.final": 0.1}, "pier.final=0.1: the lr drop at round 2 must come after"),
    ({"pier.final_lr_ratio": 1.2}, "pier.final_lr_ratio=1.2: the final outer lr"),
    ({"pier.total_rounds": -1}, "pier.total_rounds=-1: use 0"),
    ({"rounds": 3}, "pier.warmup=0.1: 3 rounds give 0 of momentum production"),
])
def test_bad_pier_configs_name_the_field(smoke_config, overrides, message):
  config = smoke_config(algorithm="pier", **{"rounds": 20, **overrides})
  with pytest.raises(check.ConfigError, match=message.replace("(", r"\(").replace(
      ")", r"\)").replace(".", r"\.")):
    check.validate(config, num_devices=8)
