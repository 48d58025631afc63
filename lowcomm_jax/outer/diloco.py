"""DiLoCo's outer rule (Douillard et al. 2023) as an optax transform on pseudo-gradients.

A round ends with every worker holding Δ_w = θ_global − θ_w. The wiring chains an
aggregator (aggregate/, where communication happens) with this rule:

    optax.chain(aggregate.replica_mean('replica'), diloco_outer(lr=0.7, momentum=0.9))

Δ is a descent direction, so the outer step treats it like a gradient: θ ← θ − lr·(Nesterov Δ̄).
DDP is the one-step special case: Δ_w is the gradient at θ_global and the outer rule is the
per-step optimizer itself (programs/optimizers.py).
"""

import jax
import optax


def pseudo_gradient(global_params, local_params):
  """Δ = θ_global − θ_local."""
  return jax.tree.map(lambda g, l: g - l, global_params, local_params)


def diloco_outer(lr: float, momentum: float, nesterov: bool = True) -> optax.GradientTransformation:
  """SGD with (Nesterov) momentum on the aggregated pseudo-gradient; momentum 0 is plain SGD."""
  return optax.sgd(lr, momentum=momentum or None, nesterov=nesterov and bool(momentum))
