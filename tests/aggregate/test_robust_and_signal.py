"""Robust rules (aggregate/robust.py) against NumPy and hand computations, and signal weights
(aggregate/signal.py) from hand-computed signals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowcomm_jax.aggregate import robust, signal

RNG = np.random.default_rng(0)
U = {"a": RNG.normal(size=(5, 3, 4)).astype(np.float32),
     "b": RNG.normal(size=(5, 7)).astype(np.float32)}  # 5 workers


def test_median_and_trimmed_mean_match_numpy():
  med = robust.median(U)
  trimmed = robust.trimmed_mean(U, 1)
  for k, x in U.items():
    np.testing.assert_allclose(med[k], np.median(x, axis=0), rtol=1e-6)
    np.testing.assert_allclose(trimmed[k], np.sort(x, axis=0)[1:4].mean(axis=0), rtol=1e-6)
  with pytest.raises(ValueError, match="trim=3 per side leaves nothing of 5"):
    robust.trimmed_mean(U, 3)


def test_weighted_mean_with_uniform_weights_is_the_mean():
  out = robust.weighted_mean(U, jnp.full((5,), 0.2))
  for k, x in U.items():
    # float32 round-off of a sum is a few ulp of its terms' size, not of a (nearly
    # cancelling) result: the bound follows the terms.
    bound = 4 * np.finfo(np.float32).eps * np.abs(x).mean(axis=0)
    np.testing.assert_array_less(np.abs(out[k] - x.astype(np.float64).mean(axis=0)), bound)


def test_centered_clip_by_hand():
  # Three workers in 2-D, centre 0, τ = 1: (3, 4) is 5 away -> clipped to (0.6, 0.8);
  # (0.3, 0) and (0, -0.5) are inside. v1 = (0.6 + 0.3 + 0, 0.8 + 0 - 0.5) / 3.
  u = {"x": jnp.asarray([[3.0, 4.0], [0.3, 0.0], [0.0, -0.5]])}
  v, tau = robust.centered_clip(u, {"x": jnp.zeros(2)}, jnp.full((3,), 1 / 3), iters=1,
                                tau=1.0)
  np.testing.assert_allclose(v["x"], [0.9 / 3, 0.3 / 3], rtol=1e-6)
  # Default τ: the median distance from the centre (0.5 here); a second iteration moves
  # from v1: by hand with NumPy.
  v2, tau = robust.centered_clip(u, {"x": jnp.zeros(2)}, jnp.full((3,), 1 / 3), iters=2)
  assert float(tau) == pytest.approx(0.5)
  x, c = np.asarray(u["x"]), np.zeros(2)
  for _ in range(2):
    d = x - c
    c = c + (d * np.minimum(1, 0.5 / np.linalg.norm(d, axis=1))[:, None]).mean(axis=0)
  np.testing.assert_allclose(v2["x"], c, rtol=1e-5)
  # An attacker 100x away moves the clipped centre by at most τ / W per iteration.
  u["x"] = u["x"].at[0].set(jnp.asarray([300.0, 400.0]))
  v3, _ = robust.centered_clip(u, {"x": jnp.zeros(2)}, jnp.full((3,), 1 / 3), iters=1,
                               tau=1.0)
  np.testing.assert_allclose(v3["x"], [0.9 / 3, 0.3 / 3], rtol=1e-6)


def test_buckets_average_shuffled_groups():
  key = jax.random.key(3)
  means, weights = robust.buckets(U, jnp.full((5,), 0.2), key, bucket=2)
  order = np.asarray(jax.random.permutation(key, 5))
  for k, x in U.items():
    expect = [x[order[0:2]].mean(0), x[order[2:4]].mean(0), x[order[4:5]].mean(0)]
    np.testing.assert_allclose(means[k], np.stack(expect), rtol=1e-6)
  np.testing.assert_allclose(weights, [0.4, 0.4, 0.2], rtol=1e-6)


def test_signal_weights_by_hand():
  s = signal.init(2)
  s = signal.observe(s, losses=jnp.asarray([2.0, 4.0]), norms=jnp.asarray([1.0, 1.0]),
                     cosines=jnp.asarray([0.5, -0.5]), probes=jnp.asarray([3.0, 1.0]), ema=0.9)
  np.testing.assert_allclose(s.loss, [2.0, 4.0])  # the first round sets the EMAs
  s = signal.observe(s, losses=jnp.asarray([1.0, 4.0]), norms=jnp.asarray([3.0, 1.0]),
                     cosines=jnp.asarray([0.5, -0.5]), probes=jnp.asarray([2.0, 1.0]), ema=0.9)
  np.testing.assert_allclose(s.loss, [1.9, 4.0], rtol=1e-6)
  # probe_loss: EMA (0.9·3 + 0.1·2, 1) = (2.9, 1); lower probe loss = more trusted.
  np.testing.assert_allclose(signal.signal_of(s, "probe_loss"), [-2.9, -1.0], rtol=1e-6)
  # Norm EMAs: worker 0 mean 1.2, mean square 1.8 -> std sqrt(0.36) = 0.6 -> 1.2/0.6 = 2;
  # worker 1 always 1: std 0 -> very stable (clamped std 1e-6 * mean).
  stab = signal.signal_of(s, "grad_norm_stability")
  assert float(stab[0]) == pytest.approx(2.0, rel=1e-5) and float(stab[1]) > 1e5
  # loss_ema: signal (-1.9, -4.0) standardizes to (+1, -1); softmax(z / T) with T = 1;
  # floor 0.2 over 2 workers; no smoothing.
  w = signal.weights_from(signal.signal_of(s, "loss_ema"), s.weights, temperature=1.0,
                          floor=0.2, weight_ema=0.0, warm=jnp.asarray(True))
  p = np.exp([1.0, -1.0]) / np.exp([1.0, -1.0]).sum()
  np.testing.assert_allclose(w, 0.8 * p + 0.1, rtol=1e-6)
  assert float(w.min()) >= 0.1 and float(w.sum()) == pytest.approx(1.0)
  # Smoothing from uniform, and uniform during warm-up.
  smooth = signal.weights_from(signal.signal_of(s, "loss_ema"), s.weights, temperature=1.0,
                               floor=0.2, weight_ema=0.5, warm=jnp.asarray(True))
  np.testing.assert_allclose(smooth, 0.5 * 0.5 + 0.5 * (0.8 * p + 0.1), rtol=1e-6)
  cold = signal.weights_from(signal.signal_of(s, "loss_ema"), s.weights, temperature=1.0,
                             floor=0.2, weight_ema=0.0, warm=jnp.asarray(False))
  np.testing.assert_allclose(cold, [0.5, 0.5])
  # Equal signals give uniform weights; effective workers 1/Σw².
  flat = signal.weights_from(jnp.asarray([3.0, 3.0, 3.0]), jnp.full((3,), 1 / 3),
                             temperature=0.5, floor=0.0, weight_ema=0.0, warm=jnp.asarray(True))
  np.testing.assert_allclose(flat, [1 / 3] * 3, rtol=1e-6)
  assert float(signal.effective_workers(flat)) == pytest.approx(3.0)
  assert float(signal.effective_workers(jnp.asarray([1.0, 0.0]))) == pytest.approx(1.0)


def test_noise_aware_standardization_by_hand():
  s = signal.init(2)
  zeros = jnp.zeros((2,))
  for losses in ([2.0, 3.0], [4.0, 3.0], [2.0, 5.0]):
    s = signal.observe(s, losses=jnp.asarray(losses), norms=zeros + 1.0, cosines=zeros,
                       probes=zeros, ema=0.5)
  # EMAs (ema 0.5): w0 2 -> 3 -> 2.5; w1 3 -> 3 -> 4.
  # The variance is of x_w − mean(x) around m_w − mean(m): centred observations (−.5, .5),
  # (.5, −.5), (−1.5, 1.5); centred EMAs before rounds 2 and 3: (−.5, .5), (0, 0).
  # var ← 0.5·(var + 0.5·d²): d = ±1 -> 0.25; d = ±1.5 -> 0.5·(0.25 + 0.5·2.25) = 0.6875.
  np.testing.assert_allclose(s.loss, [2.5, 4.0])
  np.testing.assert_allclose(s.loss_var, [0.6875, 0.6875])
  # Noise of an EMA with α = 0.5: sqrt(var·α/(2 − α)) = sqrt(var / 3).
  noise = signal.noise_of(s, "loss_ema", ema=0.5)
  np.testing.assert_allclose(noise, np.sqrt([0.6875 / 3] * 2), rtol=1e-6)
  assert not np.asarray(signal.noise_of(s, "grad_norm_stability", ema=0.5)).any()
  # Signal (−2.5, −4): spread var 0.5625; k = 2: scale = sqrt(0.5625 + (2·σ)²), z = ±0.75 / scale.
  sig = signal.signal_of(s, "loss_ema")
  w = signal.weights_from(sig, s.weights, temperature=1.0, floor=0.0, weight_ema=0.0,
                          warm=jnp.asarray(True), noise=noise, noise_sigmas=2.0)
  z = 0.75 / np.sqrt(0.5625 + 4 * 0.6875 / 3)
  np.testing.assert_allclose(w, np.exp([z, -z]) / np.exp([z, -z]).sum(), rtol=1e-5)
  # k = 0 is the plain z-score (±1), whatever the noise.
  plain = signal.weights_from(sig, s.weights, temperature=1.0, floor=0.0, weight_ema=0.0,
                              warm=jnp.asarray(True), noise=noise, noise_sigmas=0.0)
  np.testing.assert_allclose(plain, np.exp([1, -1]) / np.exp([1, -1]).sum(), rtol=1e-5)


def test_trimmed_mean_drops_trim_values_per_side_and_median_averages_the_middle_pair():
  # Six workers (even): the median is the mean of the 3rd and 4th values, not either one;
  # trim 2 keeps the middle two, trim 1 the middle four.
  x = {"v": np.asarray([[5.0, -1.0], [1.0, 7.0], [100.0, 2.0], [3.0, 3.0], [-50.0, 0.0],
                        [2.0, 30.0]], np.float32)}
  # column 0 sorted: -50 1 2 3 5 100; column 1: -1 0 2 3 7 30
  np.testing.assert_allclose(robust.median(x)["v"], [2.5, 2.5])
  np.testing.assert_allclose(robust.trimmed_mean(x, 1)["v"], [11 / 4, 12 / 4])
  np.testing.assert_allclose(robust.trimmed_mean(x, 2)["v"], [5 / 2, 5 / 2])
  np.testing.assert_allclose(robust.trimmed_mean(x, 0)["v"], x["v"].mean(0), rtol=1e-6)


def _stacked(seed, workers=6, n=40):
  return jax.random.normal(jax.random.key(seed), (workers, n))


@pytest.mark.parametrize("trim", [1, 2])
def test_robust_combine_trims_as_configured(trim):
  u = _stacked(0)
  combine = robust.robust_combine(rule="trimmed_mean", signal="none", num_workers=6, trim=trim)
  out, state = combine.update(u, combine.init(u[0]))
  expect = np.sort(np.asarray(u), axis=0)[trim:6 - trim].mean(axis=0)
  np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(state.center, out)  # the next round's centre


def test_robust_combine_with_buckets_takes_the_median_of_bucket_means():
  u = np.asarray(_stacked(1))
  combine = robust.robust_combine(rule="median", signal="none", num_workers=6, bucket=2, seed=5)
  out, _ = combine.update(jnp.asarray(u), combine.init(u[0]), round_index=3)
  # The shuffle is the run's (seed, round): the same pairing by hand.
  order = np.asarray(jax.random.permutation(jax.random.fold_in(jax.random.key(5), 3), 6))
  pairs = [u[order[i:i + 2]].mean(0) for i in (0, 2, 4)]
  np.testing.assert_allclose(out, np.median(pairs, axis=0), rtol=1e-5, atol=1e-7)
  assert not np.allclose(out, np.median(u, axis=0), atol=1e-3)  # buckets changed the answer
  # Another round shuffles otherwise.
  other, _ = combine.update(jnp.asarray(u), combine.init(u[0]), round_index=4)
  assert not np.allclose(other, out)


def test_robust_combine_weighs_workers_by_their_cosine_to_the_previous_aggregate():
  # Round 1 sets the centre (cosines 0: no previous aggregate). In round 2 worker 0 points
  # along it, worker 1 across it and worker 2 against it.
  combine = robust.robust_combine(rule="mean", signal="cosine", num_workers=3, warmup_rounds=1,
                                  temperature=1.0, floor=0.0, weight_ema=0.0, signal_ema=0.5,
                                  noise_sigmas=0.0)
  first = jnp.asarray([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
  out1, state = combine.update(first, combine.init(first[0]))
  np.testing.assert_allclose(out1, [1.0, 0.0])
  np.testing.assert_allclose(state.signals.weights, [1 / 3] * 3)
  second = jnp.asarray([[2.0, 0.0], [0.0, 3.0], [-1.0, 0.0]])
  out2, state = combine.update(second, state)
  # Cosines (1, 0, -1); the EMA's first round set them to 0: 0.5·0 + 0.5·cos.
  np.testing.assert_allclose(state.signals.cosine, [0.5, 0.0, -0.5], atol=1e-7)
  z = np.asarray([0.5, 0.0, -0.5]) / np.std([0.5, 0.0, -0.5])
  w = np.exp(z) / np.exp(z).sum()
  np.testing.assert_allclose(state.signals.weights, w, rtol=1e-5)
  np.testing.assert_allclose(out2, w @ np.asarray(second), rtol=1e-5)
