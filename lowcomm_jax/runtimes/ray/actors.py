"""What the Ray runtime's two kinds of process share: the server (server.py) and the
workers (worker.py) are plain classes that driver.py runs as Ray actors
(`ray.remote(...)(ServerProcess)`); tests may also run them in-process.

Both build the run as the simulator does (one device, `plan.one_device`), so a worker
runs the simulator's jitted local program and the server the same rule, through the same
`programs.servers.make_apply`, as the simulator's servers. What crosses Ray's object store
is host numpy: θ on a pull; on a push the codec's payload (decoded by the server, with the
worker's key) or, without a codec, Δ; and small dicts.
"""

import logging

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lowcomm_jax.programs import steps
from lowcomm_jax.programs import sync_program
from lowcomm_jax.parallel.server_names import GLOBAL


def server_view(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`config` as the server and the driver build it: one device. They hold θ and the outer
  states, whose shapes no mesh changes; a worker's devices (`mesh.data`, `model.tp.size`)
  are its own. The server evaluates θ with the exact model (no tensor-parallel plan)."""
  if config.mesh.data == 1 and config.model.tp.size == 1:
    return config
  out = config.copy_and_resolve_references()
  out.mesh.data, out.model.tp.size = 1, 1
  return out


def built(config: ml_collections.ConfigDict, what: str):
  """The run as the simulator builds it, and its jitted programs (compiled programs shared
  with the other workers through the compilation cache, as hosts of a runner share them).
  A worker's config keeps its devices (`mesh.data` × `model.tp.size` of them: its own mesh,
  as the lockstep runtime runs one host); the server's is `server_view`'s."""
  from lowcomm_jax.run import compile_cache
  from lowcomm_jax.assemble.build import build
  from lowcomm_jax.assemble.jitted import jitted_steps
  from lowcomm_jax.runtimes.ray.cluster import warn_if_niced
  from lowcomm_jax.assemble.plan import one_device
  logging.getLogger().setLevel(logging.INFO)
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  warn_if_niced(what)
  compile_cache.enable(config.compile_cache_dir)
  # The one-device layout puts every worker on this process's device; an actor holds one
  # worker (or the server, no worker): the layout's memory estimate is not this process's.
  r = build(one_device(config), check_memory=False)
  return r, jitted_steps(r, donate=False)


def initial_params(r) -> np.ndarray:
  """The run's θ₀ on the host: made once by the driver and sent to the processes it
  starts, so that none of them makes it again (a rejoining worker's start-up)."""
  return np.asarray(jax.device_get(r.state_spec.initial_params()))


def initial_state(r) -> steps.TrainState:
  """Round 0's global state (θ and the run's key) as the runner makes it, without the
  workers' states `jitted.init_run` would make beside it."""
  with jax.set_mesh(r.topology.mesh):
    return jax.jit(r.state_spec.init, out_shardings=r.state_spec.shardings)(
        r.state_spec.initial_params())


def initial_rule_state(r, name: str, params):
  """Server `name`'s rule state at θ `params`: an asynchronous server's rule's, or a
  synchronous run's outer rules' (a tuple, one per fragment, the runner's `per_fragment`),
  or where the workers read their own rows of the sync's state (NoLoCo) the runner's whole
  outer state, rows and all."""
  if r.local_reads_own:
    return r.state_spec.init(params).outer
  if r.algorithm.synchronous:
    layout = r.model.layout
    return tuple(rule.init(layout.fragment_slice(params, p))
                 for p, rule in enumerate(r.outer_rules))
  return server_rules(r)[name].init(params)


def server_rules(r) -> dict:
  """Each server's rule, by name: an asynchronous algorithm's server rules (HALoS: a
  regional server per region beside the global one), or a synchronous one's outer rule
  for the one global server (applied to each quorum round's token-weighted mean Δ, or to a
  collaborative epoch's sample-weighted mean gradient: DDP's rule is its optimizer)."""
  from lowcomm_jax.assemble.plan import make_plan
  if r.algorithm.synchronous:
    return {GLOBAL: r.outer_rules[0]}
  return r.algorithm.server_rules(r.config, make_plan(r.config, r))


def round_syncs(r) -> list:
  """The synchronous algorithm's sync per segment, as a parameter server runs it over every
  row at once (the server, and each member of a round in the peer form)."""
  segments = r.algorithm.segments(r.config, r.config.inner_steps)
  return [jax.jit(sync_program.make_server_sync(
              r.sync, r.outer_rules[s.sync], layout=r.model.layout, fragment=s.sync,
              count=len(segments), last=k == len(segments) - 1), static_argnames="full")
          for k, s in enumerate(segments)]


def round_inputs(r, rows: dict, rng) -> tuple:
  """A round's rows ({worker: (what it sent, its meta)}) in worker order (zeros where a
  worker sent nothing), the senders' codec keys, and the signals (tokens 0: no row), with
  a row per worker slot of `r`."""
  slots = r.config.num_workers
  tokens, losses = np.zeros(slots, np.float32), np.zeros(slots, np.float32)
  keys = np.zeros((slots,) + rng.shape, rng.dtype)  # (key data, as the run's)
  sent = {}
  for w, (payload, meta) in rows.items():
    tokens[w], losses[w] = meta["tokens"], meta.get("loss", 0.0)
    sent[w] = payload
    if "codec_key" in meta:
      keys[w] = meta["codec_key"]
  like = next(iter(sent.values()))
  zeros = jax.tree.map(np.zeros_like, like)
  received = jax.tree.map(lambda *rows_: jnp.asarray(np.stack(rows_)),
                          *[sent.get(w, zeros) for w in range(slots)])
  return received, jax.random.wrap_key_data(jnp.asarray(keys)), round_signals(r, tokens, losses)


def round_signals(r, tokens, losses) -> steps.Signals:
  """A round's signals, a row per worker slot: hidden units, tokens (0: no row), losses."""
  return steps.Signals(jnp.asarray(r.topology.hidden_per_worker),
                       jnp.asarray(tokens, jnp.float32), jnp.asarray(losses, jnp.float32))
