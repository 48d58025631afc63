"""Metric writing (the only module that builds CLU writers) and the metrics.jsonl file.

Every scalar goes to TensorBoard event files under `<workdir>/tensorboard` through CLU and,
as one JSON object per write, to `<workdir>/metrics.jsonl` for report.py and plots. Console
progress (steps/s, ETA) comes from CLU's ReportProgress. The x axis everywhere is `step`,
inner steps completed per worker (= rounds * H), so DDP and DiLoCo runs line up.
"""

import json
import math
import pathlib

import numpy as np
from clu import metric_writers, periodic_actions


def _scalar(value) -> float:
  return float(np.asarray(value))


def flatten_scalars(metrics: dict) -> dict[str, float]:
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


class MetricsLogger:

  def __init__(self, workdir: pathlib.Path, *, total_steps: int, resume_step: int,
               write_files: bool = True):
    self.jsonl_path = pathlib.Path(workdir) / "metrics.jsonl"
    self._write_files = write_files
    self._writer = metric_writers.create_default_writer(
        str(pathlib.Path(workdir) / "tensorboard"), just_logging=not write_files,
        asynchronous=True)
    self._progress = periodic_actions.ReportProgress(
        num_train_steps=total_steps, writer=self._writer, every_secs=10.0)
    if write_files:
      self._drop_lines_after(resume_step)

  def _drop_lines_after(self, step: int) -> None:
    """After a resume, forget lines logged past the checkpoint (they will be redone)."""
    if not self.jsonl_path.exists():
      return
    kept = [line for line in self.jsonl_path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= step]
    self.jsonl_path.write_text("".join(line + "\n" for line in kept))

  def write(self, step: int, scalars: dict) -> None:
    flat = flatten_scalars(scalars)
    self._writer.write_scalars(step, flat)
    if self._write_files:
      record = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in flat.items()}}
      with self.jsonl_path.open("a") as f:
        f.write(json.dumps(record) + "\n")

  def progress(self, step: int) -> None:
    self._progress(step)

  def close(self) -> None:
    self._writer.flush()
    self._writer.close()
