"""Assembling a run from its config: mesh, data, model, hosts, optimizers, step functions.

`build(config)` validates the config and does everything but compute; runtimes/spmd/rounds.py jits the
programs and runs them.
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
from lowcomm_jax.config.error import ConfigError
from lowcomm_jax.assemble import memory
from lowcomm_jax.programs import optimizers
from lowcomm_jax.assemble import program_cache
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
  nproc = jax.process_count()
  c = config
  algorithm = algorithms.get(c.algorithm)
  corpus = open_corpus(c.data, window=c.data.seq_len + 1)
  if c.model.init_from:  # the checkpoint's architecture (its weights: initial_params)
    model_cfg = dataclasses.replace(pretrained.read_config(c.model.init_from),
                                    dtype=c.model.dtype, dropout=c.model.dropout)
  else:
    model_cfg = get_preset(c.model.name, vocab_size=c.model.vocab_size,
                           tokenizer_vocab=corpus.vocab_size, dtype=c.model.dtype,
                           dropout=c.model.dropout)
  model_cfg = _runtime_choices(c.model, model_cfg)
  corpus.check_vocabulary(model_cfg.vocab_size)
  # Token files are read window by window: each is checked against the vocabulary too.
  window_vocab = model_cfg.vocab_size if corpus.files is not None else None
  hosts = host_table(c, model_cfg.d_ff, nproc)
  widths = eval_widths([h.tier for h in hosts], c.eval.widths)
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
    return _graphdef(dataclasses.replace(model_cfg, d_ff=d_ff))

  graphdef = graphdef_of(model_cfg.d_ff)

  # Each piece below is made once per process for equal arguments (program_cache.shared):
  # runs that differ elsewhere (codec, outer rule, aggregation) share its trace and program.
  model_tree = program_cache.shared(_model_tree, model_cfg, c.seed)
  lo = c.lora
  # θ: the adapters alone with LoRA; the model's weights stay frozen (Run.frozen)
  param_tree = (program_cache.shared(_adapter_tree, model_tree, c.seed, lo.rank,
                                     tuple(lo.targets)) if lo.rank > 0 else model_tree)
  abstract_params = jax.eval_shape(param_tree)
  layout = ParamLayout.of(abstract_params, algorithm.leaf_fragments(c, abstract_params))
  tp = c.model.tp
  plan = (SyncPlan(tp.sync, tp.layers_per_group, tuple(tp.attn_sync_layers))
          if tp.size > 1 else None)

  def loss_of(d_ff, on_mesh):
    return program_cache.shared(
        loss_fn_of, graphdef_of(d_ff), dataclasses.replace(model_cfg, d_ff=d_ff), plan,
        on_mesh, lora_scale=lo.alpha / lo.rank if lo.rank > 0 else None,
        narrow=d_ff != model_cfg.d_ff)

  # Each host's inner schedule spans its own number of steps (rounds x its H).
  optimizer = ml_collections.FrozenConfigDict(c.optimizer)
  inner_txs = [program_cache.shared(optimizers.inner_optimizer, optimizer,
                                    c.rounds * h.inner_steps) for h in hosts]
  sync = algorithm.sync(c, hosts, model_cfg.d_ff)  # codec, aggregation, robust rule, attack
  placement = sync.place(mesh.shape["replica"])
  if placement:  # before anything is compiled
    raise ConfigError(placement)
  collab = c.collab.target_batch_size > 0
  fragments = range(layout.num_fragments)
  # Each fragment has its own aggregator (a codec's error buffers) and outer rule state.
  aggregators = [sync.aggregator(layout.fragment(p)) for p in fragments]
  rules = [algorithm.outer_rule(c, inner_txs[0], layout.fragment(p)) for p in fragments]
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
  segments = algorithm.segments(c, c.inner_steps)
  syncs = [sync_program.make_sync(aggregators[s.sync], rules[s.sync], nested=sync.nested,
                           weigh_tokens=sync.weigh_tokens, layout=layout, fragment=s.sync,
                           count=len(segments), last=k == len(segments) - 1,
                           map_workers=sync.map_workers, consensus=sync.consensus,
                           attack=sync.attack)
           for k, s in enumerate(segments)]
  alpha = algorithm.mix(c)
  keeps_params = algorithm.keeps_worker_params(c)
  worker_rule = algorithm.worker_rule(c)
  reads_own = worker_rule is not None and worker_rule.reads_sync_state  # NoLoCo's φ_w
  # One worker per device runs unbatched on each (workers.map_host_workers); tensor parallelism
  # keeps the vmap its shard_map over 'model' nests in.
  worker_mesh = local_mesh if tp.size == 1 else None
  local_programs = [
      [program_cache.shared(
          steps.make_local_segment, loss_of(hosts[i].hidden, local_mesh),
          inner_tx=inner_txs[i], hidden=hosts[i].hidden, d_ff=model_cfg.d_ff, layout=layout,
          segment=s, index=k, count=len(segments), alpha=alpha,
          local_steps=algorithm.local_steps, keeps_params=keeps_params,
          worker_rule=worker_rule, mesh=worker_mesh)
       for k, s in enumerate(segments)]
      for i in local_hosts]
  init_workers = [
      program_cache.shared(
          functools.partial, steps.init_workers, workers=len(hosts[i].worker_ids),
          hidden=hosts[i].hidden, d_ff=model_cfg.d_ff, layout=layout, inner_tx=inner_txs[i],
          local_steps=algorithm.local_steps, keeps_params=keeps_params,
          worker_rule=worker_rule)
      for i in local_hosts]

  def init_fn(flat_params):
    return steps.init_state(flat_params, seed=c.seed, layout=layout,
                            aggregators=aggregators, rules=rules, num_workers=c.num_workers)

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
  abstract_state = jax.eval_shape(init_fn, jax.ShapeDtypeStruct((layout.size,), jnp.float32))
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
  rep = mesh_lib.replicated(mesh)
  state_shardings = steps.TrainState(
      rep, rep, jax.tree.map(lambda _: rep, abstract_state.params),
      steps.OuterState(
          jax.tree.map(lambda _: mesh_lib.per_worker(mesh), per_worker_outer),
          jax.tree.map(lambda _: rep, abstract_state.outer.per_fragment)))
  topology = Topology(
      mesh=mesh, local_mesh=local_mesh, hosts=hosts, local_hosts=local_hosts,
      hidden_per_worker=np.asarray([h.hidden for h in hosts for _ in h.worker_ids], np.int32))
  model = ModelSpec(name=(pretrained.source_of(c.model.init_from) if c.model.init_from
                          else c.model.name), cfg=model_cfg,
                    graphdef=graphdef, layout=layout, param_count=count_params(layout.abstract),
                    param_bytes=ledger.tree_bytes(layout.abstract), tier_bytes=tier_bytes,
                    eval_widths=widths,
                    frozen_count=count_params(frozen))
  # Workers whose data is corrupted on purpose (robust-aggregation tests and benchmarks).
  other = (other_corpus(c.data.corruption_path, c.data.tokenizer, window=c.data.seq_len + 1)
           if c.data.corrupt_workers and c.data.corruption == "other_text" else None)
  corrupt = {w: (c.data.corruption, c.data.corruption_prob, corpus.vocab_size, other)
             for w in c.data.corrupt_workers}
  data = RunData(
      streams=[WorkerStreams(corpus.train, worker_ids=hosts[i].worker_ids,
                             seq_len=c.data.seq_len, batch_size=hosts[i].batch_size,
                             seed=c.seed, batch_mode=c.data.batch_mode,
                             vocab_size=window_vocab, corrupt=corrupt,
                             partitions=c.num_workers if c.data.partition == "contiguous"
                             else 0) for i in local_hosts],
      eval_windows=eval_windows(corpus.val, seq_len=c.data.seq_len,
                                batch_size=c.data.batch_size, num_batches=c.eval_batches,
                                seed=c.seed, vocab_size=window_vocab))
  accumulate = [program_cache.shared(steps.make_accumulate,
                                     loss_of(hosts[i].hidden, local_mesh),
                                     hidden=hosts[i].hidden, d_ff=model_cfg.d_ff,
                                     layout=layout, mesh=worker_mesh)
                for i in local_hosts] if collab else []
  programs = Programs(local=local_programs, syncs=syncs, init_workers=init_workers,
                      eval=program_cache.shared(
                          steps.make_eval_step,
                          tuple((m, loss_of(m, mesh))
                                for m in (hidden_units(model_cfg.d_ff, w) for w in widths)),
                          model_cfg.d_ff, layout),
                      accumulate=accumulate,
                      overlapped=steps.make_overlapped(syncs[0], local_programs[0][0],
                                                       reads_rules=worker_rule is not None,
                                                       reads_own=reads_own),
                      state_sync=(steps.make_state_sync(state_sync)
                                  if (state_sync := algorithm.state_sync(c)) else None))
  programs, init_fn, initial_params = program_cache.same_as_before(
      program_cache.key(c, model_cfg, windows), (programs, init_fn, initial_params))
  run = Run(config=c, algorithm=algorithm, topology=topology, model=model, data=data,
            state_spec=StateSpec(init=init_fn, initial_params=initial_params,
                                 abstract=abstract_state,
                                 shardings=state_shardings),
            programs=programs, sync=sync, outer_rules=rules,
            local_reads_rules=worker_rule is not None,
            local_reads_own=reads_own, worker_state_sync=state_sync,
            partitioner=lambda: partitioner(plan), frozen=frozen)
  # Nothing but a LoRA base is allocated yet: refuse in seconds, not at RESOURCE_EXHAUSTED.
  if check_memory:
    memory.check(run)
  return run
