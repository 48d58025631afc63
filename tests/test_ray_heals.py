"""Heals in the Ray runtime (runtimes/ray/heals.py): a worker that joins or rejoins takes,
from a live peer, the replica (θ, the outer state; in the server form θ comes from the
server) and what its algorithm keeps per worker across rounds, as torchft's heal does (a
recovering replica loads a live peer's model and optimizer state before it trains again).
Streaming DiLoCo keeps each worker's local model θ_w across rounds and mixes in only the
fragment that lands
(Douillard et al. 2025, "Streaming DiLoCo", alg. 1): a worker whose θ_w were θ₀ would
train from θ₀ in every other fragment."""

import collections
import json
import statistics

import pytest

from conftest import load_config
from lowcomm_jax.runtimes.ray.heals import heal_source

ray = pytest.importorskip("ray")


def test_a_heal_is_taken_from_the_least_loaded_peer_of_the_joiners_width():
  widths = {0: 64, 1: 64, 2: 16, 3: 64}.get
  served = collections.Counter({0: 2, 1: 1})
  assert heal_source([0, 1, 3], served, widths, None) == 3  # none served yet
  served[3] = 1
  assert heal_source([0, 1, 3], served, widths, None) == 1  # a tie: the lowest id
  assert heal_source([0, 1, 2], served, lambda w: 16 if w in (2, 5) else 64, fresh=5) == 2
  assert heal_source([], served, widths, None) is None


@pytest.fixture
def cluster(ray_cluster):
  """The process's local Ray (conftest.ray_cluster)."""


def _first_loss_after(summary, events, worker: int) -> float:
  """`worker`'s first job's loss after it (re)joined: jobs are taken in push order
  (`job_moments`), and its losses are listed in that order (`loss_by_job`)."""
  joined = max(e["pushes"] for e in events
               if e["event"] == "worker_joined" and e["worker"] == worker)
  order = [m[0] for m in summary["job_moments"]]
  first = next(k for k, w in enumerate(order) if w == worker and k >= joined)
  return summary["loss_by_job"][str(worker)][order[:first].count(worker)]


@pytest.mark.slow  # (~30 s a form: sixteen rounds, a kill, a rejoin and a join)
@pytest.mark.parametrize("form", ["direct", "server"])
def test_streaming_workers_that_rejoin_or_join_train_from_a_peers_local_model(cluster,
                                                                           tmp_path, form):
  """Streaming with one fragment mixed in at α = 0.5 (θ_w ← ½θ + ½θ_w when θ lands: the
  local model outlives every round). Worker 1 is killed and comes back, and worker 2
  joins: each one's first job after it (re)joined starts from a live peer's local model
  and inner optimizer, so its loss is its peer's of the jobs just before (within 0.3),
  where a θ_w of θ₀ would have mixed half of θ₀ into θ. In the peer form the joiner adopts
  the peer's replica with them; in the server form θ comes from the server and only the
  peer's state from the peer (Heals.state_for). Without the heal (Heals.enabled False)
  both fail: peer form +0.52 and +0.83 over the peer's, against −0.10 and +0.09; server
  form (`state_for` returning None) worker 1 +0.52 (checked)."""
  from lowcomm_jax.runtimes.ray import driver
  config = load_config("smoke", **{
      "runtime": "ray", "algorithm": "streaming", "num_workers": 2, "rounds": 16,
      "inner_steps": 2, "streaming.fragments": 1, "streaming.mix": 0.5, "eval_every": 8,
      "checkpoint_every": 4, "log_every": 1, "mesh.replica": 1, "ray.apply_order": "dispatch",
      "collective_form": form,
      "ray.chaos": ("kill_worker=1@12", "rejoin_worker=1@14", "add_worker@18")})
  summary = driver.run(config, tmp_path)
  events = [row for row in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
            if "event" in row]
  assert summary["round_form"] == ("server" if form == "server" else "peers")
  assert summary["workers_joined"] == 2
  healed = "joiners_healed" if form == "server" else "replicas_adopted"
  assert summary[healed] == 2, summary  # the rejoiner and the joiner, each once
  peer = summary["loss_by_job"]["0"]
  order = [m[0] for m in summary["job_moments"]]
  for worker in (1, 2):
    joined = max(e["pushes"] for e in events
                 if e["event"] == "worker_joined" and e["worker"] == worker)
    before = order[:joined].count(0)  # the peer's jobs taken before the join
    trained = statistics.mean(peer[before - 2:before])
    assert peer[0] - trained > 1.0  # (the peer did train by then)
    first = _first_loss_after(summary, events, worker)
    assert first - trained < 0.3, (worker, first, trained)


@pytest.mark.slow  # (~30 s: ten rounds paced by sleeps)
def test_a_straggler_one_round_behind_runs_that_round_from_its_inputs(cluster, tmp_path):
  """A quorum of two of three, worker 2 slower (0.45 s a step against 0.25): its job spans
  a round's close, so it contributes to the round after the one it started from, and its
  replica is one round behind. It takes that round's inputs from a member (the mean and
  the signals: catch_up.py), not the whole replica, and runs the round's outer step itself.
  The next round's members, worker 2 among them, must stage the same θ before any commits
  (the driver compares their hashes), so a catch-up that misses the members' state stops the
  run. Without the catch-up (`serve` always handing the whole replica) `rounds_caught_up` is
  0 and `replicas_adopted` takes its place (checked)."""
  from lowcomm_jax.runtimes.ray import driver
  config = load_config("smoke", **{
      "runtime": "ray", "algorithm": "diloco", "num_workers": 3, "rounds": 10,
      "inner_steps": 2, "eval_every": 10, "checkpoint_every": 10, "log_every": 1,
      "mesh.replica": 1, "ray.apply_order": "arrival", "ray.min_quorum": 2,
      "ray.step_sleep_s": (0.25, 0.25, 0.45)})
  summary = driver.run(config, tmp_path)
  assert summary["round_form"] == "peers" and summary["rounds_closed"] == 10
  assert summary["late_contributions"] >= 1
  assert summary["rounds_caught_up"] >= 1, summary
  # what each carried: the round's mean and its signals, about θ's bytes (a whole replica
  # is θ and the outer momentum, twice that)
  per_heal = summary["rounds_caught_up_bytes"] / summary["rounds_caught_up"]
  assert 4 * summary["params"] <= per_heal < 1.1 * 4 * summary["params"], per_heal
  if summary["replicas_adopted"]:  # (one that spanned two closes, on a loaded machine)
    assert summary["replicas_adopted_bytes"] >= 2 * 4 * summary["params"]


@pytest.mark.slow  # (~35 s: ten rounds, two joiners starting)
def test_a_noloco_worker_that_joins_takes_a_live_peers_row(cluster, tmp_path):
  """NoLoCo in the peer form: each worker keeps its own outer weights and momentum (φ_i,
  δ_i) and averages with one peer a round (Kolehmainen et al. 2025, "NoLoCo"), so a worker
  that joins needs a row of its own. It takes its source's replica whole, θ and the
  source's row, as torchft's heal loads a live replica's state (the server form, whose
  server has only θ₀ for a new slot, still refuses the join). Two workers, two more join:
  each joiner's first job starts from a trained φ, its loss near its peers' of the jobs
  just before and far under θ₀'s. Without the row (a joiner keeping θ₀'s) the first losses
  are θ₀'s (checked)."""
  from lowcomm_jax.runtimes.ray import driver
  config = load_config("smoke", **{
      "runtime": "ray", "algorithm": "noloco", "num_workers": 2, "rounds": 10,
      "inner_steps": 2, "eval_every": 10, "checkpoint_every": 5, "log_every": 1,
      "mesh.replica": 1, "ray.apply_order": "dispatch",
      "ray.chaos": ("add_worker@8", "add_worker@10")})
  summary = driver.run(config, tmp_path)
  events = [row for row in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
            if "event" in row]
  assert summary["round_form"] == "peers" and summary["workers_joined"] == 2
  assert summary["rounds_closed"] == 10
  peer = summary["loss_by_job"]["0"]
  order = [m[0] for m in summary["job_moments"]]
  for worker in (2, 3):
    joined = max(e["pushes"] for e in events
                 if e["event"] == "worker_joined" and e["worker"] == worker)
    before = order[:joined].count(0)
    first = _first_loss_after(summary, events, worker)
    assert first < peer[0] - 0.4, (worker, first, peer[0])  # not θ₀'s
    assert first - statistics.mean(peer[before - 2:before]) < 0.3, (worker, first, peer)
