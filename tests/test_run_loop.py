"""The one run loop (run/loop.py) with a scripted driver: which marks read, evaluate, write
and save, in which order, for a driver that reads late (the runner) and one that reads at
the mark (the simulator); a non-finite reading stops before the save; stopping early."""

import dataclasses
import json
import math
import time

import pytest

from lowcomm_jax.run import loop
from lowcomm_jax.run.files import RunFiles, TrainingDiverged


class ScriptedDriver:
  unit = "round"
  writes_files = True

  def __init__(self, rounds: int, *, reads_late: bool, nan_at: int | None = None):
    self.rounds, self.reads_late, self.nan_at = rounds, reads_late, nan_at
    self.events = []

  def open(self, files, latest):
    self.mark = latest or 0
    return None

  def position(self):
    return self.mark, self.mark * 10, self.mark * 100

  def wall_before(self):
    return 0.0

  def advance(self, due):
    if self.mark >= self.rounds:
      return None
    self.mark += 1
    last = self.mark == self.rounds
    d = due(self.mark, last_of_run=last, last_of_call=last)
    self.events.append(("advance", self.mark))
    return loop.Mark(self.mark, d, self.mark if d.metrics else None)

  def read(self, mark):
    self.events.append(("read", mark))
    loss = math.nan if mark == self.nan_at else 1.0 / mark
    problem = f"round {mark} (train_loss=nan)" if math.isnan(loss) else None
    return loop.Reading(mark * 10, {"tokens": mark * 100, "train_loss": loss},
                            time.perf_counter(), problem)

  def evaluate(self):
    self.events.append(("eval", self.mark))
    return {"eval_loss": 2.0 / self.mark}

  def save(self, ckpt, mark, *, last, wall):
    self.events.append(("save", mark))

  def complete(self):
    return self.mark == self.rounds

  def stopped(self):
    return {"stopped_at": self.mark}

  def summary(self, eval_loss, scalars, wall):
    return {"eval_loss": eval_loss, "train_loss": scalars.get("train_loss")}

  def close(self):
    self.events.append(("close",))


def _files(smoke_config, workdir, **fields):
  config = smoke_config(**{"rounds": 6, "eval_every": 3, "log_every": 2,
                           "checkpoint_every": 3, **fields})
  return RunFiles(config, workdir)


def _rows(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_a_driver_that_reads_late_is_read_one_mark_later_except_where_a_mark_must_stop(
    tmp_path, smoke_config):
  driver = ScriptedDriver(6, reads_late=True)
  summary = loop.run(driver, _files(smoke_config, tmp_path), t_start=time.time())
  # Round 1 is due nothing (no metrics computed); 2 logs (read when 3 is reached); 3
  # evaluates and saves (read at once); 4 logs (read at 5); 6 is the last: all three.
  assert driver.events == [
      ("advance", 1), ("advance", 2), ("advance", 3), ("read", 2), ("read", 3), ("eval", 3),
      ("save", 3), ("advance", 4), ("advance", 5), ("read", 4), ("advance", 6), ("read", 6),
      ("eval", 6), ("save", 6), ("close",)]
  rows = [r for r in _rows(tmp_path) if "train_loss" in r]
  assert [r["step"] for r in rows] == [20, 30, 40, 60]
  assert [r.get("eval_loss") for r in rows] == [None, 2 / 3, None, 2 / 6]
  assert all(r["steps_per_second"] > 0 for r in rows)
  assert summary["eval_loss"] == 2 / 6 and summary["train_loss"] == 1 / 6
  assert json.loads((tmp_path / "summary.json").read_text())["eval_loss"] == 2 / 6


def test_a_driver_that_reads_at_the_mark_is_read_before_it_advances(tmp_path, smoke_config):
  driver = ScriptedDriver(6, reads_late=False)
  loop.run(driver, _files(smoke_config, tmp_path), t_start=time.time())
  assert driver.events[:7] == [("advance", 1), ("advance", 2), ("read", 2), ("advance", 3),
                               ("read", 3), ("eval", 3), ("save", 3)]


@pytest.mark.parametrize("reads_late", [True, False])
def test_a_non_finite_reading_stops_the_run_before_its_checkpoint(tmp_path, smoke_config,
                                                                 reads_late):
  driver = ScriptedDriver(6, reads_late=reads_late, nan_at=3)
  with pytest.raises(TrainingDiverged, match="round 3"):
    loop.run(driver, _files(smoke_config, tmp_path), t_start=time.time())
  assert ("save", 3) not in driver.events and ("eval", 3) not in driver.events
  assert driver.events[-1] == ("close",)  # the driver's threads are released
  assert not (tmp_path / "summary.json").exists()


def test_stop_after_checkpoints_returns_the_drivers_stop_record(tmp_path, smoke_config):
  driver = ScriptedDriver(6, reads_late=True)
  out = loop.run(driver, _files(smoke_config, tmp_path), t_start=time.time(),
                     stop_after_checkpoints=1)
  assert out == {"stopped_at": 3}
  assert ("advance", 4) not in driver.events


def test_the_runs_last_save_ends_it_with_its_summary_even_at_the_stop_count(tmp_path,
                                                                            smoke_config):
  driver = ScriptedDriver(6, reads_late=True)
  files = _files(smoke_config, tmp_path, checkpoint_every=0)  # only the last mark saves
  out = loop.run(driver, files, t_start=time.time(), stop_after_checkpoints=1)
  assert out["eval_loss"] == 2 / 6 and (tmp_path / "summary.json").exists()


def test_a_driver_whose_open_fails_is_closed(tmp_path, smoke_config):
  class Refusing(ScriptedDriver):
    def open(self, files, latest):
      raise RuntimeError("no")
  driver = Refusing(6, reads_late=True)
  with pytest.raises(RuntimeError):
    loop.run(driver, _files(smoke_config, tmp_path), t_start=time.time())
  assert driver.events == [("close",)]


@pytest.mark.parametrize("reads_late", [True, False])
def test_training_speed_leaves_out_evaluation_and_saving(tmp_path, smoke_config, monkeypatch,
                                                         reads_late):
  # A clock that moves only when the driver works: 1 s of training per round (10 steps),
  # 50 s per evaluation, 20 s per save. Every row's speed is then 10 steps/s, rounds that
  # evaluate and save included. (bench/pause_timing.py measures it with the real runner.)
  now = [100.0]
  monkeypatch.setattr(loop, "time", type("Clock", (), {
      "perf_counter": staticmethod(lambda: now[0]), "time": staticmethod(lambda: now[0])}))

  class Clocked(ScriptedDriver):
    ready = {}

    def advance(self, due):
      mark = super().advance(due)
      if mark is not None:
        now[0] += 1.0
        self.ready[mark.index] = now[0]  # its results are ready when its compute ends
      return mark

    def read(self, mark):
      return dataclasses.replace(super().read(mark), ready_time=self.ready[mark])

    def evaluate(self):
      now[0] += 50.0
      return super().evaluate()

    def save(self, ckpt, mark, *, last, wall):
      now[0] += 20.0
      super().save(ckpt, mark, last=last, wall=wall)

  loop.run(Clocked(6, reads_late=reads_late), _files(smoke_config, tmp_path), t_start=100.0)
  rows = [r for r in _rows(tmp_path) if "train_loss" in r]
  assert [r["step"] for r in rows] == [20, 30, 40, 60]
  assert [r["steps_per_second"] for r in rows] == [pytest.approx(10.0)] * 4
