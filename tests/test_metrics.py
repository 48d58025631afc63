"""Metric files and console: TensorBoard scalars without TensorFlow, an append-only
metrics.jsonl, progress lines. (Per-round speeds that evaluation and checkpoints do not
distort: tests/test_run_loop.py with a scripted clock, bench/pause_timing.py for real.)"""

import json
import logging
import subprocess
import sys

import pytest

from conftest import REPO
from lowcomm_jax.run import metrics
from lowcomm_jax.assemble import program_cache
from lowcomm_jax.runtimes.spmd import train


def _rows(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_resume_appends_only_new_rows_tensorboard_holds_scalars_console_shows_progress(
    tmp_path, smoke_config, caplog):
  program_cache.clear()  # programs of this model another test compiled would not announce
  config = smoke_config(rounds=4, checkpoint_every=2, eval_every=2)
  with caplog.at_level(logging.INFO):
    train.run(config, tmp_path, stop_after_rounds=2)
  # The interrupted invocation had logged round 3 after its last checkpoint (round 2).
  with (tmp_path / "metrics.jsonl").open("a") as f:
    f.write(json.dumps({"step": 6, "logged_before_preemption": True}) + "\n")
  with caplog.at_level(logging.INFO):
    train.run(config, tmp_path)
  rows = _rows(tmp_path)
  # Nothing deleted or reordered; round 3 (step 6) is not logged twice.
  assert [r["step"] for r in rows] == [2, 4, 6, 8]
  assert rows[2] == {"step": 6, "logged_before_preemption": True}

  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
  logged = [(r["step"], r["train_loss"]) for r in rows if "train_loss" in r]
  assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in events.Scalars("train_loss")] \
      == logged
  assert [e.step for e in events.Scalars("eval_loss")] == [4, 8]

  lines = [rec.getMessage() for rec in caplog.records]
  assert any(line.startswith("compiling the local program for host 0") for line in lines)
  assert any(line.startswith("compiling evaluation") for line in lines)
  progress = [line for line in lines if line.startswith("round ")]
  assert [line.split()[1] for line in progress] == ["1/4", "2/4", "3/4", "4/4"]
  assert " eval " in progress[1] and "tok/s" in progress[1] and "MiB sent" in progress[1]
  assert not any("param_norm" in line for line in lines)  # scalars go to files only


def test_note_appends_any_json_to_metrics_jsonl_only(tmp_path):
  logger = metrics.MetricsLogger(tmp_path, rounds=4)
  logger.write(2, {"train_loss": 1.5})
  logger.note(2, {"event": "resume", "changed": {"outer.lr": [0.7, 0.5]}})
  logger.close()
  assert _rows(tmp_path) == [
      {"step": 2, "train_loss": 1.5},
      {"step": 2, "event": "resume", "changed": {"outer.lr": [0.7, 0.5]}}]
  # A resumed logger skips steps already in the file and appends the rest.
  again = metrics.MetricsLogger(tmp_path, rounds=4)
  again.write(2, {"train_loss": 9.0})
  again.write(4, {"train_loss": 1.25})
  again.close()
  assert [r.get("train_loss") for r in _rows(tmp_path)] == [1.5, None, 1.25]


def test_a_line_cut_short_by_a_crash_is_kept_and_ended(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 2, "a": 1}\n{"step": 4, "a"')
  logger = metrics.MetricsLogger(tmp_path, rounds=4)
  logger.write(4, {"a": 2})
  logger.close()
  assert (tmp_path / "metrics.jsonl").read_text().splitlines() == [
      '{"step": 2, "a": 1}', '{"step": 4, "a"', '{"step": 4, "a": 2}']


def test_progress_line_and_eta_format():
  assert metrics.progress_line(3, 20, train_loss=2.45123, eval_loss=2.387,
                               tokens_per_second=1234.4, bytes_sent=12.3 * 2**20,
                               seconds_left=65) \
      == "round 3/20  train 2.4512  eval 2.3870  1,234 tok/s  12.3 MiB sent  ETA 1:05"
  assert metrics.progress_line(1, 2, train_loss=1.0) == "round 1/2  train 1.0000"
  assert metrics.format_eta(3725) == "1:02:05"


def test_the_runner_imports_without_tensorflow():
  code = ("import lowcomm_jax.runtimes.spmd.train, lowcomm_jax.runtimes.simulator.simulate, lowcomm_jax.main, sys; "
          "loaded = [m for m in sys.modules if m.startswith('tensorflow')]; "
          "assert not loaded, loaded")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
