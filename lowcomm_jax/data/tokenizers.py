"""Tokenizers (byte-level, tiktoken GPT-2 BPE, a Hugging Face tokenizer.json or the
byte-level BPE a GGUF model holds) and an on-disk cache of tokenized corpora.

Each has `name` (what a cache key and a prepared corpus's meta.json record), `vocab_size`,
`eot` (the id `prepare` puts between documents), `encode` and `decode`."""

import hashlib
import json
import os
import pathlib

import numpy as np

from lowcomm_jax.data.corpus import DataError, cache_dir

TOKENIZER_VOCAB = {"byte": 256, "r50k_base": 50257, "gpt2": 50257}  # name -> vocabulary size
TOKENIZER_NAMES = tuple(TOKENIZER_VOCAB)
_ALIASES = {"gpt2": "r50k_base"}  # same ranks; r50k_base needs one file instead of two


class ByteTokenizer:
  """UTF-8 bytes as tokens: vocab 256, needs no files. Documents are separated by NUL (0),
  a byte text files do not contain."""
  name = "byte"
  vocab_size = 256
  eot = 0

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
    self.eot = self._enc.eot_token  # <|endoftext|>

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._enc.encode_ordinary(text), dtype=np.uint16)

  def decode(self, tokens) -> str:
    return self._enc.decode([int(t) for t in tokens])


class HuggingFaceTokenizer:
  """A Hugging Face `tokenizer.json` through the `tokenizers` library (the `hf` extra)."""

  def __init__(self, path: str):
    try:
      from tokenizers import Tokenizer
    except ImportError as e:
      raise DataError(f"data.tokenizer={path!r} needs the tokenizers library: pip install "
                      "'lowcomm_jax[hf]' (or pip install tokenizers)") from e
    file = pathlib.Path(path).expanduser()
    if not file.is_file():
      raise DataError(f"data.tokenizer={path!r}: no such file; point it at a Hugging Face "
                      f"tokenizer.json, a .gguf model or use one of {TOKENIZER_NAMES}")
    try:
      self._tok = (Tokenizer.from_str(gguf_tokenizer_json(file)) if file.suffix == ".gguf"
                   else Tokenizer.from_file(str(file)))
    except DataError:
      raise
    except Exception as e:  # the library raises plain Exception for bad files
      raise DataError(f"{file}: no tokenizer could be built from it ({e})") from e
    self.name = tokenizer_id(path)
    # Added tokens may leave gaps: the vocabulary must cover the largest id.
    self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True),
                          max(self._tok.get_vocab(with_added_tokens=True).values()) + 1)
    special = [t for t in ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
               if self._tok.token_to_id(t) is not None]
    self.eot = self._tok.token_to_id(special[0]) if special else None

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.uint32)

  def decode(self, tokens) -> str:
    return self._tok.decode([int(t) for t in tokens], skip_special_tokens=False)


def _gguf_tokenizer_fields(file: pathlib.Path) -> dict:
  """The tokenizer metadata of a GGUF: tokens, merges, pre-tokenizer, token types."""
  try:
    import gguf
  except ImportError as e:
    raise DataError(f"data.tokenizer={str(file)!r} needs the gguf and tokenizers packages: "
                    "pip install 'lowcomm_jax[pretrained]'") from e
  try:
    fields = gguf.GGUFReader(str(file)).fields
  except Exception as e:  # the reader raises ValueError/struct errors for damaged files
    raise DataError(f"{file} is not a readable GGUF file ({e})") from e
  get = lambda name: fields[name].contents() if name in fields else None
  out = {"model": get("tokenizer.ggml.model"), "pre": get("tokenizer.ggml.pre"),
         "tokens": get("tokenizer.ggml.tokens"), "merges": get("tokenizer.ggml.merges"),
         "types": get("tokenizer.ggml.token_type")}
  if out["model"] != "gpt2" or not out["tokens"] or out["merges"] is None:
    raise DataError(f"{file}: tokenizer.ggml.model={out['model']!r}; only byte-level BPE "
                    "('gpt2', with tokens and merges) GGUF tokenizers are read")
  if out["pre"] not in _GGUF_PRE:
    raise DataError(f"{file}: tokenizer.ggml.pre={out['pre']!r} is not supported; "
                    f"{sorted(_GGUF_PRE)} are (other splitting rules would encode wrongly)")
  return out


# llama.cpp's pre-tokenizer names -> whether digits are split one by one before GPT-2's regex
_GGUF_PRE = {"gpt-2": False, "smollm": True}


def gguf_tokenizer_json(path: str | pathlib.Path) -> str:
  """The GGUF's byte-level BPE tokenizer (`tokenizer.ggml.model = gpt2`: its tokens and
  merges) as a Hugging Face tokenizer.json string, built with the `tokenizers` library."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  f = _gguf_tokenizer_fields(pathlib.Path(path).expanduser())
  merges = [tuple(m.split(" ", 1)) for m in f["merges"]]
  tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(f["tokens"])}, merges=merges))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                byte_level])
                       if _GGUF_PRE[f["pre"]] else byte_level)
  tok.decoder = decoders.ByteLevel()
  if f["types"] is not None:  # type 3: control tokens (<|endoftext|>, <|im_start|>, …)
    tok.add_special_tokens([t for t, kind in zip(f["tokens"], f["types"]) if kind == 3])
  return tok.to_str()


def is_tokenizer_file(name: str) -> bool:
  """A tokenizer.json, or a GGUF model whose metadata holds its tokenizer."""
  return name.endswith((".json", ".gguf"))


def tokenizer_id(name: str) -> str:
  """What identifies a tokenizer across machines: its canonical name, or for a
  tokenizer.json the hash of its content (paths differ between hosts)."""
  if is_tokenizer_file(name):
    file = pathlib.Path(name).expanduser()
    if not file.is_file():
      return "hf:?"
    # A GGUF is identified by the tokenizer it holds (its metadata), not by its weights.
    content = (json.dumps(_gguf_tokenizer_fields(file), default=lambda o: o.tolist()).encode()
               if file.suffix == ".gguf" else file.read_bytes())
    return f"hf:{hashlib.sha256(content).hexdigest()[:16]}"
  return _ALIASES.get(name, name)


def get_tokenizer(name: str):
  if is_tokenizer_file(name):
    return HuggingFaceTokenizer(name)
  name = _ALIASES.get(name, name)
  if name == "byte":
    return ByteTokenizer()
  if name == "r50k_base":
    return TiktokenTokenizer(name)
  raise ValueError(f"unknown tokenizer {name!r}; choose one of {TOKENIZER_NAMES} or a "
                   "tokenizer.json path")


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
