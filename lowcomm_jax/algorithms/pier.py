"""Pier (Fan & Zhang 2025): DiLoCo whose outer momentum is produced before it is used and
then decayed, with a warmup and a final drop of the outer lr (outer/pier.py).

Rounds are DiLoCo's; only the outer rule differs. Its schedules read the round count (in the
outer rule's state) over T = `pier.total_rounds` or `rounds`, so a resumed run continues them
where it stopped; one resumed with more `rounds` re-stretches them unless
`pier.total_rounds` pins T (as optimizer.decay_steps pins the inner schedule).
"""

import ml_collections

from lowcomm_jax.algorithms.base import field_problem
from lowcomm_jax.algorithms.diloco import DiLoCo
from lowcomm_jax.outer.pier import boundaries, pier_outer


class Pier(DiLoCo):
  name = "pier"
  config_section = "pier"
  summary = ("Pier: DiLoCo whose outer momentum is filled by averaging rounds first, then "
             "decayed, with an outer-lr warmup and final drop")

  def config_defaults(self):
    # Rounds [0, warmup*T): theta <- the workers' mean, the outer momentum filled
    # (m <- outer.momentum * m + delta). Then for as many rounds the momentum steps through
    # decay_momenta and the outer lr ramps up to outer.lr (the authors use 1.1); from final*T
    # on it is outer.lr * final_lr_ratio (their 0.9 / 1.1). T = total_rounds, or `rounds` (0).
    s = ml_collections.ConfigDict()
    s.warmup = 0.1  # fraction of the rounds that fill the momentum (the authors' 0.1)
    s.decay_momenta = (0.99, 0.95)  # outer momentum in equal parts of the next warmup*T rounds
    s.final_lr_ratio = 0.82  # outer lr from final*T on, as a fraction of outer.lr (0.9 / 1.1)
    s.final = 0.8  # fraction of the rounds where the outer lr drops
    s.total_rounds = 0  # pins T: a run extended on resume keeps its schedules (0: rounds)
    return s

  def problems(self, c):
    p = c.pier
    out = super().problems(c)
    total = p.total_rounds or c.rounds
    if not 0.0 <= p.warmup < 0.5:
      out.append(field_problem(c, "pier.warmup", "the fraction of rounds that fill the outer "
                               "momentum must be in [0, 0.5) (the paper's 0.1)"))
    if any(not 0.0 <= m < 1.0 for m in p.decay_momenta):
      out.append(field_problem(c, "pier.decay_momenta", "each momentum must be in [0, 1)"))
    if not 0.0 < p.final_lr_ratio <= 1.0:
      out.append(field_problem(c, "pier.final_lr_ratio", "the final outer lr as a fraction of "
                               "outer.lr must be in (0, 1] (the authors' 0.9 / 1.1)"))
    if p.total_rounds < 0:
      out.append(field_problem(c, "pier.total_rounds", "use 0 (the run's rounds) or the "
                               "schedules' length in rounds"))
      return out
    produce, ramp, last = boundaries(total, p.warmup, tuple(p.decay_momenta), p.final)
    if not produce + ramp <= last <= total:
      out.append(field_problem(c, "pier.final", f"the lr drop at round {last} must come after "
                               f"the momentum decay (round {produce + ramp}) and by round "
                               f"{total}"))
    if (p.decay_momenta or p.warmup) and produce < max(len(p.decay_momenta), 1):
      out.append(field_problem(c, "pier.warmup", f"{total} rounds give {produce} of momentum "
                               "production; use more rounds or pier.warmup=0 with "
                               "pier.decay_momenta=()"))
    return out

  def outer_rule(self, c, inner_tx, layout):
    p = c.pier
    return pier_outer(c.outer.lr, c.outer.momentum, p.total_rounds or c.rounds,
                      warmup=p.warmup, decay_momenta=tuple(p.decay_momenta),
                      lr_final=c.outer.lr * p.final_lr_ratio, final=p.final,
                      nesterov=c.outer.nesterov)


ALGORITHM = Pier()
