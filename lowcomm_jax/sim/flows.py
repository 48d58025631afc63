"""Shared links: transfers in flight share each resource on their paths, max-min fairly.

A transfer (a flow) crosses the resources sim/network.py lists for its two ends. The rates
of the flows in flight are the max-min fair allocation, by progressive filling: every rate
rises together; when a resource is full, the flows crossing it keep the rate they have
and the others go on rising. The rates are recomputed whenever a flow starts or ends. A
flow's last bit leaves after its bits are sent at those rates; it arrives one latency
later (so alone on its path it takes latency + bits/bandwidth).

This is the flow-level model SimGrid validated for TCP over long transfers, without its
corrections for TCP's window and slow start; not a packet simulator. `Flows` runs inside a
simulation's event loop (its state is plain JSON, checkpointed with the schedule);
`deliveries` runs a fixed set of transfers on their own (collectives, bench/network_validation.py).
"""

import math
from collections.abc import Sequence

from lowcomm_jax.sim.events import EventLoop
from lowcomm_jax.sim.network import Network

TICK = "flows"  # the event at which the next flow in flight finishes sending
_SLACK = 1e-9  # seconds per second of virtual time: a flow this close to done is done


def max_min_rates(paths: dict, capacity) -> dict:
  """{flow: rate} for flows {flow: [resources]}, each resource's `capacity(r)` shared
  max-min fairly. Flows sharing a bottleneck get equal rates; a flow held down elsewhere
  leaves its unused share to the others."""
  left, users = {}, {}
  for flow, path in paths.items():
    for r in path:
      if r not in left:
        left[r] = capacity(r)
      users.setdefault(r, []).append(flow)
  rates, active = {}, set(paths)
  while active:
    shares = {}
    for r, flows in users.items():
      n = sum(f in active for f in flows)
      if n:
        shares[r] = left[r] / n
    fill = min(shares.values())
    full = [r for r, s in shares.items() if s <= fill * (1 + 1e-9)]
    frozen = sorted({f for r in full for f in users[r] if f in active})
    for f in frozen:
      rates[f] = fill
      for r in paths[f]:
        left[r] = max(left[r] - fill, 0.0)
    active.difference_update(frozen)
  return rates


class Flows:
  """The flows in flight in one simulation. `send` starts one; when it arrives, the event
  `kind` with `data` (plain JSON) is scheduled on the loop. The schedule hands every
  TICK event to `handle`."""

  def __init__(self, network: Network):
    self.network = network
    self.active = {}  # id -> {"path", "bits" (left to send), "latency", "kind", "data"}
    self.updated = 0.0  # when "bits" were last brought up to date
    self.next_id = 0
    self.rates = {}

  def send(self, loop: EventLoop, src: str, src_region: int, dst: str, dst_region: int,
           nbytes: float, kind: str, data: dict) -> None:
    self._advance(loop)
    self.next_id += 1
    path = self.network.path(src, src_region, dst, dst_region)
    self.active[str(self.next_id)] = {
        "path": [list(r) for r in path], "bits": self.network.bits(nbytes),
        "latency": float(self.network.latency_s[src_region, dst_region]), "kind": kind,
        "data": data}
    self._reschedule(loop)

  def handle(self, loop: EventLoop) -> None:
    """At a TICK: delivers the flows done sending, re-rates the rest."""
    self._advance(loop)
    self._reschedule(loop)

  def _advance(self, loop: EventLoop) -> None:
    """Brings every flow's bits up to `loop.now`; a flow done sending is removed and its
    arrival scheduled one latency later."""
    now, elapsed = loop.now, loop.now - self.updated
    # Left to send within float rounding of the clock: done (else a tick could repeat).
    slack = _SLACK * max(1.0, now)
    for fid in list(self.active):
      flow, rate = self.active[fid], self.rates[fid]
      if rate == math.inf or flow["bits"] - rate * elapsed <= rate * slack:
        del self.active[fid]
        loop.schedule(now + flow["latency"], flow["kind"], **flow["data"])
      else:
        flow["bits"] -= rate * elapsed
    self.updated = now

  def _rerate(self) -> None:
    self.rates = max_min_rates({f: [tuple(r) for r in v["path"]]
                                for f, v in self.active.items()}, self.network.capacity)

  def _reschedule(self, loop: EventLoop) -> None:
    loop.cancel(TICK)
    self._rerate()
    if self.active:
      done = min(v["bits"] / self.rates[f] for f, v in self.active.items())
      loop.schedule(loop.now + done, TICK)

  def state_dict(self) -> dict:
    return {"active": self.active, "updated": self.updated, "next_id": self.next_id}

  def load_state(self, state: dict) -> None:
    self.active, self.updated = state["active"], state["updated"]
    self.next_id = state["next_id"]
    self._rerate()  # a function of the flows in flight


def deliveries(network: Network, transfers: Sequence[tuple]) -> list[float]:
  """Arrival times of `transfers`, each (start, src, src_region, dst, dst_region, nbytes),
  sharing the network with each other and nothing else."""
  loop, flows = EventLoop(), Flows(network)
  for i, (start, *_rest) in enumerate(transfers):
    loop.schedule(start, "start", i=i)
  arrived = [0.0] * len(transfers)
  while len(loop):
    for event in loop.pop_simultaneous():
      if event.kind == TICK:
        flows.handle(loop)
      elif event.kind == "start":
        _, src, src_region, dst, dst_region, nbytes = transfers[event.data["i"]]
        flows.send(loop, src, src_region, dst, dst_region, nbytes, "arrived", event.data)
      else:
        arrived[event.data["i"]] = loop.now
  return arrived
