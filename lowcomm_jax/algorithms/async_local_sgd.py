"""Asynchronous Local-SGD (simulator, and real processes on the Ray runtime): each worker
pulls the server's latest θ, takes H steps and sends Δ; the server applies every arrival at
once with plain Nesterov at lr outer.lr / W, so W arrivals move θ as far as one synchronous
round's mean would."""

from lowcomm_jax import outer
from lowcomm_jax.algorithms.diloco import DiLoCo


class AsyncLocalSGD(DiLoCo):
  name = "async"
  summary = "asynchronous Local-SGD: outer Nesterov applied per arrival (simulator)"
  simulated_only = True
  synchronous = False
  robust_aggregation = False  # one contribution at a time

  def schedule(self, plan, backend):
    from lowcomm_jax.sim.async_schedules import AsyncWorkers
    return AsyncWorkers(plan, backend)

  def server_rules(self, c, plan):
    from lowcomm_jax.parallel.server_names import GLOBAL
    o = c.outer
    return {GLOBAL: outer.diloco_outer(o.lr / plan.num_workers, o.momentum, o.nesterov)}


ALGORITHM = AsyncLocalSGD()
