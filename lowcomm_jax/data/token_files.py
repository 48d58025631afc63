"""Pre-tokenized corpora on disk, read through np.memmap: memory does not grow with the corpus.

Two layouts:
  - a prepared folder (`python -m lowcomm_jax.data.prepare`): train.bin, val.bin and
    meta.json (tokenizer, vocabulary, dtype, token counts, sources); a folder with train.bin
    and val.bin but no meta.json (nanoGPT's data/openwebtext) is read as the two files;
  - a flat token file in nanoGPT's format (little-endian uint16, or uint32 for vocabularies
    over 65,535), e.g. the train.bin nanoGPT's prepare.py writes. Validation comes from
    `data.val_path`, else the file's last `data.val_fraction` is held out.
"""

import contextlib
import dataclasses
import json
import mmap
import pathlib

import numpy as np

from lowcomm_jax.data.corpus import DataError

META = "meta.json"
META_FORMAT = "lowcomm_jax.tokens/1"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
# How much of a file without a recorded maximum is scanned for token ids at start-up (the
# windows check the rest as they are read): 2^22 tokens, 8-16 MB of reading.
SCAN_TOKENS = 1 << 22


@dataclasses.dataclass(frozen=True)
class TokenFiles:
  train: np.ndarray  # memmapped, 1-D
  val: np.ndarray
  dtype: str
  meta: dict | None  # the folder's meta.json (None for a bare .bin)
  where: str  # the path, for messages

  @property
  def tokenizer(self) -> str | None:
    return self.meta["tokenizer"] if self.meta else None

  def max_token(self) -> tuple[int, str]:
    """The largest token id (recorded by prepare, or in a scan of each split's first
    SCAN_TOKENS) and where it was found."""
    if self.meta and "max_token" in self.meta:
      return int(self.meta["max_token"]), f"{self.where}/{META}"
    found = [(int(a[:SCAN_TOKENS].max()), name) for a, name in
             ((self.train, "train"), (self.val, "val")) if len(a)]
    for a in (self.train, self.val):  # unmap the scanned pages (they stay in page cache)
      with contextlib.suppress(AttributeError, OSError, ValueError):
        a._mmap.madvise(mmap.MADV_DONTNEED)
    top, name = max(found)
    return top, f"{self.where} ({name} split, first {SCAN_TOKENS:,} tokens)"


def is_token_path(path: str) -> bool:
  """Whether `data.path` names pre-tokenized data (a folder or a .bin file), not text."""
  p = pathlib.Path(path).expanduser()
  return bool(path) and (p.suffix == ".bin" or p.is_dir())


def _memmap(path: pathlib.Path, dtype: str, field: str) -> np.ndarray:
  if not path.is_file():
    raise DataError(f"{field}={str(path)!r}: no such file; point it at a token file "
                    "(python -m lowcomm_jax.data.prepare writes them)")
  size, item = path.stat().st_size, DTYPES[dtype].itemsize
  if size == 0:
    raise DataError(f"{field}={str(path)!r} is empty; prepare the corpus again or point "
                    f"{field} at another file")
  if size % item:
    raise DataError(f"{path}: {size:,} bytes is not a whole number of {dtype} tokens "
                    f"({item} bytes each); the file is cut short or data.dtype is wrong")
  tokens = np.memmap(path, dtype=DTYPES[dtype], mode="r")
  # Windows are read at random places: without this the kernel reads ahead ~128 KB around
  # every 2 KB window, and resident memory grows with the windows read.
  with contextlib.suppress(AttributeError, OSError, ValueError):
    tokens._mmap.madvise(mmap.MADV_RANDOM)
  return tokens


def _read_meta(folder: pathlib.Path) -> dict | None:
  """The folder's meta.json; None for a folder in nanoGPT's layout (train.bin and val.bin,
  no meta.json, nothing half-written)."""
  path = folder / META
  if not path.is_file():
    if any(folder.glob("*.partial")) or not all(
        (folder / f).is_file() for f in ("train.bin", "val.bin")):
      raise DataError(f"data.path={str(folder)!r} has no {META}: not a finished prepare (an "
                      "interrupted one leaves none). Run python -m lowcomm_jax.data.prepare "
                      f"--out={folder} again, or point data.path at a .bin file")
    return None
  try:
    meta = json.loads(path.read_text())
    meta["dtype"], meta["tokenizer"], meta["vocab_size"]
  except (ValueError, KeyError, TypeError) as e:
    raise DataError(f"{path} is damaged ({type(e).__name__}: {e}); prepare the corpus "
                    "again") from e
  if meta.get("format") != META_FORMAT or meta["dtype"] not in DTYPES:
    raise DataError(f"{path}: format {meta.get('format')!r}, dtype {meta['dtype']!r}; this "
                    f"version reads {META_FORMAT!r} with {sorted(DTYPES)}: prepare the corpus "
                    "again")
  return meta


def open_token_files(path: str, *, dtype: str, val_path: str, val_fraction: float,
                     default_dtype: str = "uint16") -> TokenFiles:
  """The train and val splits of `data.path` (a prepared folder or a .bin file). A bare
  .bin's dtype is `dtype`, else `default_dtype` (the tokenizer's: uint32 above 65,535)."""
  p = pathlib.Path(path).expanduser()
  if dtype and dtype not in DTYPES:
    raise DataError(f"data.dtype={dtype!r}: use one of {sorted(DTYPES)} ('' : from "
                    f"{META}, else uint16)")
  if p.is_dir():
    meta = _read_meta(p)
    if meta is None:  # nanoGPT's train.bin and val.bin
      return open_token_files(str(p / "train.bin"), dtype=dtype,
                              val_path=val_path or str(p / "val.bin"), val_fraction=val_fraction,
                              default_dtype=default_dtype)
    if dtype and dtype != meta["dtype"]:
      raise DataError(f"data.dtype={dtype!r} contradicts {p / META} ({meta['dtype']!r}); "
                      "leave data.dtype empty to read it from there")
    if val_path:
      raise DataError(f"data.val_path={val_path!r}: a prepared folder holds its own "
                      "val.bin; leave data.val_path empty")
    splits = {}
    for name in ("train", "val"):
      splits[name] = _memmap(p / f"{name}.bin", meta["dtype"], "data.path")
      if len(splits[name]) != meta["tokens"][name]:
        raise DataError(f"{p / (name + '.bin')}: {len(splits[name]):,} tokens, {META} "
                        f"records {meta['tokens'][name]:,}: the file was cut short or "
                        "replaced; copy it again or prepare the corpus again")
    return TokenFiles(splits["train"], splits["val"], meta["dtype"], meta, str(p))
  if not p.exists():
    raise DataError(f"data.path={path!r}: no such file or folder")
  dtype = dtype or default_dtype
  tokens = _memmap(p, dtype, "data.path")
  _refuse_wider(tokens, p, dtype)
  if val_path:
    return TokenFiles(tokens, _memmap(pathlib.Path(val_path).expanduser(), dtype,
                                      "data.val_path"), dtype, None, str(p))
  n_train = int(len(tokens) * (1.0 - val_fraction))  # as split_train_val does for text
  return TokenFiles(tokens[:n_train], tokens[n_train:], dtype, None, str(p))


def _refuse_wider(tokens: np.ndarray, path: pathlib.Path, dtype: str) -> None:
  """uint32 ids read as uint16 come out as (id, 0) pairs, all inside any vocabulary: a
  file whose every second uint16 in its first 64K is 0 (and the others not all 0) is
  refused rather than trained on as interleaved garbage."""
  head = np.asarray(tokens[:1 << 16])
  if dtype == "uint16" and len(head) >= 64 and not head[1::2].any() and head[0::2].any():
    raise DataError(f"{path} looks like uint32 tokens (every second uint16 is 0); set "
                    "--config.data.dtype=uint32")
