"""The Ray runtime's two kinds of process, as plain classes: driver.py runs them as Ray
actors (`ray.remote(...)(ServerProcess)`); tests may also run them in-process.

Both build the run as the simulator does (one device, `simulate.one_device`), so a worker
runs the simulator's jitted local program and the server the same rule, through the same
`parameter_server.make_apply`, as the simulator's servers. What crosses Ray's object store
is host numpy: θ on a pull; on a push the codec's payload (decoded by the server, with the
worker's key) or, without a codec, Δ; and small dicts.
"""

import logging
import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lowcomm_jax import optimizers, outer, parameter_server, steps
from lowcomm_jax.sim import GLOBAL


def _built(config: ml_collections.ConfigDict):
  """The run as the simulator builds it, and its jitted programs (compiled programs shared
  with the other workers through the compilation cache, as hosts of a runner share them)."""
  from lowcomm_jax import compile_cache
  from lowcomm_jax.build import build
  from lowcomm_jax.rounds import jitted_steps
  from lowcomm_jax.simulate import one_device
  logging.getLogger().setLevel(logging.INFO)
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  compile_cache.enable(config.compile_cache_dir)
  # The one-device layout puts every worker on this process's device; an actor holds one
  # worker (or the server, no worker): the layout's memory estimate is not this process's.
  r = build(one_device(config), check_memory=False)
  return r, jitted_steps(r, donate=False)


def _initial_state(r) -> steps.TrainState:
  """Round 0's global state (θ and the run's key) as the runner makes it, without the
  workers' states `rounds.init_run` would make beside it."""
  with jax.set_mesh(r.topology.mesh):
    return jax.jit(r.state_spec.init, out_shardings=r.state_spec.shardings)(
        r.state_spec.initial_params())


def server_rules(r) -> dict:
  """Each server's rule, by name: an asynchronous algorithm's server rules (HALoS: a
  regional server per region beside the global one), or a synchronous one's outer rule
  for the one global server (applied to each quorum round's token-weighted mean Δ, or to a
  collaborative epoch's sample-weighted mean gradient: DDP's rule is its optimizer)."""
  from lowcomm_jax.simulate import make_plan
  if r.algorithm.synchronous:
    return {GLOBAL: r.outer_rules[0]}
  return r.algorithm.server_rules(r.config, make_plan(r.config, r))


class ServerProcess:
  """The global parameter server: θ, the algorithm's server rule and its state, the version
  (pushes applied), and the models that jobs still out pulled (their drift; and a resumed
  run's jobs start again from them)."""

  def __init__(self, config: ml_collections.ConfigDict, restored: dict | None = None,
               name: str = GLOBAL, *, standby: bool = False):
    """Server `name` from `restored` (a checkpoint's) or fresh. A `standby` is built (its
    process started, the run built, nothing compiled yet) and holds no state: `load` makes
    it a server when one dies (`ray.standby_server`)."""
    self.r, self.programs = r, _ = _built(config)
    codec = r.sync.codec
    self._decode = (jax.jit(parameter_server.make_decode(codec, r.model.layout)) if codec
                    else None)
    self._norm = jax.jit(lambda p: jnp.sqrt(jnp.sum(jnp.square(p))))
    self._lps_delta = jax.jit(outer.pseudo_gradient)  # θ_ref − θ_LPS
    self._merge = jax.jit(outer.merge_global, static_argnums=3)
    self.mesh = r.topology.mesh
    self.windows = jax.device_put(r.data.eval_windows)
    self.version = -1  # (a standby: no state yet)
    if not standby:
      self.load(restored, name)

  def load(self, restored: dict | None, name: str = GLOBAL) -> int:
    """Becomes server `name`: its state from `restored`, or fresh. Returns its version."""
    self.name = name
    rule = server_rules(self.r)[name]
    self._apply = jax.jit(parameter_server.make_apply(rule))
    self.snapshots = {}  # version -> [params, jobs out that pulled it]
    self._expected = {}  # version -> jobs out that pulled it from a server before this one
    self._round_sum, self._round_tokens = None, 0.0  # a quorum round's Σ tokens·Δ, Σ tokens
    self._replaying = False
    if restored is None:
      params = _initial_state(self.r).params
      self.params, self.opt_state = params, rule.init(params)
      self.version = 0
      # A regional server (HALoS's LPS): its model after the last merge, and at its last
      # push to the global server.
      self.reference = self.at_push = params if name != GLOBAL else None
    else:
      self.params = jnp.asarray(restored["params"])
      self.opt_state = jax.tree.map(jnp.asarray, restored["opt_state"])
      self.version = int(restored["version"])
      self.snapshots = {int(v): [jnp.asarray(p), 0]
                        for v, p in restored.get("snapshots", {}).items()}
      self.reference = (jnp.asarray(restored["reference"]) if "reference" in restored
                        else None)
      self.at_push = jnp.asarray(restored["at_push"]) if "at_push" in restored else None
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
      self.snapshots[self.version] = [self.params, self._expected.pop(self.version)]

  def theta(self) -> tuple[int, np.ndarray]:
    """(version, θ) for a collaborative epoch's micro-batches: nothing is held for them
    (their gradients are at θ: there is no drift to measure)."""
    return self.version, np.asarray(self.params)

  def pull(self, version: int | None = None) -> tuple[int, np.ndarray]:
    """(version, θ) for a worker's next job: the newest, or (a job started again after a
    resume) the one that job had pulled."""
    if version is None:
      version = self.version
      held = self.snapshots.setdefault(version, [self.params, 0])
    else:
      held = self.snapshots[version]
    held[1] += 1
    return version, np.asarray(held[0])

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
    self.params, self.opt_state, drift = self._apply(self.params, self.opt_state, delta, pulled)
    self.version += 1
    self._hold()
    return {"version": self.version, "staleness": staleness,
            "drift": None if drift is None else float(drift)}

  def contribute(self, meta: dict, sent) -> dict:
    """Adds one contribution to the open round (weighted by its tokens: a quorum round's Δ,
    or an epoch's mean gradient); its staleness in rounds."""
    delta = self._delta(meta, sent)
    tokens = float(meta["tokens"])
    self._round_sum = (tokens * delta if self._round_sum is None
                       else self._round_sum + tokens * delta)
    self._round_tokens += tokens
    self._release(meta["version"])
    return {"staleness": self.version - meta["version"]}

  def close_round(self) -> dict:
    """The round's outer step on its contributions' token-weighted mean Δ."""
    contributed = self._round_tokens > 0
    if contributed:
      mean = self._round_sum / self._round_tokens
      self.params, self.opt_state, _ = self._apply(self.params, self.opt_state, mean)
    self._round_sum, self._round_tokens = None, 0.0
    self.version += 1
    self._hold()
    return {"version": self.version, "applied": contributed}

  # --- HALoS: a regional server's exchange with the global one (sim/schedules.Halos) ----

  def lps_push(self) -> tuple[dict, np.ndarray]:
    """A regional server's push: (info, its change since the last merge θ_ref − θ)."""
    delta = self._lps_delta(self.reference, self.params)
    self.at_push = self.params
    return {"version": self.version}, np.asarray(delta)

  def apply_lps_push(self, delta) -> tuple[dict, np.ndarray]:
    """The global server takes a regional server's push: (info, its model after it)."""
    self.params, self.opt_state, _ = self._apply(self.params, self.opt_state,
                                                 jnp.asarray(delta))
    self.version += 1
    return {"version": self.version}, np.asarray(self.params)

  def merge(self, global_params, alpha: float) -> dict:
    """A regional server merges the global model it got back (weight `alpha`)."""
    self.params, self.reference = self._merge(self.params, self.at_push,
                                              jnp.asarray(global_params), alpha)
    return {"version": self.version}

  def state(self, versions=()) -> dict:
    """What a checkpoint holds of the server (host arrays), with the models jobs still out
    pulled at `versions`."""
    out = {"params": np.asarray(self.params), "opt_state": jax.device_get(self.opt_state),
           "version": self.version,
           "snapshots": {str(v): np.asarray(self.snapshots[v][0])
                         for v in sorted(set(versions)) if v in self.snapshots}}
    if self.reference is not None:
      out.update(reference=np.asarray(self.reference), at_push=np.asarray(self.at_push))
    return out

  def evaluate(self) -> float:
    with jax.set_mesh(self.mesh):
      return float(self.programs.eval(self.params, self.windows))

  def param_norm(self) -> float:
    return float(self._norm(self.params))


class WorkerProcess:
  """One worker: its inner optimizer state, its data stream, its codec's error buffer; a job
  is `steps` local steps from a pulled θ, returned as (meta, what it sends)."""

  def __init__(self, config: ml_collections.ConfigDict, worker: int,
               restored: dict | None = None, step_sleep_s: float = 0.0):
    """`restored`: {"data": its stream's state} (a worker that rejoins), and from a
    checkpoint {"state", "codec"} too."""
    from lowcomm_jax.parallel import mesh as mesh_lib
    restored = restored or {}
    self.worker, self.step_sleep_s, self.delay_s = worker, step_sleep_s, 0.0
    self.r, programs = r, programs = _built(config)
    state = _initial_state(r)
    self.rng = state.rng
    self.local = programs.local[0][0]
    self.mesh = r.topology.local_mesh
    if "state" in restored:
      self.state = jax.tree.map(jnp.asarray, restored["state"])
    else:  # one fresh row of host 0's (all alike)
      with jax.set_mesh(self.mesh):
        init_one = r.programs.init_workers[0]  # (unjitted: `workers` is static)
        self.state = jax.jit(lambda params: init_one(params, workers=1))(
            mesh_lib.local_view(state.params, self.mesh))
    self.batches_on = mesh_lib.round_batches(self.mesh)
    self.ids = jax.device_put(np.asarray([worker], np.int32), mesh_lib.per_worker(self.mesh))
    self.streams = r.data.streams[0].of_workers([worker])
    if "data" in restored:
      self.streams.set_state(restored["data"])
    codec = r.sync.codec
    self.encode = (jax.jit(jax.vmap(parameter_server.make_encode(codec, r.model.layout)))
                   if codec else None)
    self.codec_state = (jax.tree.map(jnp.asarray, restored["codec"]) if "codec" in restored
                        else jax.tree.map(lambda x: x[None], codec.init(r.model.layout.abstract))
                        if codec else ())
    # The job running (or last run) and what the worker held before it: a checkpoint taken
    # while that job is unpushed keeps these, and the resumed run runs the job again. The
    # lock: a checkpoint (the actor's second thread) reads them while a job runs.
    self.running, self.before = None, None
    self._lock = threading.Lock()
    # A collaborative epoch (micro/collect): its θ's version, the sums of the micro-batches
    # done at that θ, and the last epoch collected (a micro-batch of it that finishes later
    # is not counted).
    self.accumulate = programs.accumulate[0] if programs.accumulate else None
    self.epoch, self.collected = None, None
    if self.accumulate is not None:  # compiled before it counts as up: a joining peer's
      self._begin_epoch(-1, np.asarray(state.params))  # first micro-batch is not a compile
      zeros = np.zeros((1, r.config.data.batch_size, r.config.data.seq_len + 1), np.int32)
      with jax.set_mesh(self.mesh):
        jax.block_until_ready(self.accumulate(self.epoch["view"], self.epoch["sums"], zeros,
                                              self.ids, np.int32(0)))
      self.epoch = None

  def ping(self) -> int:
    return self.worker

  def delay(self, seconds: float) -> None:
    """From now on each push waits `seconds` before it is sent (chaos)."""
    self.delay_s = seconds

  def _view(self, version: int, params: np.ndarray) -> steps.TrainState:
    """What the local programs read of the global state pulled at `version`."""
    return self.r.local_input(steps.TrainState(
        jnp.asarray(version, jnp.int32), self.rng, jnp.asarray(params), ()))

  def _to_send(self, view, update, meta: dict):
    """What goes to the server for `update` [1, N] (a job's Δ, an epoch's mean gradient):
    itself, or the codec's payload (error buffer kept here; its key in `meta`, for the
    server's decode)."""
    if self.encode is None:
      return np.asarray(update[0])
    keys = parameter_server.codec_keys(view, self.ids)
    payload, self.codec_state = self.encode(update, self.codec_state, keys)
    meta["codec_key"] = np.asarray(jax.random.key_data(keys[0]))
    return jax.device_get(jax.tree.map(lambda x: x[0], payload))

  def checkpoint_state(self, unpushed_job: int | None) -> dict:
    """Its state for a checkpoint: as it was before job `unpushed_job` (started or not) if
    that job's push is not applied yet, else as it is."""
    with self._lock:
      if unpushed_job is not None and self.running == unpushed_job:
        state, codec_state, data = self.before
      else:  # no job of it started: it is as it was before
        state, codec_state, data = self.state, self.codec_state, self.streams.get_state()
    return {"state": jax.device_get(state), "codec": jax.device_get(codec_state), "data": data}

  def job(self, version: int, params: np.ndarray, lr_step: int, steps_: int,
          order: int) -> tuple[dict, object]:
    start = time.perf_counter()
    with self._lock:
      self.before = (self.state, self.codec_state, self.streams.get_state())
      self.running = order
    view = self._view(version, params)
    workers = self.state._replace(opt_state=optimizers.at_schedule_step(
        self.state.opt_state, np.asarray([lr_step], np.int32)))
    batches = jax.device_put(self.streams.next_steps([0], steps_), self.batches_on)
    meta = {"worker": self.worker, "version": int(version), "steps": steps_, "order": order,
            "tokens": int(self.r.tokens(steps_))}
    with jax.set_mesh(self.mesh):
      deltas, self.state, losses = self.local(view, workers, batches, self.ids)
      sent = self._to_send(view, deltas, meta)
    meta.update(loss=float(losses.mean()), compute_seconds=time.perf_counter() - start,
                data=self.streams.get_state())
    time.sleep(self.step_sleep_s * steps_ + self.delay_s)
    meta["job_seconds"] = time.perf_counter() - start  # what DyLU's speeds are made of
    return meta, sent

  # --- collaborative epochs (ray_runtime/epochs.py) ---------------------------------------

  def _begin_epoch(self, version: int, params: np.ndarray) -> None:
    view = self._view(version, params)
    sums = jnp.zeros((1, self.r.model.layout.size), jnp.float32)
    self.epoch = {"version": version, "view": view, "sums": sums, "micro": 0, "samples": 0,
                  "loss_sum": 0.0, "seconds": 0.0}

  def micro(self, version: int, params: np.ndarray) -> dict:
    """One micro-batch of the epoch at θ of `version`: its gradient times its samples is
    added to the peer's sums, which stay here until `collect`. "counted" is False if that
    epoch was collected while it ran (its samples are lost)."""
    start = time.perf_counter()
    with self._lock:  # (a checkpoint reads the stream's position)
      if self.epoch is None or self.epoch["version"] != version:
        self._begin_epoch(version, params)
      epoch = self.epoch
      batch = self.streams.next_round(1)[:, 0]
    with jax.set_mesh(self.mesh):
      sums, losses = self.accumulate(epoch["view"], epoch["sums"], batch, self.ids,
                                     np.int32(epoch["micro"]))
      loss = float(np.asarray(losses)[0])  # waits: the micro-batch counts once it is done
    took = time.perf_counter() - start
    time.sleep(self.step_sleep_s + self.delay_s)
    samples = batch.shape[1]
    with self._lock:
      counted = self.epoch is epoch and self.collected != version
      if counted:
        epoch.update(sums=sums, micro=epoch["micro"] + 1, samples=epoch["samples"] + samples,
                     loss_sum=epoch["loss_sum"] + loss * samples,
                     seconds=epoch["seconds"] + took)
    return {"worker": self.worker, "version": int(version), "counted": counted,
            "samples": samples, "compute_seconds": took,
            "job_seconds": time.perf_counter() - start}

  def collect(self, version: int) -> tuple[dict, object]:
    """The epoch's contribution: (meta, its mean gradient Σ B·g / Σ B, or the codec's
    payload of it) over the micro-batches done at θ of `version`; samples 0 (and nothing
    to send) if none is. A micro-batch still running is not waited for, and not counted."""
    with self._lock:
      self.collected = version
      epoch, self.epoch = self.epoch, None
    meta = {"worker": self.worker, "version": int(version), "samples": 0, "tokens": 0,
            "steps": 0}
    if epoch is None or epoch["version"] != version or epoch["samples"] == 0:
      return meta, None
    with jax.set_mesh(self.mesh):
      sent = self._to_send(epoch["view"], epoch["sums"] / epoch["samples"], meta)
    meta.update(samples=epoch["samples"], tokens=epoch["samples"] * self.r.config.data.seq_len,
                loss=epoch["loss_sum"] / epoch["samples"], micro=epoch["micro"],
                batch_size=self.r.config.data.batch_size,
                compute_seconds=epoch["seconds"], data=self.streams.get_state())
    return meta, sent
