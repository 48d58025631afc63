"""HALoS (Kim et al. 2025), simulator: asynchronous workers behind one local parameter server
per region (Delayed Nesterov, outer.lr/momentum/dn_buffer); every K = outer.halos.sync_every
updates an LPS pushes its change to the global server (Delayed Nesterov, outer.halos.global_*)
and merges the model it gets back (outer/halos.py, sim/schedules.Halos)."""

from lowcomm_jax import outer
from lowcomm_jax.algorithms.async_dn import dn_c_problems
from lowcomm_jax.algorithms.async_local_sgd import AsyncLocalSGD


def _regions(c) -> list[int]:
  n = c.sim.network
  placed = list(n.worker_regions)
  return placed or [w * n.regions // c.num_workers for w in range(max(c.num_workers, 0))]


class Halos(AsyncLocalSGD):
  name = "halos"
  summary = "hierarchical asynchronous servers, one per region plus a global one"
  runs_on_ray = True  # runtimes/ray/regions.py: a server actor per region and the global one
  regional_servers = True

  def problems(self, c):
    out = super().problems(c)
    regions = _regions(c)
    if regions and c.sim.network.regions >= 1:
      smallest = c.outer.dn_buffer or min(regions.count(r) for r in set(regions))
      out += dn_c_problems(c, smallest)
    h = c.outer.halos
    for field, ok, fix in (("sync_every", h.sync_every >= 1, "must be >= 1"),
                           ("merge_alpha", 0.0 <= h.merge_alpha <= 1.0, "must be in [0, 1]"),
                           ("global_lr", h.global_lr > 0, "must be > 0"),
                           ("global_momentum", 0.0 <= h.global_momentum < 1.0,
                            "must be in [0, 1)"),
                           ("global_buffer", h.global_buffer >= 1, "must be >= 1")):
      if not ok:
        out.append(f"outer.halos.{field}={h[field]!r}: {fix}")
    if c.outer.dn_c > 1.0 / max(h.global_buffer, 1):
      out.append(f"outer.dn_c={c.outer.dn_c!r}: the global server's N is {h.global_buffer}; "
                 "c must be <= 1/N")
    return out

  def schedule(self, plan, backend):
    from lowcomm_jax.sim.async_schedules import Halos as HalosSchedule
    return HalosSchedule(plan, backend)

  def server_rules(self, c, plan):
    from lowcomm_jax.sim.schedules import GLOBAL, region_server
    o, h = c.outer, c.outer.halos
    rules = {GLOBAL: outer.delayed_nesterov(h.global_lr, h.global_momentum, h.global_buffer,
                                            o.dn_c)}
    for r in sorted(set(plan.network.worker_region)):
      size = plan.network.worker_region.count(r)
      rules[region_server(r)] = outer.delayed_nesterov(o.lr, o.momentum, o.dn_buffer or size,
                                                       o.dn_c)
    return rules


ALGORITHM = Halos()
