"""The peer form's failure paths on Ray (issue 72): what must stop a run, or be survived,
when the members of a round's collective misbehave. Each test names the mutation it was
seen to fail under."""

import json

import numpy as np
import pytest

from conftest import load_config, ray_checkpoint

ray = pytest.importorskip("ray")


@pytest.fixture
def cluster(ray_cluster):
  """The process's local Ray (conftest.ray_cluster)."""


def _config(**overrides):
  """3 workers of the smoke model in the peer form, 4 rounds of H = 2, every round
  checkpointed, pushes taken in dispatch order (the same run every time)."""
  return load_config("smoke", **{
      "runtime": "ray", "algorithm": "diloco", "num_workers": 3, "rounds": 4,
      "inner_steps": 2, "eval_every": 0, "checkpoint_every": 1, "log_every": 1,
      "mesh.replica": 1, "ray.apply_order": "dispatch", "collective_form": "direct",
      **overrides})


@pytest.mark.slow  # (~20 s: two Ray runs of 3 workers)
def test_replicas_that_diverge_stop_the_run_before_any_member_commits(cluster, tmp_path):
  """flip_bit=1@4: one bit of the next θ worker 1 stages flips (silent data corruption).
  The members' hashes then differ, and the driver must stop the run before any member
  commits that round, naming the hashes; the newest checkpoint is the last round all
  members agreed on, bit-equal to the same round of a run without the flip. With the
  driver's comparison removed (`_commit` not checking) the run ends normally (checked)."""
  from lowcomm_jax.runtimes.ray import driver
  config = _config(**{"ray.chaos": ("flip_bit=1@4",)})
  with pytest.raises(RuntimeError, match=r"round (\d+): the members' θ differ .* the "
                                         r"replicas have diverged") as caught:
    driver.run(config, tmp_path / "flipped")
  hashes = str(caught.value).split("(", 1)[1]
  assert hashes.count(":") == 3  # every member's hash, named by worker
  bad_round = int(str(caught.value).split(":")[0].split()[-1])
  assert bad_round in (1, 2)  # (the flag is set after round 0's pushes, as round 1 closes)
  flipped = ray_checkpoint(config, tmp_path / "flipped")
  assert flipped[1]["counts"]["rounds"] == bad_round  # nothing of the bad round was kept

  clean = _config(rounds=bad_round)
  driver.run(clean, tmp_path / "clean")
  reference = ray_checkpoint(clean, tmp_path / "clean")
  np.testing.assert_array_equal(np.asarray(flipped[0]["global"]["params"]),
                                np.asarray(reference[0]["global"]["params"]))


def _events(workdir) -> list[dict]:
  """The membership and recovery events of the run in `workdir` (metrics.jsonl)."""
  rows = map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
  return [row for row in rows if "event" in row]


def _checkpointed_params(config, workdir) -> np.ndarray:
  return np.asarray(ray_checkpoint(config, workdir)[0]["global"]["params"])


@pytest.fixture(scope="module")
def killed_replay(ray_cluster, tmp_path_factory):
  """The run whose worker 1 is killed after contributing to round 1 and before it closed
  (pushes 4..6 are round 1's): (its summary, its final θ). The failures inside round 1's
  collective below must end where it does; one run serves them all."""
  from lowcomm_jax.runtimes.ray import driver
  killed = _config(**{"ray.chaos": ("kill_worker=1@6",)})
  workdir = tmp_path_factory.mktemp("killed")
  return driver.run(killed, workdir), _checkpointed_params(killed, workdir)


def _ends_where_the_replay_does(config, workdir, summary, killed_replay, why: str) -> None:
  """Worker 1 lost once, for `why`, round 1 tried again once, and the run ends where the
  killed-worker replay ends: the same rounds, pushes and final θ, bit for bit."""
  replay, replayed = killed_replay
  events = _events(workdir)
  assert [(e["event"], e["worker"]) for e in events] == [("worker_lost", 1)]
  assert why in events[0]["why"]
  assert summary["collective_retries"] == 1 and replay["collective_retries"] == 0
  assert summary["rounds_closed"] == replay["rounds_closed"] == 4
  assert summary["pushes_per_worker"] == replay["pushes_per_worker"]
  np.testing.assert_array_equal(_checkpointed_params(config, workdir), replayed)


@pytest.mark.slow  # (~30 s: a Ray run of 3 workers waiting out a 5 s timeout, the replay)
def test_a_member_slow_inside_a_collective_is_left_behind_and_the_round_goes_on(
    cluster, tmp_path, killed_replay):
  """stall_in_sync=1:8@4: worker 1, alive, waits 8 s inside round 1's collective before
  its part, past ray.collective_timeout_s = 5. Its peers stop waiting for its pieces, the
  driver loses it as "waited for in vain" and tries the round again among workers 0 and 2
  from the contributions they kept: the run ends bit-equal to one whose worker 1 was
  killed after contributing to round 1 and before it closed. With the members' wait not
  bounded by the timeout (a 60 s deadline in the message) the round waits for worker 1
  instead, nobody is lost, and the test fails (checked)."""
  from lowcomm_jax.runtimes.ray import driver
  stalled = _config(**{"ray.collective_timeout_s": 5.0,
                       "ray.chaos": ("stall_in_sync=1:8@4",)})
  summary = driver.run(stalled, tmp_path / "stalled")
  _ends_where_the_replay_does(stalled, tmp_path / "stalled", summary, killed_replay,
                              "was waited for in vain in a round's collective")


@pytest.mark.slow  # (~30 s: a Ray run of 3 workers, the replay)
def test_a_member_dying_after_the_round_was_staged_is_retried_from_what_was_kept(
    cluster, tmp_path, killed_replay):
  """crash_after_staging=1@4: worker 1 dies in round 1's collective once it has staged the
  round, so its peers have its shards and stage the round with its contribution too. Nobody
  has committed: the driver loses worker 1 and tries the round again among workers 0 and 2,
  whose replicas must stage anew from the contributions they kept, not commit what the
  failed attempt staged. The run ends bit-equal to one whose worker 1 was killed after
  contributing to round 1 and before it closed. With a replica keeping the first state it
  staged for a round (`_stage` not replacing it) the θ differ (checked)."""
  from lowcomm_jax.runtimes.ray import driver
  crashed = _config(**{"ray.chaos": ("crash_after_staging=1@4",)})
  summary = driver.run(crashed, tmp_path / "crashed")
  _ends_where_the_replay_does(crashed, tmp_path / "crashed", summary, killed_replay,
                              "died in a round's collective")


def test_a_bit_flip_is_refused_where_no_replicas_are_compared():
  from lowcomm_jax.config import check
  config = _config(collective_form="server", **{"ray.chaos": ("flip_bit=1@4",)})
  with pytest.raises(check.ConfigError) as refused:
    check.validate(config, num_devices=8)
  assert any(p.startswith("ray.chaos=") and "flip_bit: this run has no collective among "
             "workers" in p for p in refused.value.problems), refused.value.problems
  pairs = _config(algorithm="noloco", num_workers=4, **{"ray.chaos": ("flip_bit=1@4",)})
  with pytest.raises(check.ConfigError) as refused:  # (pair swaps compare no hashes)
    check.validate(pairs, num_devices=8)
  assert any("flip_bit: noloco's members each hold their own θ_i" in p
             for p in refused.value.problems), refused.value.problems
