"""Corrupted data streams and adversarial updates (data.corrupt_workers, attack.*), the test
bed of robust aggregation."""

import jax
import numpy as np
import pytest

from conftest import load_config, train_rounds
from lowcomm_jax.config import check
from lowcomm_jax.data import WorkerStreams
from lowcomm_jax.aggregate import make_attack

TOKENS = (np.arange(200_000) * 7 % 251).astype(np.uint16)


def _streams(corrupt=None):
  return WorkerStreams(TOKENS, worker_ids=(0, 1), seq_len=255, batch_size=8, seed=3,
                       batch_mode="different", corrupt=corrupt)


def test_token_swap_corrupts_the_configured_share_of_one_workers_tokens():
  clean = _streams().next_round(50)
  bad = _streams({1: ("token_swap", 0.3, 256)})
  dirty = bad.next_round(50)
  np.testing.assert_array_equal(dirty[0], clean[0])  # worker 0 untouched
  changed = float((dirty[1] != clean[1]).mean())
  # A swap draws the same token again with chance 1/256.
  assert changed == pytest.approx(0.3 * 255 / 256, abs=0.01)
  # Deterministic from the stream's position: a restored stream corrupts the same way.
  state = bad.get_state()
  again = _streams({1: ("token_swap", 0.3, 256)})
  again.set_state(state)
  np.testing.assert_array_equal(again.next_round(3), bad.next_round(3))


def test_shuffle_permutes_each_window():
  clean = _streams().next_round(2)
  dirty = _streams({0: ("shuffle", 0.0, 256)}).next_round(2)
  assert not np.array_equal(dirty[0], clean[0])
  np.testing.assert_array_equal(np.sort(dirty[0], axis=-1), np.sort(clean[0], axis=-1))


def test_other_text_replaces_the_configured_share_of_windows_by_the_other_corpus():
  other = np.arange(251, 256, dtype=np.uint16)[np.arange(50_000) % 5]  # ids the corpus lacks
  clean = _streams().next_round(100)
  bad = _streams({1: ("other_text", 0.4, 256, other)})
  dirty = bad.next_round(100)
  np.testing.assert_array_equal(dirty[0], clean[0])
  from_other = (dirty[1] >= 251).all(axis=-1)  # [steps, batch]: a window is one or the other
  untouched = (dirty[1] == clean[1]).all(axis=-1)
  assert (from_other ^ untouched).all()
  assert float(from_other.mean()) == pytest.approx(0.4, abs=0.05)  # 800 windows
  for window in dirty[1][from_other][:20]:  # a real window of the other text
    start = int(np.argmax(other == window[0]))
    np.testing.assert_array_equal(window, other[start:start + window.size])
  again = _streams({1: ("other_text", 0.4, 256, other)})
  again.set_state(bad.get_state())
  np.testing.assert_array_equal(again.next_round(3), bad.next_round(3))


def test_other_text_trains_from_a_second_file(tmp_path):
  other = tmp_path / "other.txt"
  other.write_text("lorem ipsum dolor sit amet " * 400)
  config = load_config("smoke", rounds=1, **{
      "data.corrupt_workers": (1,), "data.corruption": "other_text",
      "data.corruption_prob": 1.0, "data.corruption_path": str(other)})
  from lowcomm_jax.assemble import build
  batch = build.build(config).data.streams[0].next_round(2)
  assert set(np.unique(batch[1]).tolist()) <= set(b" loremipsudtca")  # worker 1: all other text
  assert not set(np.unique(batch[0]).tolist()) <= set(b" loremipsudtca")
  other.write_text("too short")  # shorter than a window: refused at start-up, named
  from lowcomm_jax.data import DataError
  with pytest.raises(DataError, match="data.corruption_path"):
    build.build(config)


def test_attacks_replace_only_the_attackers_updates():
  d = jax.random.normal(jax.random.key(0), (4, 50))
  key = jax.random.key(1)

  def attacked(*args):  # each attack one program, as in the sync (op by op, each op compiles)
    return np.asarray(jax.jit(make_attack(*args))(d, key))

  scaled = attacked((1,), "scale", 100.0, 4)
  d = np.asarray(d)
  np.testing.assert_allclose(scaled[1], 100 * d[1], rtol=1e-6)
  np.testing.assert_array_equal(np.delete(scaled, 1, 0), np.delete(d, 1, 0))
  np.testing.assert_allclose(attacked((0, 2), "sign_flip", 0, 4)[2], -d[2])
  rand = attacked((3,), "random", 0, 4)
  assert float(np.linalg.norm(rand[3])) == pytest.approx(float(np.linalg.norm(d[3])), rel=1e-5)
  assert abs(float(np.dot(rand[3], d[3]))) < 0.5 * float(np.linalg.norm(d[3])) ** 2
  assert make_attack((), "scale", 100.0, 4) is None


def test_a_scaled_attacker_breaks_the_mean_and_not_the_robust_rules():
  base = dict(num_workers=4, rounds=3, **{"attack.workers": (0,), "attack.scale": 100.0})
  r, clean_state, _, _ = train_rounds(load_config("smoke", num_workers=4, rounds=3), 3)
  # Every run's model through the clean run's eval program: the same model and eval windows.
  eval_step = jax.jit(r.programs.eval)

  def eval_loss(state) -> float:
    with jax.set_mesh(r.topology.mesh):
      return float(eval_step(state.params, r.data.eval_windows)[0])

  losses = {}
  for rule in ("mean", "median", "centered_clip"):
    config = load_config("smoke", **base, **{"aggregate.rule": rule})
    attacked, state, _, _ = train_rounds(config, 3)
    np.testing.assert_array_equal(attacked.data.eval_windows, r.data.eval_windows)
    losses[rule] = eval_loss(state)
  clean = eval_loss(clean_state)
  assert not losses["mean"] < clean + 1.0, losses  # (a NaN fails the other way, too)
  for rule in ("median", "centered_clip"):
    assert losses[rule] < clean * 1.05, (rule, losses, clean)


@pytest.mark.parametrize("overrides,message", [
    ({"data.corrupt_workers": (7,)}, "data.corrupt_workers"),
    ({"data.corrupt_workers": (1,), "data.corruption": "other"}, "data.corruption"),
    ({"data.corrupt_workers": (1,), "data.batch_mode": "same"}, "batch_mode=different"),
    ({"attack.workers": (0,), "attack.kind": "noise"}, "attack.kind"),
    ({"data.corrupt_workers": (1,), "data.corruption": "other_text"}, "data.corruption_path"),
])
def test_bad_adversary_configs_name_the_field(overrides, message):
  with pytest.raises(check.ConfigError, match=message):
    check.validate(load_config("smoke", num_workers=4, **overrides), num_devices=8)


def test_contiguous_partitions_give_each_worker_its_own_shard():
  tokens = np.arange(100_000, dtype=np.uint32)  # a token's value is its position
  streams = WorkerStreams(tokens, worker_ids=(0, 1), seq_len=15, batch_size=4, seed=0,
                          batch_mode="different", partitions=2)
  batch = streams.next_round(20)
  assert batch[0].max() < 50_000 and batch[1].min() >= 50_000
