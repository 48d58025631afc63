"""A run's corpus from `config.data`: text tokenized at start-up (cached), or pre-tokenized
token files read from disk (token_files.py). Either way: train and val token arrays, the
vocabulary the model must cover, and the check that it does."""

import dataclasses
import pathlib

import ml_collections
import numpy as np

from lowcomm_jax.data import token_files
from lowcomm_jax.data.corpus import DataError, resolve_corpus
from lowcomm_jax.data.pipeline import split_train_val
from lowcomm_jax.data.tokenizers import get_tokenizer, load_tokens, tokenizer_id


@dataclasses.dataclass(frozen=True)
class Corpus:
  train: np.ndarray  # 1-D token ids (in memory for text, memmapped for token files)
  val: np.ndarray
  vocab_size: int  # the tokenizer's vocabulary: the model's is at least this
  files: token_files.TokenFiles | None  # None for a text corpus

  def check_vocabulary(self, model_vocab: int) -> None:
    """Token files may hold ids the model has no embedding for: refuse them at start-up."""
    if self.files is None:
      return
    top, where = self.files.max_token()
    if top >= model_vocab:
      raise DataError(f"{where} holds token id {top:,} but the model's vocabulary has "
                      f"{model_vocab:,} entries (model.vocab_size); set data.tokenizer to "
                      "the tokenizer the data was made with (and data.dtype to its width), "
                      "or a larger model.vocab_size")


def open_corpus(d: ml_collections.ConfigDict, *, window: int) -> Corpus:
  """The corpus `d` (config.data) names, split into train and val, each longer than
  `window` tokens."""
  if d.path and not pathlib.Path(d.path).expanduser().exists():
    raise DataError(f"data.path={d.path!r}: no such file or folder; point it at a text "
                    "corpus, a .bin token file or a folder written by python -m "
                    "lowcomm_jax.data.prepare (or leave it empty for TinyShakespeare)")
  if token_files.is_token_path(d.path):
    wide = get_tokenizer(d.tokenizer).vocab_size > 65535 if not d.dtype else False
    files = token_files.open_token_files(d.path, dtype=d.dtype, val_path=d.val_path,
                                         val_fraction=d.val_fraction,
                                         default_dtype="uint32" if wide else "uint16")
    vocab = _tokenizer_vocab(d.tokenizer, files)
    corpus = Corpus(files.train, files.val, vocab, files)
  else:
    for field in ("dtype", "val_path"):
      if d[field]:
        raise DataError(f"data.{field}={d[field]!r} applies to token files (.bin or a "
                        "prepared folder); data.path is text: leave it empty")
    tokenizer = get_tokenizer(d.tokenizer)
    tokens = load_tokens(resolve_corpus(d.path), tokenizer)
    train, val = split_train_val(tokens, d.val_fraction)
    corpus = Corpus(train, val, tokenizer.vocab_size, None)
  for name, split in (("train", corpus.train), ("val", corpus.val)):
    if len(split) <= window:
      raise DataError(f"the corpus's {name} split has {len(split):,} tokens: too few for a "
                      f"window of data.seq_len + 1 = {window}; use a longer corpus or a "
                      "shorter seq_len")
  return corpus


def _tokenizer_vocab(name: str, files: token_files.TokenFiles) -> int:
  """The vocabulary of token files: meta.json's, once the configured tokenizer is the one
  they were prepared with; for a bare .bin, the configured tokenizer's."""
  if files.meta is None:
    return get_tokenizer(name).vocab_size
  wanted, have = files.tokenizer, tokenizer_id(name)
  if wanted != have:
    raise DataError(f"data.tokenizer={name!r} ({have}) differs from the tokenizer "
                    f"{files.where} was prepared with ({wanted}); set data.tokenizer to that "
                    "one, or prepare the corpus again with yours")
  return int(files.meta["vocab_size"])


def other_corpus(path: str, tokenizer: str, *, window: int) -> np.ndarray:
  """The tokens of `data.corruption_path` (corruption 'other_text'): a text file tokenized
  like the run's data, longer than a window."""
  p = pathlib.Path(path).expanduser()
  if not path or not p.is_file():
    raise DataError(f"data.corruption_path={path!r} is not a file; corruption 'other_text' "
                    "reads its windows from another plain-text corpus: point it at one")
  tokens = load_tokens(p, get_tokenizer(tokenizer))
  if len(tokens) <= window:
    raise DataError(f"data.corruption_path={path!r} has {len(tokens):,} tokens, too few for "
                    f"a window of data.seq_len + 1 = {window}; use a longer text")
  return tokens
