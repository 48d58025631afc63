"""One-step-delayed outer steps (as in PrimeIntellect's prime / INTELLECT-1) as an optax
transform wrapping any outer rule.

When round t's inner phase ends, its averaged pseudo-gradient Δ̄^t starts travelling; the
outer step does not wait for it but applies the previous round's, which has arrived:

    θ^{t+1} = θ^t + rule(Δ̄^{t−1}),   then Δ̄^t is kept for the next round

so the next H inner steps (from θ^{t+1}) can run while Δ̄^t is on the wire. In the first
round nothing has arrived: θ^1 = θ^0 and the rule's state is left as it was (a zero
pseudo-gradient would still advance a rule's counters, e.g. Adam's bias correction). Each
Δ̄ is applied exactly once, one round late; the last round's is never applied (a run of T
rounds makes T − 1 outer steps).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class OneStepDelayState(NamedTuple):
  rule: optax.OptState  # the wrapped rule's state
  previous: optax.Updates  # Δ̄^{t−1}: the aggregate that arrived, applied at the next step
  arrived: jax.Array  # bool: `previous` holds an aggregate (False before the first)
  # The aggregate the last step applied (zeros until one was), with `keep_applied` (eager
  # updates build their proxy from it); () otherwise.
  applied: optax.Updates | tuple = ()


def one_step_delay(rule: optax.GradientTransformation, *,
                   keep_applied: bool = False) -> optax.GradientTransformation:
  """`rule` applied to the aggregate of the previous call; nothing on the first call."""

  def init(params):
    zeros = optax.tree.zeros_like(params, jnp.float32)
    return OneStepDelayState(rule.init(params), zeros, jnp.zeros((), bool),
                             zeros if keep_applied else ())

  def update(aggregate, state, params=None):
    updates, rule_state = rule.update(state.previous, state.rule, params)
    keep = lambda new, old: jnp.where(state.arrived, new, old)
    updates = jax.tree.map(lambda u: keep(u, jnp.zeros_like(u)), updates)
    rule_state = jax.tree.map(keep, rule_state, state.rule)
    # (`previous` is zeros until an aggregate arrived: "applied" is then zeros too.)
    return updates, OneStepDelayState(rule_state, aggregate, jnp.ones((), bool),
                                      state.previous if keep_applied else ())

  return optax.GradientTransformation(init, update)
