import os

import numpy as np
import pytest

from lowcomm_jax.data import (DataError, WorkerStreams, eval_windows, get_tokenizer, load_tokens,
                              resolve_corpus, split_train_val)
from lowcomm_jax.data import corpus as corpus_lib

TOKENS = np.arange(5000, dtype=np.uint16) % 251


def _streams(mode, workers=(0, 1, 2), seed=0):
  return WorkerStreams(TOKENS, worker_ids=workers, seq_len=16, batch_size=4, seed=seed,
                       batch_mode=mode)


def test_windows_are_contiguous_corpus_slices():
  batch = _streams("different").next_round(2)
  assert batch.shape == (3, 2, 4, 17) and batch.dtype == np.int32
  for window in batch.reshape(-1, 17):
    start = int(np.flatnonzero(TOKENS == window[0])[0])
    diffs = np.diff(window.astype(np.int64)) % 251
    assert np.all(diffs == 1), start  # consecutive tokens of the corpus


def test_streams_are_deterministic_per_seed_and_worker():
  a = _streams("different").next_round(3)
  b = _streams("different").next_round(3)
  np.testing.assert_array_equal(a, b)
  # Worker 1's stream does not depend on which other workers this process holds.
  alone = _streams("different", workers=(1,)).next_round(3)
  np.testing.assert_array_equal(alone[0], a[1])
  other_seed = _streams("different", seed=1).next_round(3)
  assert not np.array_equal(a, other_seed)


def test_different_mode_gives_each_worker_its_own_batches_and_same_mode_shares_them():
  diff = _streams("different").next_round(2)
  assert not np.array_equal(diff[0], diff[1]) and not np.array_equal(diff[1], diff[2])
  same = _streams("same").next_round(2)
  np.testing.assert_array_equal(same[0], same[1])
  np.testing.assert_array_equal(same[1], same[2])
  assert not np.array_equal(same[0, 0], same[0, 1])  # but steps still differ


def test_iterator_state_round_trips():
  s = _streams("different")
  s.next_round(2)
  state = s.get_state()
  expected = s.next_round(2)
  fresh = _streams("different")
  fresh.set_state(state)
  np.testing.assert_array_equal(fresh.next_round(2), expected)
  with pytest.raises(ValueError, match="do not match"):
    _streams("same").set_state(state)


def test_eval_windows_are_fixed():
  a = eval_windows(TOKENS, seq_len=16, batch_size=4, num_batches=3, seed=0)
  np.testing.assert_array_equal(a, eval_windows(TOKENS, seq_len=16, batch_size=4, num_batches=3,
                                                seed=0))
  assert a.shape == (3, 4, 17)


def test_split_is_90_10():
  train, val = split_train_val(np.arange(1000), 0.1)
  assert len(train) == 900 and len(val) == 100 and val[0] == 900


def test_byte_tokenizer_round_trips():
  tok = get_tokenizer("byte")
  ids = tok.encode("To be, or not — to be")
  assert tok.vocab_size == 256 and ids.max() < 256
  assert tok.decode(ids) == "To be, or not — to be"


def test_gpt2_is_r50k_base_and_loads_offline():
  if not os.environ.get("TIKTOKEN_CACHE_DIR"):
    pytest.skip("needs TIKTOKEN_CACHE_DIR (../shared/data/tiktoken)")
  tok = get_tokenizer("gpt2")
  assert tok.name == "r50k_base" and tok.vocab_size == 50257
  assert tok.decode(tok.encode("Hello world")) == "Hello world"
  assert list(tok.encode("Hello world")) == [15496, 995]


def test_unknown_tokenizer_names_the_choices():
  with pytest.raises(ValueError, match="byte"):
    get_tokenizer("sentencepiece")


def test_any_text_file_is_a_corpus_and_tokens_are_cached(tmp_path, monkeypatch):
  monkeypatch.setenv("LOWCOMM_CACHE_DIR", str(tmp_path / "cache"))
  text = tmp_path / "my.txt"
  text.write_text("hello corpus " * 100)
  path = resolve_corpus(str(text))
  tokens = load_tokens(path, get_tokenizer("byte"))
  cached = list((tmp_path / "cache" / "tokens").glob("*-byte.npy"))
  assert len(cached) == 1
  np.testing.assert_array_equal(np.load(cached[0]), tokens)
  text.write_text("changed " * 100)  # new content -> new cache key
  load_tokens(path, get_tokenizer("byte"))
  assert len(list((tmp_path / "cache" / "tokens").glob("*-byte.npy"))) == 2


def test_default_corpus_comes_from_the_local_data_dir():
  if not os.environ.get("LOWCOMM_DATA_DIR"):
    pytest.skip("needs LOWCOMM_DATA_DIR (../shared/data)")
  path = resolve_corpus("")
  assert path.name == "input.txt" and path.stat().st_size == 1115394


def test_missing_corpus_without_network_says_how_to_provide_it(tmp_path, monkeypatch):
  monkeypatch.delenv("LOWCOMM_DATA_DIR", raising=False)
  monkeypatch.setenv("LOWCOMM_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(corpus_lib, "TINY_SHAKESPEARE_URL", "http://127.0.0.1:9/input.txt")
  with pytest.raises(DataError, match="LOWCOMM_DATA_DIR"):
    resolve_corpus("")
  with pytest.raises(DataError, match="data.path"):
    resolve_corpus(str(tmp_path / "nope.txt"))


def test_a_run_evaluates_on_the_validation_tail_and_trains_on_the_rest(tmp_path, monkeypatch,
                                                                         smoke_config):
  # Letters for the first 90% of the corpus, digits for the last 10%: which split a window
  # came from shows in its tokens.
  from lowcomm_jax.assemble import build
  monkeypatch.setenv("LOWCOMM_CACHE_DIR", str(tmp_path / "cache"))
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("abcdefghijklmnopqrstuvwxyz"[:20] * 450 + "0123456789" * 100)
  r = build.build(smoke_config(**{"data.path": str(corpus), "data.val_fraction": 0.1}))
  val, train = set(b"0123456789"), set(b"abcdefghijklmnopqrst")
  assert r.data.eval_windows.shape == (2, 4, 33)
  assert set(np.unique(r.data.eval_windows)) <= val
  batches = r.data.streams[0].next_round(3)
  assert set(np.unique(batches)) <= train
  # Windows start anywhere in their split, not at a fixed offset.
  assert len({w[0] for w in r.data.eval_windows.reshape(-1, 33)}) > 1
