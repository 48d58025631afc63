"""HALoS (Kim et al. 2025), simulator: asynchronous workers behind one local parameter server
per region (Delayed Nesterov, outer.lr/momentum/dn_buffer); every K = outer.halos.sync_every
updates an LPS pushes its change to the global server (Delayed Nesterov, outer.halos.global_*)
and merges the model it gets back (outer/halos.py). When an exchange is due and how it
merges is its declaration (`exchange_rule`, base.ExchangeRule): the simulator's
schedule (`HalosSchedule`) and the Ray runtime's regional servers (runtimes/ray/regions.py)
both read it from the plan."""

import ml_collections

from lowcomm_jax import outer
from lowcomm_jax.algorithms.async_dn import dn_c_problems
from lowcomm_jax.algorithms.async_local_sgd import AsyncLocalSGD
from lowcomm_jax.algorithms.base import ExchangeRule
from lowcomm_jax.sim.async_schedules import AsyncWorkers
from lowcomm_jax.sim.events import Event, EventLoop
from lowcomm_jax.parallel.server_names import GLOBAL, region_server
from lowcomm_jax.sim.schedules import Backend, Job, Plan


def _regions(c) -> list[int]:
  n = c.sim.network
  placed = list(n.worker_regions)
  return placed or [w * n.regions // c.num_workers for w in range(max(c.num_workers, 0))]


class Halos(AsyncLocalSGD):
  name = "halos"
  summary = "hierarchical asynchronous servers, one per region plus a global one"
  regional_servers = True
  config_section = "outer.halos"  # (regions' local servers use outer.lr/momentum/dn_buffer)

  def config_defaults(self):
    s = ml_collections.ConfigDict()
    s.sync_every = 8  # K: local-server updates between pushes to the global server
    s.merge_alpha = 0.25  # weight of the global model when a local server merges it
    s.global_lr = 0.3  # the global server's Delayed Nesterov lr
    s.global_momentum = 0.5  # ... its momentum
    s.global_buffer = 2  # ... its N (pushes per momentum refresh)
    return s

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
    return HalosSchedule(plan, backend)

  def exchange_rule(self, c):
    return ExchangeRule(c.outer.halos.sync_every, c.outer.halos.merge_alpha)

  def server_rules(self, c, plan):
    o, h = c.outer, c.outer.halos
    rules = {GLOBAL: outer.delayed_nesterov(h.global_lr, h.global_momentum, h.global_buffer,
                                            o.dn_c)}
    for r in sorted(set(plan.network.worker_region)):
      size = plan.network.worker_region.count(r)
      rules[region_server(r)] = outer.delayed_nesterov(o.lr, o.momentum, o.dn_buffer or size,
                                                       o.dn_c)
    return rules


class HalosSchedule(AsyncWorkers):
  """HALoS: asynchronous workers behind one local parameter server per region; an LPS
  pushes its change to the global server once `sync_every` updates are unsent (and no push
  is in flight) and merges the model it gets back. Updates applied while a push is in
  flight go with the next push; when the budget is spent, LPSs push what they have left."""

  def __init__(self, plan: Plan, backend: Backend):
    super().__init__(plan, backend)
    regions = sorted(set(plan.network.worker_region))
    # unsent: updates applied at the LPS and not yet in a push (those applied while a push
    # is in flight stay unsent and go with the next one).
    self.lps = {region_server(r): {"region": r, "unsent": 0, "pushing": False,
                                   "running": 0} for r in regions}

  def server_of(self, worker: int) -> str:
    return region_server(self.plan.network.worker_region[worker])

  def server_region(self, server: str) -> int:
    return self.plan.network.server_region if server == GLOBAL else self.lps[server]["region"]

  def _dispatch(self, loop: EventLoop, worker: int) -> bool:
    started = super()._dispatch(loop, worker)
    if started:
      self.lps[self.server_of(worker)]["running"] += 1
    return started

  def _arrive(self, loop: EventLoop, job: Job) -> None:
    lps = self.lps[job.server]
    lps["running"] -= 1
    lps["unsent"] += 1
    super()._arrive(loop, job)
    self._maybe_push(loop, job.server)

  def _server_event(self, event: Event, loop: EventLoop) -> None:
    p = self.plan
    if event.kind == "push_arrive":  # at the GPS: apply, reply with its model
      self.backend.apply_push(GLOBAL, event.data["msg"])
      reply = self.new_id()
      self.backend.send_params(GLOBAL, reply)
      self.acct.server_bytes_sent += p.param_bytes
      self._send(loop, GLOBAL, event.data["lps"], p.param_bytes, "params_arrive",
                 lps=event.data["lps"], msg=reply)
    elif event.kind == "params_arrive":  # back at the LPS
      dst = event.data["lps"]
      self.backend.merge(dst, event.data["msg"], p.exchange_rule.merge_alpha)
      self.lps[dst]["pushing"] = False
      self._maybe_push(loop, dst)
    else:
      raise ValueError(f"unexpected event {event.kind!r}")

  def _maybe_push(self, loop: EventLoop, server: str) -> None:
    p, lps = self.plan, self.lps[server]
    finished = self.dispatched_steps >= p.total_steps and lps["running"] == 0
    if lps["pushing"] or not p.exchange_rule.due(lps["unsent"], finished):
      return
    msg = self.new_id()
    self.backend.push_update(server, msg)
    lps["pushing"], lps["unsent"] = True, 0
    self.acct.server_bytes_sent += p.param_bytes
    self._send(loop, server, GLOBAL, p.param_bytes, "push_arrive", lps=server, msg=msg)

  def state_dict(self) -> dict:
    return {**super().state_dict(), "lps": self.lps}

  def load_state(self, state: dict) -> None:
    super().load_state(state)
    self.lps = state["lps"]


ALGORITHM = Halos()
