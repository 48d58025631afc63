"""Byte ledger: what each worker sends and receives, counted exactly from shapes and dtypes.

Collectives (parallel/collectives.py) report every payload they move while a function is
being traced. `count_bytes` traces a round with `jax.eval_shape` (no compute) and returns
the per-worker totals. Under `jax.vmap` over workers the traced shapes are one worker's, so
the count is per worker by construction.

Accounting convention (the logical payload, independent of the collective's algorithm):
  * all-reduce (mean): a worker sends its payload once and receives the reduced payload once;
  * all-gather: a worker sends its payload once and receives the other R-1 payloads;
  * permute: a worker sends its payload to one peer and receives one peer's;
  * all-to-all: a worker's R rows go one to each worker: it sends and receives R-1 rows
    (its own stays).
A ring all-reduce moves 2(R-1)/R times the payload per worker on the wire; that transport
factor is a property of the fabric, reported separately where it matters.
"""

import contextlib
import dataclasses
import threading

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class CommBytes:
  sent: int = 0
  received: int = 0

  def __add__(self, other: "CommBytes") -> "CommBytes":
    return CommBytes(self.sent + other.sent, self.received + other.received)

  def __mul__(self, n: int) -> "CommBytes":
    return CommBytes(self.sent * n, self.received * n)


_local = threading.local()


def tree_bytes(tree) -> int:
  """Bytes of all array leaves (arrays or ShapeDtypeStructs)."""
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def record(kind: str, payload, group_size: int) -> None:
  """Called by collectives at trace time; a no-op unless `count_bytes` is tracing."""
  log = getattr(_local, "log", None)
  if log is None:
    return
  n = tree_bytes(payload) if group_size > 1 else 0  # a lone worker sends nothing
  if kind == "all_reduce":
    log.append(CommBytes(sent=n, received=n))
  elif kind == "all_gather":
    log.append(CommBytes(sent=n, received=n * (group_size - 1)))
  elif kind == "all_to_all":  # [R, ...] rows, one to each worker
    row = n // group_size
    log.append(CommBytes(sent=row * (group_size - 1), received=row * (group_size - 1)))
  elif kind == "permute":  # to one peer, from one peer (gossip)
    log.append(CommBytes(sent=n, received=n))
  else:
    raise ValueError(f"unknown collective kind {kind!r}")


@contextlib.contextmanager
def _recording():
  _local.log = []
  try:
    yield _local.log
  finally:
    _local.log = None


def count_bytes(fn, *args, **kwargs) -> CommBytes:
  """Per-worker bytes one call of `fn` moves through the collectives (traced, not run).

  `fn` must be a plain (un-jitted) function: a jitted one may answer from its trace cache
  without running the collectives' Python code, so nothing would be recorded.
  """
  if hasattr(fn, "lower"):
    raise TypeError("count_bytes needs the plain function, not its jax.jit wrapper")
  with _recording() as log:
    # A fresh wrapper per call, so eval_shape's own cache never skips the trace.
    jax.eval_shape(lambda *a, **k: fn(*a, **k), *args, **kwargs)
  return sum(log, CommBytes())
