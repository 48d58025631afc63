"""One-step-delay DiLoCo (PrimeIntellect's prime, INTELLECT-1): the outer step of round t
applies the previous round's averaged pseudo-gradient, so round t's own average can travel
while the next H inner steps compute.

    after inner phase t:  Δ^t_w = θ^t − θ^t_w   starts averaging (Δ̄^t in flight)
                          θ^{t+1} = θ^t + OuterOpt(Δ̄^{t−1})   (nothing in round 1: θ^1 = θ^0)
                          the next H steps run from θ^{t+1} meanwhile

The outer rule is DiLoCo's Nesterov wrapped by `outer.one_step_delay`, whose state keeps
the aggregate that arrived (checkpointed with the rest: a resumed run applies it as the
uninterrupted one would). The workers restart from θ every round, as in DiLoCo. In the
simulator the transfer of Δ̄^t overlaps round t+1's compute: a round waits for the
previous round's transfer, not its own.
"""

import dataclasses

import optax

from lowcomm_jax.algorithms.diloco import DiLoCo
from lowcomm_jax.outer.one_step_delay import one_step_delay


class OneStepDelay(DiLoCo):
  name = "one_step_delay"
  server_schedule = False  # (its simulator schedule has no parameter server's form)
  summary = ("DiLoCo whose outer step applies the previous round's mean pseudo-gradient, "
             "so this round's travels during the next inner steps")

  keep_applied = False  # eager updates read the last applied average too
  delayed_sync = True

  def outer_rule(self, c, inner_tx, layout) -> optax.GradientTransformation:
    return one_step_delay(DiLoCo.outer_rule(self, c, inner_tx, layout),
                          keep_applied=self.keep_applied)

  def schedule(self, plan, backend):
    from lowcomm_jax.sim.sync_schedules import StreamingRounds
    # One fragment whose average is needed only when the next round ends: a whole round of
    # compute hides its transfer.
    return StreamingRounds(dataclasses.replace(plan, overlap_steps=max(plan.inner_steps)),
                           backend)


ALGORITHM = OneStepDelay()
