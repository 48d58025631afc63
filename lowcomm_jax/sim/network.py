"""Virtual network: regions, per-link latency and bandwidth, transfer and all-reduce times.

Every worker (and every parameter server) sits in a region. A link between regions a and b
has a latency (seconds) and a bandwidth (bits/s); inside a region the intra-region link
applies. Sending `n` bytes over a link takes

    latency + 8·n / bandwidth

Concurrent transfers do not slow each other (no contention model). Synchronous rounds use
a ring over the workers: the ring visits each region's workers contiguously, in the region
order whose slowest link is fastest ("the best ring"), and every ring step costs its slowest
link. With W workers and a payload of n bytes:

    all-reduce (dense mean):          2(W−1) steps of n/W bytes
    all-gather (compressed payloads): (W−1) steps of n bytes
"""

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

_BRUTE_FORCE_REGIONS = 8  # beyond this, regions are ringed in index order


def _matrix(value, regions: int, name: str) -> np.ndarray:
  """A scalar (every inter-region link alike) or a [regions, regions] matrix."""
  m = np.asarray(value, np.float64)
  if m.ndim == 0:
    return np.full((regions, regions), float(m))
  if m.shape != (regions, regions):
    raise ValueError(f"{name} must be a number or a {regions}x{regions} matrix, got shape "
                     f"{m.shape}")
  return m


@dataclasses.dataclass(frozen=True)
class Network:
  worker_region: tuple[int, ...]
  latency_s: np.ndarray  # [regions, regions]; the diagonal is the intra-region link
  bandwidth_bps: np.ndarray  # [regions, regions], bits per second
  # Every payload's virtual size is its real size times this: a small model trained on a CPU
  # can stand for a large one on the wire (the ledger still counts real bytes).
  bytes_scale: float = 1.0

  @classmethod
  def build(cls, *, num_workers: int, regions: int, worker_regions: Sequence[int] = (),
            intra_gbps: float, intra_latency_s: float, inter_gbps, inter_latency_s,
            bytes_scale: float = 1.0) -> "Network":
    """Workers fill regions in contiguous blocks unless `worker_regions` places them."""
    placed = (tuple(int(r) for r in worker_regions) if worker_regions else
              tuple(w * regions // num_workers for w in range(num_workers)))
    latency = _matrix(inter_latency_s, regions, "sim.network.inter_latency_s")
    bandwidth = _matrix(inter_gbps, regions, "sim.network.inter_gbps") * 1e9
    np.fill_diagonal(latency, intra_latency_s)
    np.fill_diagonal(bandwidth, intra_gbps * 1e9)
    return cls(placed, latency, bandwidth, bytes_scale)

  @property
  def regions(self) -> int:
    return self.latency_s.shape[0]

  def transfer_seconds(self, src_region: int, dst_region: int, nbytes: int) -> float:
    return float(self.latency_s[src_region, dst_region]
                 + 8.0 * nbytes * self.bytes_scale / self.bandwidth_bps[src_region, dst_region])

  def best_ring(self, workers: Sequence[int], chunk_bytes: float) -> tuple[list[int], float]:
    """(ring order of `workers`, seconds of one ring step sending `chunk_bytes` per link)."""
    by_region: dict[int, list[int]] = {}
    for w in sorted(workers):
      by_region.setdefault(self.worker_region[w], []).append(w)
    present = sorted(by_region)
    if len(present) <= _BRUTE_FORCE_REGIONS:
      # Rotations of a cycle are the same ring: fix the first region.
      orders = [(present[0],) + p for p in itertools.permutations(present[1:])]
    else:
      orders = [tuple(present)]
    best = None
    for order in orders:
      ring = [w for r in order for w in by_region[r]]
      step = max(self.transfer_seconds(self.worker_region[a], self.worker_region[b], chunk_bytes)
                 for a, b in zip(ring, ring[1:] + ring[:1]))
      if best is None or step < best[1]:
        best = (ring, step)
    return best

  def ring_allreduce_seconds(self, workers: Sequence[int], nbytes: int) -> float:
    n = len(workers)
    if n <= 1:
      return 0.0
    return 2 * (n - 1) * self.best_ring(workers, nbytes / n)[1]

  def ring_allgather_seconds(self, workers: Sequence[int], nbytes: int) -> float:
    n = len(workers)
    if n <= 1:
      return 0.0
    return (n - 1) * self.best_ring(workers, nbytes)[1]
