"""Streaming DiLoCo: DiLoCo as its one-fragment case, a hand-checked two-fragment
trajectory, fragment layouts, bytes per sync, and exact resume with an update in flight."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import checkpointed_state, load_config, train_rounds
from lowcomm_jax import algorithms, outer
from lowcomm_jax.config import check
from lowcomm_jax.programs import optimizers
from lowcomm_jax.programs import steps
from lowcomm_jax.programs import sync_program
from lowcomm_jax.runtimes.spmd import train
from lowcomm_jax.parallel import mesh as mesh_lib
from lowcomm_jax.parallel.flat import ParamLayout


def _streaming(smoke_config, **overrides):
  return smoke_config(algorithm="streaming", **overrides)


# DiLoCo's run beside streaming's: two workers on one replica device (the same reduction
# order as streaming's one-fragment run), H = 4.
DILOCO = {"num_workers": 2, "inner_steps": 4, "mesh.replica": 1}


def test_one_fragment_without_overlap_or_mix_is_diloco_exactly(smoke_config):
  common = DILOCO
  _, s_diloco, w_diloco, m_diloco = train_rounds(smoke_config(**common), 3)
  _, s_stream, w_stream, m_stream = train_rounds(_streaming(
      smoke_config, **common, **{"streaming.fragments": 1, "streaming.overlap_steps": 0,
                                 "streaming.mix": 0.0}), 3)
  np.testing.assert_array_equal(s_stream.params, s_diloco.params)
  jax.tree.map(np.testing.assert_array_equal, s_stream.outer, s_diloco.outer)
  jax.tree.map(np.testing.assert_array_equal, w_stream, w_diloco)
  np.testing.assert_array_equal(m_stream["train_loss_per_worker"],
                                m_diloco["train_loss_per_worker"])


# --- a toy problem, by hand ---------------------------------------------------------------
# Two "blocks" of one 2-vector each; worker w's loss ½‖θ_b − t_w,b‖² per block, so an SGD
# step at lr η is θ ← θ − η(θ − t). Outer rule: SGD at lr ε, no momentum.
TARGETS = np.array([[[1.0, -1.0], [2.0, 0.5]], [[-3.0, 1.0], [0.0, 4.0]]], np.float32)
THETA0 = {"blocks": {0: {"w": np.array([0.5, 0.25], np.float32)},
                     1: {"w": np.array([-1.0, 2.0], np.float32)}}}
ETA, EPS = 0.25, 0.7


def _toy_config(smoke_config, tau, alpha):
  return _streaming(smoke_config, num_workers=2, inner_steps=4, **{
      "streaming.fragments": 2, "streaming.overlap_steps": tau, "streaming.mix": alpha,
      "optimizer.name": "sgd", "optimizer.lr": ETA, "optimizer.warmup_steps": 0,
      "optimizer.min_lr_ratio": 1.0, "optimizer.grad_clip": 0.0,
      "outer.lr": EPS, "outer.momentum": 0.0})


def _toy_run(config, rounds):
  """θ after every sync, and the workers at the end, through programs/steps.py's programs."""
  algorithm = algorithms.get("streaming")
  layout = ParamLayout.of(THETA0, algorithm.leaf_fragments(config, THETA0))
  segments = algorithm.segments(config, config.inner_steps)
  inner_tx = optimizers.inner_optimizer(config.optimizer, 1000)

  def loss_fn(params, target_2x2, key, frozen):
    return sum(0.5 * jnp.sum((params["blocks"][b]["w"] - target_2x2[b]) ** 2) for b in (0, 1))

  aggregate = algorithm.sync(config, hosts=(), d_ff=1)  # no tiers: the plain mean
  aggregators = [aggregate.aggregator(layout.fragment(p)) for p in range(2)]
  rules = [outer.diloco_outer(EPS, 0.0) for _ in range(2)]
  local = [jax.jit(steps.make_local_segment(
      loss_fn, inner_tx=inner_tx, hidden=1, d_ff=1, layout=layout, segment=s, index=k,
      count=2, alpha=algorithm.mix(config), local_steps=True)) for k, s in enumerate(segments)]
  syncs = [jax.jit(sync_program.make_sync(aggregators[s.sync], rules[s.sync], nested=False,
                                   weigh_tokens=False, layout=layout, fragment=s.sync, count=2,
                                   last=k == 1), static_argnames="metrics")
           for k, s in enumerate(segments)]
  with jax.set_mesh(mesh_lib.make_mesh(1, 1, 1)):
    state = steps.init_state(layout.ravel(THETA0), seed=0, layout=layout,
                             aggregators=aggregators, rules=rules, num_workers=2)
    workers = steps.init_workers(state.params, workers=2, hidden=1, d_ff=1, layout=layout,
                                 inner_tx=inner_tx, local_steps=True)
    ids = jnp.arange(2, dtype=jnp.int32)
    signals = steps.Signals(jnp.ones(2, jnp.int32), jnp.ones(2, jnp.float32),
                            jnp.zeros(2, jnp.float32))
    thetas = []
    for _ in range(rounds):
      for k, s in enumerate(segments):
        batches = jnp.broadcast_to(jnp.asarray(TARGETS)[:, None], (2, s.steps, 2, 2))
        delta, workers, _ = local[k](state._replace(outer=()), workers, batches, ids)
        state, _ = syncs[k](state, delta, signals, metrics=False)
        thetas.append(np.asarray(layout.unravel(state.params)["blocks"][0]["w"]).tolist()
                      + np.asarray(layout.unravel(state.params)["blocks"][1]["w"]).tolist())
  return np.asarray(thetas), workers, layout


def _by_hand(rounds, tau, alpha):
  """The same trajectory in plain numpy: who syncs when, the τ-late apply, the α mix."""
  theta = [THETA0["blocks"][b]["w"].astype(np.float64) for b in (0, 1)]
  own = [[t.copy() for t in theta] for _ in range(2)]
  thetas = []
  for r in range(rounds):
    for p in (0, 1):  # segment p: 2 steps, then fragment (= block) p syncs
      landing = 1 - p  # the fragment synced at the end of the previous segment
      for t in range(2):
        if t == tau and (r > 0 or p > 0):  # nothing is in flight before the first sync
          for w in range(2):
            own[w][landing] = theta[landing] + alpha * (own[w][landing] - theta[landing])
        for w in range(2):
          for b in (0, 1):
            own[w][b] = own[w][b] - ETA * (own[w][b] - TARGETS[w, b])
      mean_delta = np.mean([theta[p] - own[w][p] for w in range(2)], axis=0)
      theta[p] = theta[p] - EPS * mean_delta
      thetas.append(np.concatenate(theta).tolist())
  return np.asarray(thetas), own


@pytest.mark.parametrize("tau,alpha", [(0, 0.0), (1, 0.5)])
def test_two_fragments_follow_the_hand_computed_trajectory(smoke_config, tau, alpha):
  got, workers, layout = _toy_run(_toy_config(smoke_config, tau, alpha), rounds=3)
  want, own = _by_hand(3, tau, alpha)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # Each sync moved only its own fragment: block p after segment p, the other untouched.
  for k in range(1, len(want)):
    moved = np.abs(got[k] - got[k - 1]) > 0
    p = k % 2
    assert moved[2 * p:2 * p + 2].all() and not moved[2 * (1 - p):2 * (1 - p) + 2].any()
  # The workers kept their own parameters (not θ) across rounds.
  for w in range(2):
    np.testing.assert_allclose(layout.unravel(workers.params[w])["blocks"][0]["w"], own[w][0],
                               rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(workers.steps) == 3 * 4)


def test_fragment_layouts_cover_every_block_once(smoke_config):
  tree = {"blocks": {i: {"w": np.zeros(3, np.float32)} for i in range(6)},
          "wte": {"embedding": np.zeros(4, np.float32)}}
  algorithm = algorithms.get("streaming")
  strided = algorithm.leaf_fragments(_streaming(smoke_config, **{"streaming.fragments": 3}),
                                     tree)
  # Leaves in tree order: blocks 0..5, then wte (which joins the lightest, fragment 0).
  assert strided == (0, 1, 2, 0, 1, 2, 0)
  sequential = algorithm.leaf_fragments(_streaming(
      smoke_config, **{"streaming.fragments": 3, "streaming.layout": "sequential"}), tree)
  assert sequential == (0, 0, 1, 1, 2, 2, 0)
  layout = ParamLayout.of(tree, strided)
  assert layout.bounds == ((0, 10), (10, 16), (16, 22))  # blocks 0, 3 and wte are contiguous
  flat = layout.ravel(jax.tree.map(lambda x: x + 1.0, tree))
  jax.tree.map(np.testing.assert_array_equal, layout.unravel(flat),
               jax.tree.map(lambda x: x + 1.0, tree))


def _in_flight_config(smoke_config):
  """Two fragments, τ = 1, α = 0.5, a checkpoint every round: the last fragment's update,
  sent at the end of a round, lands one step into the next; a checkpoint between the two
  holds it in flight (θ updated, θ_w not yet mixed)."""
  return _streaming(smoke_config, num_workers=2, inner_steps=4, rounds=2, checkpoint_every=1,
                    **{"streaming.fragments": 2, "streaming.overlap_steps": 1,
                       "streaming.mix": 0.5})


@pytest.fixture(scope="module")
def in_flight_run(tmp_path_factory):
  """(config, summary, workdir) of `_in_flight_config` trained uninterrupted (read only)."""
  config = _in_flight_config(lambda **o: load_config("smoke", **o))
  workdir = tmp_path_factory.mktemp("in_flight") / "straight"
  return config, train.run(config, workdir), workdir


def test_each_fragment_syncs_once_per_round_and_peak_bytes_shrink(smoke_config, in_flight_run):
  config, summary, _ = in_flight_run
  r = train.build(config)
  assert [s.sync for s in r.segments(4)] == [0, 1]  # one sync per fragment per H steps
  sent = [b.sent for b in r.sync_bytes()]
  fragment_bytes = [4 * (end - start) for start, end in r.model.layout.bounds]
  assert sent == fragment_bytes and sum(sent) == r.model.param_bytes
  assert summary["bytes_sent"] == 2 * r.model.param_bytes  # = DiLoCo's: the whole model per round
  assert summary["bytes_sent_peak_sync"] == max(fragment_bytes) < r.model.param_bytes
  diloco = train.build(smoke_config(**DILOCO))  # (built already beside streaming's one fragment)
  assert [b.sent for b in diloco.sync_bytes()] == [r.model.param_bytes]  # DiLoCo: all at once


def test_resume_mid_cycle_with_an_update_in_flight_is_exact(tmp_path, in_flight_run):
  # τ = 1: the last fragment's update, sent at the end of a round, lands one step into the
  # next; a checkpoint between the two holds it in flight (θ updated, θ_w not yet mixed).
  config, straight, straight_dir = in_flight_run
  assert train.run(config, tmp_path / "resumed", stop_after_rounds=1) == {"stopped_at_round": 1}
  resumed = train.run(config, tmp_path / "resumed")
  assert resumed["eval_loss"] == straight["eval_loss"]
  jax.tree.map(np.testing.assert_array_equal, checkpointed_state(config, straight_dir),
               checkpointed_state(config, tmp_path / "resumed"))


@pytest.mark.parametrize("overrides,message", [
    ({"inner_steps": 3}, "H=3 must be a multiple of streaming.fragments=2"),
    ({"streaming.overlap_steps": 2}, "H/P > streaming.overlap_steps=2"),
    ({"streaming.fragments": 3}, "streaming.fragments=3: must be in [1, 2]"),
    ({"streaming.layout": "zigzag"}, "streaming.layout='zigzag'"),
    ({"streaming.mix": 1.0}, "streaming.mix=1.0: alpha must be in [0, 1)"),
    ({"outer.dylu": True}, "outer.dylu=True: streaming's fragments"),
])
def test_bad_streaming_configs_name_the_field(smoke_config, overrides, message):
  config = _streaming(smoke_config, **{"inner_steps": 4, **overrides})
  with pytest.raises(check.ConfigError) as e:
    check.validate(config, num_devices=8)
  assert message in str(e.value)


def test_streaming_fields_without_streaming_are_refused(smoke_config):
  with pytest.raises(check.ConfigError, match="ignored unless algorithm='streaming'"):
    check.validate(smoke_config(**{"streaming.fragments": 4}), num_devices=8)



def _codec_tiers_config(smoke_config):
  """Tiers 1.0 and 0.5, the 4-bit codec, τ = 1 and α = 0.5."""
  from lowcomm_jax.assemble.hosts import host
  return _streaming(smoke_config, hosts=[host(1.0), host(0.5)], num_workers=2,
                    inner_steps=4, rounds=2, eval_every=2, checkpoint_every=2,
                    **{"compress.codec": "int4", "streaming.overlap_steps": 1,
                       "streaming.mix": 0.5})


def test_a_codec_compresses_each_fragment_with_tiers(smoke_config, tmp_path):
  """4-bit, as in the paper, with its error-feedback buffers per fragment and worker."""
  from lowcomm_jax import compress
  config = _codec_tiers_config(smoke_config)
  r = train.build(config)
  codec_ = compress.make_codec(config.compress, lr=config.optimizer.lr)
  per_fragment = [codec_.payload_bytes(r.model.layout.fragment(p).abstract) for p in range(2)]
  assert [b.sent for b in r.sync_bytes()] == per_fragment  # each sync: its fragment's payload
  summary = train.run(config, tmp_path)
  assert summary["bytes_sent"] == 2 * sum(per_fragment)
  assert summary["bytes_sent_peak_sync"] == max(per_fragment)
  assert summary["eval_loss"] < np.log(256)  # it trained


def test_a_narrow_tier_keeps_its_untrained_units_at_the_global_value(smoke_config):
  """With α > 0 a landing fragment mixes only what the tier trains: the hidden units it does
  not train follow θ exactly, so their Δ, which a codec would send, stays zero. (The local
  programs hold no codec: the codec test's run, built once.)"""
  config = _codec_tiers_config(smoke_config)
  assert config.streaming.overlap_steps == 1 and config.streaming.mix == 0.5
  r, state, workers, _ = train_rounds(config, 1)
  theta = r.model.layout.unravel(state.params)["blocks"][0]["mlp"]
  narrow = r.model.layout.unravel(workers[1].params[0])["blocks"][0]["mlp"]  # landed, not synced
  m = r.topology.hosts[1].hidden
  np.testing.assert_array_equal(narrow["fc_kernel"][:, m:], theta["fc_kernel"][:, m:])
  np.testing.assert_array_equal(narrow["proj_kernel"][m:], theta["proj_kernel"][m:])
  assert not np.array_equal(narrow["fc_kernel"][:, :m], theta["fc_kernel"][:, :m])  # trained


def test_fragments_of_a_real_model(smoke_config):
  """small12's 12 blocks in 4 strided fragments: block i (10 and 11 included) in fragment
  i mod 4, each fragment one contiguous slice whose sub-layout views that slice."""
  config = _streaming(smoke_config, inner_steps=8, **{"model.name": "small12",
                                                       "data.seq_len": 32,
                                                       "streaming.fragments": 4})
  r = train.build(config)
  layout = r.model.layout
  flat = jnp.arange(layout.size, dtype=jnp.float32)
  # One jitted program for the views (eagerly each of small12's ~200 slices compiles alone).
  tree, parts = jax.jit(lambda f: (layout.unravel(f), [
      layout.fragment(p).unravel(layout.fragment_slice(f, p)) for p in range(4)]))(flat)
  for p in range(4):
    part = parts[p]
    blocks = sorted(part.get("blocks", {}))
    assert blocks == [i for i in range(12) if i % 4 == p]
    for i in blocks:
      jax.tree.map(np.testing.assert_array_equal, part["blocks"][i], tree["blocks"][i])
  assert sorted(r.model.layout.fragment(0).abstract) == ["blocks", "ln_f", "wpe", "wte"]
  assert [end - start for start, end in r.model.layout.bounds][1:] == [
      r.model.layout.fragment(p).size for p in range(1, 4)]


def test_a_segment_in_two_parts_is_the_whole_segment(smoke_config):
  """`Programs.local_halves`: the steps before the mix (reading nothing of θ: run from a
  stale θ here), then the mix and the rest from the new θ, end where the whole segment
  ends from the new θ (the Ray runtime's peer form runs the first part while the last
  sync's collective does), up to float rounding: two programs, not one, so XLA may fuse
  Adam's update differently (measured: 2 of 23,008 coordinates 1.6e-6 apart)."""
  from lowcomm_jax.assemble.build import build
  from lowcomm_jax.assemble.jitted import init_run, jitted_steps
  from lowcomm_jax.assemble.plan import one_device
  config = _streaming(smoke_config, num_workers=1, inner_steps=6, **{
      "mesh.replica": 1, "streaming.fragments": 2, "streaming.overlap_steps": 2,
      "streaming.mix": 0.5})
  r = build(one_device(config), check_memory=False)
  fns = jitted_steps(r, donate=False)
  state, (workers,) = init_run(r, fns)
  batches = jnp.asarray(np.random.default_rng(0).integers(
      0, 256, (1, 3, config.data.batch_size, config.data.seq_len + 1)), jnp.int32)
  ids = jnp.zeros((1,), jnp.int32)
  new = state._replace(round=jnp.asarray(1, jnp.int32), params=state.params + 0.01)
  stale = state._replace(round=jnp.asarray(1, jnp.int32), params=state.params - 5.0)
  for k in range(2):
    head, tail = fns.local_halves[0][k]
    whole = fns.local[0][k](r.local_input(new), workers, batches, ids)
    _, half, first = head(r.local_input(stale), workers, batches, ids)
    delta, after, rest = tail(r.local_input(new), half, batches, ids)
    np.testing.assert_allclose(delta, whole[0], rtol=0, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), after,
                 whole[1])
    np.testing.assert_allclose(jnp.concatenate([first, rest], axis=1), whole[2], rtol=1e-6)
    assert after.steps[0] == whole[1].steps[0] == 3
  # (a mix changes the result: the whole segment from the stale θ is another one)
  other = fns.local[0][1](r.local_input(stale), workers, batches, ids)
  assert np.abs(np.asarray(other[0]) - np.asarray(whole[0])).max() > 1e-3
