"""Assembling a run from its config: mesh, data, model, hosts, optimizers, step functions.

`build(config)` validates the config and does everything but compute; rounds.py jits the
programs and runs them.
"""

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from lowcomm_jax import algorithms, config_check, memory, optimizers, program_cache, steps
from lowcomm_jax.data import (WorkerStreams, eval_windows, open_corpus, other_corpus,
                              probe_windows)
from lowcomm_jax.hosts import HostSpec, host_table
from lowcomm_jax.model import GPT, GPTConfig, count_params, get_preset
from lowcomm_jax.model import lora, pretrained
from lowcomm_jax.model.matformer import slice_tier
from lowcomm_jax.model.objective import loss_fn_of
from lowcomm_jax.model.tp import SyncPlan, count_all_reduces, partitioner
from lowcomm_jax.parallel import ledger, mesh as mesh_lib
from lowcomm_jax.parallel.flat import ParamLayout


@dataclasses.dataclass(frozen=True)
class Topology:
  """Where a run's workers are: the meshes, the host table and which hosts this process runs."""
  mesh: jax.sharding.Mesh  # global: every process's devices
  local_mesh: jax.sharding.Mesh  # this process's devices (== mesh in a single process)
  hosts: list[HostSpec]  # all of them
  local_hosts: list[int]  # indices of the hosts this process runs
  hidden_per_worker: np.ndarray  # [R] FFN hidden units each worker trains


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """The model's shapes and sizes (nothing allocated)."""
  name: str  # the preset's name, or what model.init_from read ("gguf:<path>", …)
  cfg: GPTConfig
  graphdef: nnx.GraphDef
  layout: ParamLayout  # the flat θ's tree view and fragments (abstract tree: layout.abstract)
  param_count: int
  param_bytes: int
  tier_bytes: dict[float, dict[str, int]]  # per tier: parameter and optimizer bytes per worker
  frozen_count: int = 0  # parameters of the frozen base (LoRA), beside the trained ones


@dataclasses.dataclass(frozen=True)
class RunData:
  """This process's training streams and the shared evaluation windows."""
  streams: list[WorkerStreams]  # per local host
  eval_windows: np.ndarray


@dataclasses.dataclass(frozen=True)
class StateSpec:
  """The global state's constructor, shapes and shardings."""
  init: Callable[[jax.Array], steps.TrainState]  # from the initial flat θ
  initial_params: Callable[[], jax.Array]  # θ_0: the seeded random init or the pretrained
  abstract: steps.TrainState
  shardings: steps.TrainState


@dataclasses.dataclass(frozen=True)
class Programs:
  """A run's programs, as built (pure functions) or jitted (`jitted_steps`)."""
  # per local host, per segment of the round: steps.make_local_segment
  local: list[list[Callable]]
  # per segment: (state, Δ of its fragment, signals, metrics) -> (state, metrics)
  syncs: list[Callable]
  init_workers: list[Callable]  # per local host: flat θ -> its WorkerState [G, ...]
  eval: Callable[[jax.Array, jax.Array], jax.Array]  # (flat θ, windows) -> loss
  # per local host, collaborative runs only (collab.py): steps.make_accumulate
  accumulate: list[Callable] = dataclasses.field(default_factory=list)
  # a held sync + the next round's local steps (steps.make_overlapped): run where the
  # algorithm has a delayed sync and rounds.can_overlap allows it
  overlapped: Callable | None = None


@dataclasses.dataclass
class Run:
  """Everything built from the config before the first round, in typed pieces, and the
  questions the drivers ask of them (tokens, signals, bytes, shapes)."""
  config: ml_collections.ConfigDict
  algorithm: algorithms.Algorithm
  topology: Topology
  model: ModelSpec
  data: RunData
  state_spec: StateSpec  # (the state itself is the drivers': steps.TrainState)
  programs: Programs
  # Local programs also read the outer rules' state (the algorithm has a worker rule).
  local_reads_rules: bool = False
  # Enter around compiling and running the run's programs (model/tp.py: GSPMD under TP).
  partitioner: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
  # Weights every program reads and none trains (a LoRA run's base, replicated on the mesh);
  # passed as an argument (rounds.Bound binds it), never compiled in as a constant.
  frozen: Any = ()
  _placed: dict = dataclasses.field(default_factory=dict)

  def replicated_input(self, x: np.ndarray) -> jax.Array:
    """`x` as a global replicated array, placed once per distinct value.

    Placing host data on a multi-process mesh checks that every process passed the same
    value — an all-gather. Paid every round, it was most of the outer step's overhead.
    """
    x = np.asarray(x)
    key = (x.dtype.str, x.shape, x.tobytes())
    if key not in self._placed:
      self._placed[key] = jax.device_put(x, mesh_lib.replicated(self.topology.mesh))
    return self._placed[key]

  def local_input(self, state: steps.TrainState) -> steps.TrainState:
    """What a local program reads of the global state (steps.local_input)."""
    return steps.local_input(state, self.local_reads_rules)

  def tokens(self, inner_steps: int, host: int = 0) -> int:
    """Tokens in `inner_steps` inner steps of workers of host `host` (the one way both
    drivers count them)."""
    return inner_steps * self.topology.hosts[host].batch_size * self.config.data.seq_len

  def round_tokens(self, inner_steps_per_host) -> list[int]:
    """Tokens each host's workers process in a round with these H."""
    return [len(h.worker_ids) * self.tokens(H, i)
            for i, (h, H) in enumerate(zip(self.topology.hosts, inner_steps_per_host))]

  def segments(self, inner_steps: int) -> list[algorithms.Segment]:
    """The segments of a round of a host taking `inner_steps` steps."""
    return self.algorithm.segments(self.config, inner_steps)

  def signals(self, segment_steps_per_host, losses_R=None) -> steps.Signals:
    """Every worker's signals for a sync after these steps per host (tokens as float32);
    `losses_R` the workers' train losses (zeros when the sync reports none)."""
    per_worker = [self.tokens(s, i) for i, s in enumerate(segment_steps_per_host)]
    tokens = np.asarray([t for h, t in zip(self.topology.hosts, per_worker) for _ in h.worker_ids],
                        np.float32)
    if losses_R is None:
      losses_R = self.replicated_input(np.zeros((self.config.num_workers,), np.float32))
    return steps.Signals(self.replicated_input(self.topology.hidden_per_worker),
                         self.replicated_input(tokens), losses_R)

  def abstract_sync_inputs(self, fragment: int):
    """Shapes (with shardings) of fragment `fragment`'s sync inputs: Δ and the signals."""
    sharding = mesh_lib.per_worker(self.topology.mesh)
    start, end = (self.model.layout.bounds[fragment] if self.model.layout.bounds
                  else (0, self.model.layout.size))
    r = self.config.num_workers
    deltas = jax.ShapeDtypeStruct((r, end - start), self.state_spec.abstract.params.dtype,
                                  sharding=sharding)
    rep = mesh_lib.replicated(self.topology.mesh)
    signals = steps.Signals(jax.ShapeDtypeStruct((r,), jnp.int32, sharding=rep),
                            jax.ShapeDtypeStruct((r,), jnp.float32, sharding=rep),
                            jax.ShapeDtypeStruct((r,), jnp.float32, sharding=sharding))
    return deltas, signals

  def sync_bytes(self) -> list[ledger.CommBytes]:
    """Per-worker bytes of each sync of a round (one per segment), from tracing them
    (nothing runs)."""
    out = []
    for segment, sync in zip(self.segments(self.config.inner_steps), self.programs.syncs):
      deltas, signals = self.abstract_sync_inputs(segment.sync)
      out.append(program_cache.counted(sync, lambda f: ledger.count_bytes(
          f, self.state_spec.abstract, deltas, signals)))
    return out

  def outer_bytes(self) -> ledger.CommBytes:
    """Per-worker bytes of one round's syncs."""
    return sum(self.sync_bytes(), ledger.CommBytes())

  def tp_counts(self) -> dict:
    """Tensor parallelism's sync points per forward, and the collectives of one inner step
    read from the compiled local program of this process's first host (H steps are a scan:
    its body holds one step's collectives once). Empty without TP."""
    tp = self.config.model.tp
    if tp.size <= 1:
      return {}
    plan = SyncPlan(tp.sync, tp.layers_per_group, tuple(tp.attn_sync_layers))
    host = self.topology.hosts[self.topology.local_hosts[0]]
    workers = len(host.worker_ids)
    segment = self.segments(host.inner_steps)[0]
    batches = jax.ShapeDtypeStruct(
        (workers, segment.steps, host.batch_size, self.config.data.seq_len + 1), jnp.int32)
    ids = jax.ShapeDtypeStruct((workers,), jnp.int32)
    with jax.set_mesh(self.topology.local_mesh), self.partitioner():
      hlo = jax.jit(self.programs.local[0][0]).lower(
          self.local_input(self.state_spec.abstract), self.abstract_workers()[0],
          batches, ids).compile().as_text()
    return {"tp_syncs_forward": plan.syncs_forward(self.model.cfg.n_layer,
                                                   self.model.cfg.parallel_residual),
            "tp_allreduces_train_step": count_all_reduces(hlo),
            # Parameters stay replicated over 'model': the sharded leaves' gradients are
            # gathered before the (replicated) optimizer update.
            "tp_allgathers_train_step": hlo.count(" all-gather(") + hlo.count(
                " all-gather-start(")}

  def abstract_workers(self):
    """Shapes and shardings of this process's worker states (for restoring them)."""
    sharding = mesh_lib.per_worker(self.topology.local_mesh)
    params = self.state_spec.abstract.params
    return tuple(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                              jax.eval_shape(f, params)) for f in self.programs.init_workers)


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


def build(config: ml_collections.ConfigDict) -> Run:
  """Validates the config, loads data, builds the model and the step functions (no compute)."""
  nproc = jax.process_count()
  config_check.validate(config, num_devices=jax.device_count(), num_processes=nproc,
                        local_devices=jax.local_device_count())
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
  corpus.check_vocabulary(model_cfg.vocab_size)
  # Token files are read window by window: each is checked against the vocabulary too.
  window_vocab = model_cfg.vocab_size if corpus.files is not None else None
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
  # A collaborative epoch weighs each worker's mean gradient by its samples.
  collab = c.collab.target_batch_size > 0
  nested = collab or optimizers.needs_nested_mean(c, hosts, model_cfg.d_ff)
  fragments = range(layout.num_fragments)
  # Each fragment has its own aggregator (a codec's error buffers) and outer rule state.
  aggregators = [optimizers.aggregator(c, layout.fragment(p), nested=nested) for p in fragments]
  rules = [algorithm.outer_rule(c, inner_txs[0], layout.fragment(p)) for p in fragments]
  windows = None  # data compiled into the programs (the probe batch)
  if optimizers.robust_combination(c):  # the all-gathered Δ are combined before the rule
    probes = [None] * layout.num_fragments
    if c.aggregate.signal == "probe_loss":  # every receiver scores each worker's proposal
      windows = probe_windows(corpus.train, seq_len=c.data.seq_len,
                              batch_size=c.aggregate.probe_batch_size, seed=c.seed,
                              vocab_size=window_vocab)
      step = optimizers.probe_step(c, algorithm.local_steps)
      # The plain model (no TP plan): the probe runs inside the sync, replicated over 'model'.
      probe_loss = loss_fn_of(graphdef, model_cfg, None, mesh)
      probes = [steps.make_probe(probe_loss, layout, p, windows, step) for p in fragments]
    rules = [optimizers.robust_rule(c, rule, probe) for rule, probe in zip(rules, probes)]
  segments = algorithm.segments(c, c.inner_steps)
  attack = steps.make_attack(tuple(c.attack.workers), c.attack.kind, c.attack.scale,
                             c.num_workers)
  syncs = [steps.make_sync(aggregators[s.sync], rules[s.sync], nested=nested,
                           weigh_tokens=collab or c.aggregate.weighting == "tokens",
                           layout=layout,
                           fragment=s.sync, count=len(segments), last=k == len(segments) - 1,
                           attack=attack)
           for k, s in enumerate(segments)]
  alpha = algorithm.mix(c)
  keeps_params = algorithm.keeps_worker_params(c)
  worker_rule = algorithm.worker_rule(c)
  local_programs = [
      [program_cache.shared(
          steps.make_local_segment, loss_of(hosts[i].hidden, local_mesh),
          inner_tx=inner_txs[i], hidden=hosts[i].hidden, d_ff=model_cfg.d_ff, layout=layout,
          segment=s, index=k, count=len(segments), alpha=alpha,
          local_steps=algorithm.local_steps, keeps_params=keeps_params,
          worker_rule=worker_rule)
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
                                     layout=layout)
                for i in local_hosts] if collab else []
  programs = Programs(local=local_programs, syncs=syncs, init_workers=init_workers,
                      eval=program_cache.shared(steps.make_eval_step,
                                                loss_of(model_cfg.d_ff, mesh), layout),
                      accumulate=accumulate,
                      overlapped=steps.make_overlapped(syncs[0], local_programs[0][0],
                                                       reads_rules=worker_rule is not None))
  programs, init_fn, initial_params = program_cache.same_as_before(
      program_cache.key(c, model_cfg, windows), (programs, init_fn, initial_params))
  run = Run(config=c, algorithm=algorithm, topology=topology, model=model, data=data,
            state_spec=StateSpec(init=init_fn, initial_params=initial_params,
                                 abstract=abstract_state,
                                 shardings=state_shardings),
            programs=programs, local_reads_rules=worker_rule is not None,
            partitioner=lambda: partitioner(plan), frozen=frozen)
  # Nothing but a LoRA base is allocated yet: refuse in seconds, not at RESOURCE_EXHAUSTED.
  memory.check(run)
  return run
