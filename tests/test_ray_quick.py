"""A real Ray round in each form, in the quick set (`-m "not slow"`: marked `quick`, so the
slow marker's rule leaves them in): a local Ray, a driver, 2 or 3 worker actors of the tiny
model, their jobs, and each round closed through the server, by a collective among the
members (the direct form's reduce-scatter over sockets, 3 members: its bytes are not an
all-gather's) or by NoLoCo's pair swaps; every member commits only once
their hashes agree. The equality with lockstep, failures and chaos are in
tests/test_ray_runtime.py (slow)."""

import json

import numpy as np
import pytest

from conftest import driver_gets_at_saves, load_config, ray_checkpoint
from lowcomm_jax.run import summary as summary_lib

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.quick


def _config(**overrides):
  """2 workers of the tiny model, 2 rounds of H = 2, every round checkpointed."""
  base = {"runtime": "ray", "num_workers": 2, "rounds": 2, "inner_steps": 2,
          "eval_every": 2, "checkpoint_every": 1, "log_every": 1, "mesh.replica": 1,
          "ray.apply_order": "dispatch"}
  return load_config("smoke", **{**base, **overrides})


@pytest.fixture
def cluster(ray_cluster):
  """The process's local Ray (conftest.ray_cluster: started once, as a run starts one)."""


@pytest.mark.parametrize("algorithm,form,round_form,workers", [
    ("diloco", "server", "server", 2),  # θ on the server actor; the workers pull and push
    ("diloco", "direct", "peers", 3),   # a reduce-scatter and all-gather among 3, over sockets
    ("noloco", "auto", "peers", 2),     # each member swaps θ_i with its round's peer
])
def test_a_ray_round_in_each_form_moves_theta_and_counts_its_bytes(cluster, tmp_path,
                                                                   monkeypatch, algorithm,
                                                                   form, round_form, workers):
  from lowcomm_jax.runtimes.ray import driver
  config = _config(algorithm=algorithm, collective_form=form, num_workers=workers)
  received = driver_gets_at_saves(monkeypatch)
  summary = driver.run(config, tmp_path)
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r for r in rows if "event" in r] == []  # nobody lost, joined or restarted
  assert summary["rounds_closed"] == 2 and summary["round_form"] == round_form
  assert summary_lib.problems(summary) == [] and summary["runtime"] == "ray"
  assert summary["pushes"] == 2 * workers and summary["total_inner_steps"] == 4 * workers
  assert np.isfinite(summary["eval_loss"])
  # θ moved from θ₀, the same in every coordinate a worker trains
  from lowcomm_jax.runtimes.ray.actors import initial_params
  from lowcomm_jax.runtimes.ray import checkpoints
  theta0 = np.asarray(initial_params(checkpoints.run_of(config)))
  servers, _, _ = ray_checkpoint(config, tmp_path)  # (the newest: the last round's)
  moved = np.abs(np.asarray(servers["global"]["params"]) - theta0)
  assert (moved > 0).mean() > 0.5, (moved > 0).mean()
  # Each checkpoint written where its state is: the driver got back no tensor (each
  # part's crc32 and a version), though every worker's inner state is larger than θ. Pair
  # swaps gather every member's rows of the outer state through the driver still.
  assert len(received) == 2, received  # (a checkpoint a round)
  if algorithm != "noloco":
    most = max(save["received"] for save in received)
    assert most < 2_000 < theta0.nbytes, (received, theta0.nbytes)
  if round_form == "server":
    assert summary["server_bytes_sent"] > 0 and summary["wire_bytes_per_worker"] == {}
  else:  # each link carried the ledger's bytes both ways, through no server
    # the driver calls each member twice a round (its message, its commit); NoLoCo's θ,
    # the members' mean, is reduced among them when a checkpoint reads it (every round
    # here): one call more each
    reads = 2 if algorithm == "noloco" else 0
    assert summary["server_bytes_sent"] == 0
    assert summary["collective_calls"] == 2 * 2 * workers + workers * reads
    assert (summary.get("consensus_bytes", 0) > 0) == (algorithm == "noloco")
    wire = summary["wire_bytes_per_worker"]
    assert sorted(wire) == [str(w) for w in range(workers)]
    if algorithm == "diloco":  # the dense mean reduce-scattered and all-gathered: each link
      # carries 2·(W−1)/W of Δ each way a round (shards differ by a coordinate at most), at
      # W = 3 a third less than an all-gather's (W−1)·Δ; the ledger's bytes_sent is each
      # worker's payload, Δ a round
      assert summary["bytes_sent"] == 2 * theta0.nbytes
      per_round = 2 * (workers - 1) / workers * theta0.nbytes
      for sent, received in wire.values():
        for nbytes in (sent, received):
          assert abs(nbytes - 2 * per_round) <= 2 * 4 * 2 * workers, (nbytes, per_round)
    else:  # a pair swap: each member's payload to its peer and back, the ledger's bytes
      assert wire == {str(w): [summary["bytes_sent"]] * 2 for w in range(workers)}
