"""grain pipelines: random training windows, one stream per worker, and fixed eval windows.

Every stream is a grain MapDataset indexed by position, so a stream is a pure function of
its seed and its iterator state is just where it is; both are checkpointed.

  batch_mode='different': worker w reads its own stream, seeded from (seed, w);
  batch_mode='same':      one stream; every worker gets the same batch at the same step.
"""

import contextlib
import mmap
from collections.abc import Sequence

import grain
import numpy as np

from lowcomm_jax.data.corpus import DataError

_ENDLESS = 2**62  # index space of a stream: random windows never run out
# How far a stream reads ahead. grain's default (16 threads, 500 batches) holds hundreds of
# steps of batches per worker and, from a memmapped file, faults in a page range for each;
# a round of H steps is read at once anyway. Elements depend on their index alone, so these
# options change no batch.
READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=32)


_RELEASE_EVERY = 16  # memmapped windows read between releases of their mapped pages
_WORKER, _SHARED, _EVAL, _PROBE = 0, 1, 2, 3  # stream kinds, so no two kinds ever share a seed
_CORRUPT_SEED = 0x5EED_C0DE  # the corruption's draws differ from the window's


def stream_seed(seed: int, kind: int, index: int = 0) -> int:
  return int(np.random.SeedSequence([seed, kind, index]).generate_state(1)[0])


def split_train_val(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """The first (1 - val_fraction) of the corpus trains, the tail validates."""
  n_train = int(len(tokens) * (1.0 - val_fraction))
  return tokens[:n_train], tokens[n_train:]


class _RandomWindow(grain.transforms.RandomMap):
  """A uniformly random window of `length` tokens (input + shifted target). `tokens` may be
  a memmap: a window reads only its own pages. With `vocab_size`, a window holding an id
  the model has no embedding for stops the run (token files are checked only in part at
  start-up)."""

  def __init__(self, tokens: np.ndarray, length: int, vocab_size: int | None = None):
    if len(tokens) <= length:
      raise ValueError(f"corpus split has {len(tokens)} tokens, fewer than a window of {length}")
    self._tokens, self._length, self._vocab = tokens, length, vocab_size
    # A memmap's pages stay mapped once read, and the kernel maps whole page-cache folios
    # (up to 2 MB measured per 2 KB window): drop the mappings every few windows so resident
    # memory stays flat (the pages stay in the page cache; nothing is re-read from disk).
    self._mmap = getattr(tokens, "_mmap", None)
    self._reads = 0

  def __deepcopy__(self, memo):
    # Deep-copying a memmap reads the whole corpus into memory (grain deep-copies datasets
    # for its multiprocess prefetch). The tokens are read-only: every copy shares them.
    return _RandomWindow(self._tokens, self._length, self._vocab)

  def random_map(self, element, rng: np.random.Generator) -> np.ndarray:
    del element
    start = rng.integers(0, len(self._tokens) - self._length + 1)
    raw = self._tokens[start:start + self._length]
    # Checked before the int32 cast, which would turn uint32 ids of 2^31 and up negative.
    if self._vocab is not None and raw.max() >= self._vocab:
      raise DataError(f"token id {raw.max():,} at position {start + raw.argmax():,} of the "
                      f"split is outside the model's vocabulary ({self._vocab:,}); the data "
                      "was made with another tokenizer or dtype (data.dtype), or is damaged")
    window = raw.astype(np.int32)
    self._reads += 1  # (prefetch threads race on it: a missed count only delays a release)
    if self._mmap is not None and self._reads % _RELEASE_EVERY == 0:
      with contextlib.suppress(OSError, ValueError):
        self._mmap.madvise(mmap.MADV_DONTNEED)
    return window


CORRUPTIONS = ("token_swap", "shuffle", "other_text")


class _Corrupt(grain.transforms.RandomMap):
  """A corrupted worker's windows (tests and benchmarks of robust aggregation):
  'token_swap' replaces each token by a uniformly random one with probability `prob`;
  'shuffle' permutes the window's tokens; 'other_text' replaces the whole window, with
  probability `prob`, by a random window of `other` (another corpus's tokens). Drawn from
  the element's own generator: the same for a seed and position, so a resumed stream is
  corrupted the same way."""

  def __init__(self, kind: str, prob: float, vocab_size: int, other: np.ndarray | None = None):
    if kind not in CORRUPTIONS:
      raise ValueError(f"unknown corruption {kind!r}; choose one of {CORRUPTIONS}")
    if kind == "other_text" and other is None:
      raise ValueError("corruption 'other_text' needs the other corpus's tokens")
    self._kind, self._prob, self._vocab, self._other = kind, prob, vocab_size, other

  def random_map(self, window: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if self._kind == "shuffle":
      return rng.permutation(window)
    if self._kind == "other_text":
      if rng.random() >= self._prob:
        return window
      start = rng.integers(0, len(self._other) - len(window) + 1)
      return self._other[start:start + len(window)].astype(np.int32)
    swap = rng.random(window.shape) < self._prob
    return np.where(swap, rng.integers(0, self._vocab, window.shape), window).astype(np.int32)


def window_dataset(tokens: np.ndarray, *, seq_len: int, batch_size: int, seed: int,
                   vocab_size: int | None = None,
                   corruption: tuple | None = None) -> grain.MapDataset:
  """Endless batches [batch_size, seq_len + 1] of random windows, each corrupted by
  `corruption` = (kind, prob, vocabulary[, other corpus's tokens]) if given."""
  windows = (grain.MapDataset.range(_ENDLESS)
             .random_map(_RandomWindow(tokens, seq_len + 1, vocab_size), seed=seed))
  if corruption is not None:
    windows = windows.random_map(_Corrupt(*corruption), seed=seed ^ _CORRUPT_SEED)
  return windows.batch(batch_size)


def _iterate(dataset: grain.MapDataset):
  return iter(dataset.to_iter_dataset(READ_OPTIONS))


class WorkerStreams:
  """The training batches of a set of workers, a round at a time."""

  def __init__(self, train_tokens: np.ndarray, *, worker_ids: Sequence[int], seq_len: int,
               batch_size: int, seed: int, batch_mode: str, vocab_size: int | None = None,
               corrupt: dict | None = None, partitions: int = 0):
    if batch_mode not in ("same", "different"):
      raise ValueError(f"batch_mode must be 'same' or 'different', got {batch_mode!r}")
    self.worker_ids = list(worker_ids)
    self.batch_mode = batch_mode
    self._args = dict(seq_len=seq_len, batch_size=batch_size, seed=seed, batch_mode=batch_mode,
                      vocab_size=vocab_size, corrupt=corrupt, partitions=partitions)
    self._tokens = train_tokens
    seeds = ([stream_seed(seed, _WORKER, w) for w in self.worker_ids]
             if batch_mode == "different" else [stream_seed(seed, _SHARED)])
    # `corrupt`: worker id -> (kind, prob, vocabulary[, other tokens]) for the workers whose
    # data is bad (_Corrupt).
    corrupt = corrupt or {}
    if corrupt and batch_mode != "different":
      raise ValueError("corrupting some workers' data needs batch_mode='different'")
    owners = self.worker_ids if batch_mode == "different" else [None]
    # `partitions` P > 0: worker w reads only the w-th of P contiguous shards of the corpus
    # (non-IID data: another part of the text per worker).
    if partitions and batch_mode != "different":
      raise ValueError("partitioned data needs batch_mode='different'")
    # (A worker that joins a Ray run later may have an id past P: it reads shard id mod P.)
    shard = lambda w: (train_tokens if not partitions else
                       train_tokens[len(train_tokens) * (w % partitions) // partitions:
                                    len(train_tokens) * (w % partitions + 1) // partitions])
    self._iters = [_iterate(window_dataset(shard(w), seq_len=seq_len,
                                           batch_size=batch_size, seed=s,
                                           vocab_size=vocab_size, corruption=corrupt.get(w)))
                   for s, w in zip(seeds, owners)]

  def of_workers(self, worker_ids: Sequence[int]) -> "WorkerStreams":
    """Fresh streams of other workers over the same corpus and settings (a Ray worker's
    own stream; a worker that joined later)."""
    return WorkerStreams(self._tokens, worker_ids=worker_ids, **self._args)

  def next_round(self, inner_steps: int) -> np.ndarray:
    """Batches [workers, inner_steps, batch_size, seq_len + 1] for one round."""
    per_stream = [np.stack([next(it) for _ in range(inner_steps)]) for it in self._iters]
    if self.batch_mode == "same":
      return np.broadcast_to(per_stream[0], (len(self.worker_ids),) + per_stream[0].shape)
    return np.stack(per_stream)

  def next_steps(self, positions, inner_steps: int) -> np.ndarray:
    """[len(positions), inner_steps, B, L+1] for the workers at these positions (indices into
    `worker_ids`); only their streams advance. Workers that run asynchronously read their
    streams at their own pace; needs batch_mode='different'."""
    if self.batch_mode != "different":
      raise ValueError("reading some workers' streams alone needs batch_mode='different'")
    return np.stack([np.stack([next(self._iters[i]) for _ in range(inner_steps)])
                     for i in positions])

  def get_state(self) -> dict:
    return {"batch_mode": self.batch_mode, "worker_ids": self.worker_ids,
            "streams": [it.get_state() for it in self._iters]}

  def set_state(self, state: dict) -> None:
    if state["batch_mode"] != self.batch_mode or list(state["worker_ids"]) != self.worker_ids:
      raise ValueError(
          f"checkpointed data streams ({state['batch_mode']}, workers {state['worker_ids']}) do "
          f"not match this run ({self.batch_mode}, workers {self.worker_ids})")
    for it, s in zip(self._iters, state["streams"], strict=True):
      it.set_state(s)


def eval_windows(val_tokens: np.ndarray, *, seq_len: int, batch_size: int, num_batches: int,
                 seed: int, vocab_size: int | None = None, kind: int = _EVAL) -> np.ndarray:
  """Fixed validation batches [num_batches, batch_size, seq_len + 1], the same every eval."""
  it = _iterate(window_dataset(val_tokens, seq_len=seq_len, batch_size=batch_size,
                               seed=stream_seed(seed, kind), vocab_size=vocab_size))
  return np.stack([next(it) for _ in range(num_batches)])


def probe_windows(train_tokens: np.ndarray, *, seq_len: int, batch_size: int, seed: int,
                  vocab_size: int | None = None) -> np.ndarray:
  """The probe batch [batch_size, seq_len + 1] of the `probe_loss` signal: fixed windows of
  the (clean) training split from a stream of their own, the same on every process. Not the
  validation split, so the weights are not chosen on the data the runs are judged on."""
  return eval_windows(train_tokens, seq_len=seq_len, batch_size=batch_size, num_batches=1,
                      seed=seed, vocab_size=vocab_size, kind=_PROBE)[0]
