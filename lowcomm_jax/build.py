"""Assembling a run from its config: mesh, data, model, hosts, optimizers, step functions.

`build(config)` validates the config and does everything but compute. `train_round` runs
one synchronous round: each host this process owns runs its local program on this
process's devices, then all processes run the one global outer step together.
"""

import dataclasses
import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from lowcomm_jax import config_check, memory, optimizers, steps
from lowcomm_jax.data import (DataError, WorkerStreams, eval_windows, get_tokenizer, load_tokens,
                              resolve_corpus, split_train_val)
from lowcomm_jax.hosts import HostSpec, host_table
from lowcomm_jax.metrics import announce_compile
from lowcomm_jax.model import GPT, GPTConfig, count_params, get_preset, next_token_loss
from lowcomm_jax.model.matformer import slice_tier
from lowcomm_jax.model.tp import SyncPlan, count_all_reduces, tp_loss, use_gspmd_for_tp
from lowcomm_jax.parallel import ledger, mesh as mesh_lib
from lowcomm_jax.parallel.flat import ParamLayout


@dataclasses.dataclass
class Run:
  """Everything built from the config before the first round."""
  config: ml_collections.ConfigDict
  mesh: jax.sharding.Mesh  # global: every process's devices
  local_mesh: jax.sharding.Mesh  # this process's devices (== mesh in a single process)
  model_cfg: GPTConfig
  graphdef: nnx.GraphDef
  layout: ParamLayout  # the flat θ_global's tree view (abstract tree: layout.abstract)
  hosts: list[HostSpec]  # all of them
  local_hosts: list[int]  # indices of the hosts this process runs
  local_rounds: list[Callable]  # per local host: steps.make_local_round
  init_workers: list[Callable]  # per local host: flat θ -> [G, ...] inner optimizer states
  finish_round: Callable  # (state, deltas, losses, hidden, weight, metrics) -> (state, metrics)
  eval_step: Callable[[jax.Array, jax.Array], jax.Array]  # (flat θ, windows) -> loss
  init_fn: Callable[[], steps.TrainState]
  abstract_state: steps.TrainState
  state_shardings: steps.TrainState
  streams: list[WorkerStreams]  # per local host
  eval_windows: np.ndarray
  param_count: int
  param_bytes: int
  tier_bytes: dict[float, dict[str, int]]  # per tier: parameter and optimizer bytes per worker
  hidden_per_worker: np.ndarray  # [R] FFN hidden units each worker trains
  _placed: dict = dataclasses.field(default_factory=dict)

  def replicated_input(self, x: np.ndarray) -> jax.Array:
    """`x` as a global replicated array, placed once per distinct value.

    Placing host data on a multi-process mesh checks that every process passed the same
    value — an all-gather. Paid every round, it was most of the outer step's overhead.
    """
    x = np.asarray(x)
    key = (x.dtype.str, x.shape, x.tobytes())
    if key not in self._placed:
      self._placed[key] = jax.device_put(x, mesh_lib.replicated(self.mesh))
    return self._placed[key]

  def round_tokens(self, inner_steps_per_host) -> list[int]:
    """Tokens each host's workers process in a round with these H."""
    return [len(h.worker_ids) * h.batch_size * H * self.config.data.seq_len
            for h, H in zip(self.hosts, inner_steps_per_host)]

  def worker_weights(self, inner_steps_per_host) -> np.ndarray:
    """[R] aggregation weights: 1, or tokens processed this round (aggregate.weighting)."""
    c = self.config
    if c.aggregate.weighting == "tokens":
      per_worker = [t / len(h.worker_ids)
                    for h, t in zip(self.hosts, self.round_tokens(inner_steps_per_host))]
      return np.asarray([t for h, t in zip(self.hosts, per_worker) for _ in h.worker_ids],
                        np.float32)
    return np.ones((c.num_workers,), np.float32)

  def abstract_round_inputs(self):
    """Shapes (with shardings) of the outer step's per-worker inputs: Δ and losses."""
    sharding = mesh_lib.per_worker(self.mesh)
    deltas = jax.tree.map(lambda x: jax.ShapeDtypeStruct((self.config.num_workers,) + x.shape,
                                                         x.dtype, sharding=sharding),
                          self.abstract_state.params)
    return deltas, jax.ShapeDtypeStruct((self.config.num_workers,), jnp.float32,
                                        sharding=sharding)

  def outer_bytes(self) -> ledger.CommBytes:
    """Per-worker bytes of one outer step, from tracing it (nothing runs)."""
    deltas, losses = self.abstract_round_inputs()
    return ledger.count_bytes(self.finish_round, self.abstract_state, deltas, losses,
                              self.hidden_per_worker,
                              self.worker_weights([h.inner_steps for h in self.hosts]))

  def tp_counts(self) -> dict:
    """Tensor parallelism's sync points per forward, and the collectives of one inner step
    read from the compiled local program of this process's first host (H steps are a scan:
    its body holds one step's collectives once). Empty without TP."""
    tp = self.config.model.tp
    if tp.size <= 1:
      return {}
    plan = SyncPlan(tp.sync, tp.layers_per_group, tuple(tp.attn_sync_layers))
    host = self.hosts[self.local_hosts[0]]
    workers = len(host.worker_ids)
    batches = jax.ShapeDtypeStruct(
        (workers, host.inner_steps, host.batch_size, self.config.data.seq_len + 1), jnp.int32)
    ids = jax.ShapeDtypeStruct((workers,), jnp.int32)
    with jax.set_mesh(self.local_mesh):
      hlo = jax.jit(self.local_rounds[0]).lower(
          self.abstract_state._replace(outer_opt_state=()), self.abstract_workers()[0],
          batches, ids).compile().as_text()
    return {"tp_syncs_forward": plan.syncs_forward(self.model_cfg.n_layer,
                                                   self.model_cfg.parallel_residual),
            "tp_allreduces_train_step": count_all_reduces(hlo),
            # Parameters stay replicated over 'model': the sharded leaves' gradients are
            # gathered before the (replicated) optimizer update.
            "tp_allgathers_train_step": hlo.count(" all-gather(") + hlo.count(
                " all-gather-start(")}

  def abstract_workers(self):
    """Shapes and shardings of this process's worker states (for restoring them)."""
    sharding = mesh_lib.per_worker(self.local_mesh)
    params = self.abstract_state.params
    return tuple(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                              jax.eval_shape(f, params)) for f in self.init_workers)


def _loss_fn(graphdef, model_cfg: GPTConfig, plan: SyncPlan | None, mesh):
  """(params, windows, key) -> loss: the NNX model, or its tensor-parallel form under `plan`
  over `mesh`'s 'model' axis (no dropout there; validation requires model.dropout = 0)."""
  if plan is not None:
    return lambda params, windows, key: tp_loss(params, windows, model_cfg, plan, mesh)

  def loss_fn(params, windows, key):
    return next_token_loss(nnx.merge(graphdef, params), windows, dropout_key=key)
  return loss_fn


def build(config: ml_collections.ConfigDict) -> Run:
  """Validates the config, loads data, builds the model and the step functions (no compute)."""
  nproc = jax.process_count()
  config_check.validate(config, num_devices=jax.device_count(), num_processes=nproc,
                        local_devices=jax.local_device_count())
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
  hosts = host_table(c, model_cfg.d_ff, nproc)
  if nproc > 1:  # one host per process, each on all of its devices
    local_hosts = [jax.process_index()]
    mesh = mesh_lib.make_mesh(jax.device_count() // (c.mesh.data * c.model.tp.size),
                              c.mesh.data, c.model.tp.size)
    local_mesh = mesh_lib.local_part(mesh)
  else:
    local_hosts = list(range(len(hosts)))
    if c.mesh.replica > 0:
      replica = c.mesh.replica
    elif len(hosts) > 1:  # several hosts' programs share this process: one replica device
      replica = 1
    else:
      replica = mesh_lib.replica_devices(c.num_workers,
                                         jax.device_count() // (c.mesh.data * c.model.tp.size))
    mesh = local_mesh = mesh_lib.make_mesh(replica, c.mesh.data, c.model.tp.size)

  def graphdef_of(d_ff):
    tier_cfg = dataclasses.replace(model_cfg, d_ff=d_ff)
    return nnx.split(nnx.eval_shape(lambda: GPT(tier_cfg, rngs=nnx.Rngs(0))), nnx.Param)[0]

  graphdef = graphdef_of(model_cfg.d_ff)

  def param_tree():
    return nnx.to_pure_dict(nnx.state(GPT(model_cfg, rngs=nnx.Rngs(params=c.seed)), nnx.Param))
  layout = ParamLayout.of(jax.eval_shape(param_tree))
  tp = c.model.tp
  plan = (SyncPlan(tp.sync, tp.layers_per_group, tuple(tp.attn_sync_layers))
          if tp.size > 1 else None)
  if plan is not None:
    use_gspmd_for_tp()

  def loss_of(d_ff, on_mesh):
    return _loss_fn(graphdef_of(d_ff), dataclasses.replace(model_cfg, d_ff=d_ff), plan, on_mesh)

  # Each host's inner schedule spans its own number of steps (rounds x its H).
  inner_txs = [optimizers.inner_optimizer(c.optimizer, c.rounds * h.inner_steps) for h in hosts]
  nested = optimizers.needs_nested_mean(c, hosts, model_cfg.d_ff)
  outer_tx = optimizers.outer_optimizer(c, inner_txs[0], layout, nested=nested)
  outer_step = steps.make_outer_step(outer_tx, nested=nested, layout=layout)
  # Asynchronous algorithms (simulator) run DiLoCo's local program; their servers differ.
  local_algorithm = "ddp" if c.algorithm == "ddp" else "diloco"
  local_rounds = [
      steps.make_local_round(loss_of(hosts[i].hidden, local_mesh), algorithm=local_algorithm,
                             inner_tx=inner_txs[i], hidden=hosts[i].hidden, d_ff=model_cfg.d_ff,
                             layout=layout)
      for i in local_hosts]
  init_workers = [
      (lambda p, h=hosts[i], tx=inner_txs[i]: steps.init_workers(
          p, workers=len(h.worker_ids), hidden=h.hidden, d_ff=model_cfg.d_ff, layout=layout,
          inner_tx=tx))
      if local_algorithm == "diloco" else (lambda p: ()) for i in local_hosts]

  def init_fn():
    return steps.init_state(layout.ravel(param_tree()), seed=c.seed, outer_tx=outer_tx,
                            num_workers=c.num_workers)

  def finish_round(state, deltas_R, losses_R, hidden_R, weight_R, metrics: bool = True):
    """The global program: aggregate all workers' Δ and apply the outer rule.

    With `metrics` (static; the runner asks on rounds that log, evaluate or checkpoint) it
    also returns every worker's train loss and the parameter and update norms. Without,
    the round is one all-reduce of Δ and the update: the losses would be a second
    collective (XLA puts them in the same all-reduce op, but gloo still runs one transfer
    per operand) and the norms two more passes over θ.
    """
    params, outer_opt_state, out = outer_step(state.params, state.outer_opt_state,
                                              deltas_R, hidden_R, weight_R, state.round,
                                              norms=metrics)
    if metrics:
      # Every worker's loss by a sum over workers, not an all-gather: XLA merges it into
      # the pseudo-gradient's all-reduce op. (`where`, not a product: one worker's NaN must
      # not spread to the others' entries.)
      per_worker = jnp.where(jnp.eye(losses_R.shape[0], dtype=bool), losses_R[:, None],
                             0).sum(0)
      out.update(train_loss=per_worker.mean(), train_loss_per_worker=per_worker)
    return steps.TrainState(state.round + 1, state.rng, params, outer_opt_state), out

  abstract_state = jax.eval_shape(init_fn)
  aggregator_state, rule_state = jax.eval_shape(outer_tx.init, abstract_state.params)
  tier_bytes = {}
  for h, tx in zip(hosts, inner_txs):
    tier_params = jax.eval_shape(lambda p, m=h.hidden: slice_tier(p, m), layout.abstract)
    tier_opt = (jax.eval_shape(tx.init, tier_params) if local_algorithm == "diloco"
                else rule_state)  # DDP: the one per-step optimizer
    tier_bytes[h.tier] = {"param_bytes": ledger.tree_bytes(tier_params),
                          "optimizer_bytes": ledger.tree_bytes(tier_opt),
                          "codec_state_bytes": ledger.tree_bytes(aggregator_state)}
  rep = mesh_lib.replicated(mesh)
  state_shardings = steps.TrainState(
      rep, rep, jax.tree.map(lambda _: rep, abstract_state.params),
      (jax.tree.map(lambda _: mesh_lib.per_worker(mesh), abstract_state.outer_opt_state[0]),
       jax.tree.map(lambda _: rep, abstract_state.outer_opt_state[1])))
  run = Run(
      config=c, mesh=mesh, local_mesh=local_mesh, model_cfg=model_cfg, graphdef=graphdef,
      layout=layout,
      hosts=hosts, local_hosts=local_hosts, local_rounds=local_rounds,
      init_workers=init_workers, finish_round=finish_round,
      eval_step=steps.make_eval_step(loss_of(model_cfg.d_ff, mesh), layout), init_fn=init_fn,
      abstract_state=abstract_state,
      state_shardings=state_shardings,
      streams=[WorkerStreams(train_tokens, worker_ids=hosts[i].worker_ids,
                             seq_len=c.data.seq_len, batch_size=hosts[i].batch_size,
                             seed=c.seed, batch_mode=c.data.batch_mode) for i in local_hosts],
      eval_windows=eval_windows(val_tokens, seq_len=c.data.seq_len,
                                batch_size=c.data.batch_size, num_batches=c.eval_batches,
                                seed=c.seed),
      param_count=count_params(layout.abstract),
      param_bytes=ledger.tree_bytes(layout.abstract), tier_bytes=tier_bytes,
      hidden_per_worker=np.asarray([h.hidden for h in hosts for _ in h.worker_ids], np.int32))
  memory.check(run)  # nothing is allocated yet: refuse in seconds, not at RESOURCE_EXHAUSTED
  return run


def jitted_steps(r: Run):
  """(per-local-host jitted local programs, jitted global outer program, worker init).

  A host's local program re-traces when its H changes (DyLU). Donation halves peak memory
  on accelerators; on CPU a host copy taken by an async checkpoint may alias device memory,
  so nothing is donated there.
  """
  donate = jax.default_backend() != "cpu"
  per_worker = mesh_lib.per_worker(r.local_mesh)
  local = [jax.jit(f, donate_argnums=(1,) if donate else (),
                   out_shardings=(per_worker, per_worker, per_worker)) for f in r.local_rounds]
  finish = jax.jit(r.finish_round, out_shardings=(r.state_shardings,
                                                  mesh_lib.replicated(r.mesh)),
                   static_argnames="metrics", donate_argnums=(0,) if donate else ())
  init = [jax.jit(f, out_shardings=per_worker) for f in r.init_workers]
  return local, finish, init


def init_run(r: Run, fns) -> tuple[steps.TrainState, tuple]:
  """Round-0 global state and this process's fresh worker states."""
  logging.info("compiling the initial state…")
  with jax.set_mesh(r.mesh):
    state = jax.jit(r.init_fn, out_shardings=r.state_shardings)()
  view = mesh_lib.local_view(state.params, r.local_mesh)
  with jax.set_mesh(r.local_mesh):
    workers = tuple(init(view) for init in fns[2])
  return state, workers


def train_round(r: Run, fns, state: steps.TrainState, workers: tuple, batches_per_host,
                weight_R, *, timed: bool = False, metrics: bool = True):
  """One synchronous round: this process's hosts' local programs, then the outer step.

  Returns (state, workers, device metrics (empty without `metrics`), per-local-host compute
  seconds if `timed`).
  Timing blocks on each host's result: that is what measuring it means.
  """
  local_fns, finish_fn, _ = fns
  sharding = mesh_lib.round_batches(r.local_mesh)
  # Local programs read θ_global and the round key, never the (partly per-worker) outer state.
  view = mesh_lib.local_view(state._replace(outer_opt_state=()), r.local_mesh)
  deltas, new_workers, losses, compute = [], [], [], []
  if timed:  # the previous round's outer step must not count as this round's compute
    jax.block_until_ready(view)
  with jax.set_mesh(r.local_mesh):
    for k, i in enumerate(r.local_hosts):
      batches = jax.device_put(batches_per_host[k], sharding)
      ids = jax.device_put(np.asarray(r.hosts[i].worker_ids, np.int32),
                           mesh_lib.per_worker(r.local_mesh))
      announce_compile(local_fns[k], f"the local program for host {i}")
      t0 = time.perf_counter()
      delta, opt_state, loss_GxH = local_fns[k](view, workers[k], batches, ids)
      if timed:
        jax.block_until_ready(delta)
        compute.append(time.perf_counter() - t0)
      deltas.append(delta)
      new_workers.append(opt_state)
      losses.append(loss_GxH.mean(axis=1))
    cat = lambda *xs: jnp.concatenate(xs) if len(xs) > 1 else xs[0]
    deltas_local = jax.tree.map(cat, *deltas)
    losses_local = cat(*losses)
  deltas_R = mesh_lib.to_global(deltas_local, r.mesh, r.config.num_workers)
  losses_R = mesh_lib.to_global(losses_local, r.mesh, r.config.num_workers)
  announce_compile(finish_fn, "the outer step")
  with jax.set_mesh(r.mesh):
    state, round_metrics = finish_fn(state, deltas_R, losses_R,
                                     r.replicated_input(r.hidden_per_worker),
                                     r.replicated_input(weight_R), metrics=metrics)
  return state, tuple(new_workers), round_metrics, compute
