"""Eager updates (Kale, Douillard, Donchev 2025, "Eager Updates for Overlapped Communication
and Computation in DiLoCo"): one-step-delay DiLoCo whose workers do not wait a round for
their own contribution.

After inner phase t each worker m sends its outer gradient Δ_m^t and, while the average is
in flight, takes a tentative outer step with a proxy for it: its own fresh Δ_m^t in place
of its stale one in the last average that arrived,

    Δ̂_m^t = Δ̄^{t−1} + (Δ_m^t − Δ_m^{t−1}) / M      (= (Δ_m^t + Σ_{m'≠m} Δ_{m'}^{t−1}) / M)
    x_m^{t+1} = θ^t + OuterOpt_tentative(Δ̂_m^t)     (the outer state is not advanced)

and runs its next H inner steps from x_m^{t+1}. The global model and outer state advance
with the true averages one round late, as in one-step-delay (θ^t: every average up to
Δ̄^{t−1} applied); that is the correction: each round starts again from the corrected θ plus
a fresh proxy step. Δ_m^t = x_m^t − (x_m^t after H steps): the worker's own drift. First
round: nothing has arrived, x^1 = θ^0; second: Δ̂_m^1 = Δ_m^1 / M. With one worker the proxy
is the true average and eager updates are DiLoCo (up to round-off: Δ̄ + (Δ − Δ̄) ≠ Δ).

Reconstructed from the paper's description (BUILD_NOTES.md says what was read and what was
not). Workers of equal weight only: the proxy's 1/M assumes a plain mean (no tiers, no
token weighting). Codecs apply to what is sent; the worker's own term is its exact Δ.
"""

from typing import NamedTuple

import jax
import optax

from lowcomm_jax.algorithms.base import field_problem
from lowcomm_jax.algorithms.diloco import DiLoCo
from lowcomm_jax.algorithms.one_step_delay import OneStepDelay


class EagerMemory(NamedTuple):
  last: jax.Array  # Δ_m^t: the worker's newest outer gradient
  before: jax.Array  # Δ_m^{t−1}: the one inside the average that arrived last


class EagerWorkers:
  """algorithms.base.WorkerRule for eager updates."""

  reads_sync_state = False

  def __init__(self, rule: optax.GradientTransformation, num_workers: int):
    self.rule, self.num_workers = rule, num_workers

  def init(self, flat_params):
    zeros = optax.tree.zeros_like(flat_params)
    return EagerMemory(zeros, zeros)

  def start(self, flat_params, rule_state, memory, sync_state=()):
    proxy = rule_state.applied + (memory.last - memory.before) / self.num_workers
    updates, _ = self.rule.update(proxy, rule_state.rule, flat_params)  # tentative
    return optax.apply_updates(flat_params, updates)

  def finish(self, start, trained, memory):
    delta = start - trained
    return delta, EagerMemory(delta, memory.last)


class Eager(OneStepDelay):
  name = "eager"
  summary = ("one-step-delay DiLoCo whose workers start each round from a tentative outer "
             "step with their own fresh pseudo-gradient in the last average")
  robust_aggregation = False  # equal weights: each worker's proxy assumes its share

  def problems(self, c):
    out = super().problems(c)
    if any(row.get("tier", 1.0) != 1.0 for row in c.hosts):
      out.append(field_problem(c, "algorithm", "eager updates' proxy assumes workers of "
                               "equal weight; use full-width hosts (tier 1.0) or "
                               "one_step_delay"))
    if c.aggregate.weighting != "uniform":
      out.append(field_problem(c, "aggregate.weighting", "eager updates' proxy assumes a "
                               "plain mean; use 'uniform'"))
    return out

  keep_applied = True

  def keeps_worker_params(self, c) -> bool:
    return False  # each round starts from θ and the worker's memory

  def worker_rule(self, c) -> EagerWorkers:
    # The tentative step is DiLoCo's outer rule (the one one_step_delay wraps).
    return EagerWorkers(DiLoCo.outer_rule(self, c, None, None), c.num_workers)


ALGORITHM = Eager()
