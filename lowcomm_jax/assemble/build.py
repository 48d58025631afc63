"""Assembling a run from its config: mesh, data, model, hosts, optimizers, step functions.

`build(config)` takes a checked config and does everything but compute; assemble/jitted.py
jits the programs, and each runtime runs them.
"""

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from lowcomm_jax import algorithms
from lowcomm_jax.errors import ConfigError
from lowcomm_jax.assemble import memory
from lowcomm_jax.programs import optimizers
from lowcomm_jax.assemble import program_cache
from lowcomm_jax.programs import evaluation
from lowcomm_jax.programs import state_average
from lowcomm_jax.programs import steps
from lowcomm_jax.programs import sync_program
from lowcomm_jax.data import (WorkerStreams, eval_windows, open_corpus, other_corpus,
                              probe_windows)
from lowcomm_jax.assemble.hosts import host_table
from lowcomm_jax.model import GPT, GPTConfig, count_params, get_preset
from lowcomm_jax.model import attention, cross_entropy, lora, pretrained
from lowcomm_jax.model.matformer import eval_widths, hidden_units, slice_tier
from lowcomm_jax.model.objective import loss_fn_of
from lowcomm_jax.model.tp import SyncPlan, partitioner
from lowcomm_jax.parallel import ledger, mesh as mesh_lib
from lowcomm_jax.parallel.flat import ParamLayout
from lowcomm_jax.assemble.spec import ModelSpec, Programs, Run, RunData, StateSpec, Topology


@functools.lru_cache(maxsize=32)
def _graphdef(model_cfg: GPTConfig) -> nnx.GraphDef:
  """The model's NNX graph (structure only, immutable): built once per config and process,
  as a run asks for it per host, per program and per tier."""
  return nnx.split(nnx.eval_shape(lambda: GPT(model_cfg, rngs=nnx.Rngs(0))), nnx.Param)[0]


def _model_tree(model_cfg: GPTConfig, seed: int):
  """() -> the model's seeded initial parameter tree."""
  def model_tree():
    return nnx.to_pure_dict(nnx.state(GPT(model_cfg, rngs=nnx.Rngs(params=seed)), nnx.Param))
  return model_tree


def _adapter_tree(model_tree, seed: int, rank: int, targets: tuple[str, ...]):
  """() -> LoRA adapters (B = 0) on the tree `model_tree` makes."""
  def param_tree():
    # A's draws: the run's seed folded with "LoRA" in ASCII, apart from the model's init
    return lora.init_adapters(jax.random.fold_in(jax.random.key(seed), 0x4C6F5241),
                              model_tree(), rank=rank, targets=targets)
  return param_tree


def _flat_init(param_tree, layout: ParamLayout):
  """The jitted () -> flat θ_0 of `param_tree`."""
  return jax.jit(lambda: layout.ravel(param_tree()))


def _runtime_choices(model_config, model_cfg: GPTConfig) -> GPTConfig:
  """The model with its attention kernel and loss pieces settled for this backend."""
  implementation, why = attention.resolve(model_config.attention, model_cfg.dtype,
                                          model_cfg.head_dim, attention.platform())
  logging.info("attention: %s", why)
  return dataclasses.replace(model_cfg, attention=implementation,
                             loss_chunk=cross_entropy.chunk_of(model_config.loss_chunk,
                                                               model_cfg.dtype))


def build(config: ml_collections.ConfigDict, *, check_memory: bool = True) -> Run:
  """Loads data, builds the model and the step functions (no compute) for a config checked
  once at start (config/check.py `validate_here`, by the command that started the process).
  `check_memory=False`: the process will not hold every worker the config's layout puts on
  its devices (a Ray actor holds one worker, or the server)."""
  c, nproc = config, jax.process_count()
  algorithm = algorithms.get(c.algorithm)
  corpus = open_corpus(c.data, window=c.data.seq_len + 1)
  model_cfg = _model_config(c, corpus)
  # Token files are read window by window: each is checked against the vocabulary too.
  window_vocab = model_cfg.vocab_size if corpus.files is not None else None
  hosts = host_table(c, model_cfg.d_ff, nproc)
  local_hosts, mesh, local_mesh = _meshes(c, len(hosts), nproc)
  graphdef = _graphdef(model_cfg)
  # Each piece below is made once per process for equal arguments (program_cache.shared):
  # runs that differ elsewhere (codec, outer rule, aggregation) share its trace and program.
  model_tree, param_tree, layout = _parameters(c, algorithm, model_cfg)
  tp = c.model.tp
  plan = (SyncPlan(tp.sync, tp.layers_per_group, tuple(tp.attn_sync_layers))
          if tp.size > 1 else None)
  loss_of = functools.partial(_loss_of, model_cfg, plan, c.lora)
  # Each host's inner schedule spans its own number of steps (rounds x its H).
  optimizer = ml_collections.FrozenConfigDict(c.optimizer)
  inner_txs = [program_cache.shared(optimizers.inner_optimizer, optimizer,
                                    c.rounds * h.inner_steps) for h in hosts]
  sync = algorithm.sync(c, hosts, model_cfg.d_ff)  # codec, aggregation, robust rule, attack
  placement = sync.place(mesh.shape["replica"])
  if placement:  # before anything is compiled
    raise ConfigError(placement)
  segments = algorithm.segments(c, c.inner_steps)
  aggregators, rules, syncs, windows = _sync_programs(
      c, algorithm, sync, segments, layout, inner_txs[0], corpus, window_vocab, graphdef,
      model_cfg, mesh)
  worker_rule = algorithm.worker_rule(c)
  local_programs, local_halves, init_workers, accumulate = _host_programs(
      c, algorithm, worker_rule, segments, hosts, local_hosts, inner_txs, layout, model_cfg,
      loss_of, local_mesh)
  init_fn = _init_state(c, layout, aggregators, rules)
  initial_params, frozen = _initial_params(c, param_tree, model_tree, layout, mesh)
  abstract_state = jax.eval_shape(init_fn, jax.ShapeDtypeStruct((layout.size,), jnp.float32))
  topology = Topology(
      mesh=mesh, local_mesh=local_mesh, hosts=hosts, local_hosts=local_hosts,
      hidden_per_worker=np.asarray([h.hidden for h in hosts for _ in h.worker_ids], np.int32))
  widths = eval_widths([h.tier for h in hosts], c.eval.widths)
  model = ModelSpec(name=(pretrained.source_of(c.model.init_from) if c.model.init_from
                          else c.model.name), cfg=model_cfg, graphdef=graphdef, layout=layout,
                    param_count=count_params(layout.abstract),
                    param_bytes=ledger.tree_bytes(layout.abstract),
                    tier_bytes=_tier_bytes(c, algorithm, hosts, inner_txs, layout,
                                           abstract_state),
                    eval_widths=widths, frozen_count=count_params(frozen))
  reads_own = worker_rule is not None and worker_rule.reads_sync_state  # NoLoCo's φ_w
  state_sync = algorithm.state_sync(c)
  evaluate = program_cache.shared(
      evaluation.make_eval_step, tuple((m, loss_of(m, mesh)) for m in
                                  (hidden_units(model_cfg.d_ff, w) for w in widths)),
      model_cfg.d_ff, layout)
  programs = Programs(local=local_programs, syncs=syncs, init_workers=init_workers,
                      eval=evaluate, accumulate=accumulate,
                      overlapped=steps.make_overlapped(syncs[0], local_programs[0][0],
                                                       reads_rules=worker_rule is not None,
                                                       reads_own=reads_own),
                      state_sync=state_average.make_state_sync(state_sync) if state_sync else None,
                      local_halves=local_halves)
  programs, init_fn, initial_params = program_cache.same_as_before(
      program_cache.key(c, model_cfg, windows), (programs, init_fn, initial_params))
  run = Run(config=c, algorithm=algorithm, topology=topology, model=model,
            data=_run_data(c, corpus, hosts, local_hosts, window_vocab),
            state_spec=StateSpec(init=init_fn, initial_params=initial_params,
                                 abstract=abstract_state,
                                 shardings=_state_shardings(mesh, abstract_state)),
            programs=programs, sync=sync, outer_rules=rules,
            local_reads_rules=worker_rule is not None,
            local_reads_own=reads_own, worker_state_sync=state_sync,
            partitioner=lambda: partitioner(plan), frozen=frozen)
  # Nothing but a LoRA base is allocated yet: refuse in seconds, not at RESOURCE_EXHAUSTED.
  if check_memory:
    memory.check(run)
  return run


def _model_config(c: ml_collections.ConfigDict, corpus) -> GPTConfig:
  """The model's architecture (a preset's, or a pretrained checkpoint's: its weights are
  `initial_params`), settled for this backend and checked against the corpus."""
  if c.model.init_from:
    model_cfg = dataclasses.replace(pretrained.read_config(c.model.init_from),
                                    dtype=c.model.dtype, dropout=c.model.dropout)
  else:
    model_cfg = get_preset(c.model.name, vocab_size=c.model.vocab_size,
                           tokenizer_vocab=corpus.vocab_size, dtype=c.model.dtype,
                           dropout=c.model.dropout)
  model_cfg = _runtime_choices(c.model, model_cfg)
  corpus.check_vocabulary(model_cfg.vocab_size)
  return model_cfg


def _parameters(c: ml_collections.ConfigDict, algorithm, model_cfg: GPTConfig):
  """(() -> the model's seeded tree, () -> θ's tree, θ's flat layout by fragment). θ is the
  adapters alone with LoRA; the model's weights stay frozen (Run.frozen)."""
  model_tree = program_cache.shared(_model_tree, model_cfg, c.seed)
  lo = c.lora
  param_tree = (program_cache.shared(_adapter_tree, model_tree, c.seed, lo.rank,
                                     tuple(lo.targets)) if lo.rank > 0 else model_tree)
  abstract_params = jax.eval_shape(param_tree)
  return model_tree, param_tree, ParamLayout.of(abstract_params,
                                                algorithm.leaf_fragments(c, abstract_params))


def _meshes(c: ml_collections.ConfigDict, num_hosts: int, nproc: int):
  """(the hosts this process runs, the global mesh, this process's part of it)."""
  if nproc > 1:  # one host per process, each on all of its devices
    mesh = mesh_lib.make_mesh(jax.device_count() // (c.mesh.data * c.model.tp.size),
                              c.mesh.data, c.model.tp.size)
    return [jax.process_index()], mesh, mesh_lib.local_part(mesh)
  if c.mesh.replica > 0:
    replica = c.mesh.replica
  elif num_hosts > 1:  # several hosts' programs share this process: one replica device
    replica = 1
  else:
    replica = mesh_lib.replica_devices(c.num_workers,
                                       jax.device_count() // (c.mesh.data * c.model.tp.size))
  mesh = mesh_lib.make_mesh(replica, c.mesh.data, c.model.tp.size)
  return list(range(num_hosts)), mesh, mesh


def _loss_of(model_cfg: GPTConfig, plan, lo, d_ff: int, on_mesh):
  """The loss of the model `d_ff` hidden units wide (a MatFormer tier), on `on_mesh`."""
  return program_cache.shared(
      loss_fn_of, _graphdef(dataclasses.replace(model_cfg, d_ff=d_ff)),
      dataclasses.replace(model_cfg, d_ff=d_ff), plan, on_mesh,
      lora_scale=lo.alpha / lo.rank if lo.rank > 0 else None, narrow=d_ff != model_cfg.d_ff)


def _sync_programs(c, algorithm, sync, segments, layout: ParamLayout, inner_tx, corpus,
                   window_vocab, graphdef, model_cfg: GPTConfig, mesh):
  """(each fragment's aggregator and outer rule, each segment's sync program, the probe
  batch compiled into them or None)."""
  fragments = range(layout.num_fragments)
  # Each fragment has its own aggregator (a codec's error buffers) and outer rule state.
  aggregators = [sync.aggregator(layout.fragment(p)) for p in fragments]
  rules = [algorithm.outer_rule(c, inner_tx, layout.fragment(p)) for p in fragments]
  windows = None  # data compiled into the programs (the probe batch)
  probes = [None] * layout.num_fragments
  if sync.robust and c.aggregate.signal == "probe_loss":  # each receiver scores every proposal
    windows = probe_windows(corpus.train, seq_len=c.data.seq_len,
                            batch_size=c.aggregate.probe_batch_size, seed=c.seed,
                            vocab_size=window_vocab)
    step = sync.probe_step(algorithm.local_steps)
    # The plain model (no TP plan): the probe runs inside the sync, replicated over 'model'.
    probe_loss = loss_fn_of(graphdef, model_cfg, None, mesh)
    probes = [sync_program.make_probe(probe_loss, layout, p, windows, step) for p in fragments]
  rules = [sync.outer(rule, probe) for rule, probe in zip(rules, probes)]
  syncs = [sync_program.make_sync(aggregators[s.sync], rules[s.sync], nested=sync.nested,
                                  weigh_tokens=sync.weigh_tokens, layout=layout,
                                  fragment=s.sync, count=len(segments),
                                  last=k == len(segments) - 1, map_workers=sync.map_workers,
                                  consensus=sync.consensus, attack=sync.attack)
           for k, s in enumerate(segments)]
  return aggregators, rules, syncs, windows


def _host_programs(c, algorithm, worker_rule, segments, hosts, local_hosts, inner_txs,
                   layout: ParamLayout, model_cfg: GPTConfig, loss_of, local_mesh):
  """Per local host: its local program per segment (and, where a segment has a mix inside
  it, the program in two parts: `Programs.local_halves`), its workers' initial states, and
  (a collaborative run's) its gradient accumulation."""
  alpha = algorithm.mix(c)
  keeps_params = algorithm.keeps_worker_params(c)
  # One worker per device runs unbatched on each (workers.map_host_workers); tensor parallelism
  # keeps the vmap its shard_map over 'model' nests in.
  worker_mesh = local_mesh if c.model.tp.size == 1 else None
  def local_program(i, k, s, part="whole"):
    return program_cache.shared(
        steps.make_local_segment, loss_of(hosts[i].hidden, local_mesh),
        inner_tx=inner_txs[i], hidden=hosts[i].hidden, d_ff=model_cfg.d_ff, layout=layout,
        segment=s, index=k, count=len(segments), alpha=alpha,
        local_steps=algorithm.local_steps, keeps_params=keeps_params,
        worker_rule=worker_rule, mesh=worker_mesh, part=part)

  local_programs = [[local_program(i, k, s) for k, s in enumerate(segments)]
                    for i in local_hosts]
  splits = keeps_params and algorithm.local_steps and worker_rule is None
  local_halves = [[(local_program(i, k, s, "head"), local_program(i, k, s, "tail"))
                   if splits and s.mix_at > 0 else None for k, s in enumerate(segments)]
                  for i in local_hosts]
  init_workers = [
      program_cache.shared(
          functools.partial, steps.init_workers, workers=len(hosts[i].worker_ids),
          hidden=hosts[i].hidden, d_ff=model_cfg.d_ff, layout=layout, inner_tx=inner_txs[i],
          local_steps=algorithm.local_steps, keeps_params=keeps_params,
          worker_rule=worker_rule)
      for i in local_hosts]
  accumulate = [program_cache.shared(steps.make_accumulate,
                                     loss_of(hosts[i].hidden, local_mesh),
                                     hidden=hosts[i].hidden, d_ff=model_cfg.d_ff,
                                     layout=layout, mesh=worker_mesh)
                for i in local_hosts] if algorithm.progress(c) == "epochs" else []
  return local_programs, local_halves, init_workers, accumulate


def _init_state(c, layout: ParamLayout, aggregators, rules):
  """flat θ_0 -> the round-0 global state."""
  def init_fn(flat_params):
    return steps.init_state(flat_params, seed=c.seed, layout=layout,
                            aggregators=aggregators, rules=rules, num_workers=c.num_workers)
  return init_fn


def _initial_params(c, param_tree, model_tree, layout: ParamLayout, mesh):
  """(() -> flat θ_0, the frozen base on every device: LoRA's, else ())."""
  lo = c.lora
  if lo.rank > 0 or not c.model.init_from:  # seeded (LoRA: adapters with B = 0, the base)
    initial_params = program_cache.shared(_flat_init, param_tree, layout)
  else:  # read when asked (init_run), not held for the whole run
    def initial_params():
      return layout.ravel(pretrained.weights_or_init(c.model.init_from, model_tree))
  frozen = ()
  if lo.rank > 0:
    # Straight from host memory to every device (no staging copy on device 0); each process
    # places its own copy (train.run checks the processes' bases are the same file).
    frozen = mesh_lib.replicated_from_host(
        jax.tree.map(lambda x: np.asarray(x).astype(lo.base_dtype),
                     pretrained.weights_or_init(c.model.init_from, model_tree)), mesh)
  return initial_params, frozen


def _tier_bytes(c, algorithm, hosts, inner_txs, layout: ParamLayout, abstract_state) -> dict:
  """Per tier: a worker's parameter, inner-optimizer and codec-state bytes (the memory
  pre-check's and the summary's)."""
  per_worker_outer = abstract_state.outer.per_worker
  tier_bytes = {}
  for h, tx in zip(hosts, inner_txs):
    tier_params = jax.eval_shape(lambda p, m=h.hidden: slice_tier(p, m), layout.abstract)
    tier_opt = (jax.eval_shape(tx.init, tier_params) if algorithm.local_steps
                else abstract_state.outer.per_fragment)  # DDP: the one per-step optimizer
    tier_bytes[h.tier] = {"param_bytes": ledger.tree_bytes(tier_params),
                          "optimizer_bytes": ledger.tree_bytes(tier_opt),
                          "codec_state_bytes": ledger.tree_bytes(per_worker_outer)
                          // max(c.num_workers, 1)}
  return tier_bytes


def _state_shardings(mesh, abstract_state) -> steps.TrainState:
  """The global state's shardings: replicated, but the per-worker outer state on 'replica'."""
  rep = mesh_lib.replicated(mesh)
  return steps.TrainState(
      rep, rep, jax.tree.map(lambda _: rep, abstract_state.params),
      steps.OuterState(
          jax.tree.map(lambda _: mesh_lib.per_worker(mesh), abstract_state.outer.per_worker),
          jax.tree.map(lambda _: rep, abstract_state.outer.per_fragment)))


def _run_data(c, corpus, hosts, local_hosts, window_vocab) -> RunData:
  """Each local host's workers' streams and the fixed validation windows."""
  # Workers whose data is corrupted on purpose (robust-aggregation tests and benchmarks).
  other = (other_corpus(c.data.corruption_path, c.data.tokenizer, window=c.data.seq_len + 1)
           if c.data.corrupt_workers and c.data.corruption == "other_text" else None)
  corrupt = {w: (c.data.corruption, c.data.corruption_prob, corpus.vocab_size, other)
             for w in c.data.corrupt_workers}
  return RunData(
      streams=[WorkerStreams(corpus.train, worker_ids=hosts[i].worker_ids,
                             seq_len=c.data.seq_len, batch_size=hosts[i].batch_size,
                             seed=c.seed, batch_mode=c.data.batch_mode,
                             vocab_size=window_vocab, corrupt=corrupt,
                             partitions=c.num_workers if c.data.partition == "contiguous"
                             else 0) for i in local_hosts],
      eval_windows=eval_windows(corpus.val, seq_len=c.data.seq_len,
                                batch_size=c.data.batch_size, num_batches=c.eval_batches,
                                seed=c.seed, vocab_size=window_vocab))
