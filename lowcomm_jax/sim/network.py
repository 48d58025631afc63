"""Virtual network: regions, links, and what a transfer crosses on its way.

Every worker and every parameter server is a node in a region. A link between regions a
and b has a latency (seconds) and a bandwidth (bits/s); the diagonal is the intra-region
link, which is also each node's NIC. A transfer from a node in region a to one in region b
crosses these resources:

    the sender's NIC (out) and the receiver's NIC (in)       intra-region bandwidth
    and, between regions: a's uplink, the link a→b, b's downlink

Links and NICs are full duplex (each direction is its own resource). A region's uplink and
downlink carry all its inter-region transfers together (`region_bps`; by default the
fastest of its links, so one transfer alone is never slowed by it, several are).
Concurrent transfers share every resource on their paths (max-min fair, sim/flows.py).
Alone on its path a transfer of n bytes takes

    latency + 8·n / bandwidth

The parameter server may sit in a region of its own (`server_region=None` at build): it
gets the scalar inter-region latency and bandwidth to every other region.
"""

import dataclasses
from collections.abc import Sequence

import numpy as np

Resource = tuple  # ("out", region, node) | ("in", region, node) | ("up", r) | ("down", r)
#                   | ("link", a, b)


def _matrix(value, regions: int, name: str) -> np.ndarray:
  """A scalar (every inter-region link alike) or a [regions, regions] matrix."""
  m = np.asarray(value, np.float64)
  if m.ndim == 0:
    return np.full((regions, regions), float(m))
  if m.shape != (regions, regions):
    raise ValueError(f"{name} must be a number or a {regions}x{regions} matrix, got shape "
                     f"{m.shape}")
  return m


def _with_server_region(m: np.ndarray, inter: float) -> np.ndarray:
  """`m` grown by one region (the server's own) whose links are all `inter`."""
  out = np.full((m.shape[0] + 1,) * 2, inter)
  out[:-1, :-1] = m
  return out


@dataclasses.dataclass(frozen=True)
class Network:
  worker_region: tuple[int, ...]
  latency_s: np.ndarray  # [regions, regions]; the diagonal is the intra-region link
  bandwidth_bps: np.ndarray  # [regions, regions], bits per second
  # Every payload's virtual size is its real size times this: a small model trained on a CPU
  # can stand for a large one on the wire (the ledger still counts real bytes).
  bytes_scale: float = 1.0
  region_bps: np.ndarray | None = None  # [regions]: each region's uplink (= its downlink)
  server_region: int = 0  # where the global parameter server sits
  # The direct exchange (sim/collectives.direct_*: Ray's members, every pair at once) as
  # real transports run it: the fraction of its bandwidth a member's link carries while it
  # sends and receives at once, and the seconds each step adds per member (what
  # bench/exchange_rig.py measures; 1 and 0: the bandwidth alone)
  exchange_efficiency: float = 1.0
  exchange_member_s: float = 0.0

  @classmethod
  def build(cls, *, num_workers: int, regions: int, worker_regions: Sequence[int] = (),
            intra_gbps: float, intra_latency_s: float, inter_gbps, inter_latency_s,
            bytes_scale: float = 1.0, region_gbps: float = 0.0,
            server_region: int | None = 0,
            server_link: tuple[float, float] | None = None, exchange_efficiency: float = 1.0,
            exchange_member_s: float = 0.0) -> "Network":
    """Workers fill regions in contiguous blocks unless `worker_regions` places them.
    `region_gbps` caps each region's uplink and downlink (0: its fastest link's bandwidth);
    `server_region=None` puts the server in a region of its own (index `regions`) whose
    links to every region are `server_link` (Gb/s, latency s; default: the scalar
    `inter_gbps`, `inter_latency_s`)."""
    placed = (tuple(int(r) for r in worker_regions) if worker_regions else
              tuple(w * regions // num_workers for w in range(num_workers)))
    latency = _matrix(inter_latency_s, regions, "sim.network.inter_latency_s")
    bandwidth = _matrix(inter_gbps, regions, "sim.network.inter_gbps") * 1e9
    if server_region is None:
      gbps, seconds = server_link or (float(inter_gbps), float(inter_latency_s))
      latency = _with_server_region(latency, seconds)
      bandwidth = _with_server_region(bandwidth, gbps * 1e9)
      server_region = regions
    np.fill_diagonal(latency, intra_latency_s)
    np.fill_diagonal(bandwidth, intra_gbps * 1e9)
    if region_gbps:
      region = np.full(len(bandwidth), region_gbps * 1e9)
    else:  # the fastest link out of (or into) each region
      off = np.where(np.eye(len(bandwidth), dtype=bool), 0.0, bandwidth)
      region = np.maximum(off.max(axis=0), off.max(axis=1)) if len(off) > 1 else np.zeros(1)
    return cls(placed, latency, bandwidth, bytes_scale, region, int(server_region),
               float(exchange_efficiency), float(exchange_member_s))

  @property
  def regions(self) -> int:
    return self.latency_s.shape[0]

  def transfer_seconds(self, src_region: int, dst_region: int, nbytes: float) -> float:
    """A transfer's time alone on its path."""
    return float(self.latency_s[src_region, dst_region]
                 + self.bits(nbytes) / self.bandwidth_bps[src_region, dst_region])

  def bits(self, nbytes: float) -> float:
    return 8.0 * nbytes * self.bytes_scale

  def path(self, src: str, src_region: int, dst: str, dst_region: int) -> list[Resource]:
    """The resources a transfer from node `src` to node `dst` crosses."""
    ends = [("out", src_region, src), ("in", dst_region, dst)]
    if src_region == dst_region:
      return ends
    return ends + [("up", src_region), ("link", src_region, dst_region), ("down", dst_region)]

  def capacity(self, resource: Resource) -> float:
    """Bits per second of one resource."""
    kind, a = resource[0], resource[1]
    if kind in ("out", "in"):
      return float(self.bandwidth_bps[a, a])
    if kind == "link":
      return float(self.bandwidth_bps[a, resource[2]])
    return float(self.region_bps[a])  # "up" | "down"
