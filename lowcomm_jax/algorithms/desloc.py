"""DES-LOC (Iacob et al. 2025, arXiv 2505.22549): Local Adam whose parameters and each of
Adam's two moments are averaged over the workers on periods of their own.

Each worker runs AdamW on its own data. With K_x = H (a round), K_u and K_v multiples of it:

    every K_x steps:  θ ← mean of the workers' θ_w      (desloc.plain_average; False: the
                                                           outer rule outer.lr/momentum on Δ̄)
    every K_u steps:  every worker's first moment  m_w ← mean over workers of m_w
    every K_v steps:  every worker's second moment v_w ← mean over workers of v_w

The moments are averaged at the start of the round at step t when t mod K == 0 (t > 0), the
paper's "before the step that uses them"; Adam's step count is left alone (it is the same on
every worker). The periods are `desloc.first_moment_rounds` and `desloc.second_moment_rounds`
rounds (K_u = that × H; 0: never, the workers keep their own as DiLoCo's do). The paper
recommends K_u = 3·K_x, K_v = 6·K_x, which are the defaults.

A moment average is a dense fp32 all-reduce of the moment (as large as the model), counted
by the byte ledger and timed by the simulator.
"""

import jax
import ml_collections
import optax

from lowcomm_jax import outer
from lowcomm_jax.algorithms.base import field_problem
from lowcomm_jax.algorithms.diloco import DiLoCo
from lowcomm_jax.parallel import collectives

MOMENTS = {"first_moment": "mu", "second_moment": "nu"}  # part -> optax.ScaleByAdamState field


class MomentSync:
  """`StateSync` (algorithms/base.py) for Adam's moments on periods counted in rounds."""

  def __init__(self, first_moment_rounds: int, second_moment_rounds: int):
    self.every = {"first_moment": first_moment_rounds, "second_moment": second_moment_rounds}

  def due(self, completed_rounds: int) -> tuple[str, ...]:
    if completed_rounds <= 0:  # at the start every worker's moments are zero
      return ()
    return tuple(part for part, every in self.every.items()
                 if every > 0 and completed_rounds % every == 0)

  def take(self, opt_state, parts: tuple[str, ...]) -> list[dict]:
    """`parts` of `opt_state`: per Adam state in it (tree order), {field: its value}."""
    return [{MOMENTS[p]: getattr(s, MOMENTS[p]) for p in parts}
            for s in jax.tree.leaves(opt_state, is_leaf=_is_adam) if _is_adam(s)]

  def put(self, opt_state, parts: tuple[str, ...], values: list[dict]):
    """`opt_state` with `parts` replaced by `values` (`take`'s form)."""
    del parts  # (named by the values' fields)
    values = iter(values)
    return jax.tree.map(lambda s: s._replace(**next(values)) if _is_adam(s) else s, opt_state,
                        is_leaf=_is_adam)

  def average(self, opt_state, parts: tuple[str, ...], axis_name: str):
    return self.put(opt_state, parts, [collectives.mean(fields, axis_name)
                                       for fields in self.take(opt_state, parts)])


def _is_adam(x) -> bool:
  return isinstance(x, optax.ScaleByAdamState)


class DesLoc(DiLoCo):
  name = "desloc"
  config_section = "desloc"
  summary = ("DES-LOC: Local AdamW; parameters averaged every H steps, each Adam moment on a "
             "longer period of its own")

  def config_defaults(self):
    # Parameters sync every H steps: the paper's plain average (plain_average=True), or the
    # outer rule outer.lr/momentum (False). Each AdamW moment is averaged over the workers every
    # this many rounds (0: never, each worker keeps its own as in DiLoCo).
    s = ml_collections.ConfigDict()
    s.plain_average = True  # theta <- the workers' mean (False: outer.lr/momentum on the mean delta)
    s.first_moment_rounds = 3  # K_u = 3 H, the paper's recommendation
    s.second_moment_rounds = 6  # K_v = 6 H
    return s

  def problems(self, c):
    d = c.desloc
    out = super().problems(c)
    for field in ("first_moment_rounds", "second_moment_rounds"):
      if d[field] < 0:
        out.append(field_problem(c, f"desloc.{field}", "rounds between averages of the moment: "
                                 ">= 1, or 0 for never (the paper: 3 and 6)"))
    if c.optimizer.name != "adamw":
      out.append(field_problem(c, "optimizer.name", "DES-LOC averages Adam's moments; use "
                               "optimizer.name=adamw"))
    if len({h.tier for h in c.hosts}) > 1 or any(float(h.tier) < 1.0 for h in c.hosts):
      out.append(field_problem(c, "hosts", "DES-LOC averages every worker's moments, which "
                               "need one shape: give every host tier 1.0"))
    return out

  def outer_rule(self, c, inner_tx, layout):
    if c.desloc.plain_average:  # θ ← θ − 1·Δ̄ = the workers' mean
      return outer.diloco_outer(1.0, 0.0)
    return super().outer_rule(c, inner_tx, layout)

  def state_sync(self, c):
    d = c.desloc
    if not (d.first_moment_rounds or d.second_moment_rounds):
      return None
    return MomentSync(d.first_moment_rounds, d.second_moment_rounds)

  def schedule(self, plan, backend):
    from lowcomm_jax.sim.sync_schedules import SyncRounds
    sync = self.state_sync(backend.config)
    if sync is None:
      return SyncRounds(plan, backend)
    # A moment is an fp32 tensor per parameter: as many bytes as the dense model.
    return SyncRounds(plan, backend, state_due=sync.due, state_part_bytes=plan.param_bytes)


ALGORITHM = DesLoc()
