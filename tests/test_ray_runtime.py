"""The Ray runtime on a local Ray (one cluster for the test process: conftest.ray_cluster): pushes, membership changes,
a server that dies and restarts, and its server rule against the simulator's."""

import json

import numpy as np
import pytest

from conftest import checkpointed_state, load_config, ray_checkpoint
from lowcomm_jax.config import check
from lowcomm_jax.runtimes.ray import chaos

ray = pytest.importorskip("ray")


def _config(**overrides):
  """Two workers of the tiny model (every actor is a process: few keep the module short),
  H = 2, a budget of 2·3·2 = 12 inner steps (6 pushes), a checkpoint every round-equivalent
  (4 inner steps, 2 pushes)."""
  base = {"runtime": "ray", "algorithm": "async_dn", "num_workers": 2, "rounds": 3,
          "inner_steps": 2, "eval_every": 3, "checkpoint_every": 1, "log_every": 1,
          "mesh.replica": 1, "ray.apply_order": "dispatch"}
  return load_config("smoke", **{**base, **overrides})


@pytest.fixture
def cluster(ray_cluster):
  """The process's local Ray (conftest.ray_cluster: started once, as a run starts one)."""


def test_a_ray_the_run_starts_runs_its_actors_at_the_drivers_priority(cluster):
  """Ray's default niceness 15 would starve the actors of any host that is busy with
  anything else (this suite's other workers, for one)."""
  import os

  @ray.remote(num_cpus=0)
  def niceness():
    return os.nice(0)

  assert ray.get(niceness.remote()) == os.nice(0)


def test_an_actor_below_normal_priority_says_how_to_start_ray(monkeypatch, caplog):
  import os
  from lowcomm_jax.runtimes.ray import cluster as ray_cluster
  monkeypatch.setattr(os, "nice", lambda increment: 15)
  ray_cluster.warn_if_niced("worker 3")
  assert "worker 3 runs at niceness 15" in caplog.text
  assert "RAY_worker_niceness=0" in caplog.text


def _run(config, workdir, **kwargs):
  from lowcomm_jax.runtimes.ray import driver
  summary = driver.run(config, workdir, **kwargs)
  events = [row for row in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
            if "event" in row]
  return summary, events


def _assert_same_theta(ray_config, ray_dir, runner_config, runner_dir, atol=1e-5):
  """The final θ of the Ray run and of the lockstep run (each one's last checkpoint) differ
  by at most `atol` anywhere. With a quantizing codec, a Δ that differs in its last bit (a
  Ray worker's program is one worker's, the runner's vmaps every worker: XLA may fuse them
  differently) can land in the neighbouring bin: those few coordinates differ by about one
  bin times the outer lr. There, at most 0.1% of θ may differ by more than `atol`, and
  none by more than 1e-4."""
  ours = np.asarray(_ray_checkpointed_params(ray_config, ray_dir))
  (state, _), _ = checkpointed_state(runner_config, runner_dir)
  theirs = np.asarray(state.params)
  assert ours.shape == theirs.shape
  diff = np.abs(ours - theirs)
  if ray_config.compress.codec == "none":
    assert diff.max() <= atol, diff.max()
  else:
    assert (diff > atol).mean() <= 1e-3 and diff.max() <= 1e-4, (
        (diff > atol).sum(), diff.max())


# --- config, without Ray ----------------------------------------------------------------


def _problems(**overrides):
  try:
    check.validate(load_config("smoke", **overrides), num_devices=8)
  except check.ConfigError as e:
    return e.problems
  return []


def test_config_problems_name_their_field():
  assert _problems(runtime="ray", algorithm="async_dn", **{"mesh.replica": 1}) == []
  assert any(p.startswith("runtime=") for p in _problems(runtime="lockstep"))
  # every synchronous algorithm runs from its declarations, except what the server lacks
  for name in ("diloco", "streaming", "one_step_delay", "eager", "overlap", "pier", "desloc",
               "noloco"):
    assert _problems(runtime="ray", algorithm=name, rounds=40, **{"mesh.replica": 1}) == [], name
  # NoLoCo's joiner: in the peer form it takes a live peer's row; a server would start it
  # from θ₀, refused (a rejoin keeps its row); every slot is paired, a joiner's too
  join = {"mesh.replica": 1, "ray.chaos": ("add_worker@3", "add_worker@5")}
  assert _problems(runtime="ray", algorithm="noloco", num_workers=4, **join) == []
  joins = _problems(runtime="ray", algorithm="noloco", num_workers=4,
                    collective_form="server", **join)
  assert len(joins) == 1 and joins[0].startswith("ray.chaos=") and "rejoin_worker" in joins[0]
  odd = _problems(runtime="ray", algorithm="noloco", num_workers=4,
                  **{"mesh.replica": 1, "ray.chaos": ("add_worker@3",)})
  assert len(odd) == 1 and "5 worker slots" in odd[0] and "even" in odd[0], odd
  # several fragments a round: a round closes only with every live worker
  quorum = _problems(runtime="ray", algorithm="streaming", inner_steps=4,
                     **{"mesh.replica": 1, "ray.min_quorum": 1, "ray.apply_order": "arrival"})
  assert len(quorum) == 1 and quorum[0].startswith("ray.min_quorum=1: streaming needs every")
  assert any(p.startswith("ray.apply_order")
             for p in _problems(runtime="ray", algorithm="async",
                                **{"ray.apply_order": "random"}))
  # ray.* without runtime='ray' would be ignored: refused
  assert any("ignored unless runtime is 'ray'" in p
             for p in _problems(**{"ray.chaos": ("kill_server@3",)}))
  # the asynchronous algorithms still need the simulator or Ray, and say both
  assert any("--config.runtime=ray" in p for p in _problems(algorithm="async_dn"))
  bad = _problems(runtime="ray", algorithm="async",
                  **{"ray.chaos": ("kill_worker=5@2", "rejoin_worker=0@1", "kill_worker=1@3",
                                   "rejoin_worker=1@3", "rejoin_worker=1@4"),
                     "ray.step_sleep_s": (0.1,)})
  assert sum(p.startswith("ray.chaos") for p in bad) == 4
  assert any(p.startswith("ray.apply_order")
             for p in _problems(runtime="ray", algorithm="diloco",
                                **{"ray.min_quorum": 2, "ray.apply_order": "dispatch"}))
  assert any(p.startswith("ray.step_sleep_s") for p in bad)
  # per-worker batch sizes: one per worker, collaborative epochs only
  assert any(p.startswith("ray.batch_sizes") and "collaborative" in p
             for p in _problems(runtime="ray", algorithm="async_dn",
                                **{"mesh.replica": 1, "ray.batch_sizes": (4, 8)}))
  assert any(p.startswith("ray.batch_sizes") and "one batch size >= 1 per worker" in p
             for p in _problems(runtime="ray", algorithm="ddp", inner_steps=1,
                                **{"mesh.replica": 1, "collab.target_batch_size": 16,
                                   "ray.batch_sizes": (4,)}))
  # collaborative epochs are DDP's: on Ray too, and only there without collab
  collab = {"runtime": "ray", "inner_steps": 1, "mesh.replica": 1,
            "collab.target_batch_size": 16}
  assert _problems(algorithm="ddp", **collab) == []
  assert any(p.startswith("algorithm='diloco'") and "--config.algorithm=ddp" in p
             for p in _problems(algorithm="diloco", **collab))
  # without a target batch DDP runs in quorum rounds of one gradient each
  assert _problems(algorithm="ddp", inner_steps=1, runtime="ray", **{"mesh.replica": 1}) == []
  # sim.network under Ray: the links its nodes sit on (kept for a replay); the rest of
  # sim.* would be ignored, and is refused
  links = {"sim.network.intra_gbps": 0.02, "sim.network.server_region": 0}
  assert _problems(runtime="ray", algorithm="diloco", **{"mesh.replica": 1, **links}) == []
  assert any(p.startswith("sim.speeds=") and "ignored unless runtime is 'simulator'" in p
             for p in _problems(runtime="ray", algorithm="diloco",
                                **{"mesh.replica": 1, "sim.speeds": (1.0, 0.5)}))



def test_buckets_are_refused_on_ray_in_one_line():
  # A quorum round some workers missed combines the present rows; buckets of it are not
  # defined, so the server's sync refuses them before any work.
  problems = _problems(runtime="ray", algorithm="diloco",
                       **{"mesh.replica": 1, "aggregate.rule": "median", "aggregate.bucket": 2})
  assert [p for p in problems if p.startswith("aggregate.bucket=2")] == problems
  assert len(problems) == 1 and "aggregate.bucket=0" in problems[0]
  assert _problems(runtime="ray", algorithm="diloco",
                   **{"mesh.replica": 1, "aggregate.rule": "median",
                      "attack.workers": (0,), "aggregate.signal": "loss_ema"}) == []


def test_actors_are_pinned_to_the_nodes_named_by_their_resources():
  from lowcomm_jax.runtimes.ray import cluster as ray_cluster
  config = _config()
  config.ray.worker_nodes = ("node0", "", "node2")
  config.ray.server_node = "node9"
  options = lambda **kw: ray_cluster.actor_options(config, **kw).get("resources")
  assert options(worker=True, index=0) == {"node0": 0.01}
  assert options(worker=True, index=1) is None and options(worker=True, index=3) is None
  assert options(worker=True, index=2) == {"node2": 0.01}
  assert options(worker=False) == {"node9": 0.01}
  class Cluster:  # what a cluster of two plain nodes offers
    cluster_resources = staticmethod(lambda: {"CPU": 4.0, "node0": 1.0, "node2": 1.0})
  with pytest.raises(ray_cluster.RayUnavailable, match="ray.server_node: 'node9' is not a "
                     "resource of this Ray cluster; start that node with ray start"):
    ray_cluster._nodes_present(config, Cluster)
  config.ray.server_node = "node2"
  ray_cluster._nodes_present(config, Cluster)
  too_many = _problems(runtime="ray", algorithm="diloco", num_workers=2,
                       **{"mesh.replica": 1, "ray.worker_nodes": ("a", "b", "c")})
  assert len(too_many) == 1 and too_many[0].startswith("ray.worker_nodes=")


def test_bad_ray_input_is_refused_in_one_line_before_work(monkeypatch):
  """Issue 51's bad input, each refused in one line naming the field or the fix."""
  import time
  from lowcomm_jax.runtimes.ray import cluster as ray_cluster
  quorum = _problems(runtime="ray", algorithm="diloco", num_workers=2,
                     **{"mesh.replica": 1, "ray.min_quorum": 99})
  assert len(quorum) == 1 and quorum[0].startswith("ray.min_quorum=99: must be in 0..")
  paced = _problems(runtime="ray", algorithm="diloco", num_workers=2,
                    **{"mesh.replica": 1, "ray.sends_in_flight": 2, "ray.transport": "objects"})
  assert len(paced) == 1 and paced[0].startswith("ray.sends_in_flight=2: paces sends over")
  assert _problems(runtime="ray", algorithm="diloco", num_workers=2,
                   **{"mesh.replica": 1, "ray.sends_in_flight": -1})[0].startswith(
                       "ray.sends_in_flight=-1: must be >= 0")
  shares = _problems(runtime="ray", algorithm="diloco",
                     **{"mesh.replica": 1, "mesh.data": 2, "ray.gpus_per_worker": 1.0})
  assert len(shares) == 1 and shares[0].startswith("ray.gpus_per_worker=1.0: a worker runs on")
  assert _problems(runtime="ray", algorithm="diloco",
                   **{"mesh.replica": 1, "mesh.data": 2, "ray.gpus_per_worker": 2.0}) == []
  allow = _problems(resume_allow="not_a_field")  # a fresh run, as a resume would
  assert len(allow) == 1 and allow[0].startswith("resume_allow='not_a_field': names")
  # Nothing listens at port 1: refused in well under Ray's minutes of retries.
  start = time.perf_counter()
  with pytest.raises(ray_cluster.RayUnavailable, match=r"ray.address='127.0.0.1:1'"):
    ray_cluster._answers("127.0.0.1:1")
  assert time.perf_counter() - start < 15
  # Ray's own start failing: one line with the cause and the way around it.
  monkeypatch.setattr(ray, "is_initialized", lambda: False)
  monkeypatch.setattr(ray, "shutdown", lambda: None)

  def timed_out(**kwargs):
    raise RuntimeError("The current node timed out during startup. This could happen "
                       "because some of the raylet failed to startup\n(30 more lines)")
  monkeypatch.setattr(ray, "init", timed_out)
  with pytest.raises(ray_cluster.RayUnavailable) as failed:
    ray_cluster.connect(_config())
  assert "\n" not in str(failed.value) and "timed out during startup" in str(failed.value)
  assert "ray start --head" in str(failed.value)


def test_gpus_that_ray_does_not_see_are_refused(cluster):
  from lowcomm_jax.runtimes.ray import cluster as ray_cluster
  seen = ray.cluster_resources().get("GPU", 0)  # 0 here, 1 on a GPU host
  per_worker = seen + 1
  with pytest.raises(ray_cluster.RayUnavailable, match=(
      rf"ray.gpus_per_worker={per_worker:g}: 2 workers need {2 * per_worker:g} GPUs and Ray "
      rf"sees {seen:g}")):
    ray_cluster._enough_gpus(_config(**{"ray.gpus_per_worker": per_worker}), ray)


def test_a_joining_workers_tier_must_be_one_of_the_runs():
  from lowcomm_jax.assemble.hosts import host
  tiers = {"hosts": [host(1.0), host(0.5)], "num_workers": 2}
  ok = _problems(runtime="ray", algorithm="diloco",
                 **{"mesh.replica": 1, "ray.chaos": ("add_worker=tier:0.5@2",), **tiers})
  assert ok == []
  bad = _problems(runtime="ray", algorithm="diloco",
                  **{"mesh.replica": 1, "ray.chaos": ("add_worker=tier:0.25@2",), **tiers})
  assert len(bad) == 1 and bad[0].startswith("ray.chaos=")
  assert "add_worker=tier:0.25@2: a joining worker trains one of the run's tiers [0.5, 1.0]" in bad[0]


def test_chaos_events_parse_or_name_the_form():
  events = chaos.parse(["kill_server@9", "kill_worker=1@3", "delay_worker=2:0.5@1",
                        "add_worker@4"])
  assert [str(e) for e in events] == ["delay_worker=2:0.5@1", "kill_worker=1@3",
                                      "add_worker@4", "kill_server@9"]
  for bad in ("kill_worker@3", "add_worker=1@3", "kill_server@0", "delay_worker=1@2", "boom@1"):
    with pytest.raises(ValueError, match="is not a chaos event"):
      chaos.parse([bad])


def test_a_checkpoints_meta_gives_a_resumed_driver_what_it_counted_and_dylus_h():
  """The driver's part of a checkpoint's meta, through JSON, into a new driver (no actor):
  counts, membership, chaos delays, and DyLU's measured speeds and settled H, so a resumed
  run keeps its workers' H instead of measuring them again."""
  from lowcomm_jax.runtimes.ray.driver import RayDriver
  config = _config(**{"outer.dylu": True})
  before = RayDriver(config)
  pool = before.pool
  pool.rows.speeds, pool.rows.inner_steps = {0: 40.0, 1: 10.0}, {0: 4, 1: 1}
  pool.delays, pool.lost, pool.data = {1: 0.5}, [2], {"0": {"position": 7}}
  before.counts.pushes, before.counts.applied_steps = 5, 10
  meta = json.loads(json.dumps(before._meta(wall=3.0, last=False)))
  after = RayDriver(config)
  assert after.pool.rows.inner_steps_of(0) == after.pool.rows.inner_steps_of(1) == 2  # (config's H)
  after._resume_from(meta)
  assert [after.pool.rows.inner_steps_of(w) for w in (0, 1)] == [4, 1]
  assert after.pool.rows.speeds == pool.rows.speeds and after.pool.delays == pool.delays
  assert after.pool.lost == [2] and after.pool.data == pool.data
  assert after.counts == before.counts
  assert after.wall_before() == 3.0 and not after.finished


# --- runs on a local Ray ----------------------------------------------------------------


def test_async_dn_reaches_its_pushes_and_neither_a_killed_server_nor_a_restart_changes_it(
    cluster, tmp_path):
  """Pushes applied in dispatch order repeat exactly (int8 payloads with error feedback on
  the wire). A second run loses its server after push 3 (a checkpoint holds pushes 1-2):
  a new one restores it and replays push 3 from the object store. That run then stops
  at its second checkpoint (push 4), as a preempted job would, and is started again: the
  workers' states and their jobs in flight resume. It ends where the uninterrupted run
  does."""
  int8 = {"compress.codec": "int8"}
  plain, events = _run(_config(**int8), tmp_path / "plain")
  assert plain["pushes"] == 6 and plain["total_inner_steps"] == 12
  assert [steps for _, steps in plain["timeline"]] == [0, 2, 4, 6, 8, 10, 12]  # per push
  assert sorted(plain["pushes_per_worker"].values()) == [3, 3]
  assert np.isfinite(plain["eval_loss"]) and events == []
  assert plain["workers_lost"] == plain["pushes_dropped"] == plain["server_restarts"] == 0
  # int8 payloads: a quarter of the dense bytes (plus scales), counted per push
  assert plain["bytes_sent_total"] < 6 * 4 * plain["params"] * 0.3

  config = _config(**int8, **{"ray.chaos": ("kill_server@3",)})
  stopped, events = _run(config, tmp_path / "killed", stop_after_checkpoints=2)
  assert stopped["stopped_at"] == 2
  assert [e["event"] for e in events] == ["server_restarted"]
  assert events[0]["checkpoint"] == 1 and events[0]["replayed"] == 1
  resumed, _ = _run(config, tmp_path / "killed")
  assert resumed["server_restarts"] == 1 and resumed["pushes_replayed"] == 1
  assert resumed["eval_loss"] == plain["eval_loss"]
  assert resumed["train_loss"] == plain["train_loss"]
  assert resumed["pushes"] == plain["pushes"]
  assert resumed["mean_staleness"] == plain["mean_staleness"]


def test_a_killed_worker_does_not_stop_the_run_and_a_joined_one_contributes(cluster, tmp_path):
  """Worker 1 is killed with its second job in flight (in dispatch order: push 1 is worker
  0's, 2 worker 1's, 3 worker 0's again); a new worker 2 joins; worker 1 comes back where
  its stream was: after the run, its stream has read H batches for each of its pushes, over
  both its lives (one started fresh would have read again from the start)."""
  config = _config(**{"ray.chaos": ("add_worker@2", "kill_worker=1@3", "rejoin_worker=1@4")})
  summary, events = _run(config, tmp_path)
  assert summary["workers_lost"] == 1 and summary["pushes_dropped"] == 1
  assert summary["workers_joined"] == 2
  # the lost job's steps were redone by others: the whole budget was applied
  assert summary["total_inner_steps"] == 12 and np.isfinite(summary["eval_loss"])
  assert summary["pushes_per_worker"].get("2", 0) >= 1  # the worker that joined
  assert [e["event"] for e in events].count("worker_joined") == 2
  lost = [e for e in events if e["event"] == "worker_lost"]
  assert [e["worker"] for e in lost] == [1]
  rejoined = [e for e in events if e["event"] == "worker_joined" and e["worker"] == 1]
  assert len(rejoined) == 1
  _, meta, _ = ray_checkpoint(config, tmp_path)
  pushes = summary["pushes_per_worker"]["1"]
  assert pushes >= 2  # (one before it was killed, one after it came back)
  assert meta["data"]["1"]["streams"][0]["next_index"] == config.inner_steps * pushes


def test_the_ray_server_applies_pushes_as_the_simulator_does(cluster, tmp_path):
  """The same pulls and pushes (random Δ, stale ones among them) through the Ray server
  actor and through the simulator's backend: bit-identical θ and drifts."""
  import jax
  from lowcomm_jax.runtimes.simulator import simulate
  from lowcomm_jax.runtimes.ray import cluster as cluster_lib
  from lowcomm_jax.runtimes.ray.server import ServerProcess
  from lowcomm_jax.parallel.server_names import GLOBAL
  from lowcomm_jax.sim import Job

  config = _config(**{"outer.dn_buffer": 2})  # Δ as they are: no codec
  sim = simulate.Simulation(config)
  backend = sim.backend
  server = ray.remote(**cluster_lib.actor_options(config, worker=False))(ServerProcess).remote(
      config, None)
  size = int(np.asarray(backend.servers[GLOBAL]["params"]).size)
  rng = np.random.default_rng(0)
  # (worker, pulls at, pushes at) in pushes applied: jobs overlap, so staleness varies
  jobs = [(0, 0, 0), (1, 0, 1), (2, 0, 2), (0, 1, 3), (1, 2, 4), (2, 3, 5)]
  pulled, drifts = {}, []
  order = sorted([(pull, 0, i) for i, (_, pull, _) in enumerate(jobs)]
                 + [(push, 1, i) for i, (_, _, push) in enumerate(jobs)])
  for _, is_push, i in order:
    worker = jobs[i][0]
    if not is_push:
      job = Job(i, worker, GLOBAL, backend.version(GLOBAL), 2, 0.0, 0.0)
      backend.start_job(job)
      pulled[i] = (job, server.pull.remote())
      continue
    job, pull = pulled[i]
    delta = rng.normal(0, 1e-2, size).astype(np.float32)
    backend.messages[job.id] = {"delta": jax.numpy.asarray(delta), "loss": 0.0}
    sim_drift, _ = backend.apply_job(job)
    info = ray.get(server.push.remote({"version": ray.get(pull)[0]}, delta))
    assert info["staleness"] == backend.version(GLOBAL) - 1 - job.version
    drifts.append((float(sim_drift), info["drift"]))
  state = ray.get(server.state.remote())
  np.testing.assert_array_equal(state["params"], np.asarray(backend.servers[GLOBAL]["params"]))
  assert state["version"] == backend.version(GLOBAL) == len(jobs)
  assert [a for a, _ in drifts] == [b for _, b in drifts]
  ray.kill(server)


@pytest.mark.parametrize("overrides", [
    {},
    # Issue 51: on Ray the attack was skipped (the same loss to the last digit) and median
    # died on shapes; through the run's Sync, codec and all, they are the runner's.
    {"num_workers": 3, "aggregate.rule": "median", "attack.workers": (0,),
     "attack.scale": 100.0, "compress.codec": "int8"},
    # a robust rule shard by shard among the members (dense rows): centered clipping twice,
    # cosine weights from the first round
    {"num_workers": 3, "aggregate.rule": "centered_clip", "aggregate.clip_iters": 2,
     "aggregate.signal": "cosine", "aggregate.warmup_rounds": 0},
    # the values through Ray's object store (the direct form: 'auto' takes no ring there)
    {"num_workers": 3, "ray.transport": "objects"},
    # a codec's payloads reduce-scattered: each shard's owner re-encodes its mean once;
    # each member's values sent one at a time, each once the one before it is receipted
    {"num_workers": 4, "compress.codec": "int8", "compress.reduce": "scatter",
     "ray.sends_in_flight": 1},
], ids=["mean", "median+attack+int8", "clip+cosine", "mean-objects", "int8-scatter-paced"])
def test_diloco_in_full_quorum_rounds_trains_as_the_runner_does(cluster, tmp_path, overrides):
  """Every live worker in every round (min_quorum 0, no failures): the rounds are DiLoCo's,
  through the same Sync (codec, attack, robust rule, outer rule) as the lockstep runner's.
  The server combines rows where the runner's workers meet in collectives: equal up to
  float rounding, and the same bytes per worker."""
  from lowcomm_jax.runtimes.spmd import train
  config = _config(algorithm="diloco", **overrides)
  workers = config.num_workers
  summary, events = _run(config, tmp_path / "ray")
  assert summary["rounds_closed"] == 3 and summary["pushes"] == 3 * workers
  assert summary["late_contributions"] == 0 and summary["mean_staleness"] == 0
  assert summary["total_inner_steps"] == 6 * workers and events == []
  # The timeline a replay is held against: a point per round, in time order, and each
  # worker's seconds per inner step, job by job (bench/real_vs_sim.py).
  times, steps = zip(*summary["timeline"])
  assert steps == (0, 2 * workers, 4 * workers, 6 * workers)
  assert list(times) == sorted(times) and times[-1] > 0
  assert sorted(summary["step_seconds_by_job"]) == [str(w) for w in range(workers)]
  assert all(len(jobs) == 3 and min(jobs) > 0 for jobs in summary["step_seconds_by_job"].values())
  moments = summary["job_moments"]  # [worker, steps, dispatched, started, finished, taken]
  assert len(moments) == 3 * workers and all(m[1] == 2 for m in moments)
  assert all(m[2] <= m[3] <= m[4] <= m[5] for m in moments), moments
  runner_config = _config(algorithm="diloco", runtime="spmd",
                          **{"ray.apply_order": "arrival", **overrides})
  runner = train.run(runner_config, tmp_path / "runner")
  assert abs(summary["eval_loss"] - runner["eval_loss"]) < 1e-5 * runner["eval_loss"]
  assert summary["bytes_sent"] == runner["bytes_sent"]
  _assert_same_theta(config, tmp_path / "ray", runner_config, tmp_path / "runner")
  if "attack.workers" in overrides:  # the attack was applied on Ray (issue 51 skipped it):
    # its θ is not the clean run's (the lockstep one, which the clean Ray run equals)
    clean_config = _config(algorithm="diloco", runtime="spmd",
                           **{"ray.apply_order": "arrival", **overrides, "attack.workers": ()})
    train.run(clean_config, tmp_path / "clean")
    (clean, _), _ = checkpointed_state(clean_config, tmp_path / "clean")
    moved = np.abs(_ray_checkpointed_params(config, tmp_path / "ray") - np.asarray(clean.params))
    assert moved.max() > 1e-3, moved.max()
  # The peer form: no server; each link carried the collective's bytes (a dense mean's
  # reduce-scatter and all-gather: 2·(W−1)/W of the payload each way, and a robust rule's
  # shards the same, with the rows' statistics, 3W + 1 floats, and the distances, W floats
  # per further clipping iteration, to and from each member; a codec's payloads
  # all-gathered: its own to W−1 members, theirs from each; reduce-scattered: as the dense
  # mean, 2·(W−1)/W of the payload)
  assert summary["round_form"] == "peers" and summary["server_bytes_sent"] == 0
  per_round = summary["bytes_sent"] * workers // 3 // workers  # one worker's payload
  gathered = "compress.codec" in overrides and overrides.get("compress.reduce") != "scatter"
  factor = (workers - 1) if gathered else 2 * (workers - 1) / workers
  small = (4 * (workers - 1) * (3 * workers + 1 + workers * (config.aggregate.clip_iters - 1))
           if "aggregate.rule" in overrides and not gathered else 0)
  for sent, received in summary["wire_bytes_per_worker"].values():
    assert sent == received
    assert abs(sent - 3 * (factor * per_round + small)) <= 3 * 4 * workers
  # each round's collective: [version, members, began, scattered, reduced, staged, committed]
  collectives = summary["collective_moments"]
  assert [c[:2] for c in collectives] == [[v, workers] for v in range(3)]
  assert all(c[2] <= c[5] <= c[6] for c in collectives), collectives
  assert all((c[3] is None) == gathered for c in collectives)  # (all-gathered rows)
  # the members drive each round: the driver calls each member twice (the round's one
  # message, its commit), whatever the phases of the exchange between them
  assert summary["collective_calls"] == 3 * 2 * workers


def test_a_quorum_round_does_not_wait_for_a_slow_or_dead_worker(cluster, tmp_path):
  """Two of three make a round, which then waits 0.5 s for the third: worker 2, slowed by
  4 s a push, contributes to later rounds than the one it computed from (its staleness is
  kept); worker 0, killed, stops nobody. Every round closes.
  Worker 2's first job may finish before the delay reaches it, so round 0 may have all
  three; round 1 (pushes 4 and on) is the first with worker 2 certainly slow, and worker 0
  lives through it (killed after push 6), so that round closes on workers 0 and 1 alone
  and worker 2's contribution is late, whatever the machine's load."""
  config = _config(algorithm="diloco", rounds=4, num_workers=3,
                   **{"ray.apply_order": "arrival", "ray.min_quorum": 2, "ray.grace_s": 0.5,
                      "ray.chaos": ("delay_worker=2:4.0@1", "kill_worker=0@6")})
  summary, events = _run(config, tmp_path)
  assert summary["rounds_closed"] == 4 and np.isfinite(summary["eval_loss"])
  assert summary["workers_lost"] == 1
  assert summary["late_contributions"] >= 1 and summary["mean_staleness"] > 0
  assert [e["worker"] for e in events if e["event"] == "worker_lost"] == [0]


@pytest.mark.parametrize("algorithm,rule", [("diloco", "mean"), ("one_step_delay", "mean"),
                                            ("diloco", "trimmed_mean"), ("streaming", "mean")])
def test_a_worker_dying_mid_collective_is_retried_among_the_survivors(cluster, tmp_path,
                                                                      algorithm, rule):
  """The peer form: worker 1 dies in the middle of round 1's collective (it has taken its
  peers' shards and never answers). The round is tried again among workers 0 and 2 from
  the contributions they kept, and the run ends where one ends whose worker 1 was killed
  after contributing to round 1 and before it closed: the same contributions, applied once.
  Every round's replicas agreed (the driver compares their hashes before any commit). With
  one-step delay the collective runs while round 2's jobs compute (worker 1's among them):
  the retry comes when it is settled, and θ' taken before it stands. With a robust rule
  shard by shard (the trimmed mean), worker 1 dies holding its peers' shards of the rows,
  and the retry combines the two survivors' rows. With Streaming's τ (two segments of two
  steps, τ = 1) the survivors' next jobs have started and wait, after their first step,
  for the retried collective's commit to mix its fragment in."""
  base = {"algorithm": algorithm, "rounds": 4, "num_workers": 3, "aggregate.rule": rule}
  if algorithm == "streaming":
    base.update({"inner_steps": 4, "streaming.overlap_steps": 1, "streaming.mix": 0.5})
  crashed = _config(**base, **{"ray.chaos": ("crash_in_sync=1@4",)})
  killed = _config(**base, **{"ray.chaos": ("kill_worker=1@6",)})  # round 1: pushes 4..6
  summary, events = _run(crashed, tmp_path / "crashed")
  replay, replay_events = _run(killed, tmp_path / "killed")
  assert summary["round_form"] == "peers"
  assert summary["collective_retries"] == 1 and replay["collective_retries"] == 0
  assert summary["rounds_closed"] == replay["rounds_closed"] == 4
  assert [(e["event"], e["worker"]) for e in events] == [("worker_lost", 1)]
  assert "died in a round's collective" in events[0]["why"]
  assert summary["pushes_per_worker"] == replay["pushes_per_worker"]
  assert summary["total_inner_steps"] == replay["total_inner_steps"]
  if algorithm != "streaming":  # (round 1 among 3, then 2: a round is a push each)
    assert summary["total_inner_steps"] == 2 * (3 + 2 + 2 + 2)
  np.testing.assert_array_equal(_ray_checkpointed_params(crashed, tmp_path / "crashed"),
                                _ray_checkpointed_params(killed, tmp_path / "killed"))
  assert summary["eval_loss"] == replay["eval_loss"]


@pytest.mark.parametrize("overrides", [{"algorithm": "diloco"},
                                       {"algorithm": "noloco", "num_workers": 4}],
                         ids=lambda o: o["algorithm"])
def test_a_driver_restarted_from_its_checkpoint_ends_where_the_uninterrupted_run_does(
    cluster, tmp_path, overrides):
  """The peer form, the driver stopped at its second checkpoint (as a preempted job's) and
  started again: every worker adopts the checkpoint's replica (NoLoCo: θ and its own row
  of (φ, δ)), the job in flight starts again, and the run ends bit for bit where the
  uninterrupted one ends, each round's replicas agreeing (DiLoCo: the hashes compared)."""
  config = _config(**{"rounds": 4, **overrides})
  plain, _ = _run(config, tmp_path / "plain")
  stopped, _ = _run(config, tmp_path / "stopped", stop_after_checkpoints=2)
  assert stopped["stopped_at"] == 2
  resumed, _ = _run(config, tmp_path / "stopped")
  assert resumed["round_form"] == "peers" and resumed["rounds_closed"] == 4
  np.testing.assert_array_equal(_ray_checkpointed_params(config, tmp_path / "stopped"),
                                _ray_checkpointed_params(config, tmp_path / "plain"))
  assert resumed["eval_loss"] == plain["eval_loss"]


def test_a_hierarchical_round_reduces_by_region_and_ends_where_the_flat_one_does(
    cluster, tmp_path):
  """Three workers in two regions (0, 0 | 1), DiLoCo with token weights: every round's mean
  is reduced by region (region sums, the leaders' exchange, the mean back out), each
  worker's link carrying `hierarchical_bytes` a round, and the run ends where the same run
  in one direct exchange ends, up to the order of the sums."""
  same = {"algorithm": "diloco", "num_workers": 3, "aggregate.weighting": "tokens",
          "sim.network.regions": 2, "sim.network.worker_regions": (0, 0, 1)}
  tiered = _config(**same, **{"collective_form": "hierarchical"})
  summary, _ = _run(tiered, tmp_path / "hierarchical")
  direct = _config(**same, **{"collective_form": "direct"})
  flat, _ = _run(direct, tmp_path / "flat")
  assert summary["hierarchical_collectives"] == 3 and flat["hierarchical_collectives"] == 0
  # Each link's floats a round, counted here by hand (each way alike: every phase has its
  # mirror). Worker 1: its half of the region's reduce-scatter out (n − s₁) and in (s₁),
  # its shard of the sums to its leader, the mean's shard back, the region's all-gather:
  # n + s₁. Worker 0, region 0's leader: the region's reduce-scatter and all-gather (n),
  # worker 1's shard of the sums (n − s₀), the leaders' exchange of two pieces (n): 3n − s₀.
  # Worker 2, alone in region 1: the leaders' exchange only (n). (hierarchical_bytes
  # reports them; a direct exchange would be 4n/3 each.)
  n = summary["params"]
  s0, s1 = n // 2, n - n // 2
  per_round = {0: 3 * n - s0, 1: n + s1, 2: n}
  assert summary["wire_bytes_per_worker"] == {
      str(w): [3 * 4 * floats] * 2 for w, floats in per_round.items()}
  np.testing.assert_allclose(_ray_checkpointed_params(tiered, tmp_path / "hierarchical"),
                             _ray_checkpointed_params(direct, tmp_path / "flat"),
                             rtol=0, atol=1e-6)
  assert summary["bytes_sent"] == flat["bytes_sent"]  # (the ledger counts payloads)


def test_a_joining_worker_takes_theta_from_a_peer(cluster, tmp_path):
  """The peer form: a worker that joins mid-run adopts a live peer's replica (θ and the outer
  state) and its inner optimizer state before its first job, contributes, and ends with the
  others' θ (the rounds it was in compared every member's hash); nothing went through a
  server. (Dispatch order: the driver waits for the joiner's first job, which is late, its
  round closed without it: the joiner, one round behind, runs that round from its inputs
  (catch_up.py) and is in the open round's collective.) Without the inner optimizer's heal
  the first adopt carries 2 P floats, without the catch-up a second whole replica (checked)."""
  config = _config(algorithm="diloco", rounds=4, **{"ray.chaos": ("add_worker@2",)})
  summary, events = _run(config, tmp_path)
  assert summary["round_form"] == "peers" and summary["workers_joined"] == 1
  assert summary["rounds_closed"] == 4 and np.isfinite(summary["eval_loss"])
  assert summary["pushes_per_worker"].get("2", 0) >= 1  # the joiner contributed
  assert summary["late_contributions"] >= 1
  assert "2" in summary["wire_bytes_per_worker"]  # ... in a round's collective
  assert [e["event"] for e in events][:1] == ["worker_joined"]
  # its first adopt: θ, the outer momentum and the peer's inner AdamW moments (heals.py),
  # 4 P floats; its second, one round behind, that round's mean and signals alone
  theta = 4 * summary["params"]
  assert summary["replicas_adopted"] == 1 and summary["replicas_adopted_bytes"] >= 4 * theta
  assert summary["rounds_caught_up"] == 1
  assert theta <= summary["rounds_caught_up_bytes"] < 1.1 * theta


def test_a_robust_quorum_survives_a_join_and_its_server_restarting(cluster, tmp_path):
  """DiLoCo with the median on Ray: a worker joins mid-run (the server keeps a row for its
  id), and the server dies and is restored from a checkpoint whose robust state has a row
  per worker id (3, not the 2 it started with). Rounds combine the rows that came."""
  config = _config(algorithm="diloco", rounds=4,
                   **{"aggregate.rule": "median", "aggregate.signal": "loss_ema",
                      "collective_form": "server",
                      "ray.chaos": ("add_worker@2", "kill_server@5")})
  summary, events = _run(config, tmp_path)
  assert summary["rounds_closed"] == 4 and np.isfinite(summary["eval_loss"])
  assert summary["workers_joined"] == 1 and summary["server_restarts"] == 1
  restarted = [e for e in events if e["event"] == "server_restarted"]
  assert len(restarted) == 1 and restarted[0]["checkpoint"] >= 1  # restored, not fresh
  assert "worker_joined" in {e["event"] for e in events}


@pytest.mark.parametrize("overrides", [
    {"algorithm": "one_step_delay"},
    {"algorithm": "eager"},  # its worker rule reads the outer state the pull brings
    {"algorithm": "overlap"},  # workers keep their models across rounds
    # rounds 0-1 the workers' mean (the momentum filled), 2-3 the decaying momenta (0.99,
    # then 0.95) as the outer lr ramps up, round 4 the final lr
    {"algorithm": "pier", "rounds": 5, "pier.warmup": 0.4},
    {"algorithm": "streaming", "inner_steps": 4, "compress.codec": "int8"},  # 2 fragments
    # τ = 1: each segment's collective runs while the next segment's first step computes
    {"algorithm": "streaming", "inner_steps": 4, "streaming.overlap_steps": 1,
     "streaming.mix": 0.5},
    {"algorithm": "ddp", "inner_steps": 1},  # quorum rounds of one gradient each
    # Adam's moments averaged before rounds 1 and 2 (the first) and 2 (the second)
    {"algorithm": "desloc", "desloc.first_moment_rounds": 1,
     "desloc.second_moment_rounds": 2},
    # each worker keeps its own (φ, δ) and swaps θ_i with its round's peer directly
    {"algorithm": "noloco", "num_workers": 4},
], ids=lambda o: o["algorithm"] + ("-tau" if "streaming.overlap_steps" in o else ""))
def test_every_synchronous_algorithm_on_ray_is_the_runners(cluster, tmp_path, overrides):
  """The equality contract: full quorums, dispatch order, no chaos; each algorithm runs on
  Ray from its own declarations (segments, fragments, mix, worker rule, outer rule) and ends
  where the lockstep run of the same config ends, with the same bytes per worker."""
  from lowcomm_jax.runtimes.spmd import train
  config = _config(**overrides)
  summary, events = _run(config, tmp_path / "ray")
  assert summary["rounds_closed"] == config.rounds and events == []
  runner_config = _config(runtime="spmd", **{"ray.apply_order": "arrival", **overrides})
  runner = train.run(runner_config, tmp_path / "runner")
  assert abs(summary["eval_loss"] - runner["eval_loss"]) < 1e-5 * runner["eval_loss"]
  assert summary["bytes_sent"] == runner["bytes_sent"]
  _assert_same_theta(config, tmp_path / "ray", runner_config, tmp_path / "runner")
  # every algorithm on the peer form: each link carries the ledger's bytes both ways (2
  # members' all-reduce; DES-LOC's moment averages reduced among the workers too; NoLoCo's
  # θ_i to its peer and θ_j back), nothing goes through a server
  assert summary["round_form"] == "peers" and summary["server_bytes_sent"] == 0
  assert summary["wire_bytes_per_worker"] == {str(w): [summary["bytes_sent"]] * 2
                                               for w in range(config.num_workers)}
  if overrides["algorithm"] in ("one_step_delay", "eager") or "streaming.overlap_steps" in overrides:
    # its collective ran beside the next jobs: those of version v + 1 (the next round; the
    # next segment) dispatched before version v's collective committed
    w = config.num_workers
    dispatched = sorted(m[2] for m in summary["job_moments"])
    committed = [c[6] for c in summary["collective_moments"]]
    syncs = len(committed)
    from lowcomm_jax import algorithms
    segments = algorithms.get(config.algorithm).segments(config, config.inner_steps)
    assert syncs == config.rounds * len(segments), committed
    assert all(max(dispatched[w * (v + 1):w * (v + 2)]) < committed[v]
               for v in range(syncs - 1)), (dispatched, committed)


@pytest.mark.parametrize("devices", [{"mesh.data": 2}, {"model.tp.size": 2}],
                         ids=["data2", "tp2"])
def test_workers_of_several_devices_train_as_the_runner(cluster, tmp_path, devices):
  """Each worker actor runs its local program on its own mesh of 2 (forced CPU) devices,
  as the lockstep runtime runs one host; only the outer sync goes through Ray. The mesh.data
  run is stopped after its first checkpoint and resumed (each worker's sharded state
  restored): it still ends where the uninterrupted lockstep run ends."""
  from lowcomm_jax.runtimes.ray import driver
  from lowcomm_jax.runtimes.spmd import train
  config = _config(algorithm="diloco", **devices)
  if "mesh.data" in devices:
    driver.run(config, tmp_path / "ray", stop_after_checkpoints=1)
  summary, events = _run(config, tmp_path / "ray")
  assert summary["rounds_closed"] == 3 and events == []
  runner_config = _config(algorithm="diloco", runtime="spmd",
                          **{"ray.apply_order": "arrival", **devices})
  runner = train.run(runner_config, tmp_path / "runner")
  assert abs(summary["eval_loss"] - runner["eval_loss"]) < 1e-5 * runner["eval_loss"]
  assert summary["bytes_sent"] == runner["bytes_sent"]
  _assert_same_theta(config, tmp_path / "ray", runner_config, tmp_path / "runner")


def test_a_host_table_on_ray_trains_and_exports_as_the_runner(cluster, tmp_path):
  """Two tiers of unequal batch and H, full quorums: each worker actor runs its row's tier,
  batch and H; the server's round is the nested mean. Every width's eval and the exported
  half-width model equal the lockstep runner's."""
  from lowcomm_jax import export
  from lowcomm_jax.assemble.hosts import host
  from lowcomm_jax.runtimes.spmd import train
  from safetensors.numpy import load_file
  tiers = {"hosts": [host(1.0, batch_size=4, inner_steps=2),
                     host(0.5, batch_size=2, inner_steps=3)]}
  config = _config(algorithm="diloco", **tiers)
  summary, events = _run(config, tmp_path / "ray")
  assert summary["rounds_closed"] == 3 and events == []
  assert summary["total_inner_steps"] == 3 * (2 + 3)
  runner_config = _config(algorithm="diloco", runtime="spmd",
                          **{"ray.apply_order": "arrival", **tiers})
  runner = train.run(runner_config, tmp_path / "runner")
  _assert_same_theta(config, tmp_path / "ray", runner_config, tmp_path / "runner")
  assert set(summary["eval_loss_by_width"]) == {"1", "0.5"}
  for width, loss in runner["eval_loss_by_width"].items():
    assert abs(summary["eval_loss_by_width"][width] - loss) < 1e-5 * loss
  assert summary["bytes_sent"] == runner["bytes_sent"]
  written = [load_file(export.export_width(tmp_path / run, 0.5, tmp_path / f"{run}_half"))
             for run in ("ray", "runner")]
  assert sorted(written[0]) == sorted(written[1])
  for name in written[1]:
    np.testing.assert_allclose(written[0][name], written[1][name], rtol=0, atol=1e-6)


def test_a_lost_workers_tier_is_counted_and_untrained_units_are_said(caplog):
  """The pool's membership events name the tier and the live workers per tier; when the
  last full-width worker dies the log and a `units_untrained` row say which FFN units
  nobody trains (the server leaves them: test_server_sync.py). A worker that joins from
  `add_worker=tier:1.0@N` has a full-width row. (The pool alone, no actor.)"""
  import logging
  from types import SimpleNamespace
  from lowcomm_jax.assemble.hosts import host, host_table
  from lowcomm_jax.runtimes.ray.accounts import Counts
  from lowcomm_jax.runtimes.ray.pool import Pool
  config = _config(algorithm="diloco", num_workers=3,
                   **{"hosts": [host(1.0), host(0.5), host(0.5)],
                      "ray.chaos": ("add_worker=tier:1.0@4",)})
  notes = []
  pool = Pool(config, Counts(), lambda: (None, None),
              lambda event, **fields: notes.append((event, fields)),
              hosts=host_table(chaos.with_worker_slots(config), 128))  # tiny: d_ff 128
  pool.ray = SimpleNamespace(kill=lambda actor, no_restart: None)
  pool.actors = {0: object(), 1: object(), 2: object()}
  with caplog.at_level(logging.WARNING):
    pool.lose(1, "chaos: killed")
    assert "no live worker trains" not in caplog.text
    pool.lose(0, "chaos: killed")
  assert [(e, f["worker"], f["tier"], f["live_per_tier"]) for e, f in notes
          if e == "worker_lost"] == [("worker_lost", 1, 0.5, {"1": 1, "0.5": 1}),
                                     ("worker_lost", 0, 1.0, {"0.5": 1})]
  assert [f for e, f in notes if e == "units_untrained"] == [{"first": 64, "last": 127}]
  assert "no live worker trains FFN units 64..127" in caplog.text
  assert pool.rows.host_of[3].tier == 1.0 and pool.rows.configured_inner_steps(3) == config.inner_steps


def test_the_main_job_on_ray_survives_tiered_failures_and_ends_where_its_replay_does(
    cluster, tmp_path):
  """configs/diloco_hetero.py (a full-width host and three 25% hosts), shortened, on Ray in
  quorum rounds: a 25% worker is killed, a new 25% worker joins later, the full-width worker
  is delayed, and the server is killed once. Every event is in metrics.jsonl, and the run
  ends where the same run without the server's death ends (the restored server was fed the
  same contributions again: in dispatch order every round's contributions are the same)."""
  short = {"model.name": "tiny", "rounds": 4, "inner_steps": 2, "data.seq_len": 32,
           "eval_every": 4, "checkpoint_every": 1, "log_every": 1, "mesh.replica": 1,
           "runtime": "ray", "ray.apply_order": "dispatch",
           "collective_form": "server"}  # (the peer form has no server to kill)
  chaos_ = ("delay_worker=0:0.2@1", "kill_worker=2@3", "add_worker=tier:0.25@5")
  config = load_config("diloco_hetero", **short, **{"ray.chaos": chaos_ + ("kill_server@9",)})
  summary, events = _run(config, tmp_path / "chaos")
  replay, replay_events = _run(load_config("diloco_hetero", **short,
                                           **{"ray.chaos": chaos_}), tmp_path / "replay")
  assert summary["rounds_closed"] == replay["rounds_closed"] == 4
  kinds = [e["event"] for e in events]
  assert kinds.count("worker_lost") == 1 and kinds.count("worker_joined") == 1
  assert kinds.count("server_restarted") == 1
  lost = next(e for e in events if e["event"] == "worker_lost")
  joined = next(e for e in events if e["event"] == "worker_joined")
  assert (lost["worker"], lost["tier"]) == (2, 0.25) and (joined["worker"], joined["tier"]) == (4, 0.25)
  assert summary["server_restarts"] == 1
  assert [e["event"] for e in replay_events] == [k for k in kinds if k != "server_restarted"]
  assert summary["eval_loss"] == replay["eval_loss"]
  assert summary["eval_loss_by_width"] == replay["eval_loss_by_width"]


def _ray_checkpointed_params(config, workdir) -> np.ndarray:
  """θ in the newest checkpoint of the Ray run in `workdir`."""
  return ray_checkpoint(config, workdir)[0]["global"]["params"]


def _collab_config(**overrides):
  """Three peers of batch 4 (DDP's collaborative epochs), plain SGD without clipping: the
  step is linear in the averaged gradient. Each micro-batch sleeps 0.3 s, so an epoch of 48
  samples outlasts a join (a new process compiling its micro-batch)."""
  c = load_config("smoke", runtime="ray", algorithm="ddp", inner_steps=1, rounds=1,
                  num_workers=3, checkpoint_every=1, eval_every=0, log_every=1,
                  **{"mesh.replica": 1, "optimizer.warmup_steps": 0, "optimizer.name": "sgd",
                     "optimizer.lr": 0.5, "optimizer.grad_clip": 0.0,
                     "collab.target_batch_size": 48, "ray.grace_s": 30.0,
                     "ray.step_sleep_s": (0.3, 0.3, 0.3), **overrides})
  return c


@pytest.mark.parametrize("form", ["server", "peers"])
def test_a_collaborative_epoch_completes_without_a_killed_peer_and_counts_a_joined_one(
    cluster, tmp_path, form):
  """Peer 2 brings micro-batches of 8, the others of 4 (`ray.batch_sizes`; peer 3, joining
  later, data.batch_size's). Peer 1 is killed after the epoch's second micro-batch (its
  samples go with it), a
  new peer 3 joins after the fourth and is counted from its first. Through the server, the
  server dies after the sixth (it is rebuilt: nothing of the open epoch was its). Among the
  peers (no server), peer 0 dies in the middle of the epoch's collective (after it took
  its peers' shards): the collective runs again among peers 2 and 3, whose replicas then
  agree (hashes), and peer 0's samples go with it. The epoch ends at its
  target (peer 3's first micro-batch, queued while its process starts, is running then
  and counts within the 30 s grace window), and its step is -lr times the mean of the
  surviving peers' gradients at θ_0,
  weighted by the samples each reported, computed here by hand from fresh streams."""
  from test_collab import _flat_grad
  from lowcomm_jax.assemble.build import build
  from lowcomm_jax.assemble.plan import one_device
  batch = {0: 4, 1: 4, 2: 8, 3: 4}
  last = {"server": "kill_server@6", "peers": "crash_in_sync=0@6"}[form]
  config = _collab_config(**{"ray.chaos": ("kill_worker=1@2", "add_worker@4", last),
                             "ray.batch_sizes": (4, 4, 8),
                             "collective_form": "server" if form == "server" else "auto"})
  summary, events = _run(config, tmp_path)
  assert summary["round_form"] == form and summary["rounds_closed"] == 1
  assert summary["workers_joined"] == 1
  names = [e["event"] for e in events]  # (worker 3 comes up while the others go on)
  if form == "server":
    assert summary["workers_lost"] == 1 and summary["server_restarts"] == 1
    assert sorted(set(names)) == ["server_restarted", "worker_joined", "worker_lost",
                                  "worker_up"]
  else:
    assert summary["workers_lost"] == 2 and summary["collective_retries"] == 1
    assert summary["server_bytes_sent"] == 0
    assert sorted(set(names)) == ["worker_joined", "worker_lost", "worker_up"]
    assert "died in a round's collective" in [e for e in events if e["event"] == "worker_lost"
                                              ][-1]["why"]
  assert len(names) == 4
  counts = {w: summary.get(f"samples_peer_{w}", 0) for w in range(4)}
  assert counts[1] == 0 and counts[3] > 0  # the killed peer's samples are not in the step
  assert counts[0] > 0 if form == "server" else counts[0] == 0  # nor those lost in the sync
  # the target reached; among the peers, peer 0's part of it was lost in the collective
  assert summary["samples"] == sum(counts.values()) >= (48 if form == "server" else 8)
  assert summary["samples"] + (form == "peers") * summary["samples_lost"] >= 48
  assert summary["collab"] == {"target_batch_size": 48, "epochs": 1,
                               "samples": summary["samples"]}
  assert counts[2] % 8 == 0 and counts[0] % 4 == 0
  # every micro-batch counted is in the step or was lost with its peer (of batch 4)
  assert (summary["micro_batches"] == sum(counts[w] // batch[w] for w in counts)
          + summary["samples_lost"] // 4)

  params = _ray_checkpointed_params(config, tmp_path)
  r = build(one_device(config), check_memory=False)
  theta = r.state_spec.initial_params()
  grad = _flat_grad(r.model.graphdef, r.model.layout)
  total = np.zeros(theta.shape, np.float64)
  runs = {4: r}  # by batch size: the streams of a peer with micro-batches of 8
  for w, samples in counts.items():
    if batch[w] not in runs:
      peer = config.copy_and_resolve_references()
      peer.data.batch_size = batch[w]
      runs[batch[w]] = build(one_device(peer), check_memory=False)
    stream = runs[batch[w]].data.streams[0].of_workers([w])
    for _ in range(samples // batch[w]):
      total += batch[w] * np.asarray(grad(theta, stream.next_round(1)[0, 0]))
  update = -config.optimizer.lr * total / summary["samples"]
  np.testing.assert_allclose(params - np.asarray(theta), update, rtol=1e-4, atol=1e-7)


def test_collaborative_lora_epochs_on_ray_are_the_runners(cluster, tmp_path):
  """LoRA adapters on a frozen base, two epochs. Peer 1 sleeps 4 s a micro-batch, so
  peer 0 fills the target (16) alone (four micro-batches: well within 4 s on a loaded
  machine; at 1.5 s, beside other tests, peer 1 came in first) and peer 1's one
  micro-batch, running at the target,
  counts within the grace window: 16 + 4 samples an epoch, as the runner's virtual clock
  gives a host 100 times slower (its micro-batch started before the target counts too)."""
  from lowcomm_jax.runtimes.spmd import train
  from lowcomm_jax.assemble.hosts import host
  same = {"algorithm": "ddp", "inner_steps": 1, "rounds": 2, "num_workers": 2,
          "checkpoint_every": 1, "eval_every": 0, "log_every": 1,
          "collab.target_batch_size": 16, "lora.rank": 4, "lora.alpha": 8.0,
          "lora.targets": ("attn", "mlp")}
  config = load_config("smoke", runtime="ray", **same, **{
      "mesh.replica": 1, "ray.grace_s": 30.0, "ray.step_sleep_s": (0.0, 4.0)})
  summary, _ = _run(config, tmp_path / "ray")
  epochs = [(row["samples_peer_0"], row["samples_peer_1"]) for row in map(
      json.loads, (tmp_path / "ray" / "metrics.jsonl").read_text().splitlines())
      if "samples_peer_1" in row]
  # Each epoch as the runner's clock has it; otherwise peer 1's 4 s micro-batch came in
  # before peer 0's four, on a machine too busy for this test's premise.
  assert epochs == [(16, 4)] * 2, epochs
  assert summary["collab"]["samples"] == 40
  assert summary["trainable_params"] < summary["params"]  # the adapters, not the base
  # the peer form: each epoch's mean reduced between the two peers, each link carrying the
  # ledger's bytes both ways; nothing through a server
  assert summary["round_form"] == "peers" and summary["server_bytes_sent"] == 0
  assert summary["wire_bytes_per_worker"] == {str(w): [summary["bytes_sent"]] * 2
                                               for w in range(2)}
  runner_config = load_config("smoke", **same)
  runner_config.hosts = [host(1.0, batch_size=4, speed=1.0), host(1.0, batch_size=4, speed=0.01)]
  runner = train.run(runner_config, tmp_path / "runner")
  assert runner["collab"] == summary["collab"]
  # The server's token-weighted mean and the runner's nested mean differ in rounding only.
  theta = np.asarray(checkpointed_state(runner_config, tmp_path / "runner")[0][0].params)
  trained = theta - np.asarray(train.build(runner_config).state_spec.initial_params())
  np.testing.assert_allclose(_ray_checkpointed_params(config, tmp_path / "ray"), theta,
                             rtol=0, atol=1e-4 * np.abs(trained).max())
  assert abs(summary["eval_loss"] - runner["eval_loss"]) <= 1e-4 * runner["eval_loss"]


def _halos_config(**overrides):
  """HALoS: two workers in two regions (a regional server each, and the global one), every
  regional update pushed on to the global server."""
  return _config(algorithm="halos", **{"sim.network.regions": 2, "outer.halos.sync_every": 1,
                                       "outer.dn_buffer": 1, "outer.halos.global_buffer": 1,
                                       **overrides})


def test_halos_servers_exchange_as_the_simulators_do():
  """Pushes to two regional servers and their exchanges with the global server (push,
  apply, merge), through the Ray runtime's server classes (in this process) and through
  the simulator's backend: bit-identical models at every server."""
  import jax
  from lowcomm_jax.runtimes.simulator import simulate
  from lowcomm_jax.runtimes.ray.server import ServerProcess
  from lowcomm_jax.parallel.server_names import GLOBAL, region_server
  from lowcomm_jax.sim import Job

  config = _halos_config(**{"outer.halos.merge_alpha": 0.5})
  backend = simulate.Simulation(config).backend
  names = [region_server(0), region_server(1)]
  servers = {name: ServerProcess(config, None, name) for name in [GLOBAL, *names]}
  size = int(np.asarray(backend.servers[GLOBAL]["params"]).size)
  rng = np.random.default_rng(0)
  for i, region in enumerate([0, 1, 0, 0, 1]):
    name = names[region]
    job = Job(i, region, name, backend.version(name), 2, 0.0, 0.0)
    backend.start_job(job)
    version, _, _ = servers[name].pull()
    delta = rng.normal(0, 1e-2, size).astype(np.float32)
    backend.messages[i] = {"delta": jax.numpy.asarray(delta), "loss": 0.0}
    backend.apply_job(job)
    servers[name].push({"version": version}, delta)
    backend.push_update(name, 100 + i)  # the exchange (algorithms/halos.HalosSchedule)
    backend.apply_push(GLOBAL, 100 + i)
    backend.send_params(GLOBAL, 200 + i)
    backend.merge(name, 200 + i, 0.5)
    _, lps_delta = servers[name].lps_push()
    _, global_params = servers[GLOBAL].apply_lps_push(lps_delta)
    servers[name].merge(global_params, 0.5)
  for name, server in servers.items():
    state = server.state()
    np.testing.assert_array_equal(state["params"], np.asarray(backend.servers[name]["params"]))
    if name != GLOBAL:
      np.testing.assert_array_equal(state["reference"],
                                    np.asarray(backend.servers[name]["reference"]))


def test_halos_on_ray_survives_its_global_server(cluster, tmp_path):
  """HALoS on Ray: the global server is killed after push 3, and the standby server
  process takes the checkpoint of push 2 (the regional servers' exchanges since replayed
  to it): the run ends where the uninterrupted one does, to the last bit."""
  plain, events = _run(_halos_config(), tmp_path / "plain")
  assert plain["pushes"] == 6 and plain["global_pushes"] == 6 and events == []
  killed, events = _run(_halos_config(**{"ray.chaos": ("kill_server@3",),
                                          "ray.standby_server": True}), tmp_path / "killed")
  assert [e["event"] for e in events] == ["server_restarted"]
  assert events[0]["server"] == "global" and events[0]["replayed"] == 1
  assert events[0]["standby"] is True  # (the async_dn test above starts a new process)
  assert killed["eval_loss"] == plain["eval_loss"]
