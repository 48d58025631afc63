"""The runner's driver for the run loop (run/loop.py): synchronous rounds on real devices,
a mark per round, with DyLU's choice of H per host and the hosts' compute and idle seconds;
restoring, evaluation, checkpoints and the summary. `collab.CollabDriver` extends it."""

import dataclasses
import logging
import math

import jax
import numpy as np
from jax.experimental import multihost_utils

from lowcomm_jax.run import loop, run_metrics
from lowcomm_jax.errors import ConfigError
from lowcomm_jax.assemble.spec import Run
from lowcomm_jax.assemble.jitted import init_run, jitted_steps
from lowcomm_jax.runtimes.spmd.rounds import (can_overlap, held_round, jitted_overlapped,
                                              overlapped_round, run_held, train_round)
from lowcomm_jax.run.checkpoint import CheckpointMismatch, abstract_with_shardings
from lowcomm_jax.run.metrics import ReadyClock, announce_compile
from lowcomm_jax.run.files import RunFiles
from lowcomm_jax.assemble.hosts import settle_inner_steps
from lowcomm_jax.parallel.ledger import CommBytes
from lowcomm_jax.parallel import mesh as mesh_lib


@dataclasses.dataclass
class _Schedule:
  """Per-host H and the timing behind DyLU and idle accounting (persisted in checkpoints)."""
  inner_steps: list[int]  # current H per host
  tokens: int = 0  # all workers, cumulative
  measured: bool = False  # DyLU has measured the hosts' speeds
  compute_seconds: list[float] = dataclasses.field(default_factory=list)  # per host, cumulative
  idle_seconds: list[float] = dataclasses.field(default_factory=list)


class RoundDriver:
  """The runner's progress for the run loop: synchronous rounds (train_round), a mark per
  round, with DyLU's choice of H per host and the hosts' compute and idle seconds."""

  unit = "round"
  reads_late = True

  def __init__(self, r: Run, stop_after_rounds: int | None):
    self.r, self.c = r, r.config
    self.stop_after_rounds = stop_after_rounds
    self.writes_files = jax.process_index() == 0
    self.fns = jitted_steps(r)
    # An algorithm with a delayed sync runs each round's sync inside the next round's
    # program where it can (rounds.can_overlap): its collective beside the local steps.
    self.overlapped = (jitted_overlapped(r) if r.algorithm.delayed_sync and self.c.overlap_sync
                       else None)
    self.held = None  # (HeldSync, its round, its metrics once they exist) of the last round
    self.schedule_steps = self.c.optimizer.decay_steps or self.c.rounds * self.c.inner_steps
    self.ready = None  # started once the run is known to go on (open)
    # Time each host's program when its speed matters: DyLU, idle accounting across hosts.
    self.timed = len(r.topology.hosts) > 1

  def open(self, files: RunFiles, latest: int | None) -> dict | None:
    r, c, ckpt, workdir = self.r, self.c, files.ckpt, files.workdir
    hosts = r.topology.hosts
    if latest is not None and latest > c.rounds:
      ckpt.close()
      raise ConfigError([
          f"rounds={c.rounds}: {workdir} already holds a checkpoint at round {latest}; raise "
          "rounds to continue that run, or pass another --workdir for a new one"])
    if latest == c.rounds and (summary := files.finished_summary()) is not None:
      return summary
    configured = settle_inner_steps(c, [h.inner_steps for h in hosts], [h.speed for h in hosts])
    self.sched = _Schedule(configured, 0, False, [0.0] * len(hosts), [0.0] * len(hosts))
    self._wall_before = 0.0
    if latest is None:
      self.state, self.workers = init_run(r, self.fns)
    else:
      ckpt.discard_after(latest)
      try:
        self.state, meta, self.workers, data = ckpt.restore(
            latest, abstract_with_shardings(r.state_spec.abstract, r.state_spec.shardings),
            r.abstract_workers())
        for streams, s in zip(r.data.streams, data["streams"], strict=True):
          streams.set_state(s)
      except ValueError as e:
        ckpt.close()
        raise CheckpointMismatch(f"{e}; resume with the data config that wrote {workdir}") from e
      except CheckpointMismatch:
        ckpt.close()  # orbax's threads must not outlive the run
        raise
      self.sched = _Schedule(**meta["schedule"])
      self._wall_before = meta["wall_seconds"]
      if meta["schedule_steps"] != self.schedule_steps:
        logging.warning("the inner lr schedule now spans %d steps (was %d): extending `rounds` "
                        "re-stretches the cosine decay; set optimizer.decay_steps to keep it "
                        "fixed", self.schedule_steps, meta["schedule_steps"])
      logging.info("resumed %s from round %d", workdir, latest)
    self.ready = ReadyClock()
    self.sync_bytes = r.sync_bytes()  # traced, not run
    self.round_bytes = sum(self.sync_bytes, CommBytes())
    self.round = self.start = int(self.state.round)
    self.end = (c.rounds if self.stop_after_rounds is None
                else min(c.rounds, self.start + self.stop_after_rounds))
    # DyLU without configured speeds times the hosts once, in the second round this process
    # runs (the first compiles).
    self.measure_dylu = (c.outer.dylu and not all(h.speed > 0 for h in hosts)
                         and not self.sched.measured)
    self.eval_windows = jax.device_put(r.data.eval_windows,
                                       mesh_lib.replicated(r.topology.mesh))
    if self.overlapped is not None:
      reason = can_overlap(r, self.sched.inner_steps)
      logging.info("%s", "each round's sync runs inside the next round's program, beside its "
                   "local steps" if reason is None else
                   f"each round's sync runs as its own program ({reason})")
    logging.info("%s: %d workers on %d host(s) (this process runs %s), mesh %s, model %s "
                 "(%.2fM params), rounds %d..%d, H per host %s, %d bytes sent per worker per "
                 "round", c.algorithm, c.num_workers, len(hosts), r.topology.local_hosts,
                 dict(r.topology.mesh.shape), r.model.name, r.model.param_count / 1e6,
                 self.start, c.rounds, self.sched.inner_steps, self.round_bytes.sent)
    if self.writes_files:  # shapes only: nothing is fetched (LoRA: the adapters, what trains)
      logging.info("parameters (θ, stored flat; clu.parameter_overview):\n%s",
                   run_metrics.overview(r.model.layout.abstract))
    return None

  def position(self) -> tuple[int, int, int]:
    return self.start, self.start * self.c.inner_steps, self.sched.tokens

  def wall_before(self) -> float:
    return self._wall_before

  def advance(self, due) -> loop.Mark | None:
    r, c, sched = self.r, self.c, self.sched
    if self.round >= self.end:
      return None
    self.round = round_ = self.round + 1
    mark_due = due(round_, last_of_run=round_ == c.rounds, last_of_call=round_ == self.end)
    batches = [r.data.streams[k].next_round(sched.inner_steps[i])
               for k, i in enumerate(r.topology.local_hosts)]
    metrics, compute = self._train(round_, mark_due, batches)
    sched.tokens += sum(r.round_tokens(sched.inner_steps))
    extra = {"tokens": sched.tokens}
    if self.timed:
      compute = all_hosts(compute)
      extra.update(_host_timing(sched, compute))
      if self.measure_dylu and round_ == self.start + 2:
        speeds = [H / t for H, t in zip(sched.inner_steps, compute)]
        sched.inner_steps = settle_inner_steps(c, sched.inner_steps, speeds)
        sched.measured = True
        logging.info("DyLU: measured steps/s per host %s -> H per host %s",
                     [f"{v:.2f}" for v in speeds], sched.inner_steps)
    return loop.Mark(round_, mark_due, (round_, metrics, extra))

  def _train(self, round_: int, mark_due: loop.Due, batches) -> tuple:
    """This round's local steps and its sync, or the sync held for the next round's program
    when this mark needs no state (no evaluation or checkpoint). Returns (the round's metrics,
    or a `_Later` for a held sync's; compute seconds per local host)."""
    r, sched = self.r, self.sched
    timing_dylu = self.measure_dylu and round_ <= self.start + 2
    overlap = (self.overlapped is not None and not timing_dylu
               and can_overlap(r, sched.inner_steps) is None)
    hold = overlap and not (mark_due.evaluate or mark_due.checkpoint or mark_due.last)
    held, self.held = self.held, None
    new_held = None
    if held is not None and overlap:
      (self.state, self.workers, held_metrics, metrics, compute,
       new_held) = overlapped_round(r, self.fns, self.overlapped, self.state, self.workers,
                                    held[0], batches[0], sched.inner_steps[0], timed=self.timed,
                                    metrics=mark_due.metrics, hold=hold)
      self._resolve(held, held_metrics)
    else:
      if held is not None:  # this round cannot overlap (not reached today: rounds before
        # DyLU's new H do not hold): the held sync runs on its own first
        self.state, held_metrics = run_held(r, self.fns, self.state, held[0])
        self._resolve(held, held_metrics)
      if hold:
        self.workers, compute, new_held = held_round(
            r, self.fns, self.state, self.workers, batches, sched.inner_steps,
            timed=self.timed, metrics=mark_due.metrics)
      else:
        self.state, self.workers, metrics, compute = train_round(
            r, self.fns, self.state, self.workers, batches, sched.inner_steps,
            timed=self.timed, metrics=mark_due.metrics, completed_rounds=round_ - 1)
    if new_held is not None:
      metrics = _Later()
      self.held = (new_held, round_, metrics)
      if mark_due.metrics:  # its work is its local steps: ready with their losses (the
        self.ready.watch(round_, new_held.signals)  # Δ may be donated to the next program)
    elif mark_due.metrics:
      self.ready.watch(round_, metrics)
    return metrics, compute

  def _resolve(self, held, metrics) -> None:
    held[2].value = metrics

  def read(self, handle) -> loop.Reading:
    round_, metrics, extra = handle
    if isinstance(metrics, _Later):  # a held sync's: run with the next round (read late)
      assert metrics.value is not None, f"round {round_}'s held sync was never run"
      metrics = metrics.value
    # train_loss through the run's clu Collection (run/run_metrics.py), computed on device.
    scalars = jax.device_get(run_metrics.train_scalars(metrics))
    problem = None
    if not (math.isfinite(scalars["train_loss"]) and math.isfinite(scalars["param_norm"])):
      problem = (f"round {round_} (train_loss={scalars['train_loss']}, "
                 f"param_norm={scalars['param_norm']})")
    total_bytes = self.r.bytes_through(round_, self.round_bytes)
    scalars.update(extra, round=round_,
                   bytes_sent=total_bytes.sent, bytes_received=total_bytes.received,
                   bytes_sent_round=self.round_bytes.sent,
                   bytes_received_round=self.round_bytes.received)
    if self.round_bytes.sent:
      scalars["compression_ratio"] = _compression_ratio(self.r, self.round_bytes)
    return loop.Reading(round_ * self.c.inner_steps, scalars,
                            self.ready.ready_time(round_), problem)

  def evaluate(self) -> dict[str, float]:
    announce_compile(self.fns.eval, "evaluation")
    with jax.set_mesh(self.r.topology.mesh):
      return self.r.evaluation(self.fns.eval(self.state.params, self.eval_windows))

  def save(self, ckpt, mark: int, *, last: bool, wall: float) -> None:
    ckpt.save(mark, self.state,
              {"schedule": dataclasses.asdict(self.sched), "schedule_steps": self.schedule_steps,
               "wall_seconds": wall},
              self.workers, {"streams": [s.get_state() for s in self.r.data.streams]})

  def complete(self) -> bool:
    return self.end == self.c.rounds

  def stopped(self) -> dict:
    return {"stopped_at_round": self.end}

  def summary(self, eval_loss: float, scalars: dict, wall: float) -> dict:
    return _summary(self.r, self.sched, self.sync_bytes, eval_loss, scalars, wall)

  def close(self) -> None:
    if self.ready is not None:
      self.ready.close()


class _Later:
  """A held sync's metrics: they exist once the next round's program ran it."""
  value = None


def all_hosts(local_compute: list[float]) -> list[float]:
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
  return r.model.param_bytes / round_bytes.sent if round_bytes.sent else None


def _summary(r: Run, sched: _Schedule, sync_bytes, eval_loss, scalars, wall: float) -> dict:
  c = r.config
  round_bytes = sum(sync_bytes, CommBytes())
  state_bytes = r.state_bytes_through(c.rounds)  # DES-LOC's moment averages
  total_bytes = round_bytes * c.rounds + state_bytes
  sent = total_bytes.sent
  # DDP all-reduces fp32 gradients every inner step (nothing with a single worker).
  total_steps = c.rounds * c.inner_steps
  ddp_equivalent = r.model.param_bytes * total_steps if c.num_workers > 1 else 0
  workers = []
  for i, h in enumerate(r.topology.hosts):
    busy = sched.compute_seconds[i] + sched.idle_seconds[i]
    for w in h.worker_ids:
      workers.append({"worker": w, "host": h.index,
                      "process": h.index if jax.process_count() > 1 else 0, "tier": h.tier,
                      "inner_steps": sched.inner_steps[i],
                      "idle_fraction": sched.idle_seconds[i] / busy if busy else 0.0})
  return {
      "algorithm": c.algorithm, "num_workers": c.num_workers, "rounds": c.rounds,
      "inner_steps": c.inner_steps, "model": r.model.name,
      # LoRA: the adapters train; the model's parameters count them with the frozen base
      "params": r.model.param_count + r.model.frozen_count,
      "param_count": r.model.param_count + r.model.frozen_count,
      "trainable_params": r.model.param_count,
      "eval_loss": eval_loss,
      "train_loss": float(scalars["train_loss"]) if scalars else None,
      "tokens": sched.tokens,
      "bytes_sent": sent, "bytes_received": total_bytes.received,
      # Peak bandwidth: the largest single sync a worker sends (DiLoCo: the whole model's
      # Δ; streaming: one fragment's, about 1/P of it).
      "bytes_sent_peak_sync": max(b.sent for b in sync_bytes),
      "bytes_sent_ddp_equivalent": ddp_equivalent,
      **({"bytes_sent_state_sync": state_bytes.sent} if state_bytes.sent else {}),
      "bytes_ratio_vs_ddp": ddp_equivalent / sent if sent else None,
      "codec": c.compress.codec,
      # Dense fp32 pseudo-gradient (or gradient) bytes per round / the bytes actually sent.
      "compression_ratio": _compression_ratio(r, round_bytes),
      "wall_seconds": wall,
      **r.tp_counts(),
      "workers": workers,
      "tiers": {str(t): b for t, b in r.model.tier_bytes.items()},
      **_combination(c, scalars),
  }


def _combination(c, scalars) -> dict:
  """A robust combination's last per-worker weights and effective number of workers."""
  if not scalars or "effective_workers" not in scalars:
    return {}
  return {"aggregate_rule": c.aggregate.rule, "aggregate_signal": c.aggregate.signal,
          "worker_weights": [float(w) for w in np.asarray(scalars["worker_weights"])],
          "effective_workers": float(scalars["effective_workers"])}
