"""What a Ray worker sends for an update (a job's Δ, an epoch's mean gradient): the update
itself, or its codec's payload, with the codec's error buffer kept on the worker.

Apart from the actor (worker.py), so that a test can put rows through exactly what a worker
sends without starting one (tests/test_ray_peers.py holds them against the lockstep sync)."""

import jax
import jax.numpy as jnp
import numpy as np

from lowcomm_jax import aggregate
from lowcomm_jax.programs import servers
from lowcomm_jax.runtimes.ray.catch_up import nbytes


class Sender:
  """Worker `ids` ([1] worker id)'s encoder and error buffer per fragment, as the runner's
  aggregators (one fragment for most algorithms; a push or an epoch's gradient is fragment
  0, the whole model). `codec_state`: a restored error buffer (a checkpoint's)."""

  def __init__(self, r, ids: jax.Array, codec_state=None):
    self.r, self.ids = r, ids
    self.segments = r.algorithm.segments(r.config, r.config.inner_steps)
    codec, layout = r.sync.codec, r.model.layout
    fragments = [layout.fragment(p) for p in range(layout.num_fragments)]
    self.encoders = ([jax.jit(jax.vmap(servers.make_encode(codec, part))) for part in fragments]
                     if codec else None)
    self.codec_state = (jax.tree.map(jnp.asarray, codec_state) if codec_state is not None
                        else tuple(jax.tree.map(lambda x: x[None], codec.init(part.abstract))
                                   for part in fragments) if codec else ())

  def send(self, view, update, meta: dict, segment: int = 0):
    """What goes out for `update` [1, N] computed from `view` in `segment`: itself, or the
    codec's payload (its key in `meta`, for the receivers' decode); its size in
    meta["bytes"]."""
    if self.encoders is None:
      sent = np.asarray(update[0])
    else:
      keys = self._codec_keys(view, segment)
      fragment = self.segments[segment].sync
      payload, state = self.encoders[fragment](update, self.codec_state[fragment], keys)
      self.codec_state = (self.codec_state[:fragment] + (state,)
                          + self.codec_state[fragment + 1:])
      meta["codec_key"] = np.asarray(jax.random.key_data(keys[0]))
      sent = jax.device_get(jax.tree.map(lambda x: x[0], payload))
    meta["bytes"] = nbytes(sent)
    return sent

  def _codec_keys(self, view, segment: int) -> jax.Array:
    """The codec key for what is sent from `view` in `segment`: in a synchronous run the
    compressed mean's key of that sync (round · segments + its fragment, as the lockstep
    runner's workers draw), else its push's own."""
    if not self.r.algorithm.synchronous:
      return servers.codec_keys(view, self.ids)
    sync_index = view.round * len(self.segments) + self.segments[segment].sync
    return aggregate.sender_keys(self.r.config.seed, sync_index, self.ids)
