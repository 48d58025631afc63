"""The simulator's training side: real inner steps and outer rules for virtual workers.

The schedules in sim/ decide when; this backend keeps the parameter servers (the global one,
and HALoS's per-region ones), the workers' inner optimizer states, the pulled parameter
snapshots and the in-flight messages, and does the math with the runner's own functions:
the same jitted local program (workers pulled from the same server state with the same H
run vmapped in one call) and, for synchronous DiLoCo, the same sync. Asynchronous servers'
rules are their algorithm's (algorithms/, `server_rules`), applied as programs/servers.py
applies them (the Ray runtime's server too).

Servers: {name: {"params", "opt_state", and for HALoS's regions "reference"}} plus per-server
version (updates applied: staleness is counted in these) and revision (any change, merges
included: snapshots are keyed by it).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowcomm_jax.programs import optimizers
from lowcomm_jax.programs import servers
from lowcomm_jax.programs import steps
from lowcomm_jax.assemble.spec import Programs, Run
from lowcomm_jax.parallel import mesh as mesh_lib
from lowcomm_jax.parallel.server_names import GLOBAL
from lowcomm_jax.sim import Job, Plan


def _without_empty(tree: dict) -> dict:
  """Drops empty parts: orbax cannot save an empty container as an item."""
  return {k: v for k, v in tree.items() if jax.tree.leaves(v)}


# Whole-tree gathers and scatters as single jitted calls: one dispatch per tree instead of
# one per leaf (the simulator's bookkeeping between steps stays cheap).
@jax.jit
def _take(tree, idx):
  """Rows `idx` of a stacked tree; an index past the end (a padding lane) reads the last."""
  return jax.tree.map(lambda x: x[idx], tree)


@jax.jit
def _put(tree, idx, values):
  """`tree` with rows `idx` set to `values`; rows past the end (padding lanes) are dropped."""
  return jax.tree.map(lambda x, v: x.at[idx].set(v, mode="drop"), tree, values)


# The workers' stack is written in place (donated): a copy would cost every worker's state
# per call, so a run's cost would grow with W². Its checkpoint is a synchronous host copy
# (run/checkpoint.py), so no save reads it later.
_put_in_place = jax.jit(_put.__wrapped__, donate_argnums=0)


def call_sizes(jobs: int, width: int) -> list[tuple[int, int]]:
  """The calls a group of `jobs` jobs runs in, as (jobs, lanes): one call if they fit in
  `width`, else calls of `width` lanes, the last padded. A synchronous round's group is
  every worker, each round, so its calls are always one shape: one program."""
  if jobs <= width:
    return [(jobs, jobs)]
  full, rest = divmod(jobs, width)
  return [(width, width)] * full + ([(rest, width)] if rest else [])


@jax.jit
def _unstack(tree):
  return [jax.tree.map(lambda x, i=i: x[i], tree)
          for i in range(jax.tree.leaves(tree)[0].shape[0])]


@jax.jit
def _mean_losses(losses, taken):
  """Each job's mean loss over the steps it took (`taken` None: every step)."""
  if taken is None:
    return losses.mean(axis=1)
  took = jnp.arange(losses.shape[1]) < taken[:, None]
  return jnp.where(took, losses, 0).sum(axis=1) / taken.astype(losses.dtype)


@jax.jit
def _stack(trees):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


class SimBackend:

  def __init__(self, r: Run, programs: Programs, plan: Plan, state: steps.TrainState, workers,
               *, width: int = 1):
    """`width`: the most synchronous jobs one call runs: the activations the process holds
    at once are that many jobs' (assemble/memory.py chooses it)."""
    c = r.config
    self.r, self.plan, self.config = r, plan, c
    # Asynchronous jobs of any H (DyLU) run in one program of the largest H, one job per
    # call: the steps past its own are a branch not taken (steps.make_local_segment's
    # steps_G), so it costs its own H and ends exactly as the program of its H would, with
    # whatever else started at that instant. A synchronous segment's jobs share one H and
    # run `width` at a time.
    self.max_steps = max(plan.inner_steps)
    self.rng = state.rng
    self.rules = r.algorithm.server_rules(c, plan)
    self.width = 1 if self.rules else width
    # The runner's own jitted programs (assemble/jitted.jitted_steps): one per segment of a round.
    self.local_programs, self.syncs = programs.local[0], programs.syncs
    self._consensus = jax.jit(r.sync.consensus) if r.sync.consensus is not None else None
    # Batches and worker ids placed as the runner places them (rounds._round): a program
    # traced and compiled for one serves the other in the same process.
    self._batches_on = mesh_lib.round_batches(r.topology.local_mesh)
    self._ids_on = mesh_lib.per_worker(r.topology.local_mesh)
    self.local_round = self.local_programs[0]
    self.codec = r.sync.codec if self.rules else None  # asynchronous: per contribution
    self._apply = {name: jax.jit(servers.make_apply(rule))
                   for name, rule in self.rules.items()}
    self._roundtrip = (jax.jit(jax.vmap(servers.make_roundtrip(self.codec,
                                                                        r.model.layout)))
                       if self.codec else None)
    self._exchange = servers.RegionalExchange()  # HALoS: a regional server's push and merge
    self.workers = workers  # [W, ...] steps.WorkerState: θ_w, inner optimizer states
    self.servers, self.versions = {}, {}
    if not self.rules:  # synchronous DiLoCo: the runner's TrainState is the global server
      self.servers[GLOBAL] = {"params": state.params, "opt_state": state.outer}
      self.versions[GLOBAL] = int(state.round)
    else:
      for name, rule in self.rules.items():
        server = {"params": state.params, "opt_state": rule.init(state.params)}
        if name != GLOBAL:  # an LPS: its model after the last merge, and at the last push
          server["reference"] = server["at_push"] = state.params
        self.servers[name] = server
        self.versions[name] = 0
    self.revisions = {name: 0 for name in self.servers}
    self.codec_states = (jax.tree.map(
        lambda x: jnp.broadcast_to(x, (plan.num_workers,) + x.shape),
        self.codec.init(r.model.layout.abstract)) if self.codec else ())
    self.messages = {}  # id -> payload tree (job deltas + loss, pushes, GPS models)
    self.snapshots = {}  # (server, revision) -> params pulled by jobs still out
    self.job_snapshot = {}  # job id -> (server, revision)
    self._queued: list[Job] = []
    # Asynchronous workers' inner lr schedules run on the run's clock, not each worker's own
    # step count: a job starts at the inner steps per worker of the jobs started at earlier
    # virtual instants (fast workers would otherwise overrun the schedule and slow ones never
    # decay; jobs that start together share one lr).
    self.started_steps = 0  # inner steps of every job flushed so far
    # Synchronous syncs: the global models their segments started from, newest last, as far
    # back as an applied contribution reaches. The drift of what a sync applies is measured
    # from the global model `lag` segments back (for Overlap Local-SGD, whose workers never
    # restart from θ, that is the anchor's movement). Checkpointed: a resumed run measures
    # the same drift.
    segments = len(self.syncs)
    self.lag = segments - 1 + (1 if r.algorithm.delayed_sync else 0)
    self.sync_staleness = 1 if r.algorithm.delayed_sync else 0  # in rounds (versions)
    self.pulled = []
    self._drift = jax.jit(lambda now, then: optax.tree.norm(optax.tree.sub(now, then))
                          / optax.tree.norm(now))
    self.job_lr_step = {}  # job id -> the schedule step it starts at (until it runs)
    # DES-LOC: the workers' optimizer states averaged before a synchronous round (the
    # runner's program); the version last done, so a round's several flushes average once.
    self.state_sync = programs.state_sync
    self._state_synced = None

  # --- the Backend protocol (lowcomm_jax/sim/schedules.py) ------------------------------

  def version(self, server: str) -> int:
    return self.versions[server]

  def start_job(self, job: Job) -> None:
    key = (job.server, self.revisions[job.server])
    self.snapshots.setdefault(key, self.servers[job.server]["params"])
    self.job_snapshot[job.id] = key
    self._queued.append(job)
    if self.rules:  # the clock moves at flushes: jobs queued together start together
      self.job_lr_step[job.id] = self.started_steps // self.plan.num_workers

  def flush(self, next_batches) -> None:
    """Runs the jobs started since the last flush: those pulled from one server state in
    calls of at most `width` vmapped jobs (`call_sizes`; asynchronous jobs one by one, at
    the largest H, padded). `next_batches(worker_ids, steps)` -> [G, steps, B, L+1]
    training batches."""
    if self.state_sync is not None and self._queued and not self.rules:
      version = self._queued[0].version
      parts = self.r.state_sync_due(version)
      if parts and version != self._state_synced:
        with jax.set_mesh(self.r.topology.mesh):
          self.workers = self.workers._replace(
              opt_state=self.state_sync(self.workers.opt_state, parts=parts))
        self._state_synced = version
    groups: dict[tuple, list[Job]] = {}
    for job in self._queued:
      key = self.job_snapshot[job.id] + (job.segment,) + (() if self.rules else (job.steps,))
      groups.setdefault(key, []).append(job)
      self.started_steps += job.steps
    self._queued = []
    for (server, revision, segment, *_), jobs in groups.items():
      jobs.sort(key=lambda j: j.worker)
      # The round key folds in the pulled version: (version, worker) never repeats.
      # (Synchronous schedules start a round's jobs at its sync, so the global outer state
      # a worker rule reads is the one they pulled.)
      view = self.r.local_input(steps.TrainState(
          jnp.asarray(jobs[0].version, jnp.int32), self.rng, self.snapshots[(server, revision)],
          self.servers[GLOBAL]["opt_state"] if not self.rules else ()))
      batches = self._batches(jobs, next_batches)
      done = 0
      for count, lanes in call_sizes(len(jobs), self.width):
        self._run(view, segment, jobs[done:done + count], batches[done:done + count], lanes)
        done += count

  def _batches(self, jobs: list[Job], next_batches) -> np.ndarray:
    """The jobs' training batches [G, S, B, L+1]: asynchronous jobs' padded to the largest
    H with zeros (steps they skip). Each worker's stream moves by its own job's steps."""
    if not self.rules:
      return next_batches(np.asarray([j.worker for j in jobs], np.int32), jobs[0].steps)
    out = None
    for steps_ in sorted({j.steps for j in jobs}):
      rows = [i for i, j in enumerate(jobs) if j.steps == steps_]
      got = next_batches(np.asarray([jobs[i].worker for i in rows], np.int32), steps_)
      if out is None:
        out = np.zeros((len(jobs), self.max_steps) + got.shape[2:], got.dtype)
      out[rows, :steps_] = got
    return out

  def _run(self, view, segment: int, jobs: list[Job], batches: np.ndarray, lanes: int) -> None:
    """One call of the local program for `jobs`, padded to `lanes` (padding lanes read the
    last worker's state, train on zeros, and are not written back)."""
    pad = lanes - len(jobs)
    ids = np.asarray([j.worker for j in jobs] + [self.plan.num_workers] * pad, np.int32)
    if pad:
      batches = np.concatenate([batches, np.zeros((pad,) + batches.shape[1:], batches.dtype)])
    workers = _take(self.workers, ids)
    taken = None
    if self.rules:
      lr_steps = np.asarray([self.job_lr_step.pop(j.id) for j in jobs] + [0] * pad, np.int32)
      workers = workers._replace(
          opt_state=optimizers.at_schedule_step(workers.opt_state, lr_steps))
      taken = np.asarray([j.steps for j in jobs] + [0] * pad, np.int32)
    deltas, trained, losses = self.local_programs[segment](
        view, workers, jax.device_put(batches, self._batches_on),
        jax.device_put(ids, self._ids_on), taken)
    self.workers = _put_in_place(self.workers, ids, trained)
    if self._roundtrip is not None:  # what the server receives is the decoded payload
      keys = servers.codec_keys(view, ids)
      deltas, sent_state = self._roundtrip(deltas, _take(self.codec_states, ids), keys)
      self.codec_states = _put(self.codec_states, ids, sent_state)
    per_job = _unstack({"delta": deltas, "loss": _mean_losses(losses, taken)})
    for job, message in zip(jobs, per_job):
      self.messages[job.id] = message

  def _release(self, job: Job) -> None:
    key = self.job_snapshot.pop(job.id)
    if key not in self.job_snapshot.values():
      del self.snapshots[key]

  def _changed(self, server: str, *, update: bool) -> None:
    self.revisions[server] += 1
    if update:
      self.versions[server] += 1

  def apply_job(self, job: Job):
    msg = self.messages.pop(job.id)
    server = self.servers[job.server]
    server["params"], server["opt_state"], drift = self._apply[job.server](
        server["params"], server["opt_state"], msg["delta"],
        self.snapshots[self.job_snapshot[job.id]])
    self._release(job)
    self._changed(job.server, update=True)
    return drift, msg["loss"]

  def sync_round(self, jobs: list[Job]) -> list:
    return self.sync_segment(jobs, 0)

  def sync_segment(self, jobs: list[Job], segment: int) -> list:
    """The segment's sync (its fragment's outer step) at GLOBAL, as the runner's; the
    round's last segment completes a version (versions count rounds)."""
    msgs = [self.messages.pop(j.id) for j in sorted(jobs, key=lambda j: j.worker)]
    # What this sync applies was computed from the global model `lag` segments back
    # (DiLoCo: this segment's own start, drift 0; one-step delay: the previous round's;
    # streaming with P fragments: when this fragment was last synced, P − 1 segments back).
    self.pulled = (self.pulled + [self.snapshots[self.job_snapshot[jobs[0].id]]])[-self.lag - 1:]
    drift = (self._drift(self.servers[GLOBAL]["params"], self.pulled[0])
             if len(self.pulled) == self.lag + 1 else None)
    stacked = _stack(msgs)
    deltas, losses = stacked["delta"], stacked["loss"]
    g = self.servers[GLOBAL]
    state = steps.TrainState(jnp.asarray(self.versions[GLOBAL], jnp.int32), self.rng,
                             g["params"], g["opt_state"])
    with jax.set_mesh(self.r.topology.mesh):
      state, _ = self.syncs[segment](state, deltas, self.r.signals([jobs[0].steps], losses),
                                     metrics=False)
    g["params"], g["opt_state"] = state.params, state.outer
    for job in jobs:
      self._release(job)
    self._changed(GLOBAL, update=segment == len(self.syncs) - 1)
    return [m["loss"] for m in msgs], drift, self.sync_staleness

  def push_update(self, src: str, msg: int) -> None:
    self.messages[msg] = {"delta": self._exchange.push(self.servers[src])}

  def apply_push(self, dst: str, msg: int) -> None:
    self._exchange.take(self.servers[dst], self._apply[dst], self.messages.pop(msg)["delta"])
    self._changed(dst, update=True)

  def send_params(self, src: str, msg: int) -> None:
    self.messages[msg] = {"params": self.servers[src]["params"]}

  def merge(self, dst: str, msg: int, alpha: float) -> None:
    self._exchange.merge(self.servers[dst], self.messages.pop(msg)["params"], alpha)
    self._changed(dst, update=False)

  # --- checkpointing ----------------------------------------------------------------------

  def _pulled_kept(self) -> list:
    """The part of the drift window the next syncs read (the next appends one)."""
    return self.pulled[len(self.pulled) - self.lag:] if self.lag else []

  def checkpoint_tree(self) -> dict:
    """Every array the simulation needs to continue (worker optimizer states aside)."""
    return _without_empty({"servers": self.servers,
            "snapshots": {f"{s}_r{rev}": p for (s, rev), p in self.snapshots.items()},
            "messages": {str(k): v for k, v in self.messages.items()},
            "pulled": {str(i): p for i, p in enumerate(self._pulled_kept())},
            "codec": self.codec_states})

  def checkpoint_meta(self) -> dict:
    return {"versions": self.versions, "revisions": self.revisions,
            "started_steps": self.started_steps, "pulled": len(self._pulled_kept()),
            "job_snapshot": {str(k): list(v) for k, v in self.job_snapshot.items()},
            # Each in-flight message's parts and their shapes (a fragment's Δ is its size).
            "messages": {str(k): {part: list(np.shape(x)) for part, x in v.items()}
                         for k, v in self.messages.items()}}

  def abstract_tree(self, meta: dict) -> dict:
    """Shapes of `checkpoint_tree()` for the state described by `meta` (for restoring)."""
    params = jax.eval_shape(lambda: self.servers[GLOBAL]["params"])
    keys = {tuple(v) for v in meta["job_snapshot"].values()}
    return _without_empty({
        "servers": jax.eval_shape(lambda: self.servers),
        "snapshots": {f"{s}_r{rev}": params for s, rev in keys},
        "messages": {k: {p: jax.ShapeDtypeStruct(tuple(shape), params.dtype)
                         for p, shape in v.items()} for k, v in meta["messages"].items()},
        "pulled": {str(i): params for i in range(meta["pulled"])},
        "codec": jax.eval_shape(lambda: self.codec_states)})

  def load(self, tree: dict, meta: dict) -> None:
    self.servers = tree["servers"]
    self.versions, self.revisions = dict(meta["versions"]), dict(meta["revisions"])
    self.started_steps = meta["started_steps"]
    self.job_snapshot = {int(k): (v[0], int(v[1])) for k, v in meta["job_snapshot"].items()}
    self.snapshots = {key: tree["snapshots"][f"{key[0]}_r{key[1]}"]
                      for key in set(self.job_snapshot.values())}
    self.messages = {int(k): v for k, v in tree.get("messages", {}).items()}
    pulled = tree.get("pulled", {})
    self.pulled = [pulled[str(i)] for i in range(meta["pulled"])]
    self.codec_states = tree.get("codec", ())

  def global_params(self):
    """θ: the global server's, or where the workers keep their own outer weights (NoLoCo)
    their consensus, as the runner evaluates it."""
    g = self.servers[GLOBAL]
    if self.r.sync.consensus is None:
      return g["params"]
    return self._consensus(g["opt_state"].per_worker[0])
