"""The inner optimizer a run builds (programs/optimizers.py) against hand-computed values: the
warmup-cosine schedule, global-norm clipping, AdamW's weight-decay mask; and codecs with and
without error feedback."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import load_config
from lowcomm_jax import compress
from lowcomm_jax.programs import optimizers
from lowcomm_jax.model import GPT, get_preset


def _opt(**overrides):
  opt = load_config("smoke").optimizer
  opt.update(overrides)
  return opt


def test_schedule_warms_up_linearly_then_decays_on_a_cosine_by_hand():
  # Peak 1e-2 after 4 warmup steps, cosine over the other 16 of the run's 20 inner steps
  # down to 10% of the peak, flat after that.
  schedule = optimizers.inner_schedule(_opt(lr=1e-2, warmup_steps=4, min_lr_ratio=0.1), 20)
  peak, end = 1e-2, 1e-3
  cosine = lambda t: end + (peak - end) * 0.5 * (1 + math.cos(math.pi * (t - 4) / 16))
  expected = {0: 0.0, 1: 0.25 * peak, 2: 0.5 * peak, 4: peak, 8: cosine(8), 12: 0.55 * peak,
              16: cosine(16), 20: end, 35: end}
  for step, lr in expected.items():
    assert float(schedule(step)) == pytest.approx(lr, rel=1e-6, abs=1e-12), step
  assert cosine(12) == pytest.approx(0.55 * peak)  # the midpoint: halfway from peak to end
  # decay_steps, when set, replaces the run's length.
  short = optimizers.inner_schedule(_opt(lr=1e-2, warmup_steps=4, decay_steps=8,
                                         min_lr_ratio=0.1), 20)
  assert float(short(6)) == pytest.approx(0.55 * peak, rel=1e-6)
  assert float(short(8)) == pytest.approx(end, rel=1e-6)


def test_the_inner_optimizer_steps_with_the_scheduled_lr():
  # SGD without clipping: each update is exactly −lr(t)·g.
  tx = optimizers.inner_optimizer(_opt(name="sgd", lr=1e-2, warmup_steps=4, grad_clip=0.0), 20)
  schedule = optimizers.inner_schedule(_opt(lr=1e-2, warmup_steps=4), 20)
  params = {"w": jnp.ones((2, 2))}
  state = tx.init(params)
  g = {"w": jnp.full((2, 2), 2.0)}
  update = jax.jit(tx.update)
  for t in range(6):
    updates, state = update(g, state, params)
    np.testing.assert_allclose(updates["w"], -2.0 * float(schedule(t)), rtol=1e-6)


def test_grad_clip_scales_the_global_norm_down_to_the_limit():
  tx = optimizers.inner_optimizer(_opt(name="sgd", lr=0.1, warmup_steps=0, grad_clip=1.0), 10)
  params = {"a": jnp.zeros(2), "b": jnp.zeros((1, 1))}
  # Global norm 5 -> scaled by 1/5 over the whole tree (per leaf it would be [1, 0], [[1]]).
  big = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([[4.0]])}
  updates, state = tx.update(big, tx.init(params), params)
  np.testing.assert_allclose(updates["a"], -0.1 * np.array([0.6, 0.0]), rtol=1e-6)
  np.testing.assert_allclose(updates["b"], -0.1 * np.array([[0.8]]), rtol=1e-6)
  # Under the limit nothing changes (the step-1 lr is a little below the peak: cosine).
  small = {"a": jnp.array([0.3, 0.0]), "b": jnp.array([[0.4]])}
  lr1 = float(optimizers.inner_schedule(_opt(lr=0.1, warmup_steps=0), 10)(1))
  updates, _ = tx.update(small, state, params)
  np.testing.assert_allclose(updates["a"], -lr1 * np.array([0.3, 0.0]), rtol=1e-6)
  np.testing.assert_allclose(updates["b"], -lr1 * np.array([[0.4]]), rtol=1e-6)
  # grad_clip = 0 disables it.
  unclipped = optimizers.inner_optimizer(_opt(name="sgd", lr=0.1, warmup_steps=0,
                                              grad_clip=0.0), 10)
  updates, _ = unclipped.update(big, unclipped.init(params), params)
  np.testing.assert_allclose(updates["b"], -0.1 * np.array([[4.0]]), rtol=1e-6)


def test_adamw_decays_matrices_but_not_biases_or_layernorm():
  # With zero gradients Adam's step is 0, so the update is the decay alone: −lr·wd·θ.
  model = nnx.eval_shape(lambda: GPT(get_preset("tiny", tokenizer_vocab=256),
                                     rngs=nnx.Rngs(0)))
  shapes = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  params = jax.tree.map(lambda x: jnp.linspace(0.5, 1.5, x.size).reshape(x.shape), shapes)
  tx = optimizers.inner_optimizer(_opt(lr=1e-2, warmup_steps=0, weight_decay=0.1,
                                       grad_clip=1.0), 10)
  updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params),
                                  params)
  decayed, kept = [], []
  for path, u in jax.tree_util.tree_leaves_with_path(updates):
    name = jax.tree_util.keystr(path)
    theta = params
    for k in path:
      theta = theta[k.key]
    if theta.ndim >= 2:
      np.testing.assert_allclose(u, -1e-2 * 0.1 * theta, rtol=1e-5, err_msg=name)
      decayed.append(name)
    else:
      np.testing.assert_array_equal(u, 0.0, err_msg=name)
      kept.append(name)
  assert any("fc_kernel" in n for n in decayed) and any("wte" in n for n in decayed)
  assert any("ln1" in n and "scale" in n for n in kept)
  assert any("fc_bias" in n for n in kept) and any("ln_f" in n for n in kept)


def _codec(name, error_feedback):
  cfg = ml_collections.ConfigDict(dict(
      codec=name, error_feedback=error_feedback, beta=-1.0, quant_block=0,
      stochastic_rounding=False, density=0.25, chunk=0, k=0, value_bits=32,
      mean_over_senders=False))
  return compress.make_codec(cfg)


def test_topk_without_error_feedback_drops_what_it_did_not_send():
  x = {"v": jnp.array([3.0, 2.0, 1.0, 0.5])}  # density 0.25: one entry per round
  key = jax.random.key(0)
  plain = _codec("topk", error_feedback=False)
  assert plain.init(x) == ()
  sent1, state = plain.roundtrip(x, plain.init(x), key)
  sent2, state = plain.roundtrip(x, state, key)
  assert state == ()
  np.testing.assert_array_equal(sent1["v"], [3.0, 0.0, 0.0, 0.0])
  np.testing.assert_array_equal(sent2["v"], [3.0, 0.0, 0.0, 0.0])  # the same, every round
  # With error feedback the rest is kept: round 2 encodes x + e1 = [3, 4, 2, 1].
  ef = _codec("topk", error_feedback=True)
  sent1, state = ef.roundtrip(x, ef.init(x), key)
  np.testing.assert_array_equal(state["v"], [0.0, 2.0, 1.0, 0.5])
  sent2, state = ef.roundtrip(x, state, key)
  np.testing.assert_array_equal(sent2["v"], [0.0, 4.0, 0.0, 0.0])
  np.testing.assert_array_equal(state["v"], [3.0, 0.0, 2.0, 1.0])


@pytest.mark.parametrize("name", ["int8", "randomk"])
def test_other_codecs_without_error_feedback_carry_no_state(name):
  x = {"v": jnp.linspace(-1.0, 2.0, 12).reshape(3, 4)}
  plain, ef = _codec(name, False), _codec(name, True)
  key = jax.random.key(1)
  out_plain, state = plain.roundtrip(x, plain.init(x), key)
  assert state == ()
  out_ef, residual = ef.roundtrip(x, ef.init(x), key)
  np.testing.assert_array_equal(out_plain["v"], out_ef["v"])  # same first round
  np.testing.assert_allclose(residual["v"], x["v"] - out_ef["v"], atol=1e-7)
  assert np.abs(residual["v"]).max() > 0  # lossy: there is something to carry
  # Round 2, same input: with error feedback it encodes x + e (β = 1), without it x alone.
  key2 = jax.random.key(2)
  second_plain, _ = plain.roundtrip(x, (), key2)
  second_ef, _ = ef.roundtrip(x, residual, key2)
  with_residual, _ = plain.roundtrip({"v": x["v"] + residual["v"]}, (), key2)
  np.testing.assert_array_equal(second_ef["v"], with_residual["v"])
  assert not np.allclose(second_ef["v"], second_plain["v"])


def test_sparseloco_and_demo_keep_their_buffer_whatever_the_flag():
  x = {"v": jnp.ones((8, 8))}
  for name in ("sparseloco", "demo"):
    assert jax.tree.leaves(_codec(name, error_feedback=False).init(x)), name


def _tiny_params_and_loss():
  from lowcomm_jax.model import next_token_loss
  model = GPT(get_preset("tiny", vocab_size=64), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model, nnx.Param)
  params = nnx.to_pure_dict(state)
  windows = jax.random.randint(jax.random.key(1), (4, 17), 0, 64) % 8  # a learnable pattern

  def loss(p):
    s = nnx.state(nnx.merge(graphdef, state), nnx.Param)
    nnx.replace_by_pure_dict(s, p)
    return next_token_loss(nnx.merge(graphdef, s), windows)
  return params, loss


# adafactor's lr is relative to each matrix's RMS (multiply_by_parameter_scale).
@pytest.mark.parametrize("name, lr", [("lamb", 2e-2), ("lars", 1.0), ("adafactor", 0.3),
                                      ("lion", 1e-3), ("muon", 2e-2)])
def test_each_inner_optimizer_trains(name, lr):
  params, loss = _tiny_params_and_loss()
  tx = optimizers.inner_optimizer(_opt(name=name, lr=lr, warmup_steps=0), 20)
  state = jax.jit(tx.init)(params)  # (op by op, each of its ops would compile on its own)

  @jax.jit
  def step(p, s):
    value, grads = jax.value_and_grad(loss)(p)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, value
  first = None
  for _ in range(20):
    params, state, value = step(params, state)
    first = value if first is None else first
  # From ln 64 = 4.16 towards ln 8 = 2.08 (tokens uniform over 8 values).
  last = float(jax.jit(loss)(params))
  assert last < float(first) - 0.5, (name, float(first), last)


def test_muon_orthogonalizes_hidden_matrices_and_leaves_the_rest_to_adamw():
  params, loss = _tiny_params_and_loss()
  labels = optimizers.muon_dimension_numbers(params)
  kinds = {"/".join(str(getattr(k, "key", k)) for k in path): x is not None
           for path, x in jax.tree_util.tree_leaves_with_path(
               labels, is_leaf=lambda x: x is None or not isinstance(x, dict))}
  assert kinds["blocks/0/attn/qkv/kernel"] and kinds["blocks/1/mlp/fc_kernel"]
  assert not kinds["wte/embedding"] and not kinds["wpe/embedding"]
  assert not kinds["blocks/0/ln1/scale"] and not kinds["blocks/0/mlp/fc_bias"]
  # One step from zero momentum: a Muon leaf's update is the orthogonalized gradient (its
  # singular values near one, times lr and the shape factor); AdamW's is lr·sign-like.
  tx = optimizers.inner_optimizer(_opt(name="muon", lr=1.0, warmup_steps=0,
                                       weight_decay=0.0, grad_clip=0.0, min_lr_ratio=1.0), 10)
  grads = jax.jit(jax.grad(loss))(params)
  updates, _ = jax.jit(lambda g, p: tx.update(g, tx.init(p), p))(grads, params)
  u = np.asarray(updates["blocks"][0]["mlp"]["proj_kernel"])  # [128, 32]
  singular = np.linalg.svd(u, compute_uv=False)
  raw = np.linalg.svd(np.asarray(grads["blocks"][0]["mlp"]["proj_kernel"]), compute_uv=False)
  # Newton-Schulz with Muon's coefficients maps the gradient's leading singular values (a
  # few-token batch leaves the rest near 0) into about [0.5, 1.2]: a flat spectrum.
  top = slice(0, 8)
  assert singular[top].max() / singular[top].min() < 1.5, singular
  assert raw[top].max() / raw[top].min() > 3, raw
  # AdamW's first step normalizes every coordinate: one magnitude wherever a gradient is.
  e = np.abs(np.asarray(updates["wte"]["embedding"]))
  moved = e[e > 1e-3]
  assert moved.size > 100 and moved.max() / moved.min() < 1.01


@pytest.mark.parametrize("overrides, field", [
    ({"optimizer.name": "shampoo"}, "optimizer.name"),
    ({"optimizer.momentum": 1.0}, "optimizer.momentum"),
    ({"optimizer.adam_lr": -1.0}, "optimizer.adam_lr"),
])
def test_bad_optimizer_fields_are_named(overrides, field):
  from lowcomm_jax.config import check
  with pytest.raises(check.ConfigError, match=field):
    check.validate(load_config("smoke", **overrides), num_devices=8)


def test_each_optimizer_name_picks_its_optimizer():
  # One step from a fresh state, constant lr, by hand for each method (matrix "w" decays,
  # bias "b" does not). A few gradients of 1e-8 separate AdamW (ε 1e-8: 1e-8/(1e-8 + ε) =
  # ½), LAMB (ε 1e-6) and Lion (sign: 1).
  rng = np.random.default_rng(0)
  p = {"w": rng.normal(size=(8, 16)).astype(np.float32), "b": rng.normal(size=16).astype(np.float32)}
  g = {"w": rng.normal(size=(8, 16)).astype(np.float32), "b": rng.normal(size=16).astype(np.float32)}
  g["w"][0, :4] = 1e-8
  lr, wd = 0.1, 0.1
  decay = {"w": wd * p["w"], "b": 0 * p["b"]}
  rms = lambda x: np.sqrt(np.mean(x ** 2))
  trust = lambda u, k: np.linalg.norm(p[k]) / np.linalg.norm(u)
  adam_dir = lambda eps: {k: g[k] / (np.abs(g[k]) + eps) + decay[k] for k in p}
  lamb = adam_dir(1e-6)
  lars = {k: g[k] + decay[k] for k in p}
  expected = {
      "sgd": {k: -lr * g[k] for k in p},
      "adamw": {k: -lr * v for k, v in adam_dir(1e-8).items()},
      "lion": {k: -lr * (np.sign(g[k]) + decay[k]) for k in p},
      "lamb": {k: -lr * trust(lamb[k], k) * lamb[k] for k in p},
      # LARS' trust coefficient 1e-3, on matrices only.
      "lars": {"w": -lr * 1e-3 * trust(lars["w"], "w") * lars["w"], "b": -lr * lars["b"]},
      # Adafactor's first second-moment estimate is g² itself (unfactored below 128 rows):
      # sign(g), scaled by the parameter's RMS, plus the lr-scaled decay.
      "adafactor": {k: -lr * (max(1e-3, rms(p[k])) * np.sign(g[k]) + decay[k]) for k in p},
  }
  updates = {}
  for name in optimizers.INNER:
    tx = optimizers.inner_optimizer(_opt(name=name, lr=lr, warmup_steps=0, min_lr_ratio=1.0,
                                         weight_decay=wd, grad_clip=0.0), 10)
    updates[name], _ = jax.jit(lambda g, p, tx=tx: tx.update(g, tx.init(p), p))(g, p)
  for name, expect in expected.items():
    for k in p:
      np.testing.assert_allclose(updates[name][k], expect[k], rtol=2e-4, atol=1e-7,
                                 err_msg=f"{name}: {k}")
  # Muon: the matrix's update less its decay is the orthogonalized gradient (a flat
  # spectrum; the raw gradient's is not), the bias gets an Adam step without decay.
  ortho = np.asarray(updates["muon"]["w"]) / -lr - decay["w"]
  singular = np.linalg.svd(ortho, compute_uv=False)
  raw = np.linalg.svd(g["w"], compute_uv=False)
  # Newton-Schulz with Muon's coefficients lands them in about [0.68, 1.13], times the
  # shape factor sqrt(16 / 8).
  assert (singular > 0.6 * 2 ** 0.5).all() and (singular < 1.2 * 2 ** 0.5).all(), singular
  assert raw.max() / raw.min() > 3, raw
  # Its AdamW part is Nesterov's (NAdam): the first step's m̂ is (1 + b1(1 − b1)/(1 − b1²))·g.
  nadam = 1 + 0.9 * 0.1 / (1 - 0.9 ** 2)
  np.testing.assert_allclose(updates["muon"]["b"],
                             -lr * nadam * g["b"] / (np.abs(g["b"]) + 1e-8), rtol=2e-4)
  # Seven names, seven different steps.
  flat = {n: np.concatenate([np.ravel(u[k]) for k in p]) for n, u in updates.items()}
  for a in flat:
    for b in flat:
      assert a == b or not np.allclose(flat[a], flat[b], rtol=1e-3), (a, b)
