"""A worker's replica of the global state in the peer form of quorum rounds
(`forms.among_workers`): θ, the outer rules' state and the version (syncs closed),
held by every worker as DiLoCo defines it, and what the worker computes in a round's
collective. Which of these steps run, in what order, and what crosses between members is
the collective form's (forms/: direct.py, hierarchical.py, pairs.py); here are the steps:

  shards:             its contribution from a version, cut into M shards
  reduce_shard(j):    the members' weighted mean of shard j (`make_shard_mean`)
  apply_reduced:      the outer rule on the whole mean, staged (`make_reduced_apply`)
  robust_statistics, robust_shard, robust_clip, apply_robust (robust_shards.py): a robust
                      rule shard by shard, from the rows' statistics added over the members
  scatter.pieces, scatter.reduce, scatter.apply (scatter_shards.py): a codec's payloads
                      reduce-scattered, each owner re-encoding its shard once
  sum_shard, divide_piece: a dense mean by region (a region's sums, the leaders' mean)
  apply_gathered:     the parameter server's own program over every member's row, staged
  swap_payload, apply_swap: a pair swap (`Sync.partners`: NoLoCo)
  advance:            a delayed sync's θ' before its collective (one-step delay, eager)
  commit:             the staged state becomes the replica's (once: a commit of a version
                      already applied is nothing)

Every member runs the same program on the same bytes, so θ' is the same everywhere; the
driver compares the hashes (`params_hash`) before any member commits.
"""

import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from lowcomm_jax.programs import state_average
from lowcomm_jax.programs import steps
from lowcomm_jax.programs import scatter_program, sync_program
from lowcomm_jax.runtimes.ray import catch_up
from lowcomm_jax.runtimes.ray.chaos import flip_one_bit
from lowcomm_jax.runtimes.ray.actors import (initial_rule_state, round_inputs, round_signals,
                                             round_syncs)
from lowcomm_jax.runtimes.ray.robust_shards import RobustShards
from lowcomm_jax.runtimes.ray.scatter_shards import ScatterShards
from lowcomm_jax.parallel.server_names import GLOBAL


def shard_bounds(n: int, members: int) -> list[tuple[int, int]]:
  """[start, end) of each of `members` shards of n coordinates (sizes differ by at most 1)."""
  return [(k * n // members, (k + 1) * n // members) for k in range(members)]


def flat(tree) -> np.ndarray:
  """A tree's leaves as one host vector (a state average's payload, cut into shards)."""
  return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


def unflat(vector: np.ndarray, like):
  """`flat`'s inverse: `vector` in the shapes and dtypes of `like`'s leaves."""
  leaves, tree = jax.tree.flatten(like)
  ends = np.cumsum([np.size(x) for x in leaves])[:-1]
  return jax.tree.unflatten(tree, [np.asarray(part).reshape(np.shape(x)).astype(np.asarray(x).dtype)
                                   for part, x in zip(np.split(vector, ends), leaves)])


def gathered_bytes(reduced, index: int) -> dict:
  """What member `index`'s link carries in a reduce-scatter and all-gather whose reduced
  shards are `reduced`: its shards to each other member and its reduced shard to each, the
  mirror in (shards differ in length by at most one coordinate)."""
  mine = reduced[index].nbytes
  both = int(sum(x.nbytes for x in reduced) - mine + mine * (len(reduced) - 1))
  return {"sent": both, "received": both}


def hierarchical_bytes(n: int, groups: list[list[int]], itemsize: int = 4) -> dict:
  """Each member's link bytes in the hierarchical reduce of an n-coordinate mean among
  `groups` (the members by region, each led by its first): inside each region a
  reduce-scatter (k shards) and the region's sums gathered at its leader; the leaders'
  reduce-scatter (G pieces) and all-gather; each leader's shards of the mean out to its
  region, and an all-gather there. Every phase has its mirror, so sent equals received."""
  piece = [b - a for a, b in shard_bounds(n, len(groups))]
  out = {}
  for h, group in enumerate(groups):
    k = len(group)
    shard = [b - a for a, b in shard_bounds(n, k)]
    for j, w in enumerate(group):
      own = shard[j]
      both = (n - own) + own * (k - 1)  # the region's reduce-scatter and all-gather
      if j == 0:  # the leader: its region's shards in, the leaders' exchange, shards out
        both += (n - own) + (n - piece[h]) + piece[h] * (len(groups) - 1)
      else:  # its shard of the region's sums to the leader; its shard of the mean back
        both += own
      out[w] = {"sent": both * itemsize, "received": both * itemsize}
  return out


def mean_rows(*rows: np.ndarray) -> np.ndarray:
  """The mean of the members' rows by the program the server's state average runs
  (state_average.rows_mean: coordinate by coordinate, so a shard of it is that mean's shard)."""
  return np.asarray(state_average.rows_mean(np.stack(rows)))


def params_hash(tree) -> str:
  """A fingerprint of `tree`'s leaves: xxh3-128 over their own buffers (no copy). It
  catches replicas that diverged by accident, not forgeries; blake2b over copies took
  ~10 ms a 12.5 MB θ, which W members sharing cores paid every round (BUILD_NOTES)."""
  import xxhash  # (here: the config checks import this module, without the ray extra)
  digest = xxhash.xxh3_128()
  for x in jax.tree.leaves(tree):
    digest.update(np.ascontiguousarray(np.asarray(x)).data)
  return digest.hexdigest()


def own_rows(outer, worker: int):
  """`outer` (the runner's whole outer state, a row per worker slot) with `worker`'s rows
  of its per-worker state alone (host arrays)."""
  return jax.device_get(outer._replace(per_worker=jax.tree.map(
      lambda x: x[worker:worker + 1], outer.per_worker)))


class Replica(RobustShards):
  """θ, the outer rules' state and the version one worker holds, what it contributed and
  has not seen applied yet, and the state a round staged."""

  def __init__(self, r, params0, worker: int):
    self.r, self.worker = r, worker
    segments = r.algorithm.segments(r.config, r.config.inner_steps)
    self.segments = len(segments)
    self._rng = steps.run_key(r.config.seed)
    layout = r.model.layout
    self.reduces = sync_program.peer_reduces(r.sync)
    self._gathered = round_syncs(r) if not self.reduces else None
    self._means = [jax.jit(sync_program.make_shard_mean(r.sync, layout=layout,
                                                        fragment=s.sync))
                   for s in segments] if self.reduces else None
    # a hierarchical reduce's pieces (`hierarchical_bytes`): a region's sums, their mean
    self._sums = [jax.jit(sync_program.make_shard_sum(r.sync, layout=layout, fragment=s.sync))
                  for s in segments] if self.reduces else None
    self._divides = [jax.jit(sync_program.make_shard_divide(r.sync, layout=layout,
                                                            fragment=s.sync))
                     for s in segments] if self.reduces else None
    self._applies = [jax.jit(sync_program.make_reduced_apply(
        r.sync, r.outer_rules[s.sync], layout=layout, fragment=s.sync, count=len(segments),
        last=k == len(segments) - 1), static_argnames="full")
        for k, s in enumerate(segments)] if self.reduces else None
    self._init_robust(r, segments)
    # a codec's payloads reduce-scattered (compress.reduce='scatter'): its steps, or None
    self.scatter = (ScatterShards(self, r, segments) if scatter_program.scatters(r.sync)
                    else None)
    self._lock = threading.Lock()  # a share (a checkpoint, a heal) reads while rounds run
    self._moved = threading.Condition(self._lock)  # the version moved (`wait_for`)
    params = jnp.asarray(params0)
    # A sync of pair swaps (`Sync.partners`: NoLoCo): the replica holds the worker's own row
    # of the sync's per-worker state (its φ_i, δ_i) and θ as the last consensus left it.
    self.pairs = r.sync.partners is not None
    self._set(0, params, own_rows(initial_rule_state(r, GLOBAL, params), worker)
              if self.pairs else initial_rule_state(r, GLOBAL, params))
    self.kept = {}  # the version a contribution was computed from -> (what it sent, meta)
    # A delayed sync's round whose collective runs while the next jobs compute (`advance`):
    # (its version, its members, θ and the outer state before it)
    self.pending = None
    self.staged = None  # (round version, TrainState) of the round being closed
    # Where the driver keeps records (records.py): the version, θ and outer state before
    # the last commit, until the record of that commit is in
    self.keeps_previous, self.previous = False, None
    self.last = catch_up.LastRound()  # its last round's inputs, for a replica one behind
    self.moments = {}  # when this member finished each step of the open round's collective
    self.flip_next = False  # chaos flip_bit (WorkerProcess.flip_bit)

  def _set(self, version: int, params, opt_state) -> None:
    with self._lock:
      self.version, self.params, self.opt_state = version, params, opt_state
      self._moved.notify_all()

  def wait_for(self, version: int, timeout_s: float) -> float:
    """Waits (a job's thread, while the actor's other thread runs the collective) until the
    replica holds `version`: the seconds waited. A collective may be tried again without a
    lost member, so up to three of its timeouts; past them the job fails, naming it."""
    began = time.perf_counter()
    with self._moved:
      if not self._moved.wait_for(lambda: self.version >= version, timeout=3 * timeout_s):
        raise RuntimeError(f"round {version - 1}'s collective did not commit within "
                           f"3 × ray.collective_timeout_s={timeout_s}")
    return time.perf_counter() - began

  def share(self) -> dict:
    """The replica as host arrays: what a joining or lagging worker adopts, and what a
    checkpoint keeps of the run's global state."""
    with self._lock:
      if self.pending is not None:  # (the driver settles a round in flight first)
        raise RuntimeError(f"share with round {self.pending[0]}'s collective in flight")
      return {"params": np.asarray(self.params), "opt_state": jax.device_get(self.opt_state),
              "version": self.version}

  def adopt(self, state: dict) -> int:
    """Takes a peer's (or a checkpoint's) replica, or runs the round it is behind by from
    that round's inputs ({"round": ...}: catch_up.py); what it contributed is kept."""
    if "round" in state:
      return catch_up.apply(self, state["round"])
    self.last.clear()
    self._set(int(state["version"]), jnp.asarray(state["params"]),
              jax.tree.map(jnp.asarray, state["opt_state"]))
    self.staged = self.pending = None
    return self.version

  def keep(self, version: int, sent, meta: dict) -> None:
    self.kept[version] = (sent, meta)

  def view_outer(self):
    """What the worker's rule reads of the outer state, or None: (its own rows of the
    sync's state (NoLoCo), the outer rules' state (eager updates)), as a server's pull
    brings it."""
    if self.pairs:
      return tuple(jax.device_get(self.opt_state))
    return ((), jax.device_get(self.opt_state)) if self.r.local_reads_rules else None

  # --- a pair swap (`Sync.partners`): each member with its round's peer -----------------

  def _own(self):
    """Its row of the sync's per-worker state as flat vectors (one fragment)."""
    return jax.tree.map(lambda x: x[0], self.opt_state.per_worker[0])

  def swap_payload(self, version: int) -> np.ndarray:
    """What it sends its peer for the contribution computed from `version`."""
    return np.asarray(self.r.sync.swap_payload(self._own(), jnp.asarray(self.kept[version][0])))

  def apply_swap(self, round_version: int, mine: np.ndarray, theirs) -> str:
    """Stages its own new row from its payload and its peer's (None: the peer sent nothing,
    it keeps its own model); the hash of its new φ (each member's differs)."""
    state = self._state(round_version)  # (a round of another version is refused)
    new = self.r.sync.swap_step(self._own(), jnp.asarray(mine),
                                jnp.asarray(mine if theirs is None else theirs))
    rows = jax.tree.map(lambda x: x[None], new)
    outer = self.opt_state._replace(per_worker=(rows,) + tuple(self.opt_state.per_worker[1:]))
    return self._stage(round_version, state._replace(outer=steps.OuterState((), outer)))

  def phi(self) -> np.ndarray:
    """Its own outer weights (flat): its part of the consensus θ."""
    return np.asarray(self._own()[0])

  def set_consensus(self, params) -> None:
    """θ, the workers' mean φ (evaluation, checkpoints); it moves nobody's training."""
    self._set(self.version, jnp.asarray(params), self.opt_state)

  def shards(self, version: int, members: int) -> list[np.ndarray]:
    """The contribution computed from `version`, cut into `members` shards."""
    delta = np.asarray(self.kept[version][0])
    return [delta[a:b] for a, b in shard_bounds(delta.shape[0], members)]

  def reduce_shard(self, round_version: int, index: int, members: list[int], tokens,
                   shards) -> np.ndarray:
    """Shard `index` of the round's mean: the members' shards of it, weighted."""
    start = shard_bounds(self._fragment_size(round_version), len(members))[index][0]
    hidden = np.asarray(self.r.topology.hidden_per_worker)[members]
    mean = self._means[round_version % self.segments](
        jnp.asarray(np.stack(shards)), jnp.asarray(hidden),
        jnp.asarray(tokens, jnp.float32), np.int32(start))
    return np.asarray(mean)

  # --- a hierarchical reduce (by region): sums in each region, the leaders' mean ---------

  def sum_shard(self, round_version: int, index: int, group: list[int], tokens,
                shards, parts: int | None = None) -> np.ndarray:
    """Shard `index` (of `parts`, by default len(group)) of `group`'s weighted sum,
    undivided."""
    start = shard_bounds(self._fragment_size(round_version), parts or len(group))[index][0]
    hidden = np.asarray(self.r.topology.hidden_per_worker)[group]
    total = self._sums[round_version % self.segments](
        jnp.asarray(np.stack(shards)), jnp.asarray(hidden), jnp.asarray(tokens, jnp.float32),
        np.int32(start))
    return np.asarray(total)

  def divide_piece(self, round_version: int, index: int, groups: int, members: list[int],
                   tokens, pieces) -> np.ndarray:
    """Piece `index` (of `groups`) of the mean: the regions' sums of it, added and divided
    by every member's weight."""
    start = shard_bounds(self._fragment_size(round_version), groups)[index][0]
    hidden = np.asarray(self.r.topology.hidden_per_worker)[members]
    mean = self._divides[round_version % self.segments](
        jnp.asarray(np.stack(pieces)), jnp.asarray(hidden), jnp.asarray(tokens, jnp.float32),
        np.int32(start))
    return np.asarray(mean)

  def _start(self, round_version: int, index: int, members: int) -> int:
    return shard_bounds(self._fragment_size(round_version), members)[index][0]

  def _fragment_size(self, round_version: int) -> int:
    layout = self.r.model.layout
    fragment = self.r.algorithm.segments(self.r.config, self.r.config.inner_steps)[
        round_version % self.segments].sync
    return layout.fragment(fragment).size

  def _state(self, round_version: int) -> steps.TrainState:
    if self.pending is not None and self.pending[0] == round_version:
      params, opt_state = self.pending[2:]  # (θ has moved on: `advance`)
    elif self.version != round_version:
      raise RuntimeError(f"a round of version {round_version} reached a replica at "
                         f"version {self.version}: it was not brought up to date")
    else:
      params, opt_state = self.params, self.opt_state
    return steps.TrainState(jnp.asarray(round_version // self.segments, jnp.int32),
                            self._rng, params, steps.OuterState((), opt_state))

  def _signals(self, members: list[int], tokens, losses) -> steps.Signals:
    slots = self.r.config.num_workers
    tokens_S, losses_S = np.zeros(slots, np.float32), np.zeros(slots, np.float32)
    tokens_S[members], losses_S[members] = tokens, losses
    return round_signals(self.r, tokens_S, losses_S)

  def advance(self, round_version: int, members: list[int], tokens, losses) -> str:
    """A delayed sync's round (`Algorithm.delayed_sync`: one-step delay, eager): θ' does not
    depend on the round's own mean, so it is taken now, the outer step run with zeros in the
    mean's place, and the next job starts from it while the round's collective runs. The outer
    state it leaves is right in what a worker rule reads (eager's), which the delayed sync
    says does not depend on the mean either; the rest of it (the mean kept for the next
    round) comes with the collective (`apply_reduced`, `commit`). The hash of θ'."""
    state = self._state(round_version)
    zeros = jnp.zeros(self._fragment_size(round_version), jnp.float32)
    new = self._applies[round_version % self.segments](
        state, zeros, self._signals(members, tokens, losses), full=self._full(members))
    with self._lock:  # (a share or a checkpoint reads these from the actor's other thread)
      self.pending = (round_version, list(members), self.params, self.opt_state)
      self.version, self.params, self.opt_state = (round_version + 1, new.params,
                                                   new.outer.per_fragment)
    return params_hash(new.params)

  def _full(self, members) -> bool:
    return len(members) == self.r.config.num_workers

  def apply_reduced(self, round_version: int, members: list[int], tokens, losses,
                    reduced) -> str:
    """Stages the outer step on the all-gathered mean; its θ's hash."""
    state = self._applies[round_version % self.segments](
        self._state(round_version), jnp.asarray(np.concatenate(reduced)),
        self._signals(members, tokens, losses), full=self._full(members))
    pending = self.pending
    if (pending is not None and pending[0] == round_version and pending[1] == list(members)
        and params_hash(state.params) != params_hash(self.params)):
      raise RuntimeError(f"round {round_version}: θ' moved with the round's own mean, which "
                         f"{self.r.config.algorithm}'s delayed sync says it does not")
    return self.last.note(round_version, "apply_reduced", (members, tokens, losses, reduced),
                          self._stage(round_version, state))

  def apply_gathered(self, round_version: int, rows: dict) -> str:
    """Stages the parameter server's program over every member's row ({worker: (what it
    sent, meta)}); its θ's hash."""
    received, keys, signals = round_inputs(self.r, rows, self._rng)
    state = self._gathered[round_version % self.segments](
        self._state(round_version), received, keys, signals, full=self._full(list(rows)))
    return self._stage(round_version, state)

  def _stage(self, round_version: int, state: steps.TrainState) -> str:
    """Keeps the round's new state until its commit; the hash of what must agree across
    members (θ), or of its own new row where each member's differs (a pair swap)."""
    if self.flip_next:  # chaos flip_bit: silent data corruption of what it stages
      self.flip_next, state = False, state._replace(params=jnp.asarray(flip_one_bit(state.params)))
    self.staged = (round_version, state)
    return params_hash(state.outer.per_fragment.per_worker if self.pairs else state.params)

  def commit(self, round_version: int) -> int:
    """The staged round becomes the replica (nothing if it is already applied); the
    contributions it took are let go. A round `advance` took θ' of keeps it (the next jobs
    started from it) and takes the outer state."""
    pending = self.pending is not None and self.pending[0] == round_version
    if self.version == round_version + 1 and not pending:
      return self.version
    version, state = self.staged
    if version != round_version:
      raise RuntimeError(f"commit of round {round_version}, but round {version} is staged")
    with self._lock:
      params, self.pending = (self.params if pending else state.params), None
      if self.keeps_previous:
        self.previous = (self.version, self.params, self.opt_state)
    self._set(round_version + 1, params, state.outer.per_fragment)
    self.last.committed(round_version, params_hash(params) if pending else None)
    self.staged = None
    self.kept = {v: kept for v, kept in self.kept.items() if v > round_version}
    return self.version

  def roll_back(self, version: int) -> int:
    """Back to `version` (a driver run again from its record of it): θ and the outer state
    before the last commit where that commit was of `version`'s round; a round in flight
    and contributions to rounds not before it are dropped. Returns the version held."""
    if self.version == version + 1 and self.previous and self.previous[0] == version:
      self._set(*self.previous)
    self.previous = self.staged = self.pending = None
    self.last.clear()
    self.kept = {v: kept for v, kept in self.kept.items() if v < version}
    return self.version

  def skip(self, round_version: int) -> int:
    """A round closed with no contribution: θ stays, the version moves on."""
    if self.version == round_version:
      self._set(round_version + 1, self.params, self.opt_state)
      self.last.clear()
    return self.version


def crash_here() -> None:
  """Chaos: the process dies in the middle of a collective (`ray.chaos` crash_in_sync)."""
  os._exit(1)
