"""Shared links (sim/flows.py) and collectives made of messages (sim/collectives.py), against
times computed by hand."""

import pytest

from lowcomm_jax.sim import Network, collectives
from lowcomm_jax.sim.flows import deliveries, max_min_rates

GB = 1e9  # bytes: 8 Gb, 8 s alone on a 1 Gb/s link


def _regions(worker_regions, *, inter_gbps=1.0, inter_latency_s=0.05, region_gbps=0.0,
             intra_gbps=100.0, intra_latency_s=1e-4):
  return Network.build(num_workers=len(worker_regions), regions=max(worker_regions) + 1,
                       worker_regions=worker_regions, intra_gbps=intra_gbps,
                       intra_latency_s=intra_latency_s, inter_gbps=inter_gbps,
                       inter_latency_s=inter_latency_s, region_gbps=region_gbps)


def _send(net, start, a, b, nbytes):
  return (start, f"w{a}", net.worker_region[a], f"w{b}", net.worker_region[b], nbytes)


def test_two_flows_on_one_link_each_get_half_and_the_survivor_speeds_up():
  net = _regions((0, 0, 1, 1))
  # Alone: 0.05 + 8 s.
  assert deliveries(net, [_send(net, 0.0, 0, 2, GB)]) == [pytest.approx(8.05)]
  # Two from region 0 to region 1 at once: 0.5 Gb/s each, both done sending at 16 s.
  assert deliveries(net, [_send(net, 0.0, 0, 2, GB), _send(net, 0.0, 1, 3, GB)]) == [
      pytest.approx(16.05)] * 2
  # 1 GB and 2 GB: both at 0.5 Gb/s until the first is sent (16 s); the second's last 8 Gb
  # then go at the whole 1 Gb/s (8 s more). The opposite direction is its own link.
  assert deliveries(net, [_send(net, 0.0, 0, 2, GB), _send(net, 0.0, 1, 3, 2 * GB),
                          _send(net, 0.0, 2, 0, GB)]) == [
      pytest.approx(16.05), pytest.approx(24.05), pytest.approx(8.05)]
  # A flow that starts later shares from then on: 4 Gb alone in 4 s, then halves.
  assert deliveries(net, [_send(net, 0.0, 0, 2, GB), _send(net, 4.0, 1, 3, 0.5 * GB)]) == [
      pytest.approx(12.05), pytest.approx(12.05)]


def test_a_flow_held_down_elsewhere_leaves_its_share_to_the_others():
  # Abstract resources: a (capacity 1) carries f1 and f2; b (capacity 10) carries f2 and
  # f3. Equal shares would give f3 5; f2 is held to 1/2 at a, so f3 gets 9.5.
  rates = max_min_rates({"f1": ["a"], "f2": ["a", "b"], "f3": ["b"]},
                        {"a": 1.0, "b": 10.0}.get)
  assert rates == pytest.approx({"f1": 0.5, "f2": 0.5, "f3": 9.5})
  # On the network: region 0's uplink (10 Gb/s) carries three flows: one to region 1 over
  # a 1 Gb/s link, two to region 2 over a 10 Gb/s link. A third of the uplink each would
  # be 3.33 Gb/s; the first is held to 1 Gb/s by its link, the others get 4.5 each.
  gbps = [[100.0, 1.0, 10.0], [1.0, 100.0, 10.0], [10.0, 10.0, 100.0]]
  net = Network.build(num_workers=6, regions=3, worker_regions=(0, 0, 0, 1, 2, 2),
                      intra_gbps=100.0, intra_latency_s=0.0, inter_gbps=gbps,
                      inter_latency_s=0.0, region_gbps=10.0)
  done = deliveries(net, [_send(net, 0.0, 0, 3, GB), _send(net, 0.0, 1, 4, 4.5 * GB / 8),
                          _send(net, 0.0, 2, 5, 4.5 * GB / 8)])
  # 4.5 Gb at 4.5 Gb/s: 1 s. The first flow stays at 1 Gb/s (its link) throughout: 8 s.
  assert done == [pytest.approx(8.0), pytest.approx(1.0), pytest.approx(1.0)]


def test_nics_are_shared_inside_a_region():
  # Two workers send 1 GB each to a third in their region: its 100 Gb/s NIC is split.
  net = _regions((0, 0, 0), intra_latency_s=0.0)
  assert deliveries(net, [_send(net, 0.0, 0, 2, GB), _send(net, 0.0, 1, 2, GB)]) == [
      pytest.approx(0.16)] * 2


def test_hierarchical_allreduce_time_by_hand():
  # 2 regions x 3 workers; n = 6 MB. Intra: 100 Gb/s, 0.1 ms; inter: 1 Gb/s, 50 ms.
  net, n = _regions((0, 0, 0, 1, 1, 1)), 6e6
  li, bi, l, b = 1e-4, 100e9, 0.05, 1e9
  # Each region: a reduce-scatter ring, 2 steps of n/3; the 2 shards into the leader's NIC
  # at once (half of it each); the mirror of both at the end. Leaders: 2 steps of n/2.
  inside = 2 * (li + 8 * n / 3 / bi) + (li + 8 * n / 3 / (bi / 2))
  across = 2 * (l + 8 * n / 2 / b)
  assert collectives.hierarchical_allreduce_seconds(net, range(6), n) == pytest.approx(
      2 * inside + across)  # 0.1493
  # The flat ring: 10 steps of n/6, each crossing both ways once: 10 · (0.05 + 0.008).
  assert collectives.ring_allreduce_seconds(net, range(6), n) == pytest.approx(0.58)
  assert collectives.seconds(net, "allreduce", range(6), n) == (
      pytest.approx(2 * inside + across), "hierarchical")
  assert collectives.seconds(net, "allreduce", range(6), n, "ring")[1] == "ring"


def test_hierarchical_allgather_time_by_hand():
  # 2 regions x 2 workers, payloads of n = 1 MB: gather at the leader (1 MB), the leaders
  # swap their regions' 2 MB blocks, each leader sends its other worker the 3 MB it lacks.
  net, n = _regions((0, 0, 1, 1)), 1e6
  li, bi, l, b = 1e-4, 100e9, 0.05, 1e9
  expected = (li + 8 * n / bi) + (l + 16 * n / b) + (li + 24 * n / bi)
  assert collectives.hierarchical_allgather_seconds(net, range(4), n) == pytest.approx(expected)
  # Ring: 3 steps of 1 MB, each crossing both ways once.
  assert collectives.ring_allgather_seconds(net, range(4), n) == pytest.approx(3 * (l + 8e-3))


def test_one_region_uses_the_direct_exchange_and_the_server_can_have_a_region_of_its_own():
  """On one region the direct exchange moves a ring's bytes in 2 steps, not 6, so 'auto'
  takes it (issue 70; the ring before)."""
  net = _regions((0, 0, 0, 0))
  assert collectives.seconds(net, "allreduce", range(4), 4e6, "ring") == (
      pytest.approx(6 * (1e-4 + 8e6 / 100e9)), "ring")
  assert collectives.seconds(net, "allreduce", range(4), 4e6) == (
      pytest.approx(2 * (1e-4 + 3 * 8e6 / 100e9)), "direct")
  own = Network.build(num_workers=4, regions=2, intra_gbps=100.0, intra_latency_s=1e-4,
                      inter_gbps=1.0, inter_latency_s=0.05, server_region=None,
                      server_link=(2.0, 0.01))
  assert own.regions == 3 and own.server_region == 2 and own.worker_region == (0, 0, 1, 1)
  assert own.transfer_seconds(0, 2, 1e6) == pytest.approx(0.01 + 8e6 / 2e9)
  assert own.transfer_seconds(0, 1, 1e6) == pytest.approx(0.05 + 8e6 / 1e9)
  # Its uplink and downlink: by default its fastest link.
  assert own.capacity(("up", 2)) == 2e9 and own.capacity(("down", 0)) == 2e9
