"""What an algorithm is, to the rest of the code: the declarations below, nothing else.

A round of a synchronous algorithm is a list of segments. In a segment every worker takes
some local steps from its own persistent parameters θ_w, then one fragment of the model is
synchronized: the workers' pseudo-gradients Δ_w,p = θ_p − θ_w,p on that fragment are
aggregated and the fragment's outer rule moves θ_p. The new θ_p reaches the workers
`mix_at` steps into the next segment that names it in `mix`, as
θ_w,p ← θ_p + α·(θ_w,p − θ_p) (α = 0: replaced). DiLoCo is one segment of H steps, a sync
of the whole model and θ_w ← θ at the start of the next round; DDP is one gradient at θ.

The simulator asks the same object for its schedule (when jobs run and messages travel)
and, for asynchronous algorithms, the rules of its parameter servers.
"""

import dataclasses
from typing import Any, Protocol

import jax
import ml_collections
import optax

from lowcomm_jax.errors import field_problem  # noqa: F401 - the algorithms' form
from lowcomm_jax.programs.steps import Segment  # noqa: F401 - what an algorithm declares
from lowcomm_jax.programs.sync import Sync


class WorkerRule(Protocol):
  """Where a worker starts each round and what it sends, for algorithms whose workers do not
  simply start from θ (eager updates, NoLoCo). Flat vectors; `memory` is the worker's own
  state (steps.WorkerState.memory), `rule_state` the fragment's outer rule state
  (replicated), `sync_state` the worker's own row of the sync's per-worker state where
  `reads_sync_state` (NoLoCo's φ_w; () otherwise). `swaps_with_a_peer`: its sync is a
  swap with one peer a round that each worker can run with its peer alone
  (`Sync.partners`): the Ray runtime then runs it among the workers."""
  reads_sync_state: bool = False
  swaps_with_a_peer: bool = False

  def init(self, flat_params: jax.Array) -> Any:
    """A fresh worker's memory."""

  def start(self, flat_params: jax.Array, rule_state, memory, sync_state) -> jax.Array:
    """The parameters the worker's round starts from."""

  def finish(self, start: jax.Array, trained: jax.Array, memory) -> tuple[jax.Array, Any]:
    """(Δ_w it sends, its new memory) after the round's steps took it from `start` to
    `trained`."""


class StateSync(Protocol):
  """What of each worker's own inner-optimizer state is averaged over the workers, and
  before which rounds (DES-LOC's Adam moments). Parts are names the algorithm defines."""

  def due(self, completed_rounds: int) -> tuple[str, ...]:
    """The parts averaged before the round that follows `completed_rounds` rounds."""

  def average(self, opt_state, parts: tuple[str, ...], axis_name: str):
    """One worker's `opt_state` with `parts` replaced by their mean over `axis_name`
    (through parallel/collectives.py, so the byte ledger counts it)."""

  def take(self, opt_state, parts: tuple[str, ...]):
    """`parts` of `opt_state`, a tree (what a worker sends where a server averages them:
    the Ray runtime)."""

  def put(self, opt_state, parts: tuple[str, ...], values):
    """`opt_state` with `parts` replaced by `values` (a tree as `take` gives)."""


@dataclasses.dataclass(frozen=True)
class ExchangeRule:
  """How an algorithm's regional servers exchange with the global one (HALoS): each pushes
  its change once `sync_every` updates are unsent and merges the global model back with
  weight `merge_alpha`. The simulator's schedule and the Ray runtime's regional servers both
  read it (`Algorithm.exchange_rule`), so neither knows which algorithm declared it."""
  sync_every: int
  merge_alpha: float

  def due(self, unsent: int, finished: bool) -> bool:
    """Whether a regional server pushes now: `sync_every` updates unsent, or, once the
    budget is spent and its workers are done (`finished`), whatever it has left."""
    return unsent >= self.sync_every or (finished and unsent > 0)


class Algorithm:
  """Base: synchronous, one fragment, local steps from θ_w reset to θ every round."""
  name = ""
  summary = ""  # one line: what it does (its description; the registry lists the names)
  # not on the lockstep runtime (asynchronous servers: the simulator and Ray run them)
  simulated_only = False
  # Rounds end in a sync every worker joins (attacks and robust rules act there); False:
  # parameter servers take one contribution at a time.
  synchronous = True
  # Its sync may gather the workers' Δ and combine them by a robust rule or signal weights
  # (aggregate/robust.py); False where contributions are combined its own way.
  robust_aggregation = True
  local_steps = True  # False: the local program is one gradient at θ (DDP)
  # Its simulator schedule can time the Ray runtime's parameter server
  # (collective_form='server'): rounds of one sync, or asynchronous pushes.
  server_schedule = True
  # Its own config fields, c.<section>.*, if any: `config_defaults` declares them, each
  # with its default and a trailing comment on what it means (config/doc.py prints it).
  config_section = None
  # The sync's new θ (and what local programs read of the outer state) does not depend on
  # its own aggregate, only on earlier ones: the runner may run a round's sync inside the
  # next round's program, its collective beside the local steps (rounds.can_overlap).
  delayed_sync = False
  # Its servers are regional (sim.network.regions / worker_regions place the workers), so
  # those fields matter outside the simulator too (on Ray).
  regional_servers = False

  def config_defaults(self) -> ml_collections.ConfigDict:
    """Its `config_section`'s fields at their defaults (config/defaults.py puts them in
    every config)."""
    raise NotImplementedError(f"{self.name} declares config_section but no defaults")

  def problems(self, c: ml_collections.ConfigDict) -> list[str]:
    """This algorithm's own config problems, each 'field=value: fix'."""
    return []

  def partial_rounds(self, c: ml_collections.ConfigDict) -> bool:
    """Whether a round may close without some live workers (Ray's `ray.min_quorum`; every
    algorithm runs on Ray from these declarations: asynchronous ones as their
    `server_rules` applied per push, synchronous ones as quorum rounds of their
    `segments`, runtimes/ray/quorum.py): a late
    Δ then folds into the next round's sync, which must sync the same fragment (one
    segment); its job must not have read an outer state the server no longer holds (no
    worker rule), nor miss an average of the workers' states (no state sync)."""
    return (len(self.segments(c, c.inner_steps)) == 1 and self.worker_rule(c) is None
            and self.state_sync(c) is None)

  def leaf_fragments(self, c: ml_collections.ConfigDict, abstract_params) -> tuple[int, ...] | None:
    """Each parameter leaf's fragment (tree order), or None: the whole model is one."""
    return None

  def segments(self, c: ml_collections.ConfigDict, inner_steps: int) -> list[Segment]:
    """One round of a host taking `inner_steps` local steps."""
    return [Segment(start=0, steps=inner_steps, sync=0, mix=0, mix_at=0)]

  def mix(self, c: ml_collections.ConfigDict) -> float:
    """α: the weight a worker keeps on its own fragment when a new global one arrives."""
    return 0.0

  def progress(self, c: ml_collections.ConfigDict) -> str:
    """How a run of it moves from mark to mark, which picks each runtime's driver:
    'rounds' (synchronous rounds of its segments), 'pushes' (asynchronous: each contribution
    applied as it arrives) or 'epochs' (collaborative epochs: micro-batches until a target
    batch, then one step; DDP's, runtimes/spmd/collab.py and runtimes/ray/epochs.py)."""
    return "rounds" if self.synchronous else "pushes"

  def keeps_worker_params(self, c: ml_collections.ConfigDict) -> bool:
    """Whether θ_w must outlive a round. Not when a round is one segment whose sync lands at
    its step 0 unmixed: θ_w ← θ as every round starts (DiLoCo), so keeping it would only
    cost a model per worker in memory and checkpoints."""
    segments = self.segments(c, c.inner_steps)
    return self.local_steps and not (len(segments) == 1 and segments[0].mix_at == 0
                                     and self.mix(c) == 0.0)

  def sync(self, c: ml_collections.ConfigDict, hosts, d_ff: int) -> Sync:
    """How the workers' Δ become each fragment's update (programs/sync.py): built once per run,
    asked by the runner's programs, the simulator's plan and its servers. The default chooses
    from the config (aggregate.*, compress.*, attack.*)."""
    return Sync(c, hosts, d_ff)

  def outer_rule(self, c: ml_collections.ConfigDict, inner_tx: optax.GradientTransformation,
                 layout) -> optax.GradientTransformation:
    """The synchronous outer rule on the aggregated Δ of one fragment (flat, `layout` is the
    fragment's); its state is the fragment's own."""
    raise NotImplementedError

  def worker_rule(self, c: ml_collections.ConfigDict) -> WorkerRule | None:
    """The workers' own start and contribution (one segment, full width), or None."""
    return None

  def state_sync(self, c: ml_collections.ConfigDict) -> StateSync | None:
    """Whether, and when, the workers' inner-optimizer states are averaged (None: never;
    each worker keeps its own, as DiLoCo's do)."""
    return None

  def schedule(self, plan, backend):
    """The simulator's schedule (lowcomm_jax/sim/sync_schedules.py, async_schedules.py)."""
    from lowcomm_jax.sim.sync_schedules import SyncRounds
    return SyncRounds(plan, backend)

  def server_rules(self, c: ml_collections.ConfigDict,
                   plan) -> dict[str, optax.GradientTransformation]:
    """Asynchronous parameter servers' rules by server name; {}: synchronous."""
    return {}

  def exchange_rule(self, c: ml_collections.ConfigDict) -> ExchangeRule | None:
    """Where `regional_servers`: when and how they exchange with the global one."""
    del c
    return None
