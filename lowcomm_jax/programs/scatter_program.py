"""A quantized reduce-scatter's steps where each runs on its own (the Ray runtime's members:
runtimes/ray/scatter_shards.py), from the run's `Sync` as the lockstep aggregator
(aggregate.compressed_scatter_mean) takes them: the same shards, keys, weights and codec
(compress/sharded.py), so that a full round equals the lockstep sync up to float rounding."""

import jax
import jax.numpy as jnp
import optax

from lowcomm_jax.parallel.flat import ParamLayout
from lowcomm_jax.programs.steps import Signals, TrainState
from lowcomm_jax.programs.sync_program import coordinate_weights_of, make_reduced_apply


def scatters(sync) -> bool:
  """Whether a round's payloads are reduce-scattered (compress.reduce='scatter')."""
  return sync.codec is not None and sync.codec.sharded is not None


def make_shard_reduce(sync, *, layout: ParamLayout, fragment: int):
  """`reduce(payloads[M, ...], keys[M], hidden[M], tokens[M], shard, round_index) ->
  payload`: the owner's step for shard `shard` of fragment p, from M members' payloads of
  it: decoded, weighed as the nested mean weighs (tier mask × tokens or 1) where the sync
  is nested, else averaged, and encoded once more (the reduced shard's payload)."""
  part = layout.fragment(fragment)
  sharded, seed = sync.codec.sharded, sync.config.seed
  coordinate_weights = coordinate_weights_of(part)

  def reduce(payloads_M, keys_M, hidden_M, tokens_M, shard, round_index):
    weights = None
    if sync.nested:
      weight_M = tokens_M if sync.weigh_tokens else jnp.ones_like(tokens_M)
      weights = jax.lax.dynamic_index_in_dim(sharded.shard_weights(
          jax.vmap(coordinate_weights)(hidden_M, weight_M), part.abstract), shard, axis=1,
          keepdims=False)
    mean = sharded.reduce_shard(payloads_M, part.abstract, keys_M, shard, weights)
    return sharded.encode_reduced(mean, part.abstract,
                                  sharded.reduced_key(seed, round_index, shard))

  return reduce


def make_scatter_apply(sync, rule: optax.GradientTransformation, *, layout: ParamLayout,
                       fragment: int, count: int, last: bool):
  """`apply(state, reduced[S, ...], signals, full) -> state`: the outer step of fragment p
  on the mean the S reduced shards' payloads decode to (`make_reduced_apply`'s)."""
  part = layout.fragment(fragment)
  sharded, seed = sync.codec.sharded, sync.config.seed
  reduced_apply = make_reduced_apply(sync, rule, layout=layout, fragment=fragment,
                                     count=count, last=last)

  def apply(state: TrainState, reduced_S, signals: Signals, full: bool = False):
    mean = sharded.decode_reduced(reduced_S, part.abstract, seed,
                                  state.round * count + fragment)
    return reduced_apply(state, part.ravel(mean), signals, full)

  return apply
