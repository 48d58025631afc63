"""The round loop: local programs, outer step, evaluation, metrics, checkpoints, summary.

What runs is assembled by build.py; this module decides when: rounds, DyLU's choice of H,
evaluation, metric writes, checkpoints and the final summary.
"""

import dataclasses
import logging
import math
import pathlib
import time

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from lowcomm_jax import config_check
from lowcomm_jax.build import Run, build, init_run, jitted_steps, train_round
from lowcomm_jax.checkpoint import CheckpointMismatch, abstract_with_shardings
from lowcomm_jax.metrics import ReadyClock, announce_compile
from lowcomm_jax.run_files import RunFiles, TrainingDiverged  # noqa: F401 - raised by RunFiles
from lowcomm_jax.outer import dylu_inner_steps
from lowcomm_jax.parallel.ledger import CommBytes
from lowcomm_jax.workdir import holds_lock
from lowcomm_jax.parallel import mesh as mesh_lib


def _due(round_: int, every: int, last: int) -> bool:
  return round_ == last or (every > 0 and round_ % every == 0)


@dataclasses.dataclass
class _Schedule:
  """Per-host H and the timing behind DyLU and idle accounting (persisted in checkpoints)."""
  inner_steps: list[int]  # current H per host
  tokens: int = 0  # all workers, cumulative
  measured: bool = False  # DyLU has measured the hosts' speeds
  compute_seconds: list[float] = dataclasses.field(default_factory=list)  # per host, cumulative
  idle_seconds: list[float] = dataclasses.field(default_factory=list)


@holds_lock  # one run per workdir (workdir.py)
def run(config: ml_collections.ConfigDict, workdir: str | pathlib.Path, *,
        stop_after_rounds: int | None = None) -> dict:
  """Trains (or resumes) the run in `workdir` and returns its summary.

  `stop_after_rounds` ends this invocation early, as a preemption would, leaving the last
  checkpoint for the next call to resume from (used by the resume tests).
  """
  t_start = time.time()
  files = RunFiles(config, workdir)  # refuses a changed config before any work
  r = build(config)
  with r.partitioner():  # tensor-parallel programs compile under GSPMD (model/tp.py)
    return _train(r, files, t_start, stop_after_rounds)


def _train(r: Run, files: RunFiles, t_start: float, stop_after_rounds: int | None) -> dict:
  """`run`'s round loop, on a built run."""
  c, hosts, workdir = r.config, r.hosts, files.workdir
  lead = jax.process_index() == 0
  latest = files.open_checkpoints()
  ckpt = files.ckpt
  fns = jitted_steps(r)

  schedule_steps = c.optimizer.decay_steps or c.rounds * c.inner_steps
  if latest is not None and latest > c.rounds:
    ckpt.close()
    raise config_check.ConfigError([
        f"rounds={c.rounds}: {workdir} already holds a checkpoint at round {latest}; raise "
        "rounds to continue that run, or pass another --workdir for a new one"])
  if latest == c.rounds and (summary := files.finished_summary()) is not None:
    return summary
  configured = [h.inner_steps for h in hosts]
  if c.outer.dylu and all(h.speed > 0 for h in hosts):
    configured = dylu_inner_steps(c.inner_steps, [h.speed for h in hosts])
  sched = _Schedule(configured, 0, False, [0.0] * len(hosts), [0.0] * len(hosts))
  if latest is not None:
    ckpt.discard_after(latest)
    try:
      state, meta, workers, data = ckpt.restore(
          latest, abstract_with_shardings(r.abstract_state, r.state_shardings),
          r.abstract_workers())
      for streams, s in zip(r.streams, data["streams"], strict=True):
        streams.set_state(s)
    except ValueError as e:
      ckpt.close()
      raise CheckpointMismatch(f"{e}; resume with the data config that wrote {workdir}") from e
    except CheckpointMismatch:
      ckpt.close()  # orbax's threads must not outlive the run
      raise
    sched = _Schedule(**meta["schedule"])
    wall_before = meta["wall_seconds"]
    if meta["schedule_steps"] != schedule_steps:
      logging.warning("the inner lr schedule now spans %d steps (was %d): extending `rounds` "
                      "re-stretches the cosine decay; set optimizer.decay_steps to keep it "
                      "fixed", schedule_steps, meta["schedule_steps"])
    logging.info("resumed %s from round %d", workdir, latest)
  else:
    state, workers = init_run(r, fns)
    wall_before = 0.0
  start = int(state.round)
  # DyLU without configured speeds times the hosts once, in the second round this process
  # runs (the first compiles).
  measure_dylu = c.outer.dylu and not all(h.speed > 0 for h in hosts) and not sched.measured

  eval_step = jax.jit(r.eval_step)
  eval_windows_dev = jax.device_put(r.eval_windows, mesh_lib.replicated(r.mesh))
  # Time each host's program when its speed matters: DyLU, idle accounting across hosts.
  timed = len(hosts) > 1
  sync_bytes = r.sync_bytes()
  round_bytes = sum(sync_bytes, CommBytes())
  # Config changes recorded in config.json (process 0 reports them).
  resumes = files.start_metrics(start * c.inner_steps, start, write_files=lead)
  logger = files.logger
  end = c.rounds if stop_after_rounds is None else min(c.rounds, start + stop_after_rounds)
  logging.info("%s: %d workers on %d host(s) (this process runs %s), mesh %s, model %s "
               "(%.2fM params), rounds %d..%d, H per host %s, %d bytes sent per worker per "
               "round", c.algorithm, c.num_workers, len(hosts), r.local_hosts,
               dict(r.mesh.shape), c.model.name, r.param_count / 1e6, start, c.rounds,
               sched.inner_steps, round_bytes.sent)

  def finish(round_: int, metrics, extra: dict) -> dict:
    """Checks one round's metrics on the host (blocking on them) and times the rounds since
    the last one with metrics; {} for a round without metrics. Between rounds with metrics
    nothing blocks: the host may dispatch up to log_every rounds ahead of the devices (each
    holds only its batches)."""
    scalars = jax.device_get(metrics)
    if not scalars:  # a round that logs, evaluates and checkpoints nothing computes none
      return scalars
    if not (math.isfinite(scalars["train_loss"]) and math.isfinite(scalars["param_norm"])):
      raise files.diverged(f"round {round_} (train_loss={scalars['train_loss']}, "
                           f"param_norm={scalars['param_norm']})")
    now = ready.ready_time(round_)
    # Since the last round with metrics was ready, less evaluation and checkpoint saving.
    seconds = now - clock["time"] - (clock["paused_total"] - clock["paused"])
    total_bytes = round_bytes * round_
    scalars.update(extra, round=round_,
                   bytes_sent=total_bytes.sent, bytes_received=total_bytes.received,
                   bytes_sent_round=round_bytes.sent, bytes_received_round=round_bytes.received,
                   steps_per_second=(round_ - clock["round"]) * c.inner_steps / seconds)
    if round_bytes.sent:
      scalars["compression_ratio"] = _compression_ratio(r, round_bytes)
    speed["tokens_per_second"] = (extra["tokens"] - clock["tokens"]) / seconds
    speed.setdefault("first", (round_, now))  # compilation is behind from here on
    clock.update(round=round_, time=now, tokens=extra["tokens"], paused=clock["paused_total"])
    return scalars

  def log(round_: int, scalars: dict, eval_loss: float | None = None) -> None:
    """Writes a finished round's scalars and prints its progress line, if due."""
    if eval_loss is not None:
      scalars["eval_loss"] = eval_loss
    if not scalars or not (eval_loss is not None or _due(round_, c.log_every, end)):
      return
    logger.write(round_ * c.inner_steps, scalars)
    first_round, first_time = speed["first"]  # ETA from mean wall time per round since
    left = ((c.rounds - round_) * (time.perf_counter() - first_time) / (round_ - first_round)
            if round_ > first_round else None)
    logger.progress(round_, train_loss=scalars["train_loss"], eval_loss=eval_loss,
                    tokens_per_second=speed["tokens_per_second"],
                    bytes_sent=scalars["bytes_sent"], seconds_left=left)

  # Training speed: over the rounds since the last one with metrics, from the times their
  # results were ready (`ready`), less the seconds spent evaluating and saving meanwhile.
  ready = ReadyClock()
  clock = {"round": start, "time": time.perf_counter(), "tokens": sched.tokens,
           "paused": 0.0, "paused_total": 0.0}
  speed = {}
  pending = None  # (round, device metrics, host scalars): read a round late, device never waits
  scalars, eval_loss = {}, None
  try:
    for round_ in range(start + 1, end + 1):
      batches = [r.streams[k].next_round(sched.inner_steps[i])
                 for k, i in enumerate(r.local_hosts)]
      evaluate = _due(round_, c.eval_every, c.rounds)
      checkpoint = _due(round_, c.checkpoint_every, end)
      # The round's metrics (losses, norms) cost a collective and two passes over θ: only
      # on rounds that use them. Divergence is checked on those rounds, so always before a
      # checkpoint is written.
      with_metrics = evaluate or checkpoint or _due(round_, c.log_every, end)
      state, workers, metrics, compute = train_round(
          r, fns, state, workers, batches, sched.inner_steps, timed=timed,
          metrics=with_metrics)
      if with_metrics:
        ready.watch(round_, metrics)
      sched.tokens += sum(r.round_tokens(sched.inner_steps))
      extra = {"tokens": sched.tokens}
      if timed:
        compute = _all_hosts(compute)
        extra.update(_host_timing(sched, compute))
        if measure_dylu and round_ == start + 2:
          speeds = [H / t for H, t in zip(sched.inner_steps, compute)]
          sched.inner_steps = dylu_inner_steps(c.inner_steps, speeds)
          sched.measured = True
          logging.info("DyLU: measured steps/s per host %s -> H per host %s",
                       [f"{v:.2f}" for v in speeds], sched.inner_steps)
      if pending is not None:
        log(pending[0], finish(*pending))
      pending = (round_, metrics, extra)
      if evaluate or checkpoint or round_ == end:
        # Checked before saving: a diverged state is never checkpointed.
        scalars = finish(*pending)
        pending = None
        paused_at = time.perf_counter()
        eval_loss = _evaluate(r, eval_step, state, eval_windows_dev) if evaluate else None
        log(round_, scalars, eval_loss)
        if checkpoint:
          ckpt.save(round_, state,
                    {"schedule": dataclasses.asdict(sched), "schedule_steps": schedule_steps,
                     "wall_seconds": wall_before + time.time() - t_start},
                    workers, {"streams": [s.get_state() for s in r.streams]})
        clock["paused_total"] += time.perf_counter() - paused_at
    if end == c.rounds and eval_loss is None:  # resumed at the end, summary was lost
      eval_loss = _evaluate(r, eval_step, state, eval_windows_dev)
  finally:  # also on errors: saves in flight complete, files are flushed
    ready.close()
    files.close()  # raises if a save in flight failed (WorkdirError)
  if end < c.rounds:
    return {"stopped_at_round": end}

  summary = _summary(r, sched, sync_bytes, eval_loss, scalars,
                     wall_before + time.time() - t_start)
  return files.write_summary(summary, resumes, write_files=lead)


def _evaluate(r: Run, eval_step, state, windows) -> float:
  announce_compile(eval_step, "evaluation")
  with jax.set_mesh(r.mesh):
    return float(eval_step(state.params, windows))


def _all_hosts(local_compute: list[float]) -> list[float]:
  """Every host's compute seconds this round, on every process (hosts are process-major)."""
  if jax.process_count() == 1:
    return local_compute
  gathered = multihost_utils.process_allgather(np.asarray(local_compute, np.float64))
  return [float(t) for t in np.asarray(gathered).reshape(-1)]


def _host_timing(sched: _Schedule, compute: list[float]) -> dict:
  """Per-host H, compute and idle seconds of a synchronous round (idle = wait at the barrier)."""
  slowest = max(compute)
  out = {}
  for i, t in enumerate(compute):
    sched.compute_seconds[i] += t
    sched.idle_seconds[i] += slowest - t
    out.update({f"inner_steps_host_{i}": sched.inner_steps[i], f"compute_s_host_{i}": t,
                f"idle_s_host_{i}": slowest - t})
  return out


def _compression_ratio(r: Run, round_bytes) -> float | None:
  return r.param_bytes / round_bytes.sent if round_bytes.sent else None


def _summary(r: Run, sched: _Schedule, sync_bytes, eval_loss, scalars, wall: float) -> dict:
  c = r.config
  round_bytes = sum(sync_bytes, CommBytes())
  sent = (round_bytes * c.rounds).sent
  # DDP all-reduces fp32 gradients every inner step (nothing with a single worker).
  total_steps = c.rounds * c.inner_steps
  ddp_equivalent = r.param_bytes * total_steps if c.num_workers > 1 else 0
  workers = []
  for i, h in enumerate(r.hosts):
    busy = sched.compute_seconds[i] + sched.idle_seconds[i]
    for w in h.worker_ids:
      workers.append({"worker": w, "host": h.index,
                      "process": h.index if jax.process_count() > 1 else 0, "tier": h.tier,
                      "inner_steps": sched.inner_steps[i],
                      "idle_fraction": sched.idle_seconds[i] / busy if busy else 0.0})
  return {
      "algorithm": c.algorithm, "num_workers": c.num_workers, "rounds": c.rounds,
      "inner_steps": c.inner_steps, "model": c.model.name, "params": r.param_count,
      "eval_loss": eval_loss,
      "train_loss": float(scalars["train_loss"]) if scalars else None,
      "tokens": sched.tokens,
      "bytes_sent": sent, "bytes_received": (round_bytes * c.rounds).received,
      # Peak bandwidth: the largest single sync a worker sends (DiLoCo: the whole model's
      # Δ; streaming: one fragment's, about 1/P of it).
      "bytes_sent_peak_sync": max(b.sent for b in sync_bytes),
      "bytes_sent_ddp_equivalent": ddp_equivalent,
      "bytes_ratio_vs_ddp": ddp_equivalent / sent if sent else None,
      "codec": c.compress.codec,
      # Dense fp32 pseudo-gradient (or gradient) bytes per round / the bytes actually sent.
      "compression_ratio": _compression_ratio(r, round_bytes),
      "wall_seconds": wall,
      **r.tp_counts(),
      "workers": workers,
      "tiers": {str(t): b for t, b in r.tier_bytes.items()},
  }
