"""The simulator's plain parts: event order, link and ring times, speed levels."""

import numpy as np
import pytest

from lowcomm_jax.sim import EventLoop, Network, SpeedModel, collectives, level_speeds


def test_events_pop_in_time_then_scheduling_order_and_survive_a_state_round_trip():
  loop = EventLoop()
  loop.schedule(2.0, "b", i=1)
  loop.schedule(1.0, "a", i=2)
  loop.schedule(2.0, "c", i=3)
  loop.schedule(1.0, "d", i=4)
  assert [e.kind for e in loop.pop_simultaneous()] == ["a", "d"] and loop.now == 1.0
  restored = EventLoop.from_state(loop.state_dict())
  restored.schedule(2.0, "e", i=5)  # after the restored ones at the same time
  assert [(e.kind, e.data["i"]) for e in restored.pop_simultaneous()] == [
      ("b", 1), ("c", 3), ("e", 5)]
  assert restored.now == 2.0 and not len(restored)
  with pytest.raises(ValueError, match="in the past"):
    restored.schedule(1.5, "late")


def _two_regions():
  # Workers 0,1 in region 0; 2,3 in region 1. Intra: 100 Gb/s, 0.1 ms; inter: 1 Gb/s, 50 ms.
  return Network.build(num_workers=4, regions=2, intra_gbps=100.0, intra_latency_s=1e-4,
                       inter_gbps=1.0, inter_latency_s=0.05)


def test_transfer_time_is_latency_plus_bits_over_bandwidth():
  net = _two_regions()
  assert net.worker_region == (0, 0, 1, 1)
  assert net.transfer_seconds(0, 1, 1_000_000) == pytest.approx(0.05 + 8e6 / 1e9)  # 0.058
  assert net.transfer_seconds(1, 1, 1_000_000) == pytest.approx(1e-4 + 8e6 / 100e9)


def test_ring_times_by_hand():
  net = _two_regions()
  # All-reduce of 4 MB over 4 workers: 2·3 steps of 1 MB; each step has one transfer
  # crossing each way between the regions (no two share a link): 6 · (0.05 + 8e6/1e9).
  assert collectives.ring_allreduce_seconds(net, range(4), 4_000_000) == pytest.approx(0.348)
  # All-gather of 4 MB payloads: 3 steps of 4 MB: 3 · (0.05 + 0.032).
  assert collectives.ring_allgather_seconds(net, range(4), 4_000_000) == pytest.approx(0.246)
  # Inside one region only: 2 · (1e-4 + 8·2e6/100e9).
  assert collectives.ring_allreduce_seconds(net, [0, 1], 4_000_000) == pytest.approx(
      2 * (1e-4 + 16e6 / 100e9))
  assert collectives.ring_allreduce_seconds(net, [3], 4_000_000) == 0.0


def test_a_direct_exchange_costs_a_ring_on_one_region_and_more_across_regions():
  """'direct' (the Ray runtime's flat exchange: every pair at once, two steps) moves a
  ring's bytes through each NIC: on one region of 1 Gb/s NICs, 4 MB over 4 workers takes
  2 · 3 MB · 8 / 1 Gb/s either way. Across two regions behind 1 Gb/s uplinks every pair
  that spans them crosses: 4 shards of 1 MB each way per step (2 · 32 ms), where a ring
  crosses once each way per step (6 · 8 ms) and the hierarchical reduce less again."""
  flat = Network.build(num_workers=4, regions=1, intra_gbps=1.0, intra_latency_s=0.0,
                       inter_gbps=1.0, inter_latency_s=0.0)
  assert collectives.direct_allreduce_seconds(flat, range(4), 4e6) == pytest.approx(0.048)
  assert collectives.ring_allreduce_seconds(flat, range(4), 4e6) == pytest.approx(0.048)
  net = Network.build(num_workers=4, regions=2, intra_gbps=100.0, intra_latency_s=0.0,
                      inter_gbps=1.0, inter_latency_s=0.0, region_gbps=1.0)
  assert collectives.direct_allreduce_seconds(net, range(4), 4e6) == pytest.approx(0.064)
  assert collectives.ring_allreduce_seconds(net, range(4), 4e6) == pytest.approx(0.048)
  assert collectives.hierarchical_allreduce_seconds(net, range(4), 4e6) < 0.048
  # all-gather: each worker's 4 MB to the 3 others, 2 of them across: 8 · 4 MB over 1 Gb/s
  assert collectives.direct_allgather_seconds(net, range(4), 4e6) == pytest.approx(0.128)
  assert collectives.seconds(net, "allreduce", range(4), 4e6, "direct") == (
      pytest.approx(0.064), "direct")


def test_best_ring_avoids_slow_links_when_another_region_order_exists():
  # 4 regions; 0-1 and 2-3 are slow (0.1 Gb/s), every other pair is fast (10 Gb/s). Index
  # order 0,1,2,3 would cross 0-1; the ring 0,2,1,3 uses only fast links.
  gbps = np.full((4, 4), 10.0)
  gbps[0, 1] = gbps[1, 0] = gbps[2, 3] = gbps[3, 2] = 0.1
  net = Network.build(num_workers=4, regions=4, intra_gbps=100.0, intra_latency_s=0.0,
                      inter_gbps=gbps, inter_latency_s=0.0)
  ring, step = collectives.best_ring(net, range(4), 1e6)
  assert step == pytest.approx(8e6 / 10e9)
  links = {frozenset(p) for p in zip(ring, ring[1:] + ring[:1])}
  assert frozenset((0, 1)) not in links and frozenset((2, 3)) not in links


@pytest.mark.parametrize("level,spread", [("none", 1.0), ("slight", 1.25), ("moderate", 2.0),
                                          ("very", 5.0)])
def test_heterogeneity_levels_span_their_documented_spread(level, spread):
  speeds = level_speeds(level, 8, seed=3)
  assert max(speeds) == 1.0 and max(speeds) / min(speeds) == pytest.approx(spread)
  assert len(set(speeds)) == (1 if level == "none" else 8)
  assert speeds == level_speeds(level, 8, seed=3) != (level_speeds(level, 8, seed=4)
                                                      if level != "none" else None)


def test_job_seconds_follow_speed_and_are_a_pure_function_of_worker_and_job():
  plain = SpeedModel.build(num_workers=2, level="none", explicit=(1.0, 0.25), step_seconds=0.5,
                           jitter=0.0, straggler_prob=0.0, straggler_slowdown=1.0, seed=0)
  assert plain.job_seconds(0, 0, 10) == 5.0 and plain.job_seconds(1, 7, 10) == 20.0
  noisy = SpeedModel.build(num_workers=2, level="none", explicit=(), step_seconds=1.0,
                           jitter=0.2, straggler_prob=0.5, straggler_slowdown=4.0, seed=0)
  times = [noisy.job_seconds(0, j, 20) for j in range(40)]
  assert times == [noisy.job_seconds(0, j, 20) for j in range(40)]  # same draws every time
  stragglers = [t for t in times if t > 40]
  assert 5 < len(stragglers) < 35  # about half the jobs, each ~4x the ~20 s of a normal one
  assert all(60 < t < 100 for t in stragglers)
  assert all(14 < t < 26 for t in times if t <= 40)


def test_auto_weighs_the_direct_exchange_with_what_a_real_transport_adds():
  """'auto' considers the direct exchange Ray's rounds run (issue 70): on one region it
  moves a ring's bytes in 2 steps, not 2(W−1), so with latency it is the faster. What a
  real transport adds beyond the bytes (`exchange_efficiency`, `exchange_member_s`, as
  bench/exchange_rig.py measures them) slows it, and past that 'auto' keeps the ring."""
  build = lambda **kw: Network.build(num_workers=8, regions=1, intra_gbps=1.0,
                                     intra_latency_s=0.01, inter_gbps=1.0,
                                     inter_latency_s=0.0, **kw)
  n = 8e6  # 7/8 of 8 MB through each NIC per half: 56 ms at 1 Gb/s
  seconds, form = collectives.seconds(build(), "allreduce", range(8), n)
  assert form == "direct" and seconds == pytest.approx(2 * (0.01 + 0.056))
  assert collectives.ring_allreduce_seconds(build(), range(8), n) == pytest.approx(
      14 * (0.01 + 0.008))
  slow = build(exchange_efficiency=0.8, exchange_member_s=0.01)
  assert collectives.direct_allreduce_seconds(slow, range(8), n) == pytest.approx(
      2 * ((0.01 + 0.056) / 0.8 + 8 * 0.01))
  assert collectives.seconds(slow, "allreduce", range(8), n)[1] == "ring"
  assert collectives.direct_allgather_seconds(slow, range(8), n) == pytest.approx(
      (0.01 + 7 * 0.064) / 0.8 + 8 * 0.01)
