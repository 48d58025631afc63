"""Metric files and the console progress line.

Every scalar goes to TensorBoard event files under `<workdir>/tensorboard` (scalar
summaries, written with tensorboard's own record writer: no TensorFlow; or, with
`metrics.writer='clu'`, through clu.metric_writers, which needs TensorFlow) and as one JSON
object per write to `<workdir>/metrics.jsonl` (for report.py and plots). The console gets
one short progress line per logged round (and, with the 'clu' writer, clu's line per row). The x axis everywhere is `step`,
inner steps completed per worker (= rounds * H), so DDP and DiLoCo runs line up.

metrics.jsonl is append-only: a resumed run never deletes or rewrites rows. Resume is
bit-exact, so rows at or below the file's last step, already written by the interrupted
invocation, are not written again.
"""

import itertools
import json
import logging
import math
import os
import pathlib
import queue
import socket
import threading
import time
from collections.abc import Mapping

import jax
import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.record_writer import RecordWriter


def flatten_scalars(metrics: Mapping) -> dict[str, int | float]:
  """{'train_loss_per_worker': [a, b]} -> {'train_loss_worker_0': a, 'train_loss_worker_1': b}."""
  flat = {}
  for name, value in metrics.items():
    arr = np.asarray(value)
    if arr.ndim == 0:
      flat[name] = int(arr) if arr.dtype.kind in "iu" else float(arr)
    else:
      base = name.removesuffix("_per_worker")
      flat.update({f"{base}_worker_{i}": float(v) for i, v in enumerate(arr.ravel())})
  return flat


def last_step(path: pathlib.Path) -> int | None:
  """The largest `step` in a metrics.jsonl (None for a missing or empty file); a line cut
  short by a crash is passed over."""
  if not path.exists():
    return None
  steps = []
  for line in path.read_text().splitlines():
    try:
      steps.append(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
      pass
  return max(steps, default=None)


class JsonlWriter:
  """Appends one JSON object per line; never rewrites the file."""

  def __init__(self, path: pathlib.Path):
    self.path = pathlib.Path(path)
    if self.path.exists() and self.path.stat().st_size:
      with self.path.open("rb+") as f:  # a line cut short by a crash: end it, keep it
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
          f.write(b"\n")
    self._file = self.path.open("a", buffering=1)  # line-buffered: each row on disk at once

  def write(self, record: dict) -> None:
    self._file.write(json.dumps(record) + "\n")

  def close(self) -> None:
    self._file.close()


_FILE_NUMBERS = itertools.count()  # two writers in one process and second get two files


class EventWriter:
  """TensorBoard event file of scalar summaries (`simple_value`, what `Scalars()` reads)."""

  def __init__(self, logdir: pathlib.Path):
    logdir = pathlib.Path(logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    # TensorBoard reads every events.out.tfevents.* file in the directory, in name order:
    # one per invocation, named as TensorFlow names them.
    name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
            f"{os.getpid()}.{next(_FILE_NUMBERS)}")
    self._records = RecordWriter((logdir / name).open("wb"))
    self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

  def _write(self, event) -> None:
    self._records.write(event.SerializeToString())
    self._records.flush()  # a few hundred bytes per logged round: TensorBoard sees it live

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    values = [summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()]
    self._write(event_pb2.Event(wall_time=time.time(), step=step,
                                summary=summary_pb2.Summary(value=values)))

  def close(self) -> None:
    self._records.close()


class CluWriter:
  """`metrics.writer='clu'`: the same scalars through `clu.metric_writers`'s default writer
  (TensorFlow's summary writer, and a log line per write). clu.metric_writers imports
  TensorFlow, so it is imported only here; config/check.py refuses 'clu' without TensorFlow."""

  def __init__(self, logdir: pathlib.Path):
    from clu import metric_writers  # noqa: PLC0415 -- imports TensorFlow
    self._writer = metric_writers.create_default_writer(str(logdir), asynchronous=False)

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    self._writer.write_scalars(step, dict(scalars))
    self._writer.flush()  # as EventWriter: TensorBoard sees each row at once

  def close(self) -> None:
    self._writer.close()


WRITERS = {"tensorboard": EventWriter, "clu": CluWriter}  # metrics.writer (config/defaults.py)


def format_eta(seconds: float) -> str:
  """m:ss (h:mm:ss from an hour)."""
  if not math.isfinite(seconds):
    return "?"
  m, s = divmod(int(round(max(seconds, 0.0))), 60)
  h, m = divmod(m, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def progress_line(round_: int, rounds: int, *, train_loss: float | None = None,
                  eval_loss: float | None = None, tokens_per_second: float | None = None,
                  bytes_sent: float | None = None, seconds_left: float | None = None) -> str:
  """`round 3/20  train 2.4512  eval 2.3870  1,234 tok/s  12.3 MiB sent  ETA 1:05`; parts
  without a value are left out."""
  parts = [f"round {round_}/{rounds}"]
  if train_loss is not None:
    parts.append(f"train {train_loss:.4f}")
  if eval_loss is not None:
    parts.append(f"eval {eval_loss:.4f}")
  if tokens_per_second is not None:
    parts.append(f"{tokens_per_second:,.0f} tok/s")
  if bytes_sent is not None:
    parts.append(f"{bytes_sent / 2**20:,.1f} MiB sent")
  if seconds_left is not None:
    parts.append(f"ETA {format_eta(seconds_left)}")
  return "  ".join(parts)


class ReadyClock:
  """When device results become ready, on the host's clock (`time.perf_counter`).

  The host reads a round's metrics when it needs them: a round late while the devices
  work ahead, at once on evaluation and checkpoint rounds. Timing those reads would credit
  one round with another's work; a watcher thread blocks on each watched result instead.
  """

  def __init__(self):
    self._pending = queue.SimpleQueue()
    self._times = {}
    self._recorded = threading.Condition()
    self._watcher = threading.Thread(target=self._watch, name="ready-clock", daemon=True)
    self._watcher.start()

  def watch(self, key, tree) -> None:
    self._pending.put((key, tree))

  def ready_time(self, key) -> float:
    """When `watch(key, ...)`'s arrays were ready (waits for them)."""
    with self._recorded:
      self._recorded.wait_for(lambda: key in self._times)
      return self._times.pop(key)

  def close(self) -> None:
    """Stops the watcher once the results it waits for are ready. Joined, not left to die
    with the interpreter: a daemon thread killed inside XLA's wait aborts the process
    (exit -6 instead of the run's own error code)."""
    self._pending.put(None)
    self._watcher.join()

  def _watch(self) -> None:
    while (item := self._pending.get()) is not None:
      key, tree = item
      try:
        jax.block_until_ready(tree)
      except Exception:  # noqa: BLE001 -- the host's own read of the values raises it
        pass
      with self._recorded:
        self._times[key] = time.perf_counter()
        self._recorded.notify_all()


def announce_compile(jitted, what: str) -> None:
  """Logs "compiling <what>…" before a jitted function's first call: compiling a real model
  takes minutes, which would otherwise pass in silence."""
  jitted = getattr(jitted, "func", jitted)  # through jitted.Bound (a bound frozen argument)
  cache_size = getattr(jitted, "_cache_size", None)  # jax's jit objects; not a public API
  if cache_size is None or cache_size() == 0:
    logging.info("compiling %s…", what)


class MetricsLogger:
  """Scalars to TensorBoard and metrics.jsonl (where `write_files`: process 0), progress
  lines to the log."""

  def __init__(self, workdir: pathlib.Path, *, rounds: int, write_files: bool = True,
               writer: str = "tensorboard"):
    self.rounds = rounds
    self._console = write_files  # one progress line per run, from the process that writes
    self._jsonl = self._events = None
    # Steps the interrupted invocation already logged (None: nothing yet).
    self._logged_through = None
    if write_files:
      path = pathlib.Path(workdir) / "metrics.jsonl"
      self._logged_through = last_step(path)
      self._jsonl = JsonlWriter(path)
      self._events = WRITERS[writer](pathlib.Path(workdir) / "tensorboard")

  def write(self, step: int, scalars: Mapping) -> None:
    """Scalars to both files, unless `step` was logged before a resume."""
    if self._jsonl is None or (self._logged_through is not None
                               and step <= self._logged_through):
      return
    flat = flatten_scalars(scalars)
    self._events.write_scalars(step, flat)
    # JSON has no NaN/Inf.
    self._jsonl.write({"step": int(step),
                       **{k: v if math.isfinite(v) else str(v) for k, v in flat.items()}})

  def note(self, step: int, record: Mapping, *, supersede_later_rows: bool = False) -> None:
    """One JSON object (any JSON values, e.g. a resume's changes) to metrics.jsonl only.

    `supersede_later_rows`: the run continues from `step` under another config, so rows the
    earlier invocation logged past `step` are not what this one trains. They stay in the
    file (never deleted); this invocation writes its own rows for those steps after this
    one, and readers (report.read_metrics) keep the later rows."""
    if self._jsonl is not None:
      self._jsonl.write({"step": int(step), **record})
      if supersede_later_rows:
        self._logged_through = None

  def progress(self, round_: int, **values) -> None:
    """Logs `progress_line(round_, rounds, **values)`."""
    if self._console:
      logging.info("%s", progress_line(round_, self.rounds, **values))

  def close(self) -> None:
    if self._events is not None:
      self._events.close()
      self._jsonl.close()
