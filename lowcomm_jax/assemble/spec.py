"""A run's typed pieces, as `build.build` assembles them: where its workers are (Topology),
the model's shapes (ModelSpec), the data (RunData), the global state's constructor and
shardings (StateSpec), the programs (Programs), and `Run`, which holds them and answers the
drivers' questions (tokens, signals, bytes, shapes). Nothing here builds or computes."""

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

from lowcomm_jax import algorithms
from lowcomm_jax.assemble import program_cache
from lowcomm_jax.programs import steps
from lowcomm_jax.data import WorkerStreams
from lowcomm_jax.assemble.hosts import HostSpec
from lowcomm_jax.run.metric_names import width_key
from lowcomm_jax.model import GPTConfig
from lowcomm_jax.model.tp import SyncPlan, count_all_reduces
from lowcomm_jax.parallel import ledger, mesh as mesh_lib
from lowcomm_jax.parallel.flat import ParamLayout
from lowcomm_jax.programs.sync import Sync


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
  # FFN widths the eval program evaluates, the full width first (build.eval_widths)
  eval_widths: tuple[float, ...] = (1.0,)


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
  # per local host, collaborative runs only (runtimes/spmd/collab.py): steps.make_accumulate
  accumulate: list[Callable] = dataclasses.field(default_factory=list)
  # a held sync + the next round's local steps (steps.make_overlapped): run where the
  # algorithm has a delayed sync and rounds.can_overlap allows it
  overlapped: Callable | None = None
  # (workers' inner-optimizer states [R, ...], parts) -> the same with those parts averaged
  # (state_average.make_state_sync), where the algorithm has a StateSync (DES-LOC)
  state_sync: Callable | None = None
  # per local host, per segment: its local program as (head, tail) (`make_local_segment`'s
  # `part`), or None where the segment has no mix inside it: the Ray runtime's peer form
  # runs the head while the last sync's collective does (Streaming's τ)
  local_halves: list[list] = dataclasses.field(default_factory=list)


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
  sync: Sync  # how the workers' Δ become the update (its codec, aggregation, attack)
  # per fragment: the algorithm's outer rule (inside the syncs; the Ray runtime's server
  # applies fragment 0's on its own)
  outer_rules: list = dataclasses.field(default_factory=list)
  # Local programs also read the outer rules' state (the algorithm has a worker rule).
  local_reads_rules: bool = False
  local_reads_own: bool = False  # local programs read their rows of the per-worker state
  # What of the workers' optimizer states is averaged, and before which rounds (the
  # algorithm's StateSync: DES-LOC's moments; None for the rest).
  worker_state_sync: algorithms.StateSync | None = None
  # Enter around compiling and running the run's programs (model/tp.py: GSPMD under TP).
  partitioner: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
  # Weights every program reads and none trains (a LoRA run's base, replicated on the mesh);
  # passed as an argument (assemble/jitted.Bound binds it), never compiled in as a constant.
  frozen: Any = ()
  _placed: dict = dataclasses.field(default_factory=dict)
  _state_bytes: dict = dataclasses.field(default_factory=dict)  # parts -> CommBytes

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
    return steps.local_input(state, self.local_reads_rules, self.local_reads_own)

  def local_view(self, state: steps.TrainState) -> steps.TrainState:
    """`local_input` on this process's mesh, without a copy: the replicated parts as they
    are, the per-worker outer state (where read) as this process's rows."""
    view = self.local_input(state)
    mesh = self.topology.local_mesh
    if not self.local_reads_own:
      return mesh_lib.local_view(view, mesh)
    own = mesh_lib.to_local(view.outer.per_worker, mesh)
    view = mesh_lib.local_view(view._replace(outer=view.outer._replace(per_worker=())), mesh)
    return view._replace(outer=view.outer._replace(per_worker=own))

  def host_view(self, view: steps.TrainState, k: int) -> steps.TrainState:
    """`local_view` for this process's k-th host: its workers' rows of the per-worker state."""
    local = self.topology.local_hosts
    if not self.local_reads_own or len(local) == 1:
      return view
    sizes = [len(self.topology.hosts[i].worker_ids) for i in local]
    start = sum(sizes[:k])
    rows = jax.tree.map(lambda x: x[start:start + sizes[k]], view.outer.per_worker)
    return view._replace(outer=view.outer._replace(per_worker=rows))

  def evaluation(self, losses_W) -> dict[str, float]:
    """The eval program's losses (one per width of model.eval_widths, full width first) as
    metric rows: eval_loss, and eval_loss/tier_<w> for every width where a run evaluates
    more than the full width."""
    losses = [float(x) for x in np.asarray(losses_W).reshape(-1)]
    out = {"eval_loss": losses[0]}
    if len(self.model.eval_widths) > 1:
      out.update({width_key(w): x for w, x in zip(self.model.eval_widths, losses)})
    return out

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
    (nothing runs). Traced without metrics: a round's training traffic, not what rounds that
    log add to evaluate (NoLoCo's consensus θ)."""
    out = []
    for segment, sync in zip(self.segments(self.config.inner_steps), self.programs.syncs):
      deltas, signals = self.abstract_sync_inputs(segment.sync)
      with jax.set_mesh(self.topology.mesh):  # a per-device sync maps over its 'replica'
        out.append(program_cache.counted(sync, lambda f: ledger.count_bytes(
            functools.partial(f, metrics=False), self.state_spec.abstract, deltas, signals)))
    return out

  def outer_bytes(self) -> ledger.CommBytes:
    """Per-worker bytes of one round's syncs."""
    return sum(self.sync_bytes(), ledger.CommBytes())

  def state_sync_due(self, completed_rounds: int) -> tuple[str, ...]:
    """The parts of the workers' optimizer states averaged before the round after
    `completed_rounds` rounds (algorithms.base.StateSync; () without one)."""
    sync = self.worker_state_sync
    return sync.due(completed_rounds) if sync is not None else ()

  def state_sync_bytes(self, parts: tuple[str, ...]) -> ledger.CommBytes:
    """Per-worker bytes of averaging `parts` of every worker's optimizer state (traced)."""
    if not parts:
      return ledger.CommBytes()
    if parts not in self._state_bytes:
      r = self.config.num_workers
      opt_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct((r,) + x.shape[1:], x.dtype),
                               self.abstract_workers()[0].opt_state)
      with jax.set_mesh(self.topology.mesh):
        self._state_bytes[parts] = ledger.count_bytes(
            functools.partial(self.programs.state_sync, parts=parts), opt_state)
    return self._state_bytes[parts]

  def state_bytes_through(self, rounds: int) -> ledger.CommBytes:
    """Per-worker bytes of the optimizer-state averages before rounds 2..`rounds` (DES-LOC;
    nothing for the other algorithms)."""
    total = ledger.CommBytes()
    if self.worker_state_sync is None:
      return total
    for completed in range(1, rounds):  # DES-LOC's rounds are few: one H each
      total = total + self.state_sync_bytes(self.state_sync_due(completed))
    return total

  def bytes_through(self, rounds: int, round_bytes: ledger.CommBytes | None = None
                    ) -> ledger.CommBytes:
    """Per-worker bytes of the first `rounds` rounds: their syncs (`round_bytes` a round, if
    the caller has them), and the optimizer-state averages before rounds 2..`rounds`."""
    per_round = round_bytes if round_bytes is not None else self.outer_bytes()
    return per_round * rounds + self.state_bytes_through(rounds)

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
