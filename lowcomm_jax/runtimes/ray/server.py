"""The parameter server as a Ray actor's class (ServerProcess): the global one, or one of
HALoS's regional ones."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lowcomm_jax.programs import servers
from lowcomm_jax.programs import state_average
from lowcomm_jax.programs import steps
from lowcomm_jax.runtimes.ray.actors import (built, initial_rule_state, initial_state,
                                             round_inputs, round_syncs, server_rules,
                                             server_view)
from lowcomm_jax.runtimes.ray import checkpoints
from lowcomm_jax.runtimes.ray.chaos import with_worker_slots
from lowcomm_jax.parallel.server_names import GLOBAL


class ServerProcess:
  """The global parameter server: θ, the algorithm's server rule and its state (a
  synchronous run's: its outer rules', and the sync's rows where workers read their own),
  the version (pushes applied, or syncs closed), the open round's contributions, and the
  models that jobs still out pulled (their drift; and a resumed run's jobs start again from
  them)."""

  def __init__(self, config: ml_collections.ConfigDict, restored: dict | None = None,
               name: str = GLOBAL, *, standby: bool = False,
               params0: np.ndarray | None = None):
    """Server `name` from `restored` (a checkpoint's) or fresh (from `params0`, the
    driver's θ₀, if given). A `standby` is built (its process started, the run built,
    nothing compiled yet) and holds no state: `load` makes it a server when one dies
    (`ray.standby_server`)."""
    self._params0 = params0
    # One row per worker that may ever take part (chaos adds some): the run's sync, robust
    # rule and attack are built for that many.
    self.r, self.programs = r, _ = built(server_view(with_worker_slots(config)),
                                         f"server {name}")
    codec = r.sync.codec
    self._decode = (jax.jit(servers.make_decode(codec, r.model.layout)) if codec
                    else None)
    self._rng = steps.run_key(r.config.seed)  # a round's attack draws from it
    # Workers that start from their own row of the sync's state (NoLoCo): the server keeps
    # every row and runs the runner's own sync over them (each row a worker's, as vmapped
    # workers are), θ the rows' consensus. Other synchronous runs: make_server_sync.
    self._own_rows = r.local_reads_own
    self._consensus = jax.jit(r.sync.consensus) if self._own_rows else None
    self._syncs = (round_syncs(r) if r.algorithm.synchronous and not self._own_rows
                   else None)
    # Versions count syncs: a synchronous round of P segments is P versions (segment
    # version % P of round version // P).
    self.segments = (len(r.algorithm.segments(r.config, r.config.inner_steps))
                     if r.algorithm.synchronous else 1)
    self._norm = jax.jit(lambda p: jnp.sqrt(jnp.sum(jnp.square(p))))
    self._exchange = servers.RegionalExchange()
    self.mesh = r.topology.mesh
    self.windows = jax.device_put(r.data.eval_windows)
    self.version = -1  # (a standby: no state yet)
    if not standby:
      self.load(restored, name)

  def load(self, restored: dict | None, name: str = GLOBAL) -> int:
    """Becomes server `name`: its state from `restored` (or from a checkpoint's part,
    {"part": where}: read here), or fresh. Returns its version."""
    self.name = name
    if restored is not None and "part" in restored:
      restored = checkpoints.read_server(restored["part"], self.r, name)
    rule = server_rules(self.r)[name]
    self._apply = jax.jit(servers.make_apply(rule))
    self.snapshots = {}  # version -> [params, jobs out that pulled it]
    self._expected = {}  # version -> jobs out that pulled it from a server before this one
    self._rows = {}  # the open round's contributions: worker -> (what it sent, meta)
    self._replaying = False
    # θ, its rule's state, and for a regional server (HALoS's LPS) its model after the last
    # merge and at its last push to the global server (servers.RegionalExchange's arrays).
    if restored is None:
      params = (jnp.asarray(self._params0) if self._params0 is not None
                else initial_state(self.r).params)
      self.arrays = {"params": params, "opt_state": initial_rule_state(self.r, name, params)}
      self.version = 0
      if name != GLOBAL:
        self.arrays.update(reference=params, at_push=params)
    else:
      self.arrays = {"params": jnp.asarray(restored["params"]),
                     "opt_state": jax.tree.map(jnp.asarray, restored["opt_state"])}
      self.arrays.update({k: jnp.asarray(restored[k]) for k in ("reference", "at_push")
                          if k in restored})
      self.version = int(restored["version"])
      self.snapshots = {int(v): [jnp.asarray(p), 0]
                        for v, p in restored.get("snapshots", {}).items()}
    return self.version

  def ping(self) -> int:
    return self.version

  def expect(self, pulled: dict[int, int]) -> None:
    """A server restored from a checkpoint, before the calls since are replayed: the jobs
    still out pulled these versions (version -> jobs) from the server before it. Their
    counts are set to exactly that, and each newer model is kept as it is reached again.
    Replayed calls release nothing (`replaying`): their jobs are not out any more."""
    for version, held in self.snapshots.items():
      held[1] = pulled.get(version, 0)
    self._expected = {v: n for v, n in pulled.items()
                      if v >= self.version and v not in self.snapshots}
    self._replaying = True
    self._hold()

  def replayed(self) -> None:
    """The replay is over: models no job out holds are let go."""
    self._replaying = False
    self.snapshots = {v: held for v, held in self.snapshots.items() if held[1] > 0}

  def _hold(self) -> None:
    if self.version in self._expected:
      self.snapshots[self.version] = [self.arrays["params"], self._expected.pop(self.version)]

  def theta(self) -> tuple[int, np.ndarray]:
    """(version, θ) for a collaborative epoch's micro-batches: nothing is held for them
    (their gradients are at θ: there is no drift to measure)."""
    return self.version, np.asarray(self.arrays["params"])

  def pull(self, version: int | None = None, worker: int | None = None
           ) -> tuple[int, np.ndarray, object]:
    """(version, θ, what the worker reads of the outer state or None) for `worker`'s next
    job: the newest, or (a job started again after a resume) the one that job had pulled.
    The outer state goes along only where the workers' rule reads it, as (its own rows of
    the per-worker state, the outer rules' state): the rules' for eager updates
    (`Run.local_reads_rules`), its row of the sync's state too for NoLoCo
    (`Run.local_reads_own`). Such runs close rounds only with every live worker, so a pull
    is of the newest."""
    if version is None:
      version = self.version
      held = self.snapshots.setdefault(version, [self.arrays["params"], 0])
    else:
      held = self.snapshots[version]
    held[1] += 1
    outer = None
    if self._own_rows:
      state = self.arrays["opt_state"]
      outer = (jax.device_get(jax.tree.map(lambda x: x[worker:worker + 1], state.per_worker)),
               jax.device_get(state.per_fragment))
    elif self.r.local_reads_rules:
      outer = ((), jax.device_get(self.arrays["opt_state"]))
    return version, np.asarray(held[0]), outer

  def _release(self, version: int):
    held = self.snapshots.get(version)
    if held is None:  # pulled from a server that died since: its drift is not known
      return None
    if self._replaying:
      return held[0]
    held[1] -= 1
    if held[1] <= 0:
      del self.snapshots[version]
    return held[0]

  def drop(self, version: int) -> None:
    """A job that pulled `version` will never push (its worker was lost)."""
    self._release(version)

  def _delta(self, meta: dict, sent) -> jax.Array:
    """What a worker sent, as the flat Δ (the codec's payload decoded with its key)."""
    if self._decode is None:
      return jnp.asarray(sent)
    return self._decode(sent, jax.random.wrap_key_data(jnp.asarray(meta["codec_key"])))

  def push(self, meta: dict, sent) -> dict:
    """Applies one contribution (Δ, or the codec's payload); its staleness (versions applied
    since it pulled) and drift."""
    delta = self._delta(meta, sent)
    pulled = self._release(meta["version"])
    staleness = self.version - meta["version"]
    a = self.arrays
    a["params"], a["opt_state"], drift = self._apply(a["params"], a["opt_state"], delta, pulled)
    self.version += 1
    self._hold()
    return {"version": self.version, "staleness": staleness,
            "drift": None if drift is None else float(drift)}

  def contribute(self, meta: dict, sent) -> dict:
    """Adds one worker's contribution to the open round (a quorum round's Δ or an epoch's
    mean gradient, or the codec's payload of it); its staleness in rounds. A worker
    contributes once a round (it starts again when the round closes); a second one would
    replace its first."""
    self._release(meta["version"])
    staleness = self.version - meta["version"]
    if staleness % self.segments:  # another segment's fragment: no round of it is open
      return {"staleness": staleness, "dropped": True}
    self._rows[int(meta["worker"])] = (sent, meta)
    return {"staleness": staleness}

  def close_round(self) -> dict:
    """The round's sync over its contributions, through the run's `Sync` as the lockstep
    runner's (sync_program.make_server_sync): decode, attack, weights, robust rule, outer
    rule. Workers that sent nothing this round have no row (weight 0)."""
    contributed = bool(self._rows)
    if contributed and self._own_rows:
      self._close_own_rows()
    elif contributed:
      a = self.arrays
      round_, segment = divmod(self.version, self.segments)
      state = steps.TrainState(jnp.asarray(round_, jnp.int32), self._rng, a["params"],
                               steps.OuterState((), a["opt_state"]))
      received, keys, signals = self._round_inputs()
      state = self._syncs[segment](state, received, keys, signals,
                                   full=len(self._rows) == self.r.config.num_workers)
      a["params"], a["opt_state"] = state.params, state.outer.per_fragment
    self._rows = {}
    self.version += 1
    self._hold()
    return {"version": self.version, "applied": contributed}

  def _close_own_rows(self) -> None:
    """The runner's own sync (`Run.programs.syncs`, the simulator's too) over every worker's
    row of Δ and of the sync's state; the rows of workers that sent nothing are filled as the
    algorithm says (`Sync.fill_absent`) and then keep their state. θ is the consensus of
    the rows that came."""
    a, r = self.arrays, self.r
    round_, segment = divmod(self.version, self.segments)
    fragment = r.algorithm.segments(r.config, r.config.inner_steps)[segment].sync
    received, _, signals = self._round_inputs()
    present = np.asarray(signals.tokens) > 0
    outer = a["opt_state"]
    if not present.all():
      received = jnp.asarray(r.sync.fill_absent(
          np.asarray(received), present, jax.device_get(outer.per_worker[fragment]),
          round_ * self.segments + fragment))
    state = steps.TrainState(jnp.asarray(round_, jnp.int32), self._rng, a["params"], outer)
    with jax.set_mesh(self.mesh):
      state, _ = self.programs.syncs[segment](state, received, signals, metrics=False)
    rows = jax.tree.map(
        lambda new, old: jnp.where(present.reshape((-1,) + (1,) * (new.ndim - 1)), new, old),
        state.outer.per_worker, outer.per_worker)
    a["opt_state"] = state.outer._replace(per_worker=rows)
    # θ: the consensus of the workers in this round (a dead worker's row would hold θ back)
    a["params"] = self._consensus(jax.tree.map(lambda x: x[np.flatnonzero(present)], rows[0]))

  def _round_inputs(self):
    return round_inputs(self.r, self._rows, self._rng)

  # --- HALoS: a regional server's exchange with the global one (algorithms/halos.py) ----

  def lps_push(self) -> tuple[dict, np.ndarray]:
    """A regional server's push: (info, its change since the last merge θ_ref − θ)."""
    return {"version": self.version}, np.asarray(self._exchange.push(self.arrays))

  def apply_lps_push(self, delta) -> tuple[dict, np.ndarray]:
    """The global server takes a regional server's push: (info, its model after it)."""
    params = self._exchange.take(self.arrays, self._apply, jnp.asarray(delta))
    self.version += 1
    return {"version": self.version}, np.asarray(params)

  def merge(self, global_params, alpha: float) -> dict:
    """A regional server merges the global model it got back (weight `alpha`)."""
    self._exchange.merge(self.arrays, jnp.asarray(global_params), alpha)
    return {"version": self.version}

  def state(self, versions=()) -> dict:
    """What a checkpoint holds of the server (host arrays), with the models jobs still out
    pulled at `versions`."""
    out = {"params": np.asarray(self.arrays["params"]),
           "opt_state": jax.device_get(self.arrays["opt_state"]),
           "version": self.version,
           "snapshots": {str(v): np.asarray(self.snapshots[v][0])
                         for v in sorted(set(versions)) if v in self.snapshots}}
    out.update({k: np.asarray(self.arrays[k]) for k in ("reference", "at_push")
                if k in self.arrays})
    return out

  def save_part(self, where: dict, versions=()) -> dict:
    """Writes its part of checkpoint `where` (`state`), where it is; returns its record."""
    return checkpoints.write_server(where, self.name, self.state(versions))

  def evaluate(self) -> list[float]:
    """The eval loss at each of the run's eval widths (full width first)."""
    with jax.set_mesh(self.mesh):
      return [float(x) for x in np.asarray(self.programs.eval(self.arrays["params"], self.windows))]

  def param_norm(self) -> float:
    return float(self._norm(self.arrays["params"]))


def average_parts(*rows):
  """A state average's mean (Algorithm.state_sync: the workers' optimizer-state parts, each
  row [1, ...]), by the runner's all-reduce program (state_average.rows_mean); run as a Ray task."""
  mean = state_average.rows_mean(jax.tree.map(lambda *xs: np.concatenate(xs), *rows))
  return jax.tree.map(lambda x: np.asarray(x)[None], mean)
