"""Overlap Local-SGD (Wang, Tantia, Ballas, Rabbat 2020): workers keep their own models and
never wait for an average; an anchor model pulls them together.

Every τ = H inner steps each worker

    waits for the average launched τ steps ago (it had those steps to arrive),
    pulls back toward the anchor:   x_w ← (1 − α)·x_w + α·z       (α = overlap.alpha)
    the anchor moves to the average that arrived, with momentum β (outer/anchor.py),
    launches the average of its pulled-back model (as Δ_w = z − x_w) and goes on.

Workers are never reset to z: the pull-back is their only coupling, so their models stay
apart by about the drift of one period. The global θ of this code base is the anchor z (what
is evaluated and checkpointed as the model). Reconstructed from the paper's description
(BUILD_NOTES.md). In the simulator a period waits for the previous period's average, not
its own.
"""

import ml_collections

from lowcomm_jax import outer
from lowcomm_jax.algorithms.base import Segment, field_problem
from lowcomm_jax.algorithms.one_step_delay import OneStepDelay


class OverlapLocalSGD(OneStepDelay):
  name = "overlap"
  config_section = "overlap"
  summary = ("Overlap Local-SGD: workers keep their models, pull back toward an anchor every "
             "H steps; the anchor follows the average one period late")

  def config_defaults(self):
    s = ml_collections.ConfigDict()
    s.alpha = 0.2  # pull-back every H steps: x_w <- (1 - alpha) * x_w + alpha * anchor
    s.anchor_momentum = 0.0  # beta: the anchor follows the average that arrived with momentum
    return s

  def problems(self, c):
    out = super().problems(c)
    if not 0.0 < c.overlap.alpha <= 1.0:
      out.append(field_problem(c, "overlap.alpha", "the pull-back weight must be in (0, 1] "
                               "(1: every worker restarts from the anchor)"))
    if not 0.0 <= c.overlap.anchor_momentum < 1.0:
      out.append(field_problem(c, "overlap.anchor_momentum", "must be in [0, 1)"))
    return out

  def segments(self, c, inner_steps):
    # H steps, then the pull-back (a mix with the anchor at the segment's end, in every
    # round: the anchor is θ^0 before anything arrived), then the sync.
    return [Segment(start=0, steps=inner_steps, sync=0, mix=0, mix_at=inner_steps,
                    mix_in_first_round=True)]

  def mix(self, c):
    return 1.0 - float(c.overlap.alpha)  # the weight a worker keeps on its own model

  def outer_rule(self, c, inner_tx, layout):
    return outer.anchor_momentum(c.overlap.anchor_momentum)


ALGORITHM = OverlapLocalSGD()
