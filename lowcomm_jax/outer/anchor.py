"""Overlap Local-SGD's anchor (Wang, Tantia, Ballas, Rabbat 2020) as an optax transform on
the aggregated pseudo-gradient, applied one sync late.

The workers' models x_w are averaged in the background; the anchor z (the global θ here)
moves to the average that arrived, with momentum. A sync at anchor z_k receives
Δ̄_k = z_k − x̄_k (the mean of the workers' z_k − x_w): the average model is x̄_k = z_k − Δ̄_k,
kept for the next sync, which moves the anchor with the one that arrived:

    v ← β·v + (z_k − x̄_{k−1});   z_{k+1} = z_k − v     (β = 0: the anchor becomes x̄_{k−1})

The first sync has nothing that arrived: the anchor stays (and v at 0).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class AnchorState(NamedTuple):
  velocity: optax.Updates  # v
  average: optax.Updates  # x̄ of the last sync: the average in flight
  arrived: jax.Array  # bool: `average` holds one


def anchor_momentum(momentum: float) -> optax.GradientTransformation:
  def init(params):
    zeros = optax.tree.zeros_like(params, jnp.float32)
    return AnchorState(zeros, zeros, jnp.zeros((), bool))

  def update(aggregate, state, params):
    if params is None:
      raise ValueError("anchor_momentum needs params (the anchor)")
    velocity = jax.tree.map(lambda v, z, a: jnp.where(state.arrived, momentum * v + (z - a), v),
                            state.velocity, params, state.average)
    updates = jax.tree.map(lambda v: jnp.where(state.arrived, -v, jnp.zeros_like(v)), velocity)
    average = jax.tree.map(lambda z, d: z - d, params, aggregate)
    return updates, AnchorState(velocity, average, jnp.ones((), bool))

  return optax.GradientTransformation(init, update)
