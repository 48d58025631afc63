"""Where the text comes from: a configured file, a local copy, a cache, or a download.

Order for the default corpus (TinyShakespeare), like nanoGPT's prepare step:
  1. `$LOWCOMM_DATA_DIR/tinyshakespeare/input.txt` (an offline copy, e.g. ../shared/data),
  2. the cache `$LOWCOMM_CACHE_DIR/tinyshakespeare/input.txt` (default ~/.cache/lowcomm_jax),
  3. download from the public URL into that cache.
Any plain-text file works as a corpus through `data.path`.
"""

import os
import pathlib
import urllib.error
import urllib.request

TINY_SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt")
DATA_DIR_ENV = "LOWCOMM_DATA_DIR"
CACHE_DIR_ENV = "LOWCOMM_CACHE_DIR"


class DataError(RuntimeError):
  """The corpus or tokenizer cannot be provided; the message says how to fix it."""


def cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get(CACHE_DIR_ENV, "~/.cache/lowcomm_jax")).expanduser()


def resolve_corpus(path: str = "", *, download_timeout_s: float = 20.0) -> pathlib.Path:
  """The corpus file to read, downloading TinyShakespeare into the cache if needed."""
  if path:
    p = pathlib.Path(path).expanduser()
    if not p.is_file():
      raise DataError(f"data.path={path!r} is not a file; point it at a plain-text corpus "
                      "or leave it empty for TinyShakespeare")
    return p
  relative = pathlib.Path("tinyshakespeare", "input.txt")
  if os.environ.get(DATA_DIR_ENV):
    local = pathlib.Path(os.environ[DATA_DIR_ENV]).expanduser() / relative
    if local.is_file():
      return local
  cached = cache_dir() / relative
  if cached.is_file():
    return cached
  try:
    with urllib.request.urlopen(TINY_SHAKESPEARE_URL, timeout=download_timeout_s) as response:
      text = response.read()
  except (urllib.error.URLError, OSError) as e:
    raise DataError(
        f"TinyShakespeare is not available offline and the download failed ({e}). Provide it "
        f"with one of: {DATA_DIR_ENV}=DIR holding {relative}; a copy at {cached}; or "
        "--config.data.path=/path/to/any/text.txt") from e
  cached.parent.mkdir(parents=True, exist_ok=True)
  tmp = cached.with_suffix(f".{os.getpid()}.part")  # processes may race here
  tmp.write_bytes(text)
  tmp.replace(cached)  # atomic: a half-written download never looks complete
  return cached
