"""HALoS on the Ray runtime: a regional server per region, and the global one.

Workers pull from and push to their region's server (its rule); when the algorithm's
regional exchange says so (`plan.exchange_rule`, algorithms/base.ExchangeRule: HALoS's
`sync_every` updates unsent) a regional server pushes its change since the last merge to the
global server, which applies it with its own rule and answers with its model, and the
regional server merges that (weight `merge_alpha`). The three calls are the simulator's
schedule's (`lps_push`, `apply_lps_push`, `merge` are SimBackend's push_update, apply_push
and merge), made one after the other by the driver: the simulator's schedule with instant
transfers, so no push is ever in flight when a checkpoint is taken. When the budget is
spent, a regional server whose workers are all done pushes what it has left.
"""

from lowcomm_jax.parallel.server_names import GLOBAL, region_server


class Regions:
  """Which server each worker talks to, and the regional servers' exchanges."""

  def __init__(self, plan):
    self.region_of = list(plan.network.worker_region)
    self.names = [region_server(r) for r in sorted(set(self.region_of))]
    self.rule = plan.exchange_rule
    self.unsent = {name: 0 for name in self.names}  # updates since the last push, per LPS

  def server_of(self, worker: int) -> str:
    """A worker's regional server (one that joined later: the region of its id modulo W)."""
    return region_server(self.region_of[worker % len(self.region_of)])

  def pushed(self, pool, server: str, budget_spent: bool) -> int:
    """A worker's push was applied at `server`: its exchange with the global server if one
    is due. The exchanges made (0 or 1)."""
    self.unsent[server] += 1
    done = budget_spent and not any(j.server == server for j in pool.jobs.values())
    if self.rule.due(self.unsent[server], done):
      self.exchange(pool, server)
      return 1
    return 0

  def flush(self, pool) -> int:
    """Every regional server pushes what it has left (the run's end)."""
    due = [name for name in self.names if self.unsent[name] > 0]
    for name in due:
      self.exchange(pool, name)
    return len(due)

  def exchange(self, pool, server: str) -> None:
    _, delta = pool.call("lps_push", server=server, changes=True, keep_second=True)
    _, params = pool.call("apply_lps_push", delta, server=GLOBAL, changes=True,
                          keep_second=True)
    pool.call("merge", params, self.rule.merge_alpha, server=server, changes=True)
    self.unsent[server] = 0
