"""Tokenizers (byte-level and tiktoken GPT-2 BPE) and an on-disk cache of tokenized corpora."""

import hashlib
import os
import pathlib

import numpy as np

from lowcomm_jax.data.corpus import DataError, cache_dir

TOKENIZER_VOCAB = {"byte": 256, "r50k_base": 50257, "gpt2": 50257}  # name -> vocabulary size
TOKENIZER_NAMES = tuple(TOKENIZER_VOCAB)
_ALIASES = {"gpt2": "r50k_base"}  # same ranks; r50k_base needs one file instead of two


class ByteTokenizer:
  """UTF-8 bytes as tokens: vocab 256, needs no files."""
  name = "byte"
  vocab_size = 256

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

  def decode(self, tokens) -> str:
    return bytes(np.asarray(tokens, dtype=np.uint8)).decode("utf-8", errors="replace")


class TiktokenTokenizer:
  """tiktoken's r50k_base (the GPT-2 BPE, 50,257 tokens)."""

  def __init__(self, encoding: str):
    import tiktoken  # imported here so the byte tokenizer never needs it
    try:
      self._enc = tiktoken.get_encoding(encoding)
    except Exception as e:  # tiktoken raises plain requests/OSError types when offline
      raise DataError(
          f"cannot load tiktoken encoding {encoding!r} ({type(e).__name__}: {e}). Offline, set "
          "TIKTOKEN_CACHE_DIR to a directory holding its ranks file (e.g. ../shared/data/"
          "tiktoken), or use --config.data.tokenizer=byte") from e
    self.name = encoding
    self.vocab_size = self._enc.n_vocab

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._enc.encode_ordinary(text), dtype=np.uint16)

  def decode(self, tokens) -> str:
    return self._enc.decode([int(t) for t in tokens])


def get_tokenizer(name: str):
  name = _ALIASES.get(name, name)
  if name == "byte":
    return ByteTokenizer()
  if name == "r50k_base":
    return TiktokenTokenizer(name)
  raise ValueError(f"unknown tokenizer {name!r}; choose one of {TOKENIZER_NAMES}")


def load_tokens(corpus: pathlib.Path, tokenizer) -> np.ndarray:
  """The corpus tokenized, cached on disk under a key of (content hash, tokenizer)."""
  raw = corpus.read_bytes()
  key = f"{hashlib.sha256(raw).hexdigest()[:24]}-{tokenizer.name}"
  path = cache_dir() / "tokens" / f"{key}.npy"
  if path.is_file():
    return np.load(path)
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise DataError(f"corpus {corpus} is not UTF-8 text ({e}); convert it or point "
                    "data.path at a plain-text file") from e
  tokens = tokenizer.encode(text)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f"{path.stem}.{os.getpid()}.part.npy")  # processes may race here
  np.save(tmp, tokens)
  tmp.replace(path)
  return tokens
