"""NoLoCo (Kolehmainen et al. 2025, "NoLoCo: No-all-reduce Low Communication Training Method
for Large Models", arXiv 2506.10911): DiLoCo without the all-reduce. Every worker i keeps
its own outer weights φ_i and momentum δ_i. After its H inner steps from φ_i it meets one
random peer (a group G of 2, new every round). With Δ_j = φ_j − θ_j (its pseudo-gradient,
θ_j its weights after the inner steps), α = outer.momentum and β = γ = outer.lr, each applies

    δ_i ← α·δ_i − β·mean_{j∈G} Δ_j − γ·(φ_i − mean_{j∈G} φ_j)
    φ_i ← φ_i + δ_i

The last term pulls the replicas together: it is what keeps them aligned without a global
average. Read from the authors' code (github.com/jkolehm/noloco, src/noloco/
sparse_optimizer_c.py: groups from a random permutation per outer step, both means over the
group, γ = β; it sends φ_j and Δ_j); the paper's html was read only to its abstract.
Heavy-ball momentum as there, not DiLoCo's Nesterov. With γ = β the two means combine:
β·mean Δ_j + β·(φ_i − mean φ_j) = β·(φ_i − mean θ_j), so the peers exchange θ_j alone,
half the bytes (the same maths; the rounding of the sum differs).

Here: φ_i and δ_i are the sync's per-worker state (checkpointed with it, split over the
'replica' devices); workers start each round from their own φ_i (`NoLoCoWorkers`). The
exchange is one collective-permute per round (θ_j to and from the peer), never an
all-reduce: ledger.CommBytes(sent=N, received=N) per worker for N float32 parameters, as
much as DiLoCo's all-reduce counts.
Peers come from a pool of `POOL` random pairings drawn from the seed (a permute's pairs are
fixed when the program compiles), one drawn per round from the round key. θ is the
replicas' mean, computed only on rounds that log, evaluate or checkpoint (an all-reduce for
evaluation, outside the ledger's training bytes); no worker reads it. In the simulator a
pair waits for its own slower member and their swap over the link between their regions,
not for the slowest worker (sim/sync_schedules.GossipRounds); the math is the runner's sync.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowcomm_jax import compress
from lowcomm_jax.algorithms.base import Algorithm, field_problem
from lowcomm_jax.parallel import collectives, workers
from lowcomm_jax.programs.sync import Sync

GROUP = 2  # a worker and one random peer
POOL = 8  # random pairings compiled into the sync; one is drawn per round


class NoLoCoState(NamedTuple):
  phi: jax.Array  # φ_i: this worker's outer weights (flat fragment)
  momentum: jax.Array  # δ_i


def pairings(num_workers: int, seed: int, pool: int = POOL) -> list[list[tuple[int, int]]]:
  """`pool` random partitions of the workers into pairs, each as the (source, destination)
  list of one permute that swaps every pair."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(pool):
    order = [int(w) for w in rng.permutation(num_workers)]
    pairs = []
    for a, b in zip(order[0::2], order[1::2]):
      pairs += [(a, b), (b, a)]
    out.append(pairs)
  return out


def drawn_pairing(seed: int, round_index, pool: int = POOL):
  """Which of the pool's pairings round `round_index` uses (the same on every worker)."""
  return jax.random.randint(jax.random.fold_in(jax.random.key(seed), round_index), (), 0, pool)


def peers(pools: list, seed: int, round_index: int) -> list[int]:
  """Each worker's peer in round `round_index`, from the pool of `pairings` (the simulator's
  schedule asks)."""
  pairs = pools[int(drawn_pairing(seed, round_index, len(pools)))]
  return [dst for _, dst in sorted(pairs)]


def gossip(num_workers: int, lr: float, momentum: float, seed: int,
           axis_name=workers.PER_DEVICE) -> optax.GradientTransformationExtraArgs:
  """The per-worker outer step above, as an aggregator: `update(Δ_i, state_i, θ,
  round_index=t)` returns (a zero update of θ, the worker's new (φ_i, δ_i))."""
  pools = pairings(num_workers, seed)

  def init_fn(params):
    return NoLoCoState(params, jnp.zeros_like(params))

  def update_fn(delta, state, params=None, *, round_index=None, **extra_args):
    del extra_args
    draw = drawn_pairing(seed, round_index, len(pools))
    trained = state.phi - delta  # θ_i: where the worker's inner steps took it
    new = pair_step(state, trained, collectives.permute(trained, axis_name, pools, draw),
                    lr, momentum)
    # θ is not moved here (`Sync.consensus` sets it on rounds that read it); the zero derives
    # from θ, not from per-worker state, so it leaves the map unmapped.
    return jnp.zeros_like(params), new

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def pair_step(state: NoLoCoState, trained, peer_trained, lr: float,
              momentum: float) -> NoLoCoState:
  """One worker's outer step from its own θ_i (`trained`) and its peer's θ_j."""
  pair_mean = (trained + peer_trained) / GROUP
  step = momentum * state.momentum - lr * (state.phi - pair_mean)
  return NoLoCoState(state.phi + step, step)


class GossipSync(Sync):
  """NoLoCo's sync: the gossip as the aggregator, each device mapping its own worker (a
  permute's peers are devices), θ the replicas' mean when asked."""

  def aggregator(self, layout):
    c = self.config
    return gossip(c.num_workers, c.outer.lr, c.outer.momentum, c.seed)

  def consensus(self, per_worker_state: NoLoCoState) -> jax.Array:
    return per_worker_state.phi.mean(axis=0)

  def partners(self, round_index: int) -> list[int]:
    c = self.config
    return peers(pairings(c.num_workers, c.seed), c.seed, round_index)

  def swap_payload(self, own: NoLoCoState, delta):
    return own.phi - delta  # θ_i (γ = β: the pair's means combine into one of θ)

  def swap_step(self, own: NoLoCoState, mine, theirs) -> NoLoCoState:
    """A present worker whose peer sent nothing keeps its own model (`fill_absent`):
    `theirs` is then `mine`."""
    c = self.config
    return pair_step(own, mine, theirs, c.outer.lr, c.outer.momentum)

  def fill_absent(self, deltas_RxN, present, per_worker_state, round_index: int):
    """A worker whose peer sent nothing keeps its own model that round: the absent peer's
    row is made to arrive where the present worker's steps took it (θ_j = θ_i, so the pair
    mean is θ_i)."""
    c = self.config
    peer = peers(pairings(len(present), c.seed), c.seed, round_index)
    phi = np.asarray(per_worker_state.phi)
    out = np.array(deltas_RxN)
    for j in np.flatnonzero(~np.asarray(present)):
      i = peer[j]
      if present[i]:
        out[j] = phi[j] - (phi[i] - out[i])
    return out

  def place(self, replica_devices):
    self.per_device = True  # a permute's peers are devices (or, on one, vmapped workers)
    per_device = self.config.num_workers // replica_devices
    if replica_devices > 1 and per_device > 1:  # collectives.permute: one axis or the other
      return [field_problem(self.config, "num_workers", f"NoLoCo's peers swap models device "
                            f"to device: {per_device} workers on each of {replica_devices} "
                            "devices cannot; use one worker per device, or every worker on "
                            "one device (--config.mesh.replica=1)")]
    return []


class NoLoCoWorkers:
  """algorithms.base.WorkerRule: each worker starts from its own φ_i and sends its drift."""
  reads_sync_state = True
  swaps_with_a_peer = True  # (GossipSync.partners)

  def init(self, flat_params):
    return ()

  def start(self, flat_params, rule_state, memory, sync_state: NoLoCoState):
    return sync_state.phi

  def finish(self, start, trained, memory):
    return start - trained, memory


class NoLoCo(Algorithm):
  name = "noloco"
  server_schedule = False  # (its simulator schedule has no parameter server's form)
  summary = ("DiLoCo without the all-reduce: each worker keeps its own outer weights and "
             "momentum and averages with one random peer per round")
  robust_aggregation = False  # no gather: each worker sees one peer

  def problems(self, c):
    out = []
    if c.num_workers < GROUP or c.num_workers % GROUP:
      out.append(field_problem(c, "num_workers", f"NoLoCo pairs the workers: use an even "
                               f"number >= {GROUP}"))
    if any(row.get("tier", 1.0) != 1.0 for row in c.hosts):
      out.append(field_problem(c, "hosts", "NoLoCo's peers average whole models; use "
                               "full-width hosts (tier 1.0)"))
    if compress.declared(c.compress.codec) is not None:
      out.append(field_problem(c, "compress.codec", "NoLoCo swaps trained models with a peer "
                               "as they are; use 'none'"))
    if c.aggregate.weighting != "uniform":
      out.append(field_problem(c, "aggregate.weighting", "NoLoCo's pair mean is unweighted; "
                               "use 'uniform'"))
    if c.collab.target_batch_size > 0:
      out.append(field_problem(c, "collab.target_batch_size", "collaborative epochs average "
                               "over every peer; use 0 with NoLoCo"))
    if c.model.tp.size != 1:
      out.append(field_problem(c, "model.tp.size", "NoLoCo's per-device sync runs without "
                               "tensor parallelism; use 1"))
    if c.outer.dylu:
      out.append(field_problem(c, "outer.dylu", "NoLoCo's rounds are lockstep pairs; use "
                               "False"))
    return out

  def keeps_worker_params(self, c) -> bool:
    return False  # φ_i lives in the sync's per-worker state

  def sync(self, c, hosts, d_ff) -> Sync:
    return GossipSync(c, hosts, d_ff)

  def outer_rule(self, c, inner_tx, layout) -> optax.GradientTransformation:
    return optax.identity()  # the step is the gossip's, per worker

  def worker_rule(self, c) -> NoLoCoWorkers:
    return NoLoCoWorkers()

  def schedule(self, plan, backend):
    from lowcomm_jax.sim.sync_schedules import GossipRounds
    seed = backend.config.seed
    pools = pairings(plan.num_workers, seed)
    return GossipRounds(plan, backend, lambda t: peers(pools, seed, t))


ALGORITHM = NoLoCo()
