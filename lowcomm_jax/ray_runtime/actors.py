"""The Ray runtime's two kinds of process, as plain classes: driver.py runs them as Ray
actors (`ray.remote(...)(ServerProcess)`); tests may also run them in-process.

Both build the run as the simulator does (one device, `simulate.one_device`), so a worker
runs the simulator's jitted local program and the server the same rule, through the same
`parameter_server.make_apply`, as the simulator's servers. What crosses Ray's object store
is host numpy: θ on a pull, Δ (as the server receives it: decode(encode(Δ)) under a codec)
on a push, and small dicts.
"""

import logging
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lowcomm_jax import optimizers, parameter_server, steps
from lowcomm_jax.sim import GLOBAL


def _built(config: ml_collections.ConfigDict):
  """The run as the simulator builds it, and its jitted programs (compiled programs shared
  with the other workers through the compilation cache, as hosts of a runner share them)."""
  from lowcomm_jax import compile_cache
  from lowcomm_jax.build import build
  logging.getLogger().setLevel(logging.INFO)
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  compile_cache.enable(config.compile_cache_dir)
  from lowcomm_jax.rounds import jitted_steps
  from lowcomm_jax.simulate import one_device
  r = build(one_device(config))
  return r, jitted_steps(r, donate=False)


class ServerProcess:
  """The global parameter server: θ, the algorithm's server rule and its state, the version
  (pushes applied), and the models that jobs still out pulled (for their drift)."""

  def __init__(self, config: ml_collections.ConfigDict, restored: dict | None = None):
    from lowcomm_jax.rounds import init_run
    from lowcomm_jax.simulate import make_plan
    self.r, self.programs = r, programs = _built(config)
    rules = r.algorithm.server_rules(r.config, make_plan(r.config, r))
    if set(rules) != {GLOBAL}:
      raise ValueError(f"algorithm={config.algorithm!r} has servers {sorted(rules)}; the Ray "
                       "runtime runs one global server")
    self._apply = jax.jit(parameter_server.make_apply(rules[GLOBAL]))
    self._norm = jax.jit(lambda p: jnp.sqrt(jnp.sum(jnp.square(p))))
    self.mesh = r.topology.mesh
    if restored is None:
      state, _ = init_run(r, programs)
      self.params, self.opt_state = state.params, rules[GLOBAL].init(state.params)
      self.version = 0
    else:
      self.params = jnp.asarray(restored["params"])
      self.opt_state = jax.tree.map(jnp.asarray, restored["opt_state"])
      self.version = int(restored["version"])
    self.windows = jax.device_put(r.data.eval_windows)
    self.snapshots = {}  # version -> [params, jobs out that pulled it]

  def ping(self) -> int:
    return self.version

  def pull(self) -> dict:
    """θ and its version, for a worker's next job."""
    held = self.snapshots.setdefault(self.version, [self.params, 0])
    held[1] += 1
    return {"params": np.asarray(self.params), "version": self.version}

  def _release(self, version: int):
    held = self.snapshots.get(version)
    if held is None:  # pulled from a server that died since: its drift is not known
      return None
    held[1] -= 1
    if held[1] <= 0:
      del self.snapshots[version]
    return held[0]

  def drop(self, pulled: dict) -> None:
    """A job that pulled this will never push (its worker was lost)."""
    self._release(pulled["version"])

  def push(self, meta: dict, delta: np.ndarray) -> dict:
    """Applies one contribution; its staleness (versions applied since it pulled) and drift."""
    pulled = self._release(meta["version"])
    staleness = self.version - meta["version"]
    self.params, self.opt_state, drift = self._apply(self.params, self.opt_state,
                                                     jnp.asarray(delta), pulled)
    self.version += 1
    return {"version": self.version, "staleness": staleness,
            "drift": None if drift is None else float(drift)}

  def state(self) -> dict:
    """What a checkpoint holds of the server (host arrays)."""
    return {"params": np.asarray(self.params), "opt_state": jax.device_get(self.opt_state),
            "version": self.version}

  def evaluate(self) -> float:
    with jax.set_mesh(self.mesh):
      return float(self.programs.eval(self.params, self.windows))

  def param_norm(self) -> float:
    return float(self._norm(self.params))


class WorkerProcess:
  """One worker: its inner optimizer state, its data stream, its codec's error buffer; a job
  is `steps` local steps from a pulled θ, returned as (meta, Δ)."""

  def __init__(self, config: ml_collections.ConfigDict, worker: int,
               data_state: dict | None = None, step_sleep_s: float = 0.0):
    from lowcomm_jax.parallel import mesh as mesh_lib
    from lowcomm_jax.rounds import init_run
    self.worker, self.step_sleep_s, self.delay_s = worker, step_sleep_s, 0.0
    self.r, programs = r, programs = _built(config)
    state, workers = init_run(r, programs)
    self.rng = state.rng
    self.state = jax.tree.map(lambda x: x[:1], workers[0])  # fresh rows are all alike
    self.local = programs.local[0][0]
    self.mesh = r.topology.local_mesh
    self.batches_on = mesh_lib.round_batches(self.mesh)
    self.ids = jax.device_put(np.asarray([worker], np.int32), mesh_lib.per_worker(self.mesh))
    self.streams = r.data.streams[0].of_workers([worker])
    if data_state is not None:
      self.streams.set_state(data_state)
    codec = r.sync.codec
    self.roundtrip = (jax.jit(jax.vmap(parameter_server.make_roundtrip(codec, r.model.layout)))
                      if codec else None)
    self.codec_state = (jax.tree.map(lambda x: x[None], codec.init(r.model.layout.abstract))
                        if codec else ())

  def ping(self) -> int:
    return self.worker

  def delay(self, seconds: float) -> None:
    """From now on each push waits `seconds` before it is sent (chaos)."""
    self.delay_s = seconds

  def job(self, pulled: dict, lr_step: int, steps_: int) -> tuple[dict, np.ndarray]:
    start = time.perf_counter()
    view = self.r.local_input(steps.TrainState(
        jnp.asarray(pulled["version"], jnp.int32), self.rng, jnp.asarray(pulled["params"]), ()))
    workers = self.state._replace(opt_state=optimizers.at_schedule_step(
        self.state.opt_state, np.asarray([lr_step], np.int32)))
    batches = jax.device_put(self.streams.next_steps([0], steps_), self.batches_on)
    with jax.set_mesh(self.mesh):
      deltas, self.state, losses = self.local(view, workers, batches, self.ids)
      if self.roundtrip is not None:  # the server receives what the codec carries
        deltas, self.codec_state = self.roundtrip(
            deltas, self.codec_state, parameter_server.codec_keys(view, self.ids))
    delta, loss = np.asarray(deltas[0]), float(losses.mean())
    seconds = time.perf_counter() - start
    time.sleep(self.step_sleep_s * steps_ + self.delay_s)
    return ({"worker": self.worker, "version": int(pulled["version"]), "steps": steps_,
             "loss": loss, "compute_seconds": seconds, "data": self.streams.get_state()},
            delta)
