"""The simulator at scale (issue 52): jobs in calls of a fixed width, one program for every
H, skipped steps that change nothing, a program count that does not grow with W."""

import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, load_config, rerun_with_default_compile, set_fields
from lowcomm_jax.assemble.build import build
from lowcomm_jax.assemble.jitted import init_run, jitted_steps
from lowcomm_jax.assemble.plan import one_device
from lowcomm_jax.programs import steps
from lowcomm_jax.runtimes.simulator import simulate
from lowcomm_jax.runtimes.simulator.backend import call_sizes


def test_a_round_runs_in_calls_of_one_shape():
  assert call_sizes(1, 8) == [(1, 1)]
  assert call_sizes(16, 16) == [(16, 16)]
  assert call_sizes(16, 8) == [(8, 8), (8, 8)]
  assert call_sizes(7, 4) == [(4, 4), (3, 4)]  # the last padded
  assert call_sizes(5, 1) == [(1, 1)] * 5
  for jobs in range(9, 40):
    sizes = call_sizes(jobs, 8)
    assert sum(n for n, _ in sizes) == jobs and {lanes for _, lanes in sizes} == {8}


def test_a_skipped_step_leaves_the_worker_bit_for_bit_as_it_was(request):
  """An asynchronous job runs alone, in the program of the largest H: its steps past its own
  are skipped (a branch not taken) and leave it exactly as the program of its own H does
  (as XLA compiles by default; the suite's fast compile rounds the two programs apart)."""
  if rerun_with_default_compile(request):
    return
  config = load_config("smoke", num_workers=1, inner_steps=5,
                       **{"algorithm": "async_dn", "runtime": "simulator"})
  r = build(one_device(config))
  programs = jitted_steps(r, donate=False)
  state, workers = init_run(r, programs)
  local, view, workers = programs.local[0][0], r.local_input(state), workers[0]
  ids = jnp.zeros((1,), jnp.int32)
  batches = np.asarray(r.data.streams[0].next_steps(np.arange(1), 5))
  for taken in (3, 5):  # part of the steps, and all of them
    own_h = local(view, workers, batches[:, :taken], ids)
    padded = batches.copy()
    padded[:, taken:] = 0  # what the simulator pads with
    largest_h = local(view, workers, padded, ids, jnp.full((1,), taken, jnp.int32))
    for a, b in zip(jax.tree.leaves(own_h[:2]), jax.tree.leaves(largest_h[:2])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The reported step losses: equal to the last bit on the machine this was written on; on
    # the 2026-11-29 CPU the two programs' loss reductions differ by 1 ulp (1.7e-7 relative)
    # while the worker's state stays bit for bit (BUILD_NOTES, "Gotchas").
    np.testing.assert_allclose(np.asarray(own_h[2]), np.asarray(largest_h[2])[:, :taken],
                               rtol=1e-6, atol=0)
    assert not np.asarray(largest_h[2])[:, taken:].any()
    assert int(np.asarray(largest_h[1].steps)[0]) == taken


def _dylu(workers: int, **overrides):
  return load_config("smoke", **{"algorithm": "async_dn", "outer.dylu": True,
                                 "num_workers": workers, "rounds": 2, "inner_steps": 4,
                                 "runtime": "simulator", "sim.heterogeneity": "very",
                                 "sim.jobs_per_call": 4, "eval_every": 2,
                                 "checkpoint_every": 1, **overrides})


def test_the_programs_compiled_do_not_grow_with_the_workers_or_their_h(tmp_path):
  counts = {}
  for workers in (4, 16):
    jax.clear_caches()  # each run makes its own programs
    summary = simulate.run(_dylu(workers), tmp_path / str(workers))
    # every program made: compiled, or loaded from the suite's compilation cache
    counts[workers] = summary["programs_compiled"] + summary["programs_from_cache"]
    assert summary["compile_seconds"] > 0
    assert len(set(summary["workers"][w]["inner_steps"] for w in range(workers))) > 1
  assert 0 < counts[16] <= counts[4], counts


def test_a_sixteen_worker_simulation_resumes_exactly(tmp_path):
  config = _dylu(16, rounds=3)
  whole = simulate.run(config, tmp_path / "whole")
  assert simulate.run(config, tmp_path / "split", stop_after_checkpoints=1)["stopped_at"] == 1
  resumed = simulate.run(config, tmp_path / "split")
  for key in ("eval_loss", "train_loss", "virtual_seconds", "total_inner_steps", "workers"):
    assert resumed[key] == whole[key], key
  np.testing.assert_array_equal(
      np.asarray(simulate.final_global_params(config, tmp_path / "whole")),
      np.asarray(simulate.final_global_params(config, tmp_path / "split")))


@pytest.mark.parametrize("method", ["diloco", "async_dn_dylu", "halos"])
def test_sim_geo_takes_a_one_round_smoke_override(tmp_path, method):
  config = runpy.run_path(str(REPO / "configs" / "sim_geo.py"))["get_config"](method)
  config = set_fields(config, {"rounds": 1, "inner_steps": 2, "model.name": "tiny",
                               "data.tokenizer": "byte", "data.seq_len": 32,
                               "eval_every": 1, "eval_batches": 1})
  summary = simulate.run(config, tmp_path)
  assert summary["num_workers"] == 16 and np.isfinite(summary["eval_loss"])
  assert summary["total_inner_steps"] >= 16 * 2


def test_the_memory_check_counts_one_call_of_jobs_and_names_the_width(monkeypatch):
  from lowcomm_jax.assemble import memory
  runs = {(w, width): build(one_device(load_config(
              "smoke", num_workers=w, **{"runtime": "simulator", "sim.jobs_per_call": width})),
              check_memory=False)
          for w, width in ((16, 1), (16, 4), (64, 4))}
  temporaries = {(w, width): memory.estimate(r, width)["round_temporaries"]
                 for (w, width), r in runs.items()}
  assert temporaries[(16, 4)] == 4 * temporaries[(16, 1)]  # one call's jobs
  assert temporaries[(64, 4)] == temporaries[(16, 4)]  # not every worker's
  # more lanes per call than a device has workers: only its workers run at once
  assert memory.estimate(runs[(16, 4)], 64)["round_temporaries"] == 16 * temporaries[(16, 1)]
  states = memory.estimate(runs[(64, 4)], 4)["inner_optimizer"]
  assert states == 4 * memory.estimate(runs[(16, 4)], 4)["inner_optimizer"]  # states do grow
  # Room for everything: every worker in one call; less room: the widest power of two.
  auto = build(one_device(load_config("smoke", num_workers=12, **{"runtime": "simulator"})),
               check_memory=False)
  assert memory.choose_sim_width(auto) == 12
  one_job = temporaries[(16, 1)]
  states = sum(memory.estimate(auto, 1).values()) - one_job
  for room, width in ((12, 12), (11, 8), (5, 4), (1, 1)):  # room for jobs, twice over
    monkeypatch.setattr(memory, "available_bytes", lambda devices, room=room: (
        states + 2 * room * one_job, "a test device"))
    assert memory.choose_sim_width(auto) == width, room
  # Too little for even one job per call: refused in one line naming the fields.
  monkeypatch.setattr(memory, "available_bytes", lambda devices: (2**20, "a test device"))
  with pytest.raises(memory.OutOfMemory) as e:
    simulate.build_run(load_config("smoke", num_workers=16, **{"runtime": "simulator"}))
  (message,) = e.value.problems
  assert message.startswith("num_workers=16: the simulation needs about ")
  assert "--config.sim.jobs_per_call" in message and "\n" not in message


def test_the_progress_line_gives_virtual_time_steps_and_an_eta(caplog):
  progress = simulate.SimProgress(total_steps=1000, every_s=0.0)
  with caplog.at_level("INFO"):
    progress.tick(5.0, 0)  # nothing applied yet: no rate, no line
    progress.tick(10.0, 100)  # the first applied steps: the rate is counted from here
    progress.tick(20.0, 300)
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sim: ")]
  assert len(lines) == 2
  assert lines[-1].startswith("sim: virtual 20.0s  300/1,000 inner steps applied  wall ")
  assert "ETA " in lines[-1] and "ETA ?" not in lines[-1]
