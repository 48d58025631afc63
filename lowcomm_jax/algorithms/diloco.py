"""DiLoCo (Douillard et al. 2023): H local AdamW steps per worker, then one outer step.

A round is one segment: every worker takes H steps from θ_w = θ, the pseudo-gradients
Δ_w = θ − θ_w are averaged (or a codec's payloads all-gathered and decoded) and the outer
rule, SGD with Nesterov momentum, treats the mean like a gradient:

    θ ← θ − lr·Nesterov(Δ̄)

In the simulator the rounds wait for the slowest worker plus one ring all-reduce; on the
Ray runtime they are quorum rounds (runtimes/ray/driver.py).
"""

import optax

from lowcomm_jax import compress, outer
from lowcomm_jax.algorithms.base import Algorithm, field_problem


def codec_problems(c) -> list[str]:
  """A sign-descent codec (DeMo) is a per-step optimizer: DDP's only."""
  codec = compress.declared(c.compress.codec)
  if codec is not None and codec.sign_descent:
    return [field_problem(c, "algorithm", f"compress.codec={codec.name} is a per-step "
                          "optimizer (sign descent on the decoded momentum); use "
                          f"--config.algorithm=ddp, or another codec for {c.algorithm}")]
  return []


class DiLoCo(Algorithm):
  name = "diloco"
  summary = "H local steps per worker, then an outer Nesterov step on the mean pseudo-gradient"

  def problems(self, c):
    return codec_problems(c)

  def outer_rule(self, c, inner_tx, layout) -> optax.GradientTransformation:
    return outer.diloco_outer(c.outer.lr, c.outer.momentum, c.outer.nesterov)


ALGORITHM = DiLoCo()
