"""What a parameter server does to a contribution, and how a contribution is coded: the one code
path for the simulator's servers (runtimes/simulator/backend.py) and the Ray runtime's server and
worker actors (runtimes/ray/). The rules themselves are the algorithm's (`server_rules`)."""

import jax
import optax

from lowcomm_jax import outer
from lowcomm_jax.programs import steps

# Codec keys are not the local round's per-worker keys (those split into step keys): a tag
# is folded into the round key first.
_CODEC_TAG = 0x636F6463


def make_apply(rule: optax.GradientTransformation):
  """A server's step under `rule`, to be jitted: (params, opt_state, Δ, pulled or None) ->
  (params', opt_state', drift)."""
  def apply(params, opt_state, delta, pulled=None):
    """The rule's step, and the drift ‖θ − θ_pulled‖ / ‖θ‖ (how far the server moved while
    the contribution was out) in the same dispatch; None without `pulled`."""
    drift = (None if pulled is None else
             optax.tree.norm(optax.tree.sub(params, pulled)) / optax.tree.norm(params))
    updates, opt_state = rule.update(delta, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, drift
  return apply


def make_roundtrip(codec, layout):
  """decode(encode(Δ)) of one worker's flat Δ (codecs are per tensor), to be vmapped over
  workers: what the server receives."""
  def roundtrip(delta, codec_state, key):
    decoded, codec_state = codec.roundtrip(layout.unravel(delta), codec_state, key)
    return layout.ravel(decoded), codec_state
  return roundtrip


def make_encode(codec, layout):
  """A worker's side of `make_roundtrip`: (flat Δ, codec state, key) -> (payload, state)."""
  def encode(delta, codec_state, key):
    return codec.encode(layout.unravel(delta), codec_state, key)
  return encode


def make_decode(codec, layout):
  """The server's side: (payload, key) -> the flat Δ it applies."""
  def decode(payload, key):
    return layout.ravel(codec.decode(payload, layout.abstract, key))
  return decode


def codec_keys(view: steps.TrainState, worker_ids: jax.Array) -> jax.Array:
  """Each worker's codec key for a job that pulled `view` (its round is the pulled
  version)."""
  codec_key = jax.random.fold_in(steps.round_key(view), _CODEC_TAG)
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(codec_key, worker_ids)


class RegionalExchange:
  """HALoS's exchange between a regional server and the global one (outer/halos.py), as
  steps on a server's arrays: a dict of 'params', 'opt_state' and, for a regional server,
  'reference' (its model after the last merge) and 'at_push' (at its last push). The
  simulator's backend and the Ray server actor both run these; when they run is the
  algorithm's (algorithms/halos.py)."""

  def __init__(self):
    self._delta = jax.jit(outer.pseudo_gradient)  # θ_ref − θ_LPS
    self._merge = jax.jit(outer.merge_global, static_argnums=3)

  def push(self, regional: dict) -> jax.Array:
    """A regional server's push: its change since the last merge (its model at push kept)."""
    delta = self._delta(regional["reference"], regional["params"])
    regional["at_push"] = regional["params"]
    return delta

  @staticmethod
  def take(central: dict, apply, delta) -> jax.Array:
    """The global server applies a push with its rule (`apply`: make_apply's, jitted) and
    answers with its model."""
    central["params"], central["opt_state"], _ = apply(central["params"],
                                                       central["opt_state"], delta)
    return central["params"]

  def merge(self, regional: dict, global_params, alpha: float) -> None:
    """A regional server merges the global model it got back (weight `alpha`)."""
    regional["params"], regional["reference"] = self._merge(
        regional["params"], regional["at_push"], global_params, alpha)

