"""Wiring: config -> mesh, data, model, optimizers, state; then the round loop.

Everything that computes lives elsewhere (steps.py, outer/, model/, data/); this module
decides what runs when: rounds, evaluation, metrics, checkpoints and the final summary.
"""

import dataclasses
import json
import logging
import math
import pathlib
import time
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
from flax import nnx

from lowcomm_jax import config_check, optimizers, steps
from lowcomm_jax.checkpoint import Checkpointer, CheckpointMismatch, abstract_with_shardings
from lowcomm_jax.data import (DataError, WorkerStreams, eval_windows, get_tokenizer, load_tokens,
                              resolve_corpus, split_train_val)
from lowcomm_jax.metrics import MetricsLogger
from lowcomm_jax.model import GPT, GPTConfig, count_params, get_preset, next_token_loss
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
  round_step: Callable[[steps.TrainState, jax.Array], tuple[steps.TrainState, dict]]
  eval_step: Callable[[dict, jax.Array], jax.Array]
  init_fn: Callable[[], steps.TrainState]
  abstract_state: steps.TrainState
  state_shardings: steps.TrainState
  streams: WorkerStreams
  eval_windows: np.ndarray
  param_count: int
  param_bytes: int


def _state_shardings(abstract_state: steps.TrainState, mesh) -> steps.TrainState:
  rep, per_worker = mesh_lib.replicated(mesh), mesh_lib.per_worker(mesh)
  shard = lambda tree, s: jax.tree.map(lambda _: s, tree)
  return steps.TrainState(
      round=rep, rng=rep, params=shard(abstract_state.params, rep),
      outer_opt_state=shard(abstract_state.outer_opt_state, rep),
      worker_opt_state=shard(abstract_state.worker_opt_state, per_worker))


def build(config: ml_collections.ConfigDict) -> _Run:
  """Validates the config, loads data, builds the model and the jitted steps (no compute)."""
  config_check.validate(config, num_devices=jax.device_count())
  c = config
  tokenizer = get_tokenizer(c.data.tokenizer)
  tokens = load_tokens(resolve_corpus(c.data.path), tokenizer)
  train_tokens, val_tokens = split_train_val(tokens, c.data.val_fraction)
  if min(len(train_tokens), len(val_tokens)) <= c.data.seq_len + 1:
    raise DataError(f"the corpus has {len(tokens)} tokens: too few for data.seq_len="
                    f"{c.data.seq_len} in both splits; use a longer corpus or a shorter seq_len")

  replica = (c.mesh.replica if c.mesh.replica > 0 else mesh_lib.replica_devices(
      c.num_workers, jax.device_count() // (c.mesh.data * c.mesh.model)))
  mesh = mesh_lib.make_mesh(replica, c.mesh.data, c.mesh.model)

  model_cfg = get_preset(c.model.name, vocab_size=c.model.vocab_size,
                         tokenizer_vocab=tokenizer.vocab_size, dtype=c.model.dtype,
                         dropout=c.model.dropout)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: GPT(model_cfg, rngs=nnx.Rngs(0))), nnx.Param)

  def loss_fn(params, windows, key):
    return next_token_loss(nnx.merge(graphdef, params), windows,
                           ffn_fraction=c.model.ffn_fraction, dropout_key=key)

  inner_tx = optimizers.inner_optimizer(c.optimizer, c.rounds * c.inner_steps)
  outer_tx = optimizers.outer_optimizer(c, inner_tx)

  def init_fn():
    params = nnx.to_pure_dict(nnx.state(GPT(model_cfg, rngs=nnx.Rngs(params=c.seed)), nnx.Param))
    return steps.init_state(params, seed=c.seed, num_workers=c.num_workers,
                            algorithm=c.algorithm, inner_tx=inner_tx, outer_tx=outer_tx)

  abstract_state = jax.eval_shape(init_fn)
  streams = WorkerStreams(train_tokens, worker_ids=range(c.num_workers), seq_len=c.data.seq_len,
                          batch_size=c.data.batch_size, seed=c.seed,
                          batch_mode=c.data.batch_mode)
  return _Run(
      config=c, mesh=mesh, model_cfg=model_cfg, graphdef=graphdef,
      round_step=steps.make_round_step(loss_fn, algorithm=c.algorithm, inner_tx=inner_tx,
                                       outer_tx=outer_tx),
      eval_step=steps.make_eval_step(loss_fn), init_fn=init_fn, abstract_state=abstract_state,
      state_shardings=_state_shardings(abstract_state, mesh), streams=streams,
      eval_windows=eval_windows(val_tokens, seq_len=c.data.seq_len,
                                batch_size=c.data.batch_size, num_batches=c.eval_batches,
                                seed=c.seed),
      param_count=count_params(abstract_state.params),
      param_bytes=ledger.tree_bytes(abstract_state.params))


def _due(round_: int, every: int, last: int) -> bool:
  return round_ == last or (every > 0 and round_ % every == 0)


def run(config: ml_collections.ConfigDict, workdir: str | pathlib.Path, *,
        stop_after_rounds: int | None = None) -> dict:
  """Trains (or resumes) the run in `workdir` and returns its summary.

  `stop_after_rounds` ends this invocation early, as a preemption would, leaving the last
  checkpoint for the next call to resume from (used by the resume tests).
  """
  t_start = time.time()
  r = build(config)
  c = r.config
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
  if latest is not None:
    state, meta = ckpt.restore(latest, abstract_with_shardings(r.abstract_state,
                                                               r.state_shardings))
    try:
      r.streams.set_state(meta["streams"])
    except ValueError as e:
      ckpt.close()
      raise CheckpointMismatch(f"{e}; resume with the data config that wrote {workdir}") from e
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

  batch_sharding = mesh_lib.round_batches(r.mesh)
  abstract_batches = jax.ShapeDtypeStruct(
      (c.num_workers, c.inner_steps, c.data.batch_size, c.data.seq_len + 1), np.int32)
  round_bytes = ledger.count_bytes(r.round_step, r.abstract_state, abstract_batches)
  # On CPU a host copy taken by an async checkpoint may alias device memory; donating the
  # state there could overwrite a save in flight. On accelerators donation halves peak memory.
  donate = (0,) if jax.default_backend() != "cpu" else ()
  round_step = jax.jit(r.round_step, out_shardings=(r.state_shardings, None),
                       donate_argnums=donate)
  eval_step = jax.jit(r.eval_step)
  eval_windows_dev = jax.device_put(r.eval_windows, mesh_lib.replicated(r.mesh))
  tokens_per_round = c.num_workers * c.inner_steps * c.data.batch_size * c.data.seq_len

  logger = MetricsLogger(workdir, total_steps=c.rounds * c.inner_steps,
                         resume_step=start * c.inner_steps, write_files=lead)
  end = c.rounds if stop_after_rounds is None else min(c.rounds, start + stop_after_rounds)
  logging.info("%s: %d workers on mesh %s, model %s (%.2fM params), rounds %d..%d, H=%d, "
               "%d bytes sent per worker per round", c.algorithm, c.num_workers,
               dict(r.mesh.shape), c.model.name, r.param_count / 1e6, start, c.rounds,
               c.inner_steps, round_bytes.sent)

  def finish_round(round_: int, metrics, eval_loss: float | None = None) -> dict:
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
    rounds_timed = round_ - clock["round"]
    scalars.update(round=round_, tokens=round_ * tokens_per_round,
                   bytes_sent=(round_bytes * round_).sent,
                   bytes_received=(round_bytes * round_).received,
                   bytes_sent_round=round_bytes.sent, bytes_received_round=round_bytes.received,
                   steps_per_second=rounds_timed * c.inner_steps / (now - clock["time"]))
    clock.update(round=round_, time=now)
    if eval_loss is not None:
      scalars["eval_loss"] = eval_loss
    if eval_loss is not None or _due(round_, c.log_every, end):
      logger.write(round_ * c.inner_steps, scalars)
    return scalars

  clock = {"round": start, "time": time.perf_counter()}  # for steps_per_second
  pending = None  # (round, device metrics): read one round late so the device never waits
  scalars, eval_loss = {}, None
  try:
    with jax.set_mesh(r.mesh):
      for round_ in range(start + 1, end + 1):
        batches = jax.device_put(r.streams.next_round(c.inner_steps), batch_sharding)
        state, metrics = round_step(state, batches)
        if pending is not None:
          finish_round(*pending)
        pending = (round_, metrics)
        logger.progress(round_ * c.inner_steps)
        evaluate = _due(round_, c.eval_every, c.rounds)
        checkpoint = _due(round_, c.checkpoint_every, end)
        if evaluate or checkpoint or round_ == end:
          # Checked before saving: a diverged state is never checkpointed.
          eval_loss = float(eval_step(state.params, eval_windows_dev)) if evaluate else None
          scalars = finish_round(*pending, eval_loss=eval_loss)
          pending = None
          if checkpoint:
            ckpt.save(round_, state, {"streams": r.streams.get_state(),
                                      "schedule_steps": schedule_steps,
                                      "wall_seconds": wall_before + time.time() - t_start})
      if end == c.rounds and eval_loss is None:  # resumed at the end, summary was lost
        eval_loss = float(eval_step(state.params, eval_windows_dev))
  finally:  # also on errors: saves in flight complete, files are flushed
    ckpt.wait()
    ckpt.close()
    logger.close()
  if end < c.rounds:
    return {"stopped_at_round": end}

  total_steps = c.rounds * c.inner_steps
  sent = (round_bytes * c.rounds).sent
  # DDP all-reduces fp32 gradients every inner step (nothing with a single worker).
  ddp_equivalent = r.param_bytes * total_steps if c.num_workers > 1 else 0
  summary = {
      "algorithm": c.algorithm, "num_workers": c.num_workers, "rounds": c.rounds,
      "inner_steps": c.inner_steps, "model": c.model.name, "params": r.param_count,
      "eval_loss": eval_loss,
      "train_loss": float(scalars["train_loss"]) if scalars else None,
      "tokens": c.rounds * tokens_per_round,
      "bytes_sent": sent, "bytes_received": (round_bytes * c.rounds).received,
      "bytes_sent_ddp_equivalent": ddp_equivalent,
      "bytes_ratio_vs_ddp": ddp_equivalent / sent if sent else None,
      "wall_seconds": wall_before + time.time() - t_start,
  }
  if lead:
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
  return summary
