"""The one run loop, for the runner (runtimes/spmd/train.py), the simulator
(runtimes/simulator/simulate.py) and the Ray driver (runtimes/ray/driver.py).

A driver makes progress and reports each *mark* it reaches: a round of the runner, a
round-equivalent of the simulator (W·H inner steps applied, or a synchronous round). This
loop decides what each mark is due (metrics, evaluation, a checkpoint), reads metrics a mark
late where the driver allows it (the host never makes the devices wait), stops a diverged
run before anything is saved, times training without the pauses for evaluation and saving,
and writes the metrics rows, progress lines and summary through the workdir's `RunFiles`.
The drivers differ only in how, and when, they make progress.
"""

import dataclasses
import math
import time
from typing import Any, Callable, Protocol

from lowcomm_jax.run import compile_cache
from lowcomm_jax.run.checkpoint import Checkpointer
from lowcomm_jax.run.metric_names import widths_of
from lowcomm_jax.run.files import RunFiles


@dataclasses.dataclass(frozen=True)
class Due:
  """What a mark must do."""
  evaluate: bool
  write: bool  # a metrics row and a progress line
  checkpoint: bool
  last: bool  # the last mark of this invocation (of the run, or of a stop_after)

  @property
  def metrics(self) -> bool:
    """Whether the mark's metrics are computed (they cost a collective and two passes over θ,
    so only marks that use them pay; divergence is checked on them, always before a save)."""
    return self.evaluate or self.write or self.checkpoint


def due_at(config, mark: int, *, last_of_run: bool, last_of_call: bool) -> Due:
  """`eval_every`, `log_every`, `checkpoint_every` (0: never) at `mark`; the run's last mark
  always evaluates, an invocation's last one always writes and saves."""
  every = lambda n: n > 0 and mark % n == 0
  evaluate = last_of_run or every(config.eval_every)
  return Due(evaluate=evaluate, write=evaluate or last_of_call or every(config.log_every),
             checkpoint=last_of_call or every(config.checkpoint_every), last=last_of_call)


@dataclasses.dataclass(frozen=True)
class Mark:
  index: int  # rounds or round-equivalents done
  due: Due
  handle: Any = None  # what `Driver.read` turns into scalars (when due.metrics)


@dataclasses.dataclass
class Reading:
  """A mark's metrics on the host."""
  step: int  # the metrics' x axis: inner steps per worker
  scalars: dict  # includes "tokens" (all workers, cumulative)
  ready_time: float  # when its results were ready (time.perf_counter)
  problem: str | None = None  # what is non-finite, if anything: the run stops


class Driver(Protocol):
  unit: str  # what a mark is called in messages ("round", "round-equivalent")
  writes_files: bool  # this process writes metrics and summary (process 0 of a runner)
  # A mark's metrics may be read when the next mark is reached (the runner: the host never
  # waits for the devices), or must be read at once (the simulator's accounts move on).
  reads_late: bool

  def open(self, files: RunFiles, latest: int | None) -> dict | None:
    """Restores checkpoint `latest` (or starts fresh when None); returns the summary of a
    run that already finished there, or None."""

  def position(self) -> tuple[int, int, int]:
    """(mark, metrics step, tokens) where this invocation starts."""

  def wall_before(self) -> float:
    """Wall seconds spent by earlier invocations of this run."""

  def advance(self, due: Callable[..., Due]) -> Mark | None:
    """Makes progress up to the next mark, or None when there is nothing left to do.
    `due(mark, last_of_run=, last_of_call=)` says what a mark must do, as soon as the
    driver knows the mark (the runner before computing it: it skips metrics it won't need)."""

  def read(self, handle) -> Reading:
    """Blocks on a mark's metrics."""

  def evaluate(self) -> dict[str, float]:
    """The global model's loss on the evaluation windows: {"eval_loss": ...}, plus one
    `eval_loss/tier_<w>` per width where the run evaluates several (Run.evaluation)."""

  def save(self, ckpt: Checkpointer, mark: int, *, last: bool, wall: float) -> None:
    """Checkpoints everything needed to continue from `mark`."""

  def complete(self) -> bool:
    """Whether the run is done (not only this invocation)."""

  def stopped(self) -> dict:
    """What an invocation that stopped early (`stop_after_*`) returns."""

  def summary(self, eval_loss: float, scalars: dict, wall: float) -> dict:
    """The finished run's summary.json."""

  def close(self) -> None:
    """Releases the driver's threads (also on errors)."""


def run(driver: Driver, files: RunFiles, *, t_start: float,
        stop_after_checkpoints: int | None = None) -> dict:
  """Runs (or resumes) `driver`'s run in `files.workdir` and returns its summary, or the
  driver's `stopped()` record after `stop_after_checkpoints` saves (as a preemption would).
  `t_start`: when this invocation started (time.time()), for the run's wall seconds."""
  c = files.config
  compiled_before = compile_cache.counts()
  latest = files.open_checkpoints()
  try:
    summary = driver.open(files, latest)
  except BaseException:
    driver.close()
    raise
  if summary is not None:
    driver.close()
    return summary
  wall = lambda: driver.wall_before() + time.time() - t_start
  start, step, tokens = driver.position()
  # A restart under a changed config is recorded at the mark it continues from (0: a run
  # that died before its first checkpoint).
  resumes = files.start_metrics(step, start, write_files=driver.writes_files)
  reporter = _Reporter(files, driver.unit, step, tokens)
  report, clock = reporter.report, reporter.clock
  due = lambda mark, **last: due_at(c, mark, **last)
  pending = None  # a mark whose metrics are read one mark late
  scalars, evals, saved = {}, None, 0
  startup = None  # seconds until the first mark's programs were compiled and dispatched
  try:
    while (mark := driver.advance(due)) is not None:
      startup = time.time() - t_start if startup is None else startup
      if pending is not None:
        report(pending, driver.read(pending.handle))
        pending = None
      if mark.due.metrics:
        pending = mark
      if not (mark.due.evaluate or mark.due.checkpoint or mark.due.last):
        if pending is not None and not driver.reads_late:
          report(pending, driver.read(pending.handle))
          pending = None
        continue
      # Read now: a diverged state is never evaluated as good nor checkpointed.
      reading = driver.read(mark.handle) if pending is not None else None
      pending = None
      if reading is not None and reading.problem is not None:
        raise files.diverged(reading.problem, unit=driver.unit)
      paused_at = time.perf_counter()
      evals = driver.evaluate() if mark.due.evaluate else None
      if evals is not None and not math.isfinite(evals["eval_loss"]):
        raise files.diverged(f"{driver.unit} {mark.index} (eval_loss={evals['eval_loss']})",
                             unit=driver.unit)
      scalars = report(mark, reading, evals)
      if mark.due.checkpoint:
        driver.save(files.ckpt, mark.index, last=mark.due.last, wall=wall())
        saved += 1
      # report() restarted the clock at the reading; what followed was not training.
      clock["paused"] += time.perf_counter() - max(paused_at, clock["time"])
      # (The run's last save ends it anyway: its summary is written, not a stop record.)
      if (stop_after_checkpoints is not None and saved >= stop_after_checkpoints
          and not mark.due.last):
        return driver.stopped()
    if not driver.complete():
      return driver.stopped()
    if evals is None:  # resumed at the end: the summary was lost, its evaluation too
      evals = driver.evaluate()
    wall_seconds = wall()  # as the last checkpoint's, not counting the wait for its save
  finally:  # also on errors: saves in flight complete, files are flushed
    driver.close()
    files.close()  # raises if a save in flight failed (WorkdirError)
  summary = {"runtime": files.config.runtime,  # (run/summary.py: the keys every one writes)
             **driver.summary(evals["eval_loss"], scalars, wall_seconds)}
  if by_width := widths_of(evals):  # the last evaluation at every width (Run.evaluation)
    summary["eval_loss_by_width"] = by_width
  compiled, loaded, compiling = (now - before for now, before in zip(compile_cache.counts(),
                                                                     compiled_before))
  # This invocation's start-up: compiles (or cache loads), data, the first mark's dispatch.
  summary.update(startup_seconds=startup, programs_compiled=compiled,
                 programs_from_cache=loaded, compile_seconds=compiling)
  return files.write_summary(summary, resumes, write_files=driver.writes_files)


class _Reporter:
  """A run's metric rows and progress lines, one per reading, with its training speed:
  from one reading's ready time to the next, less the seconds spent evaluating and saving
  in between (`clock["paused"]`, which the loop adds to)."""

  def __init__(self, files: RunFiles, unit: str, step: int, tokens: int):
    self.files, self.unit, self.rounds = files, unit, files.config.rounds
    self.clock = {"step": step, "tokens": tokens, "time": time.perf_counter(), "paused": 0.0}
    self.first = None  # (mark, time) of the first reading: compilation is behind from there

  def report(self, mark: Mark, reading: Reading | None, evals: dict | None = None) -> dict:
    if reading is None:
      return {}
    if reading.problem is not None:
      raise self.files.diverged(reading.problem, unit=self.unit)
    clock = self.clock
    scalars = reading.scalars
    seconds = max(reading.ready_time - clock["time"] - clock["paused"], 1e-9)
    scalars["steps_per_second"] = (reading.step - clock["step"]) / seconds
    tokens_per_second = (scalars["tokens"] - clock["tokens"]) / seconds
    clock.update(step=reading.step, tokens=scalars["tokens"], time=reading.ready_time,
                 paused=0.0)
    first = self.first = self.first or (mark.index, reading.ready_time)
    eval_loss = evals["eval_loss"] if evals else None
    scalars.update(evals or {})
    if mark.due.write:
      self.files.logger.write(reading.step, scalars)
      left = ((self.rounds - mark.index) * (reading.ready_time - first[1])
              / (mark.index - first[0]) if mark.index > first[0] else None)
      self.files.logger.progress(
          mark.index, train_loss=scalars.get("train_loss"), eval_loss=eval_loss,
          tokens_per_second=tokens_per_second, bytes_sent=scalars.get("bytes_sent"),
          seconds_left=left)
    return scalars
