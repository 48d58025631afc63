"""Collectives as their messages: how long a synchronous all-reduce or all-gather takes.

Each collective is a sequence of steps; a step's messages start together and share the
network (sim/flows.py), and the next step starts when the last of them has arrived. Over
W workers and a payload of n bytes (a dense mean all-reduces n; compressed payloads are
all-gathered, n each):

  ring          a ring visiting each region's workers contiguously, in the region order
                whose step is fastest: all-reduce 2(W−1) steps of n/W, all-gather W−1
                steps of n.
  hierarchical  inside each region (k workers, the first its leader): a ring
                reduce-scatter (k−1 steps of n/k) and the shards gathered at the leader;
                a ring among the leaders (all-reduce: 2(R−1) steps of n/R over R regions);
                then the mirror of the first phase (the leader scatters the shards, a ring
                all-gather). All-gather: payloads gathered at the leader, the leaders'
                ring forwards each region's block, the leader sends each worker the rest.
                Regions run their inside phases at once; the leaders' phase waits for all.
  direct        the Ray runtime's exchange among a round's workers (runtimes/ray/replica.py):
                all-reduce, a reduce-scatter and an all-gather of one step each, every
                worker sending each other worker n/W at once; all-gather, one step of n to
                each other worker. On one NIC per worker the bytes of a ring in 2 steps
                (not 2(W−1) latencies); across regions more crosses the regions' links
                (every pair, not a ring's two hops). A real transport's cost beyond the
                bytes: `sim.network.exchange_efficiency` (the fraction of the bandwidth a
                member gets while it sends and receives at once) and
                `exchange_member_s` (seconds a step adds per member), as
                bench/exchange_rig.py measures them (defaults: the bandwidth alone).
  auto          the fastest of ring, hierarchical and direct for the placement (the
                default; issue 70 added direct, the form Ray's rounds run).
  server        not a collective: the transfers of a parameter server as the Ray runtime
                makes them. A synchronous round: each worker pulls θ from the server and
                sends its contribution back (sim/sync_schedules.SyncRounds). In every
                schedule, the server takes contributions one at a time, in the order they
                are ready (the Ray driver hands them over in turn). Schedules of
                several syncs a round (Streaming's) and NoLoCo's gossip have no such form
                (`Algorithm.server_schedule`); a collective asked for under it is refused.

Nothing else is on the wire while a synchronous collective runs, so its time is computed
once, alone.
"""

import itertools
from collections.abc import Sequence

from lowcomm_jax.sim.flows import deliveries
from lowcomm_jax.sim.network import Network

COLLECTIVES = ("auto", "ring", "hierarchical", "direct", "server")
SERVER = "server"
_BRUTE_FORCE_REGIONS = 6  # beyond this, rings visit regions in index order


def node(worker: int) -> str:
  return f"w{worker}"


def _step_seconds(net: Network, sends: Sequence[tuple[int, int, float]]) -> float:
  """One step: every (src worker, dst worker, bytes) message starts at 0; the last arrival."""
  region = net.worker_region
  return max(deliveries(net, [(0.0, node(a), region[a], node(b), region[b], n)
                              for a, b, n in sends]), default=0.0)


def _ring_sends(ring: Sequence[int], nbytes: float) -> list:
  return [(a, b, nbytes) for a, b in zip(ring, list(ring[1:]) + list(ring[:1]))]


def _regions_of(net: Network, workers: Sequence[int]) -> dict[int, list[int]]:
  by_region = {}
  for w in sorted(workers):
    by_region.setdefault(net.worker_region[w], []).append(w)
  return by_region


def best_ring(net: Network, workers: Sequence[int], chunk_bytes: float) -> tuple[list, float]:
  """(ring order of `workers`, seconds of one ring step sending `chunk_bytes` per worker)."""
  by_region = _regions_of(net, workers)
  present = sorted(by_region)
  if len(present) <= _BRUTE_FORCE_REGIONS:
    # Rotations of a cycle are the same ring: fix the first region.
    orders = [(present[0],) + p for p in itertools.permutations(present[1:])]
  else:
    orders = [tuple(present)]
  best = None
  for order in orders:
    ring = [w for r in order for w in by_region[r]]
    step = _step_seconds(net, _ring_sends(ring, chunk_bytes))
    if best is None or step < best[1]:
      best = (ring, step)
  return best


def ring_allreduce_seconds(net: Network, workers: Sequence[int], nbytes: float) -> float:
  n = len(workers)
  return 2 * (n - 1) * best_ring(net, workers, nbytes / n)[1] if n > 1 else 0.0


def ring_allgather_seconds(net: Network, workers: Sequence[int], nbytes: float) -> float:
  n = len(workers)
  return (n - 1) * best_ring(net, workers, nbytes)[1] if n > 1 else 0.0


def _inside(net: Network, group: list[int], nbytes: float) -> float:
  """One region's reduce-scatter ring and the gather of its shards at the leader (the
  mirror, scatter and all-gather, takes as long: links and NICs are symmetric)."""
  k = len(group)
  if k == 1:
    return 0.0
  ring = (k - 1) * _step_seconds(net, _ring_sends(group, nbytes / k))
  return ring + _step_seconds(net, [(w, group[0], nbytes / k) for w in group[1:]])


def hierarchical_allreduce_seconds(net: Network, workers: Sequence[int], nbytes: float) -> float:
  groups = list(_regions_of(net, workers).values())
  if len(groups) == 1:
    return ring_allreduce_seconds(net, workers, nbytes)
  inside = max(_inside(net, g, nbytes) for g in groups)
  return 2 * inside + ring_allreduce_seconds(net, [g[0] for g in groups], nbytes)


def hierarchical_allgather_seconds(net: Network, workers: Sequence[int], nbytes: float) -> float:
  groups = list(_regions_of(net, workers).values())
  if len(groups) == 1:
    return ring_allgather_seconds(net, workers, nbytes)
  gather = max(_step_seconds(net, [(w, g[0], nbytes) for w in g[1:]]) for g in groups)
  leaders = [g[0] for g in groups]
  ring, _ = best_ring(net, leaders, nbytes)
  block = {g[0]: len(g) * nbytes for g in groups}
  successor = dict(zip(ring, ring[1:] + ring[:1]))
  # Step s: each leader forwards the block it received s steps ago (its own at s = 0).
  across = 0.0
  for s in range(len(ring) - 1):
    holding = {ring[i]: ring[(i - s) % len(ring)] for i in range(len(ring))}
    across += _step_seconds(net, [(a, successor[a], block[holding[a]]) for a in ring])
  total = len(workers)
  spread = max(_step_seconds(net, [(g[0], w, (total - 1) * nbytes) for w in g[1:]])
               for g in groups)
  return gather + across + spread


def _direct_step(net: Network, sends, members: int) -> float:
  """A step of the direct exchange: its messages at `exchange_efficiency` of the bandwidth
  (a member sends and receives at once), and `exchange_member_s` for each member."""
  return (_step_seconds(net, sends) / net.exchange_efficiency
          + net.exchange_member_s * members)


def direct_allreduce_seconds(net: Network, workers: Sequence[int], nbytes: float) -> float:
  n = len(workers)
  sends = [(a, b, nbytes / n) for a in workers for b in workers if a != b]
  return 2 * _direct_step(net, sends, n) if n > 1 else 0.0


def direct_allgather_seconds(net: Network, workers: Sequence[int], nbytes: float) -> float:
  n = len(workers)
  sends = [(a, b, nbytes) for a in workers for b in workers if a != b]
  return _direct_step(net, sends, n) if n > 1 else 0.0


_TIMES = {("allreduce", "ring"): ring_allreduce_seconds,
          ("allreduce", "direct"): direct_allreduce_seconds,
          ("allgather", "direct"): direct_allgather_seconds,
          ("allreduce", "hierarchical"): hierarchical_allreduce_seconds,
          ("allgather", "ring"): ring_allgather_seconds,
          ("allgather", "hierarchical"): hierarchical_allgather_seconds}


def seconds(net: Network, op: str, workers: Sequence[int], nbytes: float,
            how: str = "auto") -> tuple[float, str]:
  """(seconds, the collective used) of `op` ('allreduce' | 'allgather') over `workers`."""
  if how == "server":
    raise ValueError("collective_form='server' times a parameter server's rounds of "
                     "one sync each (DiLoCo's kind); this schedule all-reduces: use ring, "
                     "hierarchical or auto")
  if how != "auto":
    return _TIMES[op, how](net, workers, nbytes), how
  # the fastest; on a tie the first (ring, hierarchical, direct: the order before issue 70
  # added the direct exchange, which ties a ring's bandwidth on one region)
  times = [(_TIMES[op, form](net, workers, nbytes), k, form)
           for k, form in enumerate(("ring", "hierarchical", "direct"))]
  seconds, _, form = min(times)
  return seconds, form
