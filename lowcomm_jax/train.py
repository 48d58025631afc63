"""Wiring: config -> mesh, data, model, hosts, optimizers, state; then the round loop.

Everything that computes lives elsewhere (steps.py, outer/, aggregate/, model/, data/);
this module decides what runs when: each host's local round, the outer step, evaluation,
metrics, checkpoints and the final summary.
"""

import dataclasses
import json
import logging
import math
import pathlib
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from lowcomm_jax import config_check, optimizers, steps
from lowcomm_jax.checkpoint import Checkpointer, CheckpointMismatch, abstract_with_shardings
from lowcomm_jax.data import (DataError, WorkerStreams, eval_windows, get_tokenizer, load_tokens,
                              resolve_corpus, split_train_val)
from lowcomm_jax.hosts import HostSpec, host_table
from lowcomm_jax.metrics import MetricsLogger
from lowcomm_jax.model import GPT, GPTConfig, count_params, get_preset, next_token_loss
from lowcomm_jax.model.matformer import slice_tier
from lowcomm_jax.outer import dylu_inner_steps
from lowcomm_jax.parallel import ledger, mesh as mesh_lib


class TrainingDiverged(RuntimeError):
  """A non-finite loss or parameter; the last good checkpoint is left as it was."""


@dataclasses.dataclass
class _Run:
  """Everything built from the config before the first round."""
  config: ml_collections.ConfigDict
  mesh: jax.sharding.Mesh
  model_cfg: GPTConfig
  graphdef: nnx.GraphDef
  hosts: list[HostSpec]
  local_rounds: list[Callable]  # per host: steps.make_local_round
  finish_round: Callable  # (state, opt_states, deltas, losses, hidden, weight) -> (state, metrics)
  eval_step: Callable[[dict, jax.Array], jax.Array]
  init_fn: Callable[[], steps.TrainState]
  abstract_state: steps.TrainState
  state_shardings: steps.TrainState
  streams: list[WorkerStreams]  # per host
  eval_windows: np.ndarray
  param_count: int
  param_bytes: int
  tier_bytes: dict[float, dict[str, int]]  # per tier: parameter and optimizer bytes per worker
  hidden_per_worker: jax.Array  # [R] FFN hidden units each worker trains

  def worker_weights(self, inner_steps_per_host) -> jax.Array:
    """[R] aggregation weights: 1, or tokens processed this round (aggregate.weighting)."""
    c = self.config
    if c.aggregate.weighting == "tokens":
      return jnp.asarray([h.batch_size * H * c.data.seq_len
                          for h, H in zip(self.hosts, inner_steps_per_host)
                          for _ in h.worker_ids], jnp.float32)
    return jnp.ones((c.num_workers,), jnp.float32)

  def outer_bytes(self) -> ledger.CommBytes:
    """Per-worker bytes of one outer step, from tracing it (nothing runs)."""
    deltas = tuple(jax.tree.map(
        lambda x, n=len(h.worker_ids): jax.ShapeDtypeStruct((n,) + x.shape, x.dtype),
        self.abstract_state.params) for h in self.hosts)
    losses = tuple(jax.ShapeDtypeStruct((len(h.worker_ids), 1), jnp.float32)
                   for h in self.hosts)
    return ledger.count_bytes(self.finish_round, self.abstract_state,
                              self.abstract_state.worker_opt_state, deltas, losses,
                              self.hidden_per_worker,
                              self.worker_weights([h.inner_steps for h in self.hosts]))


def _state_shardings(abstract_state: steps.TrainState, mesh) -> steps.TrainState:
  rep, per_worker = mesh_lib.replicated(mesh), mesh_lib.per_worker(mesh)
  shard = lambda tree, s: jax.tree.map(lambda _: s, tree)
  return steps.TrainState(
      round=rep, rng=rep, params=shard(abstract_state.params, rep),
      outer_opt_state=shard(abstract_state.outer_opt_state, rep),
      worker_opt_state=shard(abstract_state.worker_opt_state, per_worker))


def _loss_fn(graphdef):
  def loss_fn(params, windows, key):
    return next_token_loss(nnx.merge(graphdef, params), windows, dropout_key=key)
  return loss_fn


def build(config: ml_collections.ConfigDict) -> _Run:
  """Validates the config, loads data, builds the model and the step functions (no compute)."""
  config_check.validate(config, num_devices=jax.device_count())
  c = config
  tokenizer = get_tokenizer(c.data.tokenizer)
  tokens = load_tokens(resolve_corpus(c.data.path), tokenizer)
  train_tokens, val_tokens = split_train_val(tokens, c.data.val_fraction)
  if min(len(train_tokens), len(val_tokens)) <= c.data.seq_len + 1:
    raise DataError(f"the corpus has {len(tokens)} tokens: too few for data.seq_len="
                    f"{c.data.seq_len} in both splits; use a longer corpus or a shorter seq_len")

  model_cfg = get_preset(c.model.name, vocab_size=c.model.vocab_size,
                         tokenizer_vocab=tokenizer.vocab_size, dtype=c.model.dtype,
                         dropout=c.model.dropout)
  hosts = host_table(c, model_cfg.d_ff)
  replica = (c.mesh.replica if c.mesh.replica > 0 else 1 if len(hosts) > 1 else
             mesh_lib.replica_devices(c.num_workers,
                                      jax.device_count() // (c.mesh.data * c.mesh.model)))
  mesh = mesh_lib.make_mesh(replica, c.mesh.data, c.mesh.model)

  def graphdef_of(d_ff):
    tier_cfg = dataclasses.replace(model_cfg, d_ff=d_ff)
    return nnx.split(nnx.eval_shape(lambda: GPT(tier_cfg, rngs=nnx.Rngs(0))), nnx.Param)[0]

  graphdef = graphdef_of(model_cfg.d_ff)
  inner_tx = optimizers.inner_optimizer(c.optimizer, c.rounds * c.inner_steps)
  nested = optimizers.needs_nested_mean(c, hosts, model_cfg.d_ff)
  outer_step = steps.make_outer_step(optimizers.outer_optimizer(c, inner_tx, nested=nested),
                                     nested=nested)
  local_rounds = [
      steps.make_local_round(_loss_fn(graphdef_of(h.hidden)), algorithm=c.algorithm,
                             inner_tx=inner_tx, hidden=h.hidden, d_ff=model_cfg.d_ff)
      for h in hosts]

  def init_fn():
    params = nnx.to_pure_dict(nnx.state(GPT(model_cfg, rngs=nnx.Rngs(params=c.seed)), nnx.Param))
    host_inits = [(len(h.worker_ids), inner_tx.init(slice_tier(params, h.hidden))) for h in hosts]
    return steps.init_state(params, seed=c.seed, algorithm=c.algorithm, host_inits=host_inits,
                            outer_tx=optimizers.outer_optimizer(c, inner_tx, nested=nested))

  def finish_round(state, opt_states, deltas, losses, hidden_R, weight_R):
    """The global program: aggregate all workers' Δ and apply the outer rule."""
    deltas_R = jax.tree.map(lambda *xs: jnp.concatenate(xs), *deltas)
    params, outer_opt_state, metrics = outer_step(state.params, state.outer_opt_state,
                                                  deltas_R, hidden_R, weight_R)
    per_worker = jnp.concatenate([l.mean(axis=1) for l in losses])
    metrics.update(train_loss=per_worker.mean(), train_loss_per_worker=per_worker)
    return steps.TrainState(state.round + 1, state.rng, params, outer_opt_state,
                            tuple(opt_states)), metrics

  abstract_state = jax.eval_shape(init_fn)
  param_bytes = ledger.tree_bytes(abstract_state.params)
  tier_bytes = {}
  for h, opt in zip(hosts, abstract_state.worker_opt_state or [None] * len(hosts)):
    tier_params = jax.eval_shape(lambda p, m=h.hidden: slice_tier(p, m), abstract_state.params)
    tier_opt = (ledger.tree_bytes(opt) // len(h.worker_ids) if opt is not None
                else ledger.tree_bytes(abstract_state.outer_opt_state))
    tier_bytes[h.tier] = {"param_bytes": ledger.tree_bytes(tier_params),
                          "optimizer_bytes": tier_opt}
  streams = [WorkerStreams(train_tokens, worker_ids=h.worker_ids, seq_len=c.data.seq_len,
                           batch_size=h.batch_size, seed=c.seed, batch_mode=c.data.batch_mode)
             for h in hosts]
  return _Run(
      config=c, mesh=mesh, model_cfg=model_cfg, graphdef=graphdef, hosts=hosts,
      local_rounds=local_rounds, finish_round=finish_round,
      eval_step=steps.make_eval_step(_loss_fn(graphdef)), init_fn=init_fn,
      abstract_state=abstract_state, state_shardings=_state_shardings(abstract_state, mesh),
      streams=streams,
      eval_windows=eval_windows(val_tokens, seq_len=c.data.seq_len,
                                batch_size=c.data.batch_size, num_batches=c.eval_batches,
                                seed=c.seed),
      param_count=count_params(abstract_state.params), param_bytes=param_bytes,
      tier_bytes=tier_bytes,
      hidden_per_worker=jnp.asarray([h.hidden for h in hosts for _ in h.worker_ids], jnp.int32))


def _due(round_: int, every: int, last: int) -> bool:
  return round_ == last or (every > 0 and round_ % every == 0)


@dataclasses.dataclass
class _Schedule:
  """Per-host H and the timing behind DyLU and idle accounting (persisted in checkpoints)."""
  inner_steps: list[int]  # current H per host
  tokens: int = 0  # all workers, cumulative
  compute_seconds: list[float] = dataclasses.field(default_factory=list)  # per host, cumulative
  idle_seconds: list[float] = dataclasses.field(default_factory=list)


def run(config: ml_collections.ConfigDict, workdir: str | pathlib.Path, *,
        stop_after_rounds: int | None = None) -> dict:
  """Trains (or resumes) the run in `workdir` and returns its summary.

  `stop_after_rounds` ends this invocation early, as a preemption would, leaving the last
  checkpoint for the next call to resume from (used by the resume tests).
  """
  t_start = time.time()
  r = build(config)
  c, hosts = r.config, r.hosts
  workdir = pathlib.Path(workdir)
  lead = jax.process_index() == 0
  workdir.mkdir(parents=True, exist_ok=True)
  summary_path = workdir / "summary.json"
  ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=c.keep_checkpoints)

  schedule_steps = c.optimizer.decay_steps or c.rounds * c.inner_steps
  latest = ckpt.latest_round()
  if latest is not None and latest > c.rounds:
    ckpt.close()
    raise config_check.ConfigError([
        f"rounds={c.rounds}: {workdir} already holds a checkpoint at round {latest}; raise "
        "rounds to continue that run, or pass another --workdir for a new one"])
  if latest == c.rounds and summary_path.exists():
    logging.info("run in %s already finished (round %d); keeping summary.json", workdir, latest)
    ckpt.close()
    return json.loads(summary_path.read_text())
  configured = [h.inner_steps for h in hosts]
  if c.outer.dylu and all(h.speed > 0 for h in hosts):
    configured = dylu_inner_steps(c.inner_steps, [h.speed for h in hosts])
  sched = _Schedule(configured, 0, [0.0] * len(hosts), [0.0] * len(hosts))
  if latest is not None:
    state, meta = ckpt.restore(latest, abstract_with_shardings(r.abstract_state,
                                                               r.state_shardings))
    try:
      for streams, s in zip(r.streams, meta["streams"], strict=True):
        streams.set_state(s)
    except ValueError as e:
      ckpt.close()
      raise CheckpointMismatch(f"{e}; resume with the data config that wrote {workdir}") from e
    sched = _Schedule(**meta["schedule"])
    wall_before = meta["wall_seconds"]
    if meta["schedule_steps"] != schedule_steps:
      logging.warning("the inner lr schedule now spans %d steps (was %d): extending `rounds` "
                      "re-stretches the cosine decay; set optimizer.decay_steps to keep it "
                      "fixed", schedule_steps, meta["schedule_steps"])
    logging.info("resumed %s from round %d", workdir, latest)
  else:
    state = jax.jit(r.init_fn, out_shardings=r.state_shardings)()
    wall_before = 0.0
  start = int(state.round)
  measure_dylu = c.outer.dylu and not all(h.speed > 0 for h in hosts) and start == 0

  fns = jitted_steps(r)
  eval_step = jax.jit(r.eval_step)
  eval_windows_dev = jax.device_put(r.eval_windows, mesh_lib.replicated(r.mesh))
  timed = len(hosts) > 1  # hosts share this process: time each one's program separately
  round_bytes = r.outer_bytes()
  logger = MetricsLogger(workdir, total_steps=c.rounds * c.inner_steps,
                         resume_step=start * c.inner_steps, write_files=lead)
  end = c.rounds if stop_after_rounds is None else min(c.rounds, start + stop_after_rounds)
  logging.info("%s: %d workers on %d host(s), mesh %s, model %s (%.2fM params), rounds "
               "%d..%d, H per host %s, %d bytes sent per worker per round", c.algorithm,
               c.num_workers, len(hosts), dict(r.mesh.shape), c.model.name,
               r.param_count / 1e6, start, c.rounds, sched.inner_steps, round_bytes.sent)

  def finish(round_: int, metrics, extra: dict, eval_loss: float | None = None) -> dict:
    """Checks one round's metrics on the host (blocking on them) and logs them if due."""
    scalars = jax.device_get(metrics)
    if not (math.isfinite(scalars["train_loss"]) and math.isfinite(scalars["param_norm"])):
      ckpt.wait()
      raise TrainingDiverged(
          f"non-finite training at round {round_} (train_loss={scalars['train_loss']}, "
          f"param_norm={scalars['param_norm']}). The last good checkpoint "
          f"(round {ckpt.latest_round()}) in {ckpt.directory} is intact; lower "
          "optimizer.lr or outer.lr and resume from it")
    now = time.perf_counter()
    scalars.update(extra, round=round_,
                   bytes_sent=(round_bytes * round_).sent,
                   bytes_received=(round_bytes * round_).received,
                   bytes_sent_round=round_bytes.sent, bytes_received_round=round_bytes.received,
                   steps_per_second=(round_ - clock["round"]) * c.inner_steps
                   / (now - clock["time"]))
    clock.update(round=round_, time=now)
    if eval_loss is not None:
      scalars["eval_loss"] = eval_loss
    if eval_loss is not None or _due(round_, c.log_every, end):
      logger.write(round_ * c.inner_steps, scalars)
    return scalars

  clock = {"round": start, "time": time.perf_counter()}  # for steps_per_second
  pending = None  # (round, device metrics, host scalars): read a round late, device never waits
  scalars, eval_loss = {}, None
  try:
    with jax.set_mesh(r.mesh):
      for round_ in range(start + 1, end + 1):
        batches = [r.streams[i].next_round(H) for i, H in enumerate(sched.inner_steps)]
        state, metrics, compute = train_round(r, fns, state, batches,
                                              r.worker_weights(sched.inner_steps),
                                              timed=timed)
        sched.tokens += sum(len(h.worker_ids) * h.batch_size * H * c.data.seq_len
                            for h, H in zip(hosts, sched.inner_steps))
        extra = {"tokens": sched.tokens}
        if timed:
          extra.update(_host_timing(hosts, sched, compute))
        if measure_dylu and round_ == start + 1:
          speeds = [H / t for H, t in zip(sched.inner_steps, compute)]
          sched.inner_steps = dylu_inner_steps(c.inner_steps, speeds)
          logging.info("DyLU: measured steps/s per host %s -> H per host %s",
                       [f"{s:.2f}" for s in speeds], sched.inner_steps)
        if pending is not None:
          finish(*pending)
        pending = (round_, metrics, extra)
        logger.progress(round_ * c.inner_steps)
        evaluate = _due(round_, c.eval_every, c.rounds)
        checkpoint = _due(round_, c.checkpoint_every, end)
        if evaluate or checkpoint or round_ == end:
          # Checked before saving: a diverged state is never checkpointed.
          eval_loss = float(eval_step(state.params, eval_windows_dev)) if evaluate else None
          scalars = finish(*pending, eval_loss=eval_loss)
          pending = None
          if checkpoint:
            ckpt.save(round_, state, {
                "streams": [s.get_state() for s in r.streams],
                "schedule": dataclasses.asdict(sched), "schedule_steps": schedule_steps,
                "wall_seconds": wall_before + time.time() - t_start})
      if end == c.rounds and eval_loss is None:  # resumed at the end, summary was lost
        eval_loss = float(eval_step(state.params, eval_windows_dev))
  finally:  # also on errors: saves in flight complete, files are flushed
    ckpt.wait()
    ckpt.close()
    logger.close()
  if end < c.rounds:
    return {"stopped_at_round": end}

  summary = _summary(r, sched, round_bytes, eval_loss, scalars,
                     wall_before + time.time() - t_start)
  if lead:
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
  return summary


def jitted_steps(r: _Run):
  """(per-host jitted local programs, jitted global outer program).

  A host's local program re-traces when its H changes (DyLU). Donation halves peak memory
  on accelerators; on CPU a host copy taken by an async checkpoint may alias device memory,
  so nothing is donated there.
  """
  donate = jax.default_backend() != "cpu"
  local = [jax.jit(f, donate_argnums=(1,) if donate else ()) for f in r.local_rounds]
  finish = jax.jit(r.finish_round, out_shardings=(r.state_shardings, None),
                   donate_argnums=(0,) if donate else ())
  return local, finish


def train_round(r: _Run, fns, state: steps.TrainState, batches_per_host, weight_R, *,
                timed: bool = False):
  """One synchronous round: every host's local program, then the outer step.

  Returns (state, device metrics, per-host compute seconds if `timed` else []). Timing
  blocks on each host's result, which is what measuring it means when hosts share a process.
  """
  local_fns, finish_fn = fns
  sharding = mesh_lib.round_batches(r.mesh)
  deltas, opt_states, losses, compute = [], [], [], []
  for i, h in enumerate(r.hosts):
    batches = jax.device_put(batches_per_host[i], sharding)
    opt_state = state.worker_opt_state[i] if state.worker_opt_state else ()
    t0 = time.perf_counter()
    delta, opt_state, loss = local_fns[i](state, opt_state, batches,
                                          jnp.asarray(h.worker_ids, jnp.int32))
    if timed:
      jax.block_until_ready(delta)
      compute.append(time.perf_counter() - t0)
    deltas.append(delta)
    opt_states.append(opt_state)
    losses.append(loss)
  state, metrics = finish_fn(state, tuple(opt_states) if state.worker_opt_state else (),
                             tuple(deltas), tuple(losses), r.hidden_per_worker, weight_R)
  return state, metrics, compute


def _host_timing(hosts: list[HostSpec], sched: _Schedule, compute: list[float]) -> dict:
  """Per-host H, compute and idle seconds of a synchronous round (idle = wait at the barrier)."""
  slowest = max(compute)
  out = {}
  for i, (h, t) in enumerate(zip(hosts, compute)):
    sched.compute_seconds[i] += t
    sched.idle_seconds[i] += slowest - t
    out.update({f"inner_steps_host_{i}": sched.inner_steps[i], f"compute_s_host_{i}": t,
                f"idle_s_host_{i}": slowest - t})
  return out


def _summary(r: _Run, sched: _Schedule, round_bytes, eval_loss, scalars, wall: float) -> dict:
  c = r.config
  sent = (round_bytes * c.rounds).sent
  # DDP all-reduces fp32 gradients every inner step (nothing with a single worker).
  total_steps = c.rounds * c.inner_steps
  ddp_equivalent = r.param_bytes * total_steps if c.num_workers > 1 else 0
  workers = []
  for i, h in enumerate(r.hosts):
    busy = sched.compute_seconds[i] + sched.idle_seconds[i]
    for w in h.worker_ids:
      workers.append({"worker": w, "process": h.index, "tier": h.tier,
                      "inner_steps": sched.inner_steps[i],
                      "idle_fraction": sched.idle_seconds[i] / busy if busy else 0.0})
  return {
      "algorithm": c.algorithm, "num_workers": c.num_workers, "rounds": c.rounds,
      "inner_steps": c.inner_steps, "model": c.model.name, "params": r.param_count,
      "eval_loss": eval_loss,
      "train_loss": float(scalars["train_loss"]) if scalars else None,
      "tokens": sched.tokens,
      "bytes_sent": sent, "bytes_received": (round_bytes * c.rounds).received,
      "bytes_sent_ddp_equivalent": ddp_equivalent,
      "bytes_ratio_vs_ddp": ddp_equivalent / sent if sent else None,
      "wall_seconds": wall,
      "workers": workers,
      "tiers": {str(t): b for t, b in r.tier_bytes.items()},
  }
