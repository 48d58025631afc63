"""Tokenize a corpus once into nanoGPT-format token files that runs read from disk.

  python -m lowcomm_jax.data.prepare --input=PATH [--input=PATH ...] --tokenizer=gpt2 \\
      --out=DIR [--workers=4] [--val_fraction=0.01 | --val_input=PATH ...] [--text_field=text]

Inputs: text files (one document each), `.jsonl` files (one document per line, its
`--text_field`), gzip of either (`.gz`), and folders of them (searched recursively, in name
order). An end-of-text token follows every document.

Writes DIR/train.bin and DIR/val.bin (flat little-endian uint16 token ids, uint32 when the
vocabulary exceeds 65,535: the format of nanoGPT's prepare.py) and DIR/meta.json. Without
`--val_input`, the last `--val_fraction` of the token stream is held out for validation (as
runs split a text corpus). Files are written under `.partial` names and renamed when done,
meta.json last: a folder without meta.json is not a finished prepare, and a rerun starts
over; a rerun over a finished one with the same inputs does nothing.
"""

import argparse
import dataclasses
import gzip
import io
import json
import multiprocessing
import os
import pathlib
import sys
import time
import zlib
from collections.abc import Iterator

import numpy as np

from lowcomm_jax.data.corpus import DataError
from lowcomm_jax.data.token_files import META, META_FORMAT
from lowcomm_jax.data.tokenizers import get_tokenizer, tokenizer_id

PIECE_BYTES = 4 << 20  # text handed to a tokenizing process at a time


@dataclasses.dataclass
class Piece:
  """Text to tokenize: documents, the last of which may continue in the next piece."""
  texts: list[str]
  last_ends: bool  # whether the last text ends its document
  position: int  # input bytes consumed once this piece is read (for progress)


def input_files(paths: list[str]) -> list[pathlib.Path]:
  """Every file the inputs name, folders expanded recursively in name order."""
  files = []
  for raw in paths:
    p = pathlib.Path(raw).expanduser()
    if p.is_dir():
      found = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
      if not found:
        raise DataError(f"--input={raw!r}: the folder holds no files")
      files.extend(found)
    elif p.is_file():
      files.append(p)
    else:
      raise DataError(f"--input={raw!r}: no such file or folder")
  return files


def _is_jsonl(path: pathlib.Path) -> bool:
  return path.name.removesuffix(".gz").endswith(".jsonl")


def read_pieces(files: list[pathlib.Path], text_field: str) -> Iterator[Piece]:
  """The inputs' documents in order, cut into pieces of about PIECE_BYTES."""
  done = 0
  for path in files:
    raw = open(path, "rb")
    with raw:
      stream = gzip.open(raw, "rb") if path.suffix == ".gz" else raw
      # newline="": CR and CRLF stay as they are (a text run reads the bytes as they are).
      text = io.TextIOWrapper(stream, encoding="utf-8", newline="")
      try:
        if _is_jsonl(path):
          yield from _jsonl_pieces(text, path, text_field, raw, done)
        else:
          yield from _text_pieces(text, raw, done)
      except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e}); convert it first") from e
      except (OSError, EOFError, zlib.error) as e:  # damaged or truncated gzip files
        raise DataError(f"{path} cannot be read ({type(e).__name__}: {e})") from e
    done += path.stat().st_size


def _text_pieces(text, raw, done: int) -> Iterator[Piece]:
  """A text file is one document, cut into pieces between "x\n" and a line that starts with
  a non-space character: a lone newline between two non-spaces is a token of its own for
  GPT-2's pre-tokenizer (and bytes are bytes), so the pieces tokenize as the whole file
  would. (Runs of whitespace at a cut would not: "\n\n" at a piece's end is one token,
  inside the text two.) A Hugging Face pre-tokenizer may differ; decoding round-trips."""
  buffer, size = [], 0
  for line in text:
    if (size >= PIECE_BYTES and line[:1].strip() and buffer
        and buffer[-1].endswith("\n") and buffer[-1][-2:-1].strip()):
      yield Piece(["".join(buffer)], False, done + raw.tell())
      buffer, size = [], 0
    buffer.append(line)
    size += len(line)  # characters: a piece's size need not be exact
  yield Piece(["".join(buffer)], True, done + raw.tell())


def _jsonl_pieces(text, path, field: str, raw, done: int) -> Iterator[Piece]:
  docs, size = [], 0
  for number, line in enumerate(text, 1):
    if not line.strip():
      continue
    try:
      doc = json.loads(line)[field]
    except (ValueError, KeyError, TypeError) as e:
      raise DataError(f"{path}:{number}: no text field {field!r} in this line ({e}); pass "
                      "--text_field=NAME") from e
    docs.append(str(doc))
    size += len(docs[-1])
    if size >= PIECE_BYTES:
      yield Piece(docs, True, done + raw.tell())
      docs, size = [], 0
  if docs:
    yield Piece(docs, True, done + raw.tell())


_TOKENIZER = None


def _init_worker(name: str) -> None:
  global _TOKENIZER
  _TOKENIZER = get_tokenizer(name)


def _tokenize(piece: Piece) -> tuple[np.ndarray, int]:
  """Token ids of a piece (end-of-text after each finished document) and its input position."""
  tok, parts = _TOKENIZER, []
  for i, text in enumerate(piece.texts):
    parts.append(np.asarray(tok.encode(text), np.uint32))
    if i < len(piece.texts) - 1 or piece.last_ends:
      parts.append(np.asarray([tok.eot], np.uint32))
  return (np.concatenate(parts) if parts else np.zeros(0, np.uint32)), piece.position


class Progress:
  """One status line on stderr: input read, tokens, rate, ETA."""
  line_open = False  # a status line without its newline is on stderr (an error starts anew)

  def __init__(self, total_bytes: int, label: str):
    self.total, self.label, self.t0, self.shown = max(total_bytes, 1), label, time.time(), 0.0

  def update(self, done: int, tokens: int, *, final: bool = False) -> None:
    now = time.time()
    if not final and now - self.shown < 0.5:
      return
    self.shown = now
    rate = done / max(now - self.t0, 1e-9)
    eta = (self.total - done) / rate if rate > 0 else 0
    line = (f"\r{self.label}: {done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB "
            f"({100 * done / self.total:.0f}%), {tokens:,} tokens, {rate / 1e6:.2f} MB/s, "
            f"ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}")
    print(line, end="\n" if final else "", file=sys.stderr, flush=True)
    Progress.line_open = not final


def _write_tokens(files, args, out: pathlib.Path, dtype, label: str) -> tuple[int, int]:
  """Tokenizes `files` into `out` (a .partial file); returns (tokens, largest id)."""
  progress = Progress(sum(f.stat().st_size for f in files), label)
  count, top = 0, -1
  pieces = read_pieces(files, args.text_field)
  with open(out, "wb") as sink:
    if args.workers > 1:
      pool = multiprocessing.get_context("spawn").Pool(
          args.workers, initializer=_init_worker, initargs=(args.tokenizer,))
      results = pool.imap(_tokenize, pieces)
    else:
      pool = None
      _init_worker(args.tokenizer)
      results = map(_tokenize, pieces)
    try:
      for tokens, position in results:
        if tokens.size:
          top = max(top, int(tokens.max()))
          sink.write(tokens.astype(dtype).tobytes())
          count += tokens.size
        progress.update(position, count)
    finally:
      if pool is not None:
        pool.terminate()
    sink.flush()
    os.fsync(sink.fileno())
  progress.update(progress.total, count, final=True)
  return count, top


def _split_tail(train: pathlib.Path, val: pathlib.Path, dtype, fraction: float) -> int:
  """Moves the last `fraction` of `train`'s tokens into `val`; returns how many."""
  item = np.dtype(dtype).itemsize
  total = train.stat().st_size // item
  keep = int(total * (1.0 - fraction))  # pipeline.split_train_val's formula
  n_val = total - keep
  with open(train, "rb") as src, open(val, "wb") as dst:
    src.seek(keep * item)
    while chunk := src.read(64 << 20):
      dst.write(chunk)
    dst.flush()
    os.fsync(dst.fileno())
  os.truncate(train, keep * item)
  _fsync(train)
  return n_val


def _fsync(path: pathlib.Path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _sources(files: list[pathlib.Path]) -> list[dict]:
  return [{"path": str(f.resolve()), "bytes": f.stat().st_size,
           "mtime_ns": f.stat().st_mtime_ns} for f in files]


def prepare(args) -> dict:
  """Writes args.out/{train,val}.bin and meta.json; returns meta."""
  tokenizer = get_tokenizer(args.tokenizer)
  if tokenizer.eot is None:
    raise DataError(f"--tokenizer={args.tokenizer!r} has no end-of-text token to put "
                    "between documents")
  out = pathlib.Path(args.out).expanduser()
  files = input_files(args.input)
  val_files = input_files(args.val_input) if args.val_input else []
  dtype = np.uint32 if tokenizer.vocab_size > 65535 else np.uint16
  wanted = {"tokenizer": tokenizer_id(args.tokenizer), "sources": _sources(files),
            "val_sources": _sources(val_files),
            "val_fraction": 0.0 if val_files else args.val_fraction,
            "text_field": args.text_field}
  meta_path = out / META
  if meta_path.is_file():
    try:
      have = json.loads(meta_path.read_text())
      have["tokens"]["train"]
    except (ValueError, KeyError, TypeError) as e:
      raise DataError(f"{meta_path} is damaged ({type(e).__name__}: {e}); choose another "
                      "--out, or move that folder aside and prepare again") from e
    if all(have.get(k) == v for k, v in wanted.items()):
      print(f"{out} already holds this corpus ({have['tokens']['train']:,} train tokens); "
            "nothing to do", file=sys.stderr)
      return have
    raise DataError(f"--out={str(out)!r} already holds a prepared corpus of other inputs or "
                    "another tokenizer; choose another --out (nothing was changed)")
  out.mkdir(parents=True, exist_ok=True)
  partial = {name: out / f"{name}.partial" for name in ("train.bin", "val.bin", META)}
  t0 = time.time()
  n_train, top = _write_tokens(files, args, partial["train.bin"], dtype, "prepare train")
  if val_files:
    n_val, top_val = _write_tokens(val_files, args, partial["val.bin"], dtype, "prepare val")
    top = max(top, top_val)
  else:
    n_val = _split_tail(partial["train.bin"], partial["val.bin"], dtype, args.val_fraction)
    n_train -= n_val
  if min(n_train, n_val) == 0:
    raise DataError(f"the inputs give {n_train:,} train and {n_val:,} val tokens; both must "
                    "be non-empty (more text, a larger --val_fraction or a --val_input)")
  meta = {"format": META_FORMAT, **wanted, "tokenizer_name": args.tokenizer,
          "vocab_size": tokenizer.vocab_size, "dtype": np.dtype(dtype).name,
          "eot": int(tokenizer.eot), "max_token": top,
          "tokens": {"train": n_train, "val": n_val}, "seconds": round(time.time() - t0, 3)}
  partial[META].write_text(json.dumps(meta, indent=2) + "\n")
  _fsync(partial[META])
  os.replace(partial["train.bin"], out / "train.bin")
  os.replace(partial["val.bin"], out / "val.bin")
  os.replace(partial[META], meta_path)  # last: only now does the folder look complete
  _fsync(out)  # the renames themselves
  print(f"wrote {out}: {n_train:,} train + {n_val:,} val tokens ({meta['dtype']}) in "
        f"{meta['seconds']:.1f} s", file=sys.stderr)
  return meta


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m lowcomm_jax.data.prepare",
                              description=__doc__.splitlines()[0])
  p.add_argument("--input", action="append", required=True, metavar="PATH",
                 help="text/.jsonl file (or .gz of either), or a folder of them; repeatable")
  p.add_argument("--tokenizer", default="gpt2",
                 help="byte | gpt2 | r50k_base | a Hugging Face tokenizer.json path")
  p.add_argument("--out", required=True, help="folder to write train.bin, val.bin, meta.json")
  p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
  p.add_argument("--val_fraction", type=float, default=None,
                 help="tail of the token stream held out for validation (default 0.01)")
  p.add_argument("--val_input", action="append", default=[], metavar="PATH",
                 help="validation text instead of a tail of the inputs; repeatable")
  p.add_argument("--text_field", default="text", help="the document field of .jsonl lines")
  args = p.parse_args(argv)
  if args.val_input and args.val_fraction is not None:
    p.error("--val_fraction and --val_input exclude each other: give one")
  if args.val_fraction is None:
    args.val_fraction = 0.01
  if not 0.0 < args.val_fraction < 1.0:
    p.error(f"--val_fraction={args.val_fraction}: must be in (0, 1)")
  if args.workers < 1:
    p.error(f"--workers={args.workers}: must be >= 1")
  return args


def main(argv=None) -> None:
  args = parse_args(argv)
  try:
    prepare(args)
  except (DataError, ValueError) as e:  # ValueError: an unknown tokenizer name
    print(f"{chr(10) if Progress.line_open else ''}error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  main()
