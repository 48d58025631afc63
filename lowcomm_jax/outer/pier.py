"""Pier's outer rule (Fan & Zhang 2025, arXiv 2511.17849): DiLoCo's Nesterov step with the
outer momentum produced before it is used, then decayed, and a scheduled outer lr.

Round r of T (the count of syncs applied), f = r / T, w = `warmup` (a fraction of T):

    r <  wT (momentum production):  m ← β·m + Δ;   θ ← θ − Δ          (the workers' mean)
    r >= wT:                        m ← μ_r·m + Δ;  θ ← θ − η_r·(Δ + μ_r·m)   (Nesterov)

μ_r steps down through `decay_momenta` in equal parts of the next wT rounds, then stays at β
(the outer momentum). η_r ramps linearly from η/n to η over those n = wT rounds, stays at η
until round `final`·T, then is `lr_final`. The authors' code (the paper's body was not
available) uses w = 0.1, μ 0.99 then 0.95, β = 0.9, η = 1.1 and 0.9 from f = 0.8. Where
Pier trains its first wT rounds as DDP, this rule averages the workers' rounds instead
(BUILD_NOTES.md, "Pier").

With warmup 0, no decay momenta and lr_final = lr (or final = 1) it is DiLoCo's
`diloco_outer(lr, β)`: the same operations in the same order (equal to float rounding: μ and
η are traced values here, constants there, which XLA may fuse differently).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class PierState(NamedTuple):
  count: jax.Array  # outer steps taken (rounds)
  momentum: optax.Updates  # m


def boundaries(total_rounds: int, warmup: float, decay_momenta: tuple, final: float):
  """(rounds of momentum production, rounds of the decay and lr ramp, first round at lr_final)."""
  produce = int(round(warmup * total_rounds))
  return produce, produce, int(round(final * total_rounds))


def schedules(total_rounds: int, *, lr: float, momentum: float, warmup: float,
              decay_momenta: tuple, lr_final: float, final: float):
  """(μ(r), η(r), producing(r)) as jittable functions of the round count r."""
  produce, ramp, last = boundaries(total_rounds, warmup, decay_momenta, final)
  momenta = jnp.asarray(tuple(decay_momenta) or (momentum,), jnp.float32)

  def mu(r):
    if not decay_momenta:
      return jnp.asarray(momentum, jnp.float32)
    part = (r - produce) * len(decay_momenta) // max(ramp, 1)
    in_decay = (r >= produce) & (r < produce + ramp)
    return jnp.where(in_decay, momenta[jnp.clip(part, 0, len(decay_momenta) - 1)],
                     jnp.float32(momentum))

  def eta(r):
    ramped = (jnp.float32(lr) * (r - produce + 1).astype(jnp.float32) / ramp if ramp
              else jnp.float32(lr))
    value = jnp.where(r < produce + ramp, ramped, jnp.float32(lr))
    return jnp.where(r >= last, jnp.float32(lr_final), value)

  return mu, eta, lambda r: r < produce


def pier_outer(lr: float, momentum: float, total_rounds: int, *, warmup: float = 0.1,
               decay_momenta: tuple = (0.99, 0.95), lr_final: float = 0.9,
               final: float = 0.8, nesterov: bool = True) -> optax.GradientTransformation:
  mu, eta, producing = schedules(total_rounds, lr=lr, momentum=momentum, warmup=warmup,
                                 decay_momenta=decay_momenta, lr_final=lr_final, final=final)

  def init(params):
    return PierState(jnp.zeros((), jnp.int32), optax.tree.zeros_like(params, jnp.float32))

  def update(g, state, params=None):
    del params
    r = state.count
    produce = producing(r)
    m_r = jnp.where(produce, jnp.float32(momentum), mu(r))
    step = lambda g, m: g + m_r * m  # optax.trace's form, so a constant μ is DiLoCo's exactly
    m = jax.tree.map(step, g, state.momentum)
    u = jax.tree.map(step, g, m) if nesterov else m
    e = eta(r)
    updates = jax.tree.map(lambda u, g: jnp.where(produce, -g, -e * u), u, g)
    return updates, PierState(r + 1, m)

  return optax.GradientTransformation(init, update)
