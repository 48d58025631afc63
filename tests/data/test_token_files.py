"""Pre-tokenized corpora: `prepare`, nanoGPT's format read from disk through np.memmap, the
vocabulary check, bad inputs, and an interrupted prepare."""

import gzip
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, checkpointed_state, load_config
from lowcomm_jax.runtimes.spmd import train
from lowcomm_jax.data import DataError, WorkerStreams, eval_windows, get_tokenizer, open_corpus
from lowcomm_jax.data import prepare as prepare_lib


@pytest.fixture
def shakespeare() -> pathlib.Path:
  """The offline corpus in LOWCOMM_DATA_DIR (conftest: ../shared/data by default)."""
  path = pathlib.Path(os.environ.get("LOWCOMM_DATA_DIR", "/nonexistent"))
  path = path / "tinyshakespeare" / "input.txt"
  if not path.is_file():
    pytest.skip("needs LOWCOMM_DATA_DIR with tinyshakespeare/input.txt (../shared/data)")
  return path


def _prepare(*argv):
  return prepare_lib.prepare(prepare_lib.parse_args([str(a) for a in argv]))


def _data(path, **fields):
  c = load_config("smoke", **{"data.path": str(path), **{f"data.{k}": v
                                                          for k, v in fields.items()}})
  return c


def test_prepare_then_decode_round_trips_documents_and_separators(tmp_path):
  docs = ["First document.\nTwo lines.", "Second: üñíçødé", "Third, in a gzip file."]
  (tmp_path / "in").mkdir()
  with open(tmp_path / "in" / "a.jsonl", "w") as f:
    for d in docs[:2]:
      f.write(json.dumps({"body": d}) + "\n")
  with gzip.open(tmp_path / "in" / "b.jsonl.gz", "wt") as f:
    f.write(json.dumps({"body": docs[2]}) + "\n")
  text = "A plain text file,\n" * 50
  (tmp_path / "c.txt").write_text(text)
  meta = _prepare("--input", tmp_path / "in", "--input", tmp_path / "c.txt", "--tokenizer",
                  "gpt2", "--out", tmp_path / "out", "--text_field", "body",
                  "--val_fraction", "0.2", "--workers", "2")
  out = tmp_path / "out"
  assert meta["dtype"] == "uint16" and meta["tokenizer"] == "r50k_base"
  train_ids = np.fromfile(out / "train.bin", np.uint16)
  val_ids = np.fromfile(out / "val.bin", np.uint16)
  assert (len(train_ids), len(val_ids)) == (meta["tokens"]["train"], meta["tokens"]["val"])
  tok = get_tokenizer("gpt2")
  eot = "<|endoftext|>"
  assert tok.decode(np.concatenate([train_ids, val_ids])) == eot.join(docs + [text]) + eot
  total = len(train_ids) + len(val_ids)
  assert len(train_ids) == int(total * 0.8)  # the stream's tail validates, as for text
  assert meta["max_token"] == int(np.concatenate([train_ids, val_ids]).max())
  # A rerun with the same inputs keeps what is there; other inputs are refused.
  before = (out / "train.bin").stat().st_mtime_ns
  _prepare("--input", tmp_path / "in", "--input", tmp_path / "c.txt", "--tokenizer", "gpt2",
           "--out", out, "--text_field", "body", "--val_fraction", "0.2")
  assert (out / "train.bin").stat().st_mtime_ns == before
  with pytest.raises(DataError, match="already holds a prepared corpus of other inputs"):
    _prepare("--input", tmp_path / "c.txt", "--tokenizer", "gpt2", "--out", out,
             "--text_field", "body", "--val_fraction", "0.2")  # only the inputs differ


def test_pieces_cut_where_the_whole_text_would_split_its_tokens(tmp_path, monkeypatch, shakespeare):
  """Text files are cut into pieces for the tokenizing processes; GPT-2 BPE of the pieces
  equals BPE of the whole file (cuts fall before lines that start with a non-space)."""
  monkeypatch.setattr(prepare_lib, "PIECE_BYTES", 200)
  text = shakespeare.read_text()[:30_000] + "end.\n\n\n  indented\r\nCRLF\r\n"
  (tmp_path / "t.txt").write_bytes(text.encode())
  _prepare("--input", tmp_path / "t.txt", "--tokenizer", "gpt2", "--out", tmp_path / "p",
           "--val_fraction", "0.1")
  ids = np.concatenate([np.fromfile(tmp_path / "p" / f, np.uint16)
                        for f in ("train.bin", "val.bin")])
  whole = get_tokenizer("gpt2").encode(text)
  np.testing.assert_array_equal(ids, np.append(whole, 50256))


def test_a_bad_input_line_is_an_error_with_several_processes(tmp_path):
  (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
  with pytest.raises(DataError, match=r"a.jsonl:2: no text field 'text'"):
    _prepare("--input", tmp_path / "a.jsonl", "--tokenizer", "byte", "--out",
             tmp_path / "p", "--workers", "2")
  assert not (tmp_path / "p" / "meta.json").exists()


def test_a_file_from_a_numpy_writer_in_nanogpts_format_is_read(tmp_path):
  # nanoGPT's prepare.py, in three lines:
  ids = (np.arange(3000) * 7 % 256).astype(np.uint16)
  ids.tofile(tmp_path / "train.bin")
  ids[:500].tofile(tmp_path / "val.bin")
  corpus = open_corpus(_data(tmp_path / "train.bin", val_path=str(tmp_path / "val.bin")).data,
                       window=33)
  assert isinstance(corpus.train, np.memmap)
  np.testing.assert_array_equal(corpus.train, ids)
  np.testing.assert_array_equal(corpus.val, ids[:500])
  # Without a val file, the tail is held out as a text corpus's would be.
  tail = open_corpus(_data(tmp_path / "train.bin").data, window=33)
  np.testing.assert_array_equal(tail.train, ids[:2700])
  np.testing.assert_array_equal(tail.val, ids[2700:])
  # nanoGPT's folder (train.bin and val.bin, no meta.json) reads as the two files.
  folder = open_corpus(_data(tmp_path).data, window=33)
  np.testing.assert_array_equal(folder.val, ids[:500])
  # uint32 files (vocabularies over 65,535) too.
  ids.astype(np.uint32).tofile(tmp_path / "wide.bin")
  wide = open_corpus(_data(tmp_path / "wide.bin", dtype="uint32").data, window=33)
  np.testing.assert_array_equal(wide.train, ids[:2700])


def test_memmapped_windows_equal_in_memory_windows(tmp_path):
  ids = (np.arange(20_000) * 31 % 256).astype(np.uint16)
  ids.tofile(tmp_path / "t.bin")
  mapped = np.memmap(tmp_path / "t.bin", dtype=np.uint16, mode="r")
  kwargs = dict(worker_ids=(0, 3), seq_len=16, batch_size=4, seed=5, batch_mode="different")
  a, b = WorkerStreams(mapped, **kwargs), WorkerStreams(ids, vocab_size=256, **kwargs)
  np.testing.assert_array_equal(a.next_round(3), b.next_round(3))
  b2 = WorkerStreams(ids, **kwargs)
  b2.set_state(b.get_state())  # positions carry over between the two kinds
  np.testing.assert_array_equal(a.next_round(2), b2.next_round(2))
  np.testing.assert_array_equal(
      eval_windows(mapped, seq_len=16, batch_size=4, num_batches=2, seed=1),
      eval_windows(ids, seq_len=16, batch_size=4, num_batches=2, seed=1))


def _shakespeare_bin(tmp_path, shakespeare) -> tuple[pathlib.Path, pathlib.Path]:
  """TinyShakespeare's bytes as uint16 token files, split as a text run splits it."""
  ids = np.frombuffer(shakespeare.read_bytes(), np.uint8).astype(np.uint16)
  n_train = int(len(ids) * 0.9)
  ids[:n_train].tofile(tmp_path / "train.bin")
  ids[n_train:].tofile(tmp_path / "val.bin")
  return tmp_path / "train.bin", tmp_path / "val.bin"


def test_token_files_train_exactly_as_the_same_text_and_resume_exactly(tmp_path, shakespeare):
  train_bin, val_bin = _shakespeare_bin(tmp_path, shakespeare)
  text = load_config("smoke", rounds=4)
  on_disk = load_config("smoke", rounds=4, **{"data.path": str(train_bin),
                                              "data.val_path": str(val_bin)})
  from_text = train.run(text, tmp_path / "text")
  straight = train.run(on_disk, tmp_path / "bin")
  assert straight["eval_loss"] == from_text["eval_loss"]
  rows = lambda d: [{k: v for k, v in json.loads(x).items() if k in ("train_loss", "eval_loss")}
                    for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
  assert rows("bin") == rows("text")
  # Stopped after round 2's checkpoint, resumed: the streams continue where they were.
  assert train.run(on_disk, tmp_path / "split", stop_after_rounds=2) == {"stopped_at_round": 2}
  assert train.run(on_disk, tmp_path / "split")["eval_loss"] == straight["eval_loss"]
  (a, wa), da = checkpointed_state(on_disk, tmp_path / "bin")
  (b, wb), db = checkpointed_state(on_disk, tmp_path / "split")
  assert da == db
  import jax
  for x, y in zip(jax.tree.leaves((a, wa)), jax.tree.leaves((b, wb))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("make,fields,message", [
    (lambda d: None, {}, "no such file or folder"),
    (lambda d: (d / "x.bin").write_bytes(b""), {}, "is empty"),
    (lambda d: (d / "x.bin").write_bytes(b"\x01\x00" * 20), {}, "too few for a window"),
    (lambda d: (d / "x.bin").write_bytes(b"\x01\x00" * 999 + b"\x01"), {},
     "not a whole number of uint16 tokens"),
    (lambda d: (d / "x.bin").write_bytes(np.full(999, 300, np.uint16).tobytes()), {},
     "holds token id 300 but the model's vocabulary has 256 entries"),
])
def test_bad_token_files_are_one_line_errors(tmp_path, make, fields, message):
  make(tmp_path)
  with pytest.raises(DataError, match=message):
    train.build(_data(tmp_path / "x.bin", **fields))


def test_a_prepared_folder_refuses_another_tokenizer_dtype_or_no_meta(tmp_path, shakespeare):
  src = tmp_path / "s.txt"
  src.write_text(shakespeare.read_text()[:20_000])
  _prepare("--input", src, "--tokenizer", "byte", "--out", tmp_path / "p", "--val_fraction",
           "0.2")
  corpus = open_corpus(_data(tmp_path / "p").data, window=33)
  assert isinstance(corpus.train, np.memmap) and corpus.vocab_size == 256
  with pytest.raises(DataError, match="differs from the tokenizer .* was prepared with"):
    train.build(_data(tmp_path / "p", tokenizer="gpt2"))
  with pytest.raises(DataError, match="data.dtype='uint32' contradicts .*meta.json"):
    train.build(_data(tmp_path / "p", dtype="uint32"))
  # Without meta.json it is nanoGPT's layout (the two files, data.dtype's tokens)...
  os.rename(tmp_path / "p" / "meta.json", tmp_path / "p" / "meta.json.partial")
  # ...unless a half-written file shows an interrupted prepare.
  with pytest.raises(DataError, match="has no meta.json: not a finished prepare"):
    train.build(_data(tmp_path / "p"))
  os.remove(tmp_path / "p" / "meta.json.partial")
  assert len(open_corpus(_data(tmp_path / "p").data, window=33).train) == len(corpus.train)


def test_ids_past_the_start_up_scan_are_caught_by_the_windows(tmp_path, monkeypatch):
  from lowcomm_jax.data import token_files
  monkeypatch.setattr(token_files, "SCAN_TOKENS", 8)
  ids = np.full(5000, 999, np.uint16)
  ids[:8] = 7  # all the scan sees
  ids.tofile(tmp_path / "t.bin")
  np.full(500, 7, np.uint16).tofile(tmp_path / "v.bin")
  r = train.build(_data(tmp_path / "t.bin", val_path=str(tmp_path / "v.bin")))
  with pytest.raises(DataError, match="token id 999 at position .* outside the model's "
                     "vocabulary \\(256\\)"):
    r.data.streams[0].next_round(1)


def test_uint32_tokens_read_as_uint16_and_a_cut_file_are_refused(tmp_path, shakespeare):
  (np.arange(5000) % 200).astype(np.uint32).tofile(tmp_path / "wide.bin")
  with pytest.raises(DataError, match="looks like uint32 tokens.*data.dtype=uint32"):
    train.build(_data(tmp_path / "wide.bin"))
  src = tmp_path / "s.txt"
  src.write_text(shakespeare.read_text()[:20_000])
  _prepare("--input", src, "--tokenizer", "byte", "--out", tmp_path / "p")
  with open(tmp_path / "p" / "train.bin", "r+b") as f:
    f.truncate(f.seek(0, 2) - 2)
  with pytest.raises(DataError, match="train.bin: 19,.* tokens, meta.json records"):
    train.build(_data(tmp_path / "p"))


def test_a_bad_data_path_exits_2_and_writes_nothing(tmp_path):
  bad = tmp_path / "odd.bin"
  bad.write_bytes(b"\x00" * 3)
  proc = subprocess.run(
      [sys.executable, "-m", "lowcomm_jax.main", f"--config={REPO / 'configs/smoke.py'}",
       f"--config.data.path={bad}", f"--workdir={tmp_path / 'run'}"],
      capture_output=True, text=True, timeout=120, cwd=REPO)
  assert proc.returncode == 2, proc.stderr
  assert "not a whole number of uint16 tokens" in proc.stderr.strip().splitlines()[-1]
  assert not (tmp_path / "run").exists()


def test_an_interrupted_prepare_leaves_nothing_that_looks_complete(tmp_path, shakespeare):
  big = tmp_path / "big.txt"
  big.write_text(shakespeare.read_text() * 20)  # ~22 MB: a few seconds of BPE
  out = tmp_path / "out"
  argv = [sys.executable, "-m", "lowcomm_jax.data.prepare", f"--input={big}",
          "--tokenizer=gpt2", f"--out={out}"]
  proc = subprocess.Popen(argv, cwd=REPO, stderr=subprocess.DEVNULL)
  partial = out / "train.bin.partial"
  deadline = time.time() + 60
  while time.time() < deadline and not (partial.exists() and partial.stat().st_size):
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert partial.exists(), "prepare finished before it could be interrupted"
  assert not (out / "meta.json").exists() and not (out / "train.bin").exists()
  with pytest.raises(DataError, match="not a finished prepare"):
    train.build(_data(out, tokenizer="gpt2"))
  # A rerun starts over and finishes.
  subprocess.run(argv, cwd=REPO, check=True, stderr=subprocess.DEVNULL, timeout=300)
  meta = json.loads((out / "meta.json").read_text())
  assert not partial.exists()
  total = meta["tokens"]["train"] + meta["tokens"]["val"]
  assert total == len(get_tokenizer("gpt2").encode(big.read_text())) + 1


def test_a_hugging_face_tokenizer_json(tmp_path, shakespeare):
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import models, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.train_from_iterator([shakespeare.read_text()[:50_000]], trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.decoder = __import__("tokenizers.decoders", fromlist=["ByteLevel"]).ByteLevel()
  tok.save(str(tmp_path / "tokenizer.json"))
  src = tmp_path / "s.txt"
  src.write_text(shakespeare.read_text()[:30_000])
  meta = _prepare("--input", src, "--tokenizer", tmp_path / "tokenizer.json", "--out",
                  tmp_path / "p", "--val_fraction", "0.2")
  assert meta["tokenizer"].startswith("hf:") and meta["vocab_size"] == 300
  hf = get_tokenizer(str(tmp_path / "tokenizer.json"))
  ids = np.concatenate([np.fromfile(tmp_path / "p" / f, np.uint16)
                        for f in ("train.bin", "val.bin")])
  assert hf.decode(ids) == src.read_text() + "<|endoftext|>"
  r = train.build(_data(tmp_path / "p", tokenizer=str(tmp_path / "tokenizer.json")))
  assert r.model.cfg.vocab_size == 320  # 300 rounded up to a multiple of 64
