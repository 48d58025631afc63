"""Asynchronous Local-SGD with Delayed Nesterov (Liu, Douillard et al. 2024), simulator:
the server applies each arrival at once but refreshes its momentum every N arrivals
(N = outer.dn_buffer, 0: the number of workers); outer/delayed_nesterov.py."""

from lowcomm_jax import outer
from lowcomm_jax.algorithms.async_local_sgd import AsyncLocalSGD


def dn_c_problems(c, smallest_buffer: int) -> list[str]:
  """Delayed Nesterov's c must lie in [0, 1/N] for the smallest server's N (a negative c is
  config/check.py's, for every algorithm)."""
  if (c.outer.dn_buffer < 0 or smallest_buffer < 1 or c.outer.dn_c < 0
      or c.outer.dn_c <= 1.0 / smallest_buffer):
    return []
  return [f"outer.dn_c={c.outer.dn_c!r}: must be in [0, 1/N] = [0, {1.0 / smallest_buffer:g}] "
          f"(N = {smallest_buffer})"]


class AsyncDelayedNesterov(AsyncLocalSGD):
  name = "async_dn"
  summary = "asynchronous Local-SGD with Delayed Nesterov (simulator)"

  def problems(self, c):
    return super().problems(c) + dn_c_problems(c, c.outer.dn_buffer or c.num_workers)

  def server_rules(self, c, plan):
    from lowcomm_jax.parallel.server_names import GLOBAL
    o = c.outer
    return {GLOBAL: outer.delayed_nesterov(o.lr, o.momentum, o.dn_buffer or plan.num_workers,
                                           o.dn_c)}


ALGORITHM = AsyncDelayedNesterov()
