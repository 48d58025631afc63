"""Schedules on a fake backend: who starts when, what arrives when, when HALoS servers talk."""

import pytest

from lowcomm_jax import algorithms
from lowcomm_jax.algorithms.base import ExchangeRule
from lowcomm_jax.parallel.server_names import GLOBAL
from lowcomm_jax.sim import EventLoop, Network, Plan, SpeedModel
from lowcomm_jax.sim.replay import CountingBackend


class FakeBackend(CountingBackend):
  """Counts versions as the real servers move them (sim/replay.py) and records calls; the
  math is not the schedule's business."""

  def __init__(self, segments: int = 1):
    super().__init__(segments)
    self.calls = []
    self.unpushed = {}  # per LPS: jobs applied there and not yet in a push
    self.pushed_jobs = 0
    self.push_sizes = []  # jobs carried by each push, in order

  def start_job(self, job):
    self.calls.append(("start", job.worker, job.server, job.version, job.steps))

  def apply_job(self, job):
    self.unpushed[job.server] = self.unpushed.get(job.server, 0) + 1
    self.calls.append(("apply", job.worker, job.server))
    return super().apply_job(job)

  def sync_round(self, jobs):
    self.calls.append(("sync", len(jobs)))
    return super().sync_round(jobs)

  def sync_segment(self, jobs, segment):
    self.calls.append(("sync_segment", segment, len(jobs)))
    return super().sync_segment(jobs, segment)

  def push_update(self, src, msg):
    self.calls.append(("push", src))
    self.push_sizes.append(self.unpushed.get(src, 0))
    self.pushed_jobs += self.unpushed.pop(src, 0)

  def apply_push(self, dst, msg):
    self.calls.append(("apply_push", dst))
    super().apply_push(dst, msg)

  def send_params(self, src, msg):
    self.calls.append(("send_params", src))

  def merge(self, dst, msg, alpha):
    self.calls.append(("merge", dst))


def _plan(speeds, *, regions=1, inner=2, total=None, rounds=2, inter_seconds_per_byte=1.0,
          server_region=0, worker_regions=(), **kw):
  """Bandwidth 8e-9 Gb/s = 8 bits/s: one byte takes one second on a NIC; latency 0. HALoS's
  exchange from `sync_every` and `merge_alpha` (the config's defaults, 8 and 0.25)."""
  w = len(speeds)
  kw["exchange_rule"] = ExchangeRule(kw.pop("sync_every", 8), kw.pop("merge_alpha", 0.25))
  return Plan(inner_steps=[inner] * w, rounds=rounds, total_steps=total or w * rounds * inner,
              speeds=SpeedModel.build(num_workers=w, level="none", explicit=speeds,
                                      step_seconds=1.0, jitter=0.0, straggler_prob=0.0,
                                      straggler_slowdown=1.0, seed=0),
              network=Network.build(num_workers=w, regions=regions, intra_gbps=8e-9,
                                    worker_regions=worker_regions, intra_latency_s=0.0,
                                    inter_gbps=8e-9 / inter_seconds_per_byte,
                                    inter_latency_s=0.0, server_region=server_region),
              delta_bytes=1, param_bytes=1, gathers=False, **kw)


def _run(algorithm, plan):
  backend, loop = FakeBackend(), EventLoop()
  schedule = algorithms.get(algorithm).schedule(plan, backend)
  schedule.start(loop)
  times = []
  while len(loop):
    for event in loop.pop_simultaneous():
      schedule.handle(event, loop)
      if event.kind not in ("flows", "pulled", "computed"):
        times.append((loop.now, event.kind))
  return schedule, backend, times


def test_sync_rounds_wait_for_the_slowest_worker_and_the_ring():
  # Bandwidth 8e-9 Gb/s = 8 bits/s: one byte takes one second. Speeds 1 and 0.5, H = 2:
  # computes take 2 s and 4 s; the all-reduce of 1 byte over 2 workers is 2·(1/2 byte) = 1 s.
  schedule, backend, times = _run("diloco", _plan((1.0, 0.5)))
  assert times == [(5.0, "round_end"), (10.0, "round_end")]
  assert [c for c in backend.calls if c[0] == "sync"] == [("sync", 2), ("sync", 2)]
  assert schedule.acct.compute_seconds == [4.0, 8.0]  # idle: 6/10 and 2/10 of the time


def test_server_rounds_are_pulls_computes_and_contributions_as_on_ray():
  # collective='server' (the Ray runtime's rounds), one byte each way over NICs of 1 byte/s,
  # the server a node of region 0. t=0: both pull at once through the server's NIC, half
  # each: pulled at 2. w0 computes 2 s (to 4) and sends alone (arrives 5); w1 computes 4 s
  # (to 6) and sends alone (7): the round ends at 7, the next at 14.
  schedule, backend, times = _run("diloco", _plan((1.0, 0.5), collective="server"))
  assert times == [(7.0, "round_end"), (14.0, "round_end")]
  assert schedule.collective_used == "server"
  assert schedule.acct.bytes_sent == 4 and schedule.acct.server_bytes_sent == 4
  # The server in a region of its own behind links of 0.5 byte/s: the two pulls share that
  # (a quarter byte/s each) and both arrive at 4; w0 sends at 6 (arrives 8), w1 at 8 (10).
  _, _, times = _run("diloco", _plan((1.0, 0.5), collective="server", server_region=None,
                                     inter_seconds_per_byte=2.0))
  assert times == [(10.0, "round_end"), (20.0, "round_end")]


def test_under_server_the_server_takes_one_contribution_at_a_time():
  # Two equal workers (H = 2 in 2 s), one byte each way, NICs of 1 byte/s. Shared fairly,
  # they stay in step: pulls arrive at 2, both send at 4 (half the server's NIC each: 6),
  # pull again (8), send again (12). Taken one at a time, as the Ray driver does: w0's
  # arrives at 5 and w1's, waiting, at 6; w0 pulls alone (6) and sends at 8 (9), w1 pulls
  # at 6 (7) and sends at 9 (10): out of step, so the server's two directions both work.
  arrivals = lambda times: [t for t, kind in times if kind == "arrive"]
  _, _, fair = _run("async_dn", _plan((1.0, 1.0)))
  assert arrivals(fair) == [6.0, 6.0, 12.0, 12.0]
  schedule, _, serial = _run("async_dn", _plan((1.0, 1.0), collective="server"))
  assert arrivals(serial) == [5.0, 6.0, 9.0, 10.0]
  assert schedule.acct.applied_steps == 8 and schedule.waiting == []


def test_a_streaming_schedule_refuses_the_server_rounds():
  with pytest.raises(ValueError, match="collective_form='server'"):
    _run("streaming", _plan((1.0, 1.0), collective="server", fragment_bytes=(1, 1)))


def test_async_workers_pull_latest_and_count_staleness_until_the_budget():
  # Worker 0 (speed 1: H = 2 in 2 s) and worker 1 (speed 0.5: 4 s), one byte each way; the
  # server's NIC carries 1 byte/s each way, shared by the transfers in flight.
  # t=0: both pull at once, half the NIC each: pulled at 2. w0 computes to 4, sends alone
  # (arrives 5), pulls alone (6), computes to 8. w1 computes to 6, arrives 7, pulls (8),
  # computes to 12. w0 arrives 9, pulls (10), computes to 12. At 12 both send at once:
  # half the NIC each, both arrive at 14 (w1's first: its send started first).
  schedule, backend, times = _run("async_dn", _plan((1.0, 0.5), total=10))
  assert times == [(5.0, "arrive"), (7.0, "arrive"), (9.0, "arrive"), (14.0, "arrive"),
                   (14.0, "arrive")]
  starts = [c for c in backend.calls if c[0] == "start"]
  # (worker, pulled version, steps): the last job is cut to the 2 steps left of 10.
  assert [(w, v, s) for _, w, _, v, s in starts] == [(0, 0, 2), (1, 0, 2), (0, 1, 2), (1, 2, 2),
                                                      (0, 3, 2)]
  assert schedule.acct.applied_steps == 10 and schedule.dispatched_steps == 10
  # Staleness at apply: worker 0's first job 0, worker 1's 1, worker 0's second 1, worker
  # 1's second 1 (pulled 2, applied at 3), worker 0's last 1 (pulled 3, applied at 4).
  assert schedule.acct.staleness_sum == 4


def test_halos_pushes_every_k_local_updates_merges_and_flushes_at_the_end():
  # 2 regions x 2 equal workers, K = 2: each LPS pushes after its 2nd update, merges the
  # GPS reply, and pushes again; at the end every LPS pushes what it has not yet sent.
  plan = _plan((1.0, 1.0, 1.0, 1.0), regions=2, total=24, sync_every=2, merge_alpha=0.5)
  schedule, backend, _ = _run("halos", plan)
  servers = {c[2] for c in backend.calls if c[0] == "start"}
  assert servers == {"region0", "region1"}
  pushes = [c for c in backend.calls if c[0] == "push"]
  merges = [c for c in backend.calls if c[0] == "merge"]
  assert len(pushes) == len(merges) == backend.versions[GLOBAL] >= 4
  assert {c[1] for c in pushes} == {"region0", "region1"}
  assert all(not lps["pushing"] and lps["unsent"] == 0 for lps in schedule.lps.values())
  assert schedule.acct.applied_steps == 24


def test_halos_push_timing_by_hand():
  # Both workers in region 0 with their LPS, the GPS in region 1. NICs carry 1 byte/s each
  # way, the link between the regions 1/5 byte/s; every transfer is 1 byte. K = 2, H = 2,
  # a 12-step budget; w0 computes a job in 2 s, w1 in 4 s.
  #  0     both pull at once, half the LPS's NIC each: pulled at 2.
  #  4, 6  w0 arrives at 5 (v1), pulls alone (6), computes to 8. w1 arrives at 7 (v2).
  #  7     w1 pulls while push 1 (2 updates) leaves: the push is held to 1/5 by the link,
  #        the pull gets the other 4/5 of the NIC (1.25 s): pulled at 8.25, computes to
  #        12.25. Push 1 is at the GPS at 12, its reply back at 17.
  #  8     w0 arrives at 9 (v3), pulls beside the push (1.25 s, 10.25), computes to 12.25.
  #  12.25 w1 and w0 send beside the reply (1/5 on the link): 2/5 each, arrive at 14.75.
  #        w1 pulls the last job (alone, 15.75) and computes to 19.75; w0 has no budget.
  #  17    the reply lands: push 2 with the 3 updates unsent (at 22, back at 27).
  #  19.75 w1 arrives at 20.75; it is the last: push 3 goes when push 2's reply lands, at
  #        27 (at the GPS at 32, back at 37).
  plan = _plan((1.0, 0.5), regions=2, total=12, sync_every=2, server_region=1,
               worker_regions=(0, 0), inter_seconds_per_byte=5.0)
  schedule, backend, times = _run("halos", plan)
  at = lambda kind: [t for t, k in times if k == kind]
  assert at("arrive") == pytest.approx([5.0, 7.0, 9.0, 14.75, 14.75, 20.75])
  assert at("push_arrive") == pytest.approx([12.0, 22.0, 32.0])
  assert at("params_arrive") == pytest.approx([17.0, 27.0, 37.0])
  assert backend.push_sizes == [2, 3, 1]
  assert [c[0] for c in backend.calls if c[0] in ("push", "apply_push", "merge")] == [
      "push", "apply_push", "merge"] * 3
  # Servers sent 6 pulls, 3 pushes and 3 GPS replies, workers 6 contributions: 1 byte each.
  assert schedule.acct.server_bytes_sent == 6 + 3 + 3 and schedule.acct.bytes_sent == 6


def test_halos_pushes_updates_that_arrived_during_a_push_with_the_next_one():
  # Pushes to the GPS take 10 s each way while workers arrive every 3 s: most updates
  # arrive while a push is in flight. Every applied job must end up in some push.
  plan = _plan((1.0, 0.9, 1.0, 0.8), regions=2, total=40, sync_every=2,
               inter_seconds_per_byte=10.0, server_region=0)
  schedule, backend, _ = _run("halos", plan)
  assert schedule.acct.applied_jobs == 20
  assert backend.pushed_jobs == 20 and not any(backend.unpushed.values())
  assert all(not lps["pushing"] and lps["unsent"] == 0 for lps in schedule.lps.values())


def _continued(algorithm, plan, stop_after_batches):
  """Runs `stop_after_batches` event batches, rebuilds the schedule and loop from their JSON
  state (and the backend's versions), and finishes; returns the calls after the cut."""
  import json
  backend, loop = FakeBackend(), EventLoop()
  schedule = algorithms.get(algorithm).schedule(plan, backend)
  schedule.start(loop)
  for _ in range(stop_after_batches):
    for event in loop.pop_simultaneous():
      schedule.handle(event, loop)
  saved = json.loads(json.dumps({"schedule": schedule.state_dict(), "loop": loop.state_dict(),
                                 "versions": backend.versions}))
  cut = len(backend.calls)
  again, loop2 = FakeBackend(), EventLoop.from_state(saved["loop"])
  again.versions = saved["versions"]
  resumed = algorithms.get(algorithm).schedule(plan, again)
  resumed.load_state(saved["schedule"])
  for s, b, lp in ((schedule, backend, loop), (resumed, again, loop2)):
    while len(lp):
      for event in lp.pop_simultaneous():
        s.handle(event, lp)
  return backend.calls[cut:], again.calls, schedule.state_dict(), resumed.state_dict()


@pytest.mark.parametrize("algorithm", ["diloco", "async_dn", "halos"])
def test_a_schedule_rebuilt_mid_run_from_its_state_continues_identically(algorithm):
  plan = _plan((1.0, 0.7, 0.4, 1.0), regions=2, total=24, sync_every=2, rounds=4,
               inter_seconds_per_byte=4.0)
  rest, rest_resumed, final, final_resumed = _continued(algorithm, plan, 2)
  assert rest and rest == rest_resumed
  assert final == final_resumed


def test_asynchronous_servers_get_their_documented_outer_rules():
  """async: Nesterov per arrival at lr/W; async_dn: Delayed Nesterov with N = W; halos: one
  Delayed Nesterov per region (N = its workers) and the global one."""
  import jax.numpy as jnp
  import optax
  from conftest import load_config
  from lowcomm_jax.outer import DelayedNesterovState
  plan = _plan((1.0, 1.0, 1.0, 0.5), regions=2)
  config = load_config("smoke", num_workers=4, **{"runtime": "simulator", "outer.lr": 0.8})
  x = jnp.ones(3)
  config.algorithm = "async"
  rule = algorithms.get(config.algorithm).server_rules(config, plan)["global"]
  updates, _ = rule.update(x, rule.init(x), x)
  expected, _ = optax.sgd(0.2, momentum=0.9, nesterov=True).update(x, rule.init(x), x)
  assert jnp.allclose(updates, expected)
  config.algorithm = "async_dn"
  rule = algorithms.get(config.algorithm).server_rules(config, plan)["global"]
  updates, state = rule.update(x, rule.init(x), x)
  assert isinstance(state, DelayedNesterovState) and jnp.allclose(updates, -0.8 * x / 4)
  config.algorithm = "halos"
  rules = algorithms.get(config.algorithm).server_rules(config, plan)
  assert sorted(rules) == ["global", "region0", "region1"]
  updates, _ = rules["region0"].update(x, rules["region0"].init(x), x)
  assert jnp.allclose(updates, -0.8 * x / 2)  # two workers per region: N = 2


@pytest.mark.parametrize("tau,expected", [
    # τ = 0: each segment waits for the previous fragment. Speeds 1 and 0.5, H = 4 in two
    # segments of 2 steps (2 s and 4 s of compute), each fragment 1 byte: ring 1 s.
    (0, [(5.0, 0), (10.0, 1), (15.0, 0), (20.0, 1)]),
    # τ = 1: the slow worker's first step (2 s) hides the 1 s transfer: segments end every
    # 4 s after the first, each fragment lands 1 s after its segment.
    (1, [(5.0, 0), (9.0, 1), (13.0, 0), (17.0, 1)]),
])
def test_streaming_segments_hide_transfers_behind_tau_steps(tau, expected):
  plan = _plan((1.0, 0.5), inner=4, fragment_bytes=(1, 1), overlap_steps=tau)
  backend, loop = FakeBackend(segments=2), EventLoop()
  schedule = algorithms.get("streaming").schedule(plan, backend)
  schedule.start(loop)
  seen = []
  while len(loop):
    for event in loop.pop_simultaneous():
      schedule.handle(event, loop)
      seen.append((loop.now, event.data["segment"]))
  assert seen == expected
  assert [c for c in backend.calls if c[0] == "sync_segment"] == [
      ("sync_segment", k, 2) for k in (0, 1, 0, 1)]
  assert schedule.acct.applied_steps == 2 * 2 * 4 and schedule.progress() == 2
  assert schedule.acct.bytes_sent == 4 * 2  # each segment: both workers send one fragment


def test_gossip_rounds_wait_only_for_the_peer():
  # Computes of H = 2 take 2, 2, 4, 4 s; a swap of 1 byte with a peer takes 1 s each way at
  # once. Fixed pairs (0,1), (2,3): the fast pair runs ahead of the slow one.
  from lowcomm_jax.sim.sync_schedules import GossipRounds

  def run(peers):
    backend, loop = FakeBackend(), EventLoop()
    schedule = GossipRounds(_plan([1.0, 1.0, 0.5, 0.5]), backend, peers)
    schedule.start(loop)
    times = []
    while len(loop):
      for event in loop.pop_simultaneous():
        schedule.handle(event, loop)
        times.append(loop.now)
    return schedule, backend, times

  schedule, backend, times = run(lambda t: [1, 0, 3, 2])
  assert times == [5.0, 10.0]  # the slow pair's round ends; the fast pair was ready at 3, 6
  assert schedule.ready == [6.0, 6.0, 10.0, 10.0]
  assert [c for c in backend.calls if c[0] == "sync"] == [("sync", 4)] * 2
  assert schedule.acct.bytes_sent == 2 * 4
  # Pairs change in round 2, (0,2), (1,3): the fast workers then wait for a slow peer.
  schedule, _, times = run(lambda t: [1, 0, 3, 2] if t == 0 else [2, 3, 0, 1])
  assert times == [5.0, 10.0] and schedule.ready == [10.0] * 4
  # A checkpointed schedule resumes with its per-worker clocks.
  again = GossipRounds(_plan([1.0] * 4), FakeBackend(), lambda t: [1, 0, 3, 2])
  again.load_state(schedule.state_dict())
  assert again.ready == schedule.ready


def test_the_server_in_a_region_of_its_own_evens_out_the_regions_shares_of_the_steps():
  # Four equal workers in two regions, links between regions 10x slower than NICs.
  def region0_share(server_region):
    plan = _plan((1.0,) * 4, regions=2, total=80, inter_seconds_per_byte=10.0,
                 server_region=server_region)
    schedule, _, _ = _run("async_dn", plan)
    steps = schedule.acct.applied_steps_by_worker
    assert sum(steps) == schedule.acct.applied_steps == 80
    return (steps[0] + steps[1]) / 80

  # Beside the server, region 0's workers wait ~2 s per job on the wire, region 1's ~20 s.
  assert region0_share(0) > 0.7
  # In a region of its own, every worker is equally far from it.
  assert region0_share(None) == 0.5
