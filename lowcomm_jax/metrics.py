"""Metric writing (the only module that builds CLU writers) and the metrics.jsonl file.

Every scalar goes, through one CLU MultiWriter, to TensorBoard event files under
`<workdir>/tensorboard`, to the console log, and as one JSON object per write to
`<workdir>/metrics.jsonl` (for report.py and plots). Console progress (steps/s, ETA) comes
from CLU's ReportProgress. The x axis everywhere is `step`, inner steps completed per
worker (= rounds * H), so DDP and DiLoCo runs line up.
"""

import json
import math
import pathlib
from collections.abc import Mapping

import numpy as np
from clu import metric_writers, periodic_actions
from clu.metric_writers import interface


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


class JsonlWriter(interface.MetricWriter):
  """A CLU writer appending `{"step": s, **scalars}` lines; other summary kinds are ignored."""

  def __init__(self, path: pathlib.Path, *, drop_after_step: int | None = None):
    self.path = pathlib.Path(path)
    if drop_after_step is not None and self.path.exists():
      # After a resume, forget lines logged past the checkpoint: they will be redone.
      kept = [line for line in self.path.read_text().splitlines()
              if line.strip() and json.loads(line)["step"] <= drop_after_step]
      self.path.write_text("".join(line + "\n" for line in kept))

  def write_scalars(self, step, scalars):
    record = {"step": int(step)}
    for k, v in scalars.items():
      record[k] = v if math.isfinite(v) else str(v)  # JSON has no NaN/Inf
    with self.path.open("a") as f:
      f.write(json.dumps(record) + "\n")

  def write_summaries(self, step, values, metadata=None): pass
  def write_images(self, step, images): pass
  def write_videos(self, step, videos): pass
  def write_audios(self, step, audios, *, sample_rate): pass
  def write_texts(self, step, texts): pass
  def write_histograms(self, step, arrays, num_buckets=None): pass
  def write_hparams(self, hparams): pass
  def flush(self): pass
  def close(self): pass


class MetricsLogger:

  def __init__(self, workdir: pathlib.Path, *, total_steps: int, resume_step: int,
               write_files: bool = True):
    default = metric_writers.create_default_writer(
        str(pathlib.Path(workdir) / "tensorboard"), just_logging=not write_files,
        asynchronous=True)
    writers = [default]
    if write_files:
      writers.append(JsonlWriter(pathlib.Path(workdir) / "metrics.jsonl",
                                 drop_after_step=resume_step))
    self._writer = metric_writers.MultiWriter(writers)
    self._progress = periodic_actions.ReportProgress(
        num_train_steps=total_steps, writer=default, every_secs=10.0)

  def write(self, step: int, scalars: Mapping) -> None:
    self._writer.write_scalars(step, flatten_scalars(scalars))

  def progress(self, step: int) -> None:
    self._progress(step)

  def close(self) -> None:
    self._writer.flush()
    self._writer.close()
