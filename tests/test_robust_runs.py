"""Robust rules and signal weights in the runner's sync (issue 18): the plain mean is
untouched, uniform weights equal it exactly, weights and effective N are reported, the
ledger counts an all-gather, the signal state resumes exactly, bad combinations are refused."""

import json

import jax
import numpy as np
import pytest

from conftest import checkpointed_state, load_config, train_rounds
from lowcomm_jax.config import check
from lowcomm_jax.programs import sync
from lowcomm_jax.runtimes.spmd import train


def _config(**overrides):
  return load_config("smoke", **{"num_workers": 4, **overrides})


def test_uniform_weights_equal_the_plain_mean_exactly():
  assert not sync.robust_combination(_config())  # default: the all-reduce mean
  _, plain, _, _ = train_rounds(_config(), 3)
  # Signal weights still warming up are uniform: the gathered mean is the all-reduced one.
  warming = _config(**{"aggregate.signal": "loss_ema", "aggregate.warmup_rounds": 5})
  assert sync.robust_combination(warming)
  _, robust, _, metrics = train_rounds(warming, 3)
  # Equal up to the order of the sum: an all-reduce across the 4 replica devices adds in
  # another order than the mean of the gathered stack (4e-7 apart after 3 rounds).
  np.testing.assert_allclose(np.asarray(robust.params), np.asarray(plain.params), atol=2e-6)
  np.testing.assert_allclose(metrics["worker_weights"], [0.25] * 4)
  assert float(metrics["effective_workers"]) == pytest.approx(4.0)


def test_uniform_weights_give_the_gathered_mean_bit_exactly():
  from lowcomm_jax.aggregate import robust_combine
  stacked = jax.random.normal(jax.random.key(0), (4, 1000))
  combine = robust_combine(rule="mean", signal="loss_ema", num_workers=4, warmup_rounds=3)

  @jax.jit  # one program, as in the runner's sync (op by op, each op would compile alone)
  def combined_and_mean(stacked, losses):
    return combine.update(stacked, combine.init(stacked[0]), worker_losses=losses), \
        stacked.mean(axis=0)

  (out, state), mean = combined_and_mean(stacked, jax.numpy.asarray([1.0, 2.0, 3.0, 4.0]))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(mean))
  np.testing.assert_array_equal(np.asarray(state.signals.weights), [0.25] * 4)


def test_signal_weighted_centered_clipping_trains_reports_and_resumes_exactly(tmp_path):
  # Three rounds (the other 4-worker runs' schedule: their local program, compiled once):
  # weighted from round 2 on, checkpointed after round 2, round 3 resumed from it.
  config = _config(rounds=3, checkpoint_every=2, log_every=1,
                   **{"aggregate.rule": "centered_clip", "aggregate.signal": "loss_ema",
                      "aggregate.warmup_rounds": 1, "aggregate.temperature": 0.1})
  straight = train.run(config, tmp_path / "straight")
  assert len(straight["worker_weights"]) == 4
  assert sum(straight["worker_weights"]) == pytest.approx(1.0, abs=1e-5)
  assert 1.0 <= straight["effective_workers"] < 4.0  # after warm-up, not uniform
  assert min(straight["worker_weights"]) >= 0.2 / 4 - 1e-6  # the floor
  # An all-gather: each worker receives the other three updates.
  assert straight["bytes_received"] == 3 * straight["bytes_sent"]
  rows = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
  assert any("worker_weights_worker_3" in r for r in rows)
  # Stopped after round 2's checkpoint, resumed: the signal EMAs and the previous centre
  # come back with the outer state.
  assert train.run(config, tmp_path / "split", stop_after_rounds=2) == {"stopped_at_round": 2}
  resumed = train.run(config, tmp_path / "split")
  assert resumed["eval_loss"] == straight["eval_loss"]
  assert resumed["worker_weights"] == straight["worker_weights"]
  (a, wa), _ = checkpointed_state(config, tmp_path / "straight")
  (b, wb), _ = checkpointed_state(config, tmp_path / "split")
  for x, y in zip(jax.tree.leaves((a, wa)), jax.tree.leaves((b, wb))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_probe_scores_each_workers_proposal_by_hand():
  import jax.numpy as jnp
  from lowcomm_jax.parallel.flat import ParamLayout
  from lowcomm_jax.programs.sync_program import make_probe
  tree = {"a": jnp.zeros((2,)), "b": jnp.zeros((3,))}
  layout = ParamLayout.of(tree, [0, 1])  # two fragments: 'a' then 'b'
  target = jnp.arange(5.0)

  def loss_fn(params, windows, key, frozen):  # a quadratic that ignores the windows
    del key, frozen
    flat = jnp.concatenate([params["a"], params["b"]])
    return jnp.sum((flat - target) ** 2) + 0.0 * windows.sum()

  theta = jnp.asarray([1.0, 1.0, 2.0, 2.0, 2.0])
  deltas = jnp.asarray([[0.0, 2.0, 0.0], [1.0, 1.0, 1.0]])  # fragment 1 ('b'): 3 values
  probe = make_probe(loss_fn, layout, 1, np.zeros((1, 2), np.int32), step=0.5)
  # Proposals: b - 0.5 * Δ_w with a unchanged; loss = (1-0)^2 + (1-1)^2 + Σ_b (b' - target_b)^2
  # w0: b' = (2, 1, 2) vs (2, 3, 4): 0 + 4 + 4 -> 9;  w1: b' = (1.5, 1.5, 1.5): 0.25 + 2.25 + 6.25 -> 9.75
  np.testing.assert_allclose(probe(deltas, theta), [9.0, 9.75], rtol=1e-6)


@pytest.mark.parametrize("kind", ["scale", "sign_flip"])
def test_the_probe_loss_signal_weighs_down_an_attacker(kind):
  # (In the first round a x100 step along a fresh model's descent direction scores *better*
  # on the probe; the weight falls once the step overshoots, from round 3 on.)
  config = _config(rounds=6, **{"aggregate.signal": "probe_loss", "aggregate.warmup_rounds": 1,
                                "attack.workers": (2,), "attack.kind": kind,
                                "attack.scale": 100.0, "aggregate.probe_batch_size": 4})
  _, state, _, metrics = train_rounds(config, 6)
  weights = np.asarray(metrics["worker_weights"])
  assert weights.sum() == pytest.approx(1.0, abs=1e-5)
  assert int(np.argmin(weights)) == 2 and weights[2] < 0.25 * 0.75, weights
  assert np.isfinite(np.asarray(state.params)).all()


def test_robust_rules_combine_decoded_payloads_of_a_codec():
  # Uniform weights over decoded int8 payloads give the compressed mean (up to the order of
  # the sum), and the ledger counts the same payloads: the codec's bytes, all-gathered.
  # One round: later rounds' Δ differ by round-off, which can flip an int8 rounding.
  codec = {"compress.codec": "int8"}
  # The clean run's three rounds (below), its first sync recorded: θ after round 1.
  syncs = []
  r_mean, clean_state, _, _ = train_rounds(_config(**codec), 3, record=syncs)
  r_gather, gathered, _, _ = train_rounds(
      _config(**codec, **{"aggregate.signal": "loss_ema", "aggregate.warmup_rounds": 5}), 1)
  np.testing.assert_allclose(np.asarray(gathered.params), syncs[0].new_theta, atol=1e-6)
  assert r_gather.outer_bytes() == r_mean.outer_bytes()
  # A x100 attacker through the codec: the median stays within 5% of the clean run (that
  # the mean does not is test_adversaries' case without a codec).
  r_attacked, attacked_state, _, _ = train_rounds(
      _config(**codec, **{"attack.workers": (1,), "attack.scale": 100.0,
                          "aggregate.rule": "median"}), 3)
  # Both models through one eval program (the same model and eval windows in both runs).
  np.testing.assert_array_equal(r_attacked.data.eval_windows, r_mean.data.eval_windows)
  with jax.set_mesh(r_mean.topology.mesh):
    eval_loss = jax.jit(r_mean.programs.eval)
    clean = float(eval_loss(clean_state.params, r_mean.data.eval_windows)[0])
    attacked = float(eval_loss(attacked_state.params, r_mean.data.eval_windows)[0])
  assert attacked < clean * 1.05, (attacked, clean)


@pytest.mark.parametrize("overrides,message", [
    ({"aggregate.rule": "krum"}, "aggregate.rule"),
    ({"aggregate.signal": "vibes"}, "aggregate.signal"),
    ({"aggregate.rule": "trimmed_mean", "aggregate.trim": 2}, "aggregate.trim"),
    ({"aggregate.rule": "median", "compress.codec": "demo", "algorithm": "ddp",
      "inner_steps": 1}, "demo's payloads are averaged by its own rule"),
    ({"aggregate.signal": "cosine", "algorithm": "eager"}, "eager combines"),
    ({"aggregate.rule": "median", "aggregate.weighting": "tokens"}, "equal weight"),
    ({"aggregate.floor": 1.5}, "aggregate.floor"),
    ({"aggregate.signal": "probe_loss", "aggregate.probe_batch_size": 0},
     "aggregate.probe_batch_size"),
    ({"aggregate.signal": "probe_loss", "aggregate.probe_step": -1.0}, "aggregate.probe_step"),
])
def test_bad_robust_configs_name_the_field(overrides, message):
  with pytest.raises(check.ConfigError, match=message):
    check.validate(_config(**overrides), num_devices=8)


def _recorded(config, rounds=1):
  calls = []
  train_rounds(config, rounds, record=calls)
  return calls


# Six workers, a plain outer step (lr 1, no momentum: θ_1 = θ_0 − the combined Δ), through
# the sync's wiring of the config (Sync.outer).
SIX = {"num_workers": 6, "outer.lr": 1.0, "outer.momentum": 0.0}


@pytest.mark.parametrize("trim", [1, 2])
def test_the_runner_trims_aggregate_trim_values_per_side(trim):
  (theta0, deltas, theta1), = _recorded(
      _config(**SIX, **{"aggregate.rule": "trimmed_mean", "aggregate.trim": trim}))
  assert deltas.shape[0] == 6
  expect = np.sort(deltas, axis=0)[trim:6 - trim].mean(axis=0)
  np.testing.assert_allclose(theta0 - theta1, expect, rtol=1e-4, atol=1e-6)


def _pairings(workers):
  if not workers:
    yield []
    return
  for other in workers[1:]:
    for tail in _pairings([w for w in workers[1:] if w != other]):
      yield [(workers[0], other)] + tail


def test_the_runner_takes_the_median_of_shuffled_buckets():
  (theta0, deltas, theta1), = _recorded(
      _config(**SIX, **{"aggregate.rule": "median", "aggregate.bucket": 2}))
  # Whatever the shuffle: exactly one of the 15 ways of pairing six workers gives the update.
  close = lambda x: np.allclose(theta0 - theta1, x, rtol=1e-4, atol=1e-6)
  matches = [p for p in _pairings(list(range(6)))
             if close(np.median([deltas[list(pair)].mean(0) for pair in p], axis=0))]
  assert len(matches) == 1, matches
  assert not close(np.median(deltas, axis=0))


def test_the_runner_weighs_workers_by_the_cosine_signal():
  from lowcomm_jax.aggregate import robust_combine
  fields = {"aggregate.signal": "cosine", "aggregate.warmup_rounds": 1,
            "aggregate.temperature": 0.5, "aggregate.noise_sigmas": 0.0}
  config = _config(**SIX, **fields)
  calls = _recorded(config, rounds=3)
  # The same combination replayed on the recorded Δ, step by step.
  a = config.aggregate
  combine = robust_combine(rule="mean", signal="cosine", num_workers=6,
                           temperature=a.temperature, floor=a.floor, weight_ema=a.weight_ema,
                           warmup_rounds=a.warmup_rounds, signal_ema=a.signal_ema,
                           noise_sigmas=a.noise_sigmas)
  state = combine.init(jax.numpy.zeros(calls[0].theta.shape))
  # One program per round (op by op, each op of the combination would compile alone).
  update = jax.jit(lambda deltas, state, k: combine.update(deltas, state, round_index=k))
  for k, (theta, deltas, new_theta) in enumerate(calls):
    out, state = update(jax.numpy.asarray(deltas), state, k)
    np.testing.assert_allclose(theta - new_theta, out, rtol=1e-4, atol=1e-6)
  weights = np.asarray(state.signals.weights)
  assert weights.std() > 1e-3, weights  # past the warm-up the cosines set unequal weights
