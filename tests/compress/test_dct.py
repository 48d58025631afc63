"""DCT orthonormality and a DeMo step checked against a NumPy/SciPy reference."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
import scipy.fft

from lowcomm_jax.aggregate import compressed_mean
from lowcomm_jax.compress import DCTTopK, TreeCodec, dct_matrix, error_feedback
from lowcomm_jax.programs.optimizers import sign_descent

RNG = np.random.default_rng(0)


def test_dct_matrix_is_orthonormal_and_matches_scipy():
  d = dct_matrix(48)
  np.testing.assert_allclose(d @ d.T, np.eye(48), atol=1e-5)
  x = RNG.standard_normal(48)
  np.testing.assert_allclose(d @ x, scipy.fft.dct(x, norm="ortho"), atol=1e-5)


@pytest.mark.parametrize("shape", [(128, 192), (96,), (100, 70), (4099,)])
def test_keeping_every_coefficient_reconstructs_the_tensor(shape):
  x = jnp.asarray(RNG.standard_normal(shape), jnp.float32)
  codec = DCTTopK(shape, chunk=64, k=10 ** 6)
  codec.k = codec.chunks.size  # bypass the half-chunk cap: k = all
  payload, sent = codec.encode(x, None)
  np.testing.assert_allclose(codec.decode(payload, None), x, atol=1e-4)
  np.testing.assert_allclose(sent, x, atol=1e-4)


def _reference_demo(params, grads, deltas, *, lr, beta, k, wd, over_senders, sign_only):
  """DeMo (Peng et al. 2024, Algorithm 1 / reference code) in NumPy for R workers.

  Each tensor here is exactly one DCT chunk, so chunking is the identity.
  """
  R = len(grads)
  sent = []
  for w in range(R):
    for name in params:
      deltas[w][name] = beta * deltas[w][name] + lr * grads[w][name]
    mine = {}
    for name, delta in deltas[w].items():
      y = scipy.fft.dctn(delta, norm="ortho")
      flat = y.reshape(-1)
      idx = np.argsort(-np.abs(flat), kind="stable")[:k]
      mine[name] = (idx, flat[idx])
      transmitted = np.zeros_like(flat)
      transmitted[idx] = flat[idx]
      deltas[w][name] = delta - scipy.fft.idctn(transmitted.reshape(y.shape), norm="ortho")
    sent.append(mine)
  new = {}
  for name, p in params.items():
    total = np.zeros(p.size)
    count = np.zeros(p.size)
    for w in range(R):
      idx, val = sent[w][name]
      total[idx] += np.sign(val) if sign_only else val
      count[idx] += 1
    mean = total / np.maximum(count, 1) if over_senders else total / R
    g = scipy.fft.idctn(mean.reshape(p.shape), norm="ortho")
    decay = wd * p if p.ndim >= 2 else 0.0
    new[name] = p - lr * (np.sign(g) + decay)
  return new, deltas


@pytest.mark.parametrize("over_senders,sign_only", [(False, False), (True, False), (False, True)])
def test_demo_step_on_two_workers_matches_the_numpy_reference(over_senders, sign_only):
  lr, beta, k, wd = 0.01, 0.9, 6, 0.1
  params = {"w": RNG.standard_normal((16, 32)).astype(np.float32),
            "b": RNG.standard_normal((24,)).astype(np.float32)}
  codec = error_feedback(TreeCodec("demo", lambda s: DCTTopK(s, chunk=64, k=k,
                                                             sign_only=sign_only,
                                                             mean_over_senders=over_senders)),
                         beta=beta, scale=lr)
  opt = ml_collections.ConfigDict(dict(lr=lr, warmup_steps=0, decay_steps=0, min_lr_ratio=1.0,
                                       weight_decay=wd))
  tx = optax.chain(compressed_mean(codec), sign_descent(opt, total_steps=10))
  agg_state, rule_state = tx.init(params)
  state = (jax.tree.map(lambda x: jnp.stack([x, x]), agg_state), rule_state)

  @jax.jit
  def step(params, state, grads):
    def worker(state, g):
      updates, state = tx.update(g, state, params)
      return optax.apply_updates(params, updates), state
    return jax.vmap(worker, in_axes=((0, None), 0), out_axes=(None, (0, None)),
                    axis_name="replica")(state, grads)

  ref_params = {n: p.astype(np.float64) for n, p in params.items()}
  ref_deltas = [{n: np.zeros(p.shape) for n, p in params.items()} for _ in range(2)]
  ours = jax.tree.map(jnp.asarray, params)
  for _ in range(3):
    grads = [{n: RNG.standard_normal(p.shape) for n, p in params.items()} for _ in range(2)]
    ref_params, ref_deltas = _reference_demo(ref_params, grads, ref_deltas, lr=lr, beta=beta,
                                             k=k, wd=wd, over_senders=over_senders,
                                             sign_only=sign_only)
    stacked = {n: jnp.asarray(np.stack([g[n] for g in grads]), jnp.float32) for n in params}
    ours, state = step(ours, state, stacked)
    for n in params:
      np.testing.assert_allclose(ours[n], ref_params[n], atol=1e-5)
      for w in range(2):
        np.testing.assert_allclose(state[0].codec_state[n][w], ref_deltas[w][n], atol=1e-5)


def test_all_zero_chunks_send_nothing_even_as_signs():
  x = np.zeros((64, 128), np.float32)
  x[:, :64] = RNG.standard_normal((64, 64))
  for sign_only in (False, True):
    codec = DCTTopK(x.shape, chunk=64, k=8, sign_only=sign_only)
    payload, sent = codec.encode(jnp.asarray(x), None)
    out = np.asarray(codec.decode(payload, None))
    np.testing.assert_allclose(out[:, 64:], 0, atol=1e-7)
    np.testing.assert_allclose(sent[:, 64:], 0, atol=1e-7)
