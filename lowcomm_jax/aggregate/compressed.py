"""Compressed mean: encode locally, all-gather the payloads, decode and average; or, for a
sharded quantizer (compress.reduce='scatter'), reduce-scatter them (`compressed_scatter_mean`).

The codec (compress/) is passed in, not imported: aggregators only need its interface
(`init`, `encode`, `average`, `decode_sum`). The payload arrays are all that crosses the
network, so the ledger counts exactly the packed bytes.

State is per worker: the codec's error-feedback buffer and a round counter. Every sender's
key derives from the round, so receivers regenerate the senders' random draws (random-k's
positions). The runner's outer step passes the global round as `round_index`: the counter
is stacked [R] like the rest of the state, so vmap treats whatever derives from it — the
decoded mean, then θ_global, which must come out unmapped — as per worker, though every
copy is equal. Without `round_index` (callers that map every output) the counter is used.

Tier-aware (aggregate/nested.py): with `sender_weights` (every worker's a_w, stacked [R, ...],
known to all from the host table) and `weight_totals` (Σ_w a_w) the result is
Σ_w a_w ⊙ decode(payload_w) / Σ_w a_w. The weights are applied after decoding, so what a
lossy codec reconstructs outside a narrow worker's tier (a DCT chunk straddling the tier
edge, say) never counts.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowcomm_jax.parallel import collectives, weighted


class CompressedMeanState(NamedTuple):
  count: jax.Array  # rounds encoded so far
  codec_state: Any  # this worker's error-feedback buffer (or ())


def compressed_mean(codec, axis_name: str = "replica", seed: int = 0
                    ) -> optax.GradientTransformationExtraArgs:
  """Mean over the workers on `axis_name` of their decoded, compressed updates."""

  def init_fn(params):
    return CompressedMeanState(jnp.zeros((), jnp.int32), codec.init(params))

  def update_fn(updates, state, params=None, *, sender_weights=None, weight_totals=None,
                round_index=None, **extra_args):
    del params, extra_args  # e.g. the nested mean's own coordinate_weights
    payloads, sender_keys, codec_state = _encode_and_gather(codec, updates, state, round_index,
                                                            axis_name, seed)
    if sender_weights is None:
      mean = codec.average(payloads, updates, sender_keys)
    else:
      total = codec.weighted_sum(payloads, updates, sender_keys, sender_weights)
      mean = jax.tree.map(weighted.divide_by_weight, total, weight_totals)
    return mean, CompressedMeanState(state.count + 1, codec_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def compressed_scatter_mean(codec, axis_name: str = "replica", seed: int = 0
                            ) -> optax.GradientTransformationExtraArgs:
  """The compressed mean as a quantized reduce-scatter (compress.reduce='scatter'; the
  codec is compress/sharded.py's): each worker encodes its update in R shards and sends
  shard k to worker k (all-to-all); worker k decodes its shard of every sender, averages
  them (weighted after decoding, as `compressed_mean`), re-encodes that once and
  all-gathers it; every worker decodes the R reduced shards. Per link 2·(R−1)/R payloads
  where `compressed_mean` moves R−1. The senders' keys and error buffers are
  `compressed_mean`'s."""
  sharded = codec.sharded

  def init_fn(params):
    return CompressedMeanState(jnp.zeros((), jnp.int32), codec.init(params))

  def update_fn(updates, state, params=None, *, sender_weights=None, weight_totals=None,
                round_index=None, **extra_args):
    del params, weight_totals, extra_args
    round_ = state.count if round_index is None else round_index
    size, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    if size != sharded.shards:
      raise ValueError(f"a reduce-scatter cut for {sharded.shards} workers runs over {size}")
    keys = sender_keys(seed, round_, jnp.arange(size))
    payload, codec_state = codec.encode(updates, state.codec_state, keys[me])
    mine = collectives.all_to_all(payload, axis_name)  # my shard of every sender's payload
    weights = None
    if sender_weights is not None:  # [R, S, L] -> every sender's weights of my shard
      weights = jax.lax.dynamic_index_in_dim(sharded.shard_weights(sender_weights, updates),
                                             me, axis=1, keepdims=False)
    reduced = sharded.reduce_shard(mine, updates, keys, me, weights)
    reduced = sharded.encode_reduced(reduced, updates, sharded.reduced_key(seed, round_, me))
    mean = sharded.decode_reduced(collectives.all_gather(reduced, axis_name), updates, seed,
                                  round_)
    return mean, CompressedMeanState(state.count + 1, codec_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def compressed_gather(codec, axis_name: str = "replica", seed: int = 0
                      ) -> optax.GradientTransformationExtraArgs:
  """Every worker's decoded, compressed update, stacked [R, ...] on every worker: what a
  robust rule combines (aggregate/robust.py) when a codec compresses the sync. The same
  payloads cross the network as for the compressed mean."""

  def init_fn(params):
    return CompressedMeanState(jnp.zeros((), jnp.int32), codec.init(params))

  def update_fn(updates, state, params=None, *, round_index=None, **extra_args):
    del params, extra_args
    payloads, sender_keys, codec_state = _encode_and_gather(codec, updates, state, round_index,
                                                            axis_name, seed)
    decoded = jax.vmap(lambda payload, key: codec.decode(payload, updates, key))(
        payloads, sender_keys)
    return decoded, CompressedMeanState(state.count + 1, codec_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def sender_keys(seed: int, round_index, senders: jax.Array) -> jax.Array:
  """The codec keys of `senders` (worker indices) in round `round_index`: what every
  receiver regenerates, and what a worker that encodes for a parameter server uses (the Ray
  runtime's quorum rounds), so both runtimes draw the same."""
  round_key = jax.random.fold_in(jax.random.key(seed), round_index)
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(round_key, senders)


def _encode_and_gather(codec, updates, state: CompressedMeanState, round_index, axis_name,
                       seed):
  """This worker's payload, encoded with its key, all-gathered: (payloads [R, ...], every
  sender's key [R], this worker's new codec state)."""
  round_ = state.count if round_index is None else round_index
  size = jax.lax.axis_size(axis_name)
  keys = sender_keys(seed, round_, jnp.arange(size))
  my_key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), round_),
                              jax.lax.axis_index(axis_name))
  payload, codec_state = codec.encode(updates, state.codec_state, my_key)
  return collectives.all_gather(payload, axis_name), keys, codec_state
