"""A run's life in its workdir, the same for the runner (runtimes/spmd/train.py) and the simulator
(runtimes/simulator/simulate.py): the identity check before any work, the checkpoints (recovered on
open), the metrics files with their resume record, the divergence stop that leaves the last good
checkpoint intact, and the summary. The drivers differ only in how they make progress.
"""

import json
import logging
import pathlib

import ml_collections

from lowcomm_jax.run import identity
from lowcomm_jax.run.checkpoint import Checkpointer
from lowcomm_jax.run.metrics import MetricsLogger


class TrainingDiverged(RuntimeError):
  """A non-finite loss or parameter; the last good checkpoint is left as it was."""


class RunFiles:
  """Open with the config (refuses a changed one at once), then `open_checkpoints`,
  `start_metrics`, and `close` in a `finally`."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str | pathlib.Path):
    self.config = config
    self.workdir = pathlib.Path(workdir)
    # A workdir holds one run: a changed config is refused before any work.
    # A LoRA run's base (hashed once): its adapters resume on no other.
    self.base = identity.base_of(config)
    self.config_changes = identity.changes(self.workdir, config, self.base)
    self.summary_path = self.workdir / "summary.json"
    self.ckpt: Checkpointer | None = None
    self.logger: MetricsLogger | None = None

  def open_checkpoints(self) -> int | None:
    """Creates the workdir, opens its checkpoints and returns the newest intact round
    (damaged newer ones are moved aside), or None."""
    self.workdir.mkdir(parents=True, exist_ok=True)
    self.ckpt = Checkpointer(self.workdir / "checkpoints",
                             max_to_keep=self.config.keep_checkpoints)
    return self.ckpt.recover()

  def finished_summary(self) -> dict | None:
    """The summary of a run that already finished here (and closes), or None."""
    if not self.summary_path.exists():
      return None
    logging.info("run in %s already finished; keeping summary.json", self.workdir)
    self.ckpt.close()
    return json.loads(self.summary_path.read_text())

  def start_metrics(self, step: int, resumed_at: int | None, *, write_files: bool) -> list:
    """Opens the metrics files; on the writing process records a resume under changed
    fields (config.json, and an event row that supersedes later rows). Returns the run's
    recorded resumes."""
    self.logger = MetricsLogger(self.workdir, rounds=self.config.rounds, write_files=write_files,
                                writer=self.config.metrics.writer)
    if not write_files:
      return []
    if self.config_changes:
      self.logger.note(step, {"event": "resume", "round": resumed_at,
                              "changed": self.config_changes}, supersede_later_rows=True)
    return identity.write(self.workdir, self.config, resumed_at=resumed_at,
                              changed=self.config_changes, base=self.base)

  def diverged(self, what: str, unit: str = "round") -> TrainingDiverged:
    """The error for non-finite training at `what`, once saves in flight are done."""
    self.ckpt.wait()
    return TrainingDiverged(
        f"non-finite training at {what}. The last good checkpoint ({unit} "
        f"{self.ckpt.latest_round()}) in {self.ckpt.directory} is intact; lower "
        "optimizer.lr or outer.lr and resume from it")

  def close(self) -> None:
    """Saves in flight complete (raising if one failed: WorkdirError), files are flushed."""
    try:
      if self.ckpt is not None:
        self.ckpt.wait()
    finally:
      if self.ckpt is not None:
        self.ckpt.close()
      if self.logger is not None:
        self.logger.close()

  def write_summary(self, summary: dict, resumes: list, *, write_files: bool) -> dict:
    summary["config_changes"] = resumes
    if self.base is not None:
      summary["base"] = self.base
    if write_files:
      self.summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary
