"""The simulator end to end: agreement with the real runner, exact resume, every algorithm."""

import json

import jax
import numpy as np
import optax
import pytest

from conftest import load_config, train_rounds
from lowcomm_jax.config import check
from lowcomm_jax.runtimes.simulator import simulate
from lowcomm_jax.run.checkpoint import CheckpointMismatch
from lowcomm_jax.run.identity import ResumeRefused
from lowcomm_jax.sim import Network, collectives
from lowcomm_jax.runtimes.simulator.backend import SimBackend


def _sim_config(**overrides):
  base = {"runtime": "simulator", "num_workers": 4, "rounds": 4, "inner_steps": 2,
          "eval_every": 2, "checkpoint_every": 1, "log_every": 1}
  return load_config("smoke", **{**base, **overrides})


# A simulation compared with the runner (train_rounds) hands the runner its own config, on
# the simulator's layout (one replica device, as plan.one_device sets): the runner
# reads no sim.* field, and a config built again in the same process gets the same programs
# back (program_cache) instead of a build of its own.
ONE_DEVICE = {"mesh.replica": 1}


def _async_dn_config(**overrides):
  """Asynchronous, noisy and compressed; the resume and divergence tests share it (and with
  it its programs)."""
  return _sim_config(**{"algorithm": "async_dn", "rounds": 3, "sim.heterogeneity": "moderate",
                        "sim.jitter": 0.2, "sim.straggler_prob": 0.3,
                        "sim.network.regions": 2, "compress.codec": "int8", **overrides})


def test_synchronous_diloco_in_the_simulator_equals_the_real_runner(tmp_path):
  config = _sim_config(rounds=3, **{"sim.heterogeneity": "very", "sim.network.regions": 2,
                                    **ONE_DEVICE})
  summary = simulate.run(config, tmp_path)
  sim_params = simulate.final_global_params(config, tmp_path)
  # Bit for bit: the simulator runs the runner's own jitted local round and outer step,
  # with the workers vmapped on one device. The runner must use the same layout
  # (mesh.replica=1): on 4 replica devices its mean is a cross-device all-reduce, summed in
  # another order, and round-off (~1e-6 after 3 rounds of AdamW) separates the two.
  _, state, _, _ = train_rounds(config, 3)
  np.testing.assert_array_equal(np.asarray(sim_params), np.asarray(state.params))
  # Bytes: every round each worker sends its dense Δ once; no server sends anything.
  param_bytes = 4 * summary["params"]
  assert summary["bytes_sent"] == 3 * param_bytes and summary["server_bytes_sent"] == 0
  assert summary["bytes_sent_total"] == 4 * 3 * param_bytes
  assert summary["bytes_sent_ddp_equivalent"] == 3 * 2 * param_bytes  # DDP: every step
  # Virtual time: the slowest (speed 0.2) worker's 2 steps of 0.1 s per round, plus the
  # faster collective of 2 regions x 2 workers (the defaults' links; sim/collectives.py).
  net = Network.build(num_workers=4, regions=2, intra_gbps=100.0, intra_latency_s=1e-4,
                      inter_gbps=1.0, inter_latency_s=0.05)
  comm, used = collectives.seconds(net, "allreduce", range(4), param_bytes)
  assert summary["collective"] == used
  assert summary["virtual_seconds"] == pytest.approx(3 * (2 * 0.1 / 0.2 + comm))
  assert summary["mean_staleness"] == 0 and summary["total_inner_steps"] == 3 * 4 * 2
  # The slowest worker computes 3 x 1 s and only waits for the all-reduces; the fastest
  # (5x faster) idles at every barrier as well.
  slowest = min(summary["workers"], key=lambda w: w["idle_fraction"])
  assert slowest["speed"] == 0.2
  assert slowest["idle_fraction"] == pytest.approx(1 - 3 * 1.0 / summary["virtual_seconds"])
  fastest = max(summary["workers"], key=lambda w: w["speed"])
  assert fastest["idle_fraction"] == pytest.approx(1 - 3 * 0.2 / summary["virtual_seconds"])


def test_simulation_resumed_from_a_checkpoint_equals_an_uninterrupted_one(tmp_path):
  # Asynchronous, noisy and compressed: the clock, the queue, in-flight contributions,
  # pulled snapshots, server and codec states all have to come back.
  config = _async_dn_config()
  whole = simulate.run(config, tmp_path / "whole")
  stopped = simulate.run(config, tmp_path / "split", stop_after_checkpoints=2)
  assert stopped["stopped_at"] == 2
  resumed = simulate.run(config, tmp_path / "split")
  for key in ("eval_loss", "train_loss", "virtual_seconds", "mean_staleness", "mean_drift",
              "total_inner_steps", "bytes_sent", "workers"):
    assert resumed[key] == whole[key], key
  for a, b in zip(jax.tree.leaves(simulate.final_global_params(config, tmp_path / "whole")),
                  jax.tree.leaves(simulate.final_global_params(config, tmp_path / "split"))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert whole["mean_staleness"] > 0 and whole["mean_drift"] > 0
  # A finished simulation re-run returns its summary without redoing anything.
  assert simulate.run(config, tmp_path / "whole") == whole


def _plain_async_config():
  """The plain-async and lr-schedule tests share it (and with it its programs)."""
  return _sim_config(**{"algorithm": "async", "sim.heterogeneity": "very",
                        "checkpoint_every": 0})


def test_plain_async_trains_end_to_end_and_counts_its_bytes(tmp_path):
  config = _plain_async_config()
  summary = simulate.run(config, tmp_path)
  # The budget is W·rounds·H = 32 inner steps, in 16 jobs of H = 2 applied one at a time.
  assert summary["total_inner_steps"] == 32 and summary["contributions"] == 16
  assert summary["mean_staleness"] > 0 and summary["mean_drift"] > 0
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  evals = [r["eval_loss"] for r in records if "eval_loss" in r]
  assert len(evals) == 2 and evals[-1] < evals[0] < np.log(256)
  # Every job pulls the dense model (the server sends it) and sends a dense Δ back.
  param_bytes = 4 * summary["params"]
  assert summary["bytes_sent_total"] == 16 * param_bytes
  assert summary["bytes_sent"] == 16 * param_bytes // 4  # per worker
  assert summary["server_bytes_sent"] == 16 * param_bytes
  assert summary["bytes_sent_ddp_equivalent"] == param_bytes * 32 // 4


def test_asynchronous_inner_lr_schedules_follow_the_runs_clock(tmp_path, monkeypatch):
  """Each async job's schedule starts at the inner steps per worker of the jobs started at
  earlier virtual instants (jobs that start together share one lr): no worker runs past the
  schedule's end, though the fastest takes more steps than rounds·H of its own (its own
  count would have overrun the cosine)."""
  seen = {}
  real = simulate.SimBackend.flush

  def flush(self, next_batches):
    seen["backend"] = self
    starts = [(j.id, j.start, self.job_lr_step[j.id]) for j in self._queued]
    real(self, next_batches)
    seen.setdefault("starts", []).extend(starts)
  monkeypatch.setattr(simulate.SimBackend, "flush", flush)
  config = _plain_async_config()
  simulate.run(config, tmp_path)
  W, H, budget = 4, 2, 4 * 2
  starts = sorted(seen["starts"])  # by job id: start order
  lr_steps = [step for _, _, step in starts]
  assert lr_steps == sorted(lr_steps) and lr_steps[:W] == [0] * W  # all start at t = 0
  times = [t for _, t, _ in starts]
  # Every job has H = 2: the steps of the jobs started strictly before, per worker.
  assert lr_steps == [sum(u < t for u in times) * H // W for t in times]
  assert max(lr_steps) > budget // 2  # the clock moves through the run
  backend = seen["backend"]
  own_steps = np.asarray(backend.workers.steps)
  counts = [np.asarray(s.count) for s in jax.tree.leaves(
      backend.workers.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
      if isinstance(s, optax.ScaleByScheduleState)]
  assert own_steps.max() > budget + H  # the fastest worker's own clock would overrun
  assert counts and all(c.max() <= budget + H for c in counts)


def test_halos_trains_and_logs_virtual_time(tmp_path, monkeypatch):
  pushes = []
  real_push = SimBackend.push_update
  monkeypatch.setattr(SimBackend, "push_update",
                      lambda self, src, msg: (pushes.append(src), real_push(self, src, msg)))
  config = _sim_config(**{"algorithm": "halos", "sim.heterogeneity": "slight",
                          "sim.network.regions": 2, "outer.halos.sync_every": 2})
  summary = simulate.run(config, tmp_path)
  assert summary["total_inner_steps"] == 4 * 4 * 2 and summary["contributions"] == 16
  # Servers send a model per pull (16 jobs), and per push an LPS sends its change and the
  # GPS its model back. A push carries K = 2 or more of the 16 updates, but for each
  # region's last one: at most 8 + 2 pushes.
  param_bytes = 4 * summary["params"]
  assert set(pushes) == {"region0", "region1"} and len(pushes) <= 10
  assert summary["server_bytes_sent"] == (16 + 2 * len(pushes)) * param_bytes
  assert summary["bytes_sent_total"] == 16 * param_bytes
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  evals = [r for r in records if "eval_loss" in r]
  assert evals[-1]["eval_loss"] < np.log(256)  # below a uniform guess over bytes
  times = [r["virtual_seconds"] for r in records]
  assert times == sorted(times) and times[-1] == summary["virtual_seconds"]
  assert {"mean_staleness", "mean_drift", "bytes_sent", "eval_loss",
          "idle_fraction_worker_3"} <= set(records[-1])
  assert summary["train_loss"] == [r["train_loss"] for r in records if "train_loss" in r][-1]
  assert all(0.0 <= w["idle_fraction"] < 1.0 for w in summary["workers"])
  assert (tmp_path / "tensorboard").is_dir()
  # The global server sits in a region of its own (2, after the workers' 0 and 1); each
  # region's share of the applied steps and its staleness are reported.
  assert summary["server_region"] == 2 and not summary["server_colocated"]
  regions = summary["regions"]
  assert [r["region"] for r in regions] == [0, 1] and regions[1]["workers"] == [2, 3]
  assert sum(r["applied_step_share"] for r in regions) == pytest.approx(1.0)
  assert all(r["mean_staleness"] >= 0 for r in regions)
  # Time never depends on the math: the schedule replayed without training ends when the
  # simulation did, having applied the same steps (sim/replay.py).
  points = simulate.clock(config)
  assert points[-1] == (pytest.approx(summary["virtual_seconds"]), summary["total_inner_steps"])
  # Every metrics row was written at an instant of the replay's clock.
  for row in records:
    assert (pytest.approx(row["virtual_seconds"]), row["total_inner_steps"]) in points


def test_divergence_keeps_the_last_good_checkpoint_and_a_changed_plan_is_refused(tmp_path):
  config = _async_dn_config()
  assert simulate.run(config, tmp_path, stop_after_checkpoints=1)["stopped_at"] == 1
  good = simulate.final_global_params(config, tmp_path)
  exploding = _async_dn_config(**{"outer.lr": 1e30,  # resumes, blows up
                                  "resume_allow": "outer.lr"})
  with pytest.raises(simulate.TrainingDiverged, match="non-finite training at virtual t=.*"
                     "last good checkpoint \\(round-equivalent 1\\)"):
    simulate.run(exploding, tmp_path)
  after = simulate.final_global_params(config, tmp_path)
  jax.tree.map(np.testing.assert_array_equal, good, after)
  # Continuing it as another simulation (other speeds) is refused, naming both plans.
  other = _async_dn_config(**{"sim.heterogeneity": "very",
                              "resume_allow": "outer.lr,sim.heterogeneity"})
  with pytest.raises(ResumeRefused, match="resume_allow names sim.heterogeneity"):
    simulate.run(other, tmp_path)
  # Without config.json (a workdir from before it existed) the checkpoint's plan check does.
  (tmp_path / "config.json").unlink()
  with pytest.raises(CheckpointMismatch, match="this config asks for"):
    simulate.run(other, tmp_path)


@pytest.mark.parametrize("overrides,message", [
    ({"algorithm": "async_dn", "runtime": "spmd"}, "--config.runtime=simulator"),
    ({"sim.heterogeneity": "extreme"}, "sim.heterogeneity"),
    ({"sim.speeds": (1.0, 0.5)}, "sim.speeds"),
    ({"sim.network.inter_gbps_matrix": ((1.0, 2.0),)}, "sim.network.inter_gbps_matrix"),
    ({"sim.network.inter_latency_s": -1.0}, "sim.network.inter_latency_s"),
    ({"sim.network.worker_regions": (0, 0, 1, 3)}, "sim.network.worker_regions"),
    ({"sim.network.server_region": 2}, "sim.network.server_region"),
    ({"sim.network.region_gbps": -1.0}, "sim.network.region_gbps"),
    ({"collective_form": "tree"}, "collective_form"),
    ({"algorithm": "async", "data.batch_mode": "same"}, "data.batch_mode"),
    ({"algorithm": "async_dn", "outer.dn_c": 0.5}, "outer.dn_c"),
    ({"algorithm": "halos", "outer.halos.merge_alpha": 1.5}, "outer.halos.merge_alpha"),
    ({"model.tp.size": 2}, "model.tp.size"),
])
def test_bad_simulator_configs_name_the_field(overrides, message):
  with pytest.raises(check.ConfigError, match=message):
    check.validate(_sim_config(**overrides), num_devices=8)


def test_streaming_in_the_simulator_equals_the_real_runner(tmp_path):
  """Same programs, same order: the simulator only decides when each segment runs."""
  streaming = {"algorithm": "streaming", "inner_steps": 4, "streaming.fragments": 2,
               "streaming.overlap_steps": 1, "streaming.mix": 0.5}
  config = _sim_config(rounds=2, **streaming, **{"sim.heterogeneity": "very", **ONE_DEVICE})
  summary = simulate.run(config, tmp_path / "whole")
  sim_params = simulate.final_global_params(config, tmp_path / "whole")
  # Stopped after round 1's checkpoint, with round 2's first fragment in flight.
  assert simulate.run(config, tmp_path / "split", stop_after_checkpoints=1)["stopped_at"] == 1
  resumed = simulate.run(config, tmp_path / "split")
  # Drift too: the window of pulled models is in the checkpoint.
  for key in ("virtual_seconds", "mean_drift", "drift_p90", "drift_per_worker"):
    assert resumed[key] == summary[key], key
  assert summary["mean_drift"] > 0
  split_params = simulate.final_global_params(config, tmp_path / "split")
  np.testing.assert_array_equal(np.asarray(split_params), np.asarray(sim_params))
  _, state, _, _ = train_rounds(config, 2)
  np.testing.assert_array_equal(np.asarray(sim_params), np.asarray(state.params))
  # Each round every worker sends the whole model once, one fragment at a time.
  assert summary["bytes_sent"] == 2 * 4 * summary["params"]
  assert summary["total_inner_steps"] == 2 * 4 * 4
  # ...but never more than its largest fragment at once.
  assert 0 < summary["bytes_sent_peak_sync"] < 4 * summary["params"]


SLOW = {"sim.network.intra_gbps": 0.002}  # the gradient's ring takes longer than the step


def _diloco_one_step_config(**overrides):
  """DiLoCo of one inner step a round on a slow link; the donation and DDP tests share it."""
  return _sim_config(rounds=3, inner_steps=1, **SLOW, **overrides)


def test_the_simulator_never_donates_what_its_servers_keep(tmp_path, monkeypatch):
  """On accelerators the runner donates its state to the jitted sync; the simulator must not
  (it reuses the run's key and keeps snapshots). Forcing the runner's accelerator default
  on CPU, where donation is honored too, shows it."""
  from lowcomm_jax.runtimes.spmd import rounds
  monkeypatch.setattr(rounds.jax, "default_backend", lambda: "gpu")
  summary = simulate.run(_diloco_one_step_config(), tmp_path)  # the DDP test's DiLoCo
  assert summary["total_inner_steps"] == 3 * 4 * 1


def test_ddp_in_the_simulator_equals_the_runner_and_pays_a_ring_every_step(tmp_path):
  config = _diloco_one_step_config(algorithm="ddp", **ONE_DEVICE)
  summary = simulate.run(config, tmp_path / "ddp")
  _, state, _, _ = train_rounds(config, 3)
  np.testing.assert_array_equal(
      np.asarray(simulate.final_global_params(config, tmp_path / "ddp")),
      np.asarray(state.params))
  # Every step each worker sends its dense gradient once, and the step waits for its ring:
  # the virtual time of a DiLoCo round of one step, every step.
  assert summary["bytes_sent"] == 3 * 4 * summary["params"]
  diloco = simulate.run(_diloco_one_step_config(), tmp_path / "diloco")
  assert summary["virtual_seconds"] == diloco["virtual_seconds"]
  assert summary["virtual_seconds"] > 2 * 3 * 0.1  # communication dominates here
