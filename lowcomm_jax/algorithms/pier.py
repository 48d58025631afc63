"""Pier (Fan & Zhang 2025): DiLoCo whose outer momentum is produced before it is used and
then decayed, with a warmup and a final drop of the outer lr (outer/pier.py).

Rounds are DiLoCo's; only the outer rule differs. Its schedules read the round over
`rounds` (the run's length), so a resumed run continues them where it stopped.
"""

from lowcomm_jax.algorithms.base import field_problem
from lowcomm_jax.algorithms.diloco import DiLoCo
from lowcomm_jax.outer.pier import pier_outer


class Pier(DiLoCo):
  name = "pier"
  config_section = "pier"
  summary = ("Pier: DiLoCo whose outer momentum is filled by averaging rounds first, then "
             "decayed, with an outer-lr warmup and final drop")
  runs_on_ray = False  # its quorum rounds would need the schedules' round count: not tested

  def problems(self, c):
    p = c.pier
    out = super().problems(c)
    if not 0.0 <= p.warmup < 0.5:
      out.append(field_problem(c, "pier.warmup", "the fraction of rounds that fill the outer "
                               "momentum must be in [0, 0.5) (the paper's 0.1)"))
    if any(not 0.0 <= m < 1.0 for m in p.decay_momenta):
      out.append(field_problem(c, "pier.decay_momenta", "each momentum must be in [0, 1)"))
    if not p.warmup * 2 <= p.final <= 1.0:
      out.append(field_problem(c, "pier.final", "the fraction where the outer lr drops to "
                               "pier.lr_final must be in [2 * pier.warmup, 1]"))
    if p.lr_final <= 0:
      out.append(field_problem(c, "pier.lr_final", "must be > 0"))
    if (p.decay_momenta or p.warmup) and round(p.warmup * c.rounds) < max(len(p.decay_momenta), 1):
      out.append(field_problem(c, "pier.warmup", f"{c.rounds} rounds give "
                               f"{round(p.warmup * c.rounds)} of momentum production; use "
                               "more rounds or pier.warmup=0 with pier.decay_momenta=()"))
    return out

  def outer_rule(self, c, inner_tx, layout):
    p = c.pier
    return pier_outer(c.outer.lr, c.outer.momentum, c.rounds, warmup=p.warmup,
                      decay_momenta=tuple(p.decay_momenta), lr_final=p.lr_final,
                      final=p.final, nesterov=c.outer.nesterov)


ALGORITHM = Pier()
