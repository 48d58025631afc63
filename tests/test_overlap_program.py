"""Real overlap in the runner: an algorithm with a delayed sync (one-step-delay, eager,
overlap) runs each round's sync inside the next round's program. The compiled program has
no data dependence between the sync's all-reduce and the local steps' loop (so XLA may run
them at once), and the runner trains exactly as with separate programs."""

import json
import re

import jax
import numpy as np
import pytest

from conftest import checkpointed_state, load_config, rerun_with_default_compile
from lowcomm_jax.runtimes.spmd import driver
from lowcomm_jax.assemble import jitted
from lowcomm_jax.runtimes.spmd import rounds
from lowcomm_jax.runtimes.spmd import train
from lowcomm_jax.assemble.hosts import host
from lowcomm_jax.parallel import mesh as mesh_lib


def _entry_graph(hlo: str) -> tuple[dict[str, str], dict[str, set[str]]]:
  """The entry computation of an optimized HLO module: (instruction -> opcode, instruction
  -> the instructions it reads)."""
  entry = hlo[hlo.index("ENTRY"):]
  entry = entry[:entry.index("\n}")]
  ops, reads = {}, {}
  for line in entry.splitlines()[1:]:
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*? ([\w\-]+)\((.*)", line)
    if m:
      ops[m.group(1)] = m.group(2)
      reads[m.group(1)] = set(re.findall(r"%([\w.\-]+)", m.group(3)))
  return ops, {name: {x for x in rs if x in ops} for name, rs in reads.items()}


def _reaches(reads: dict[str, set[str]], start: str, targets: set[str]) -> bool:
  """Whether `start` (transitively) reads any of `targets`."""
  seen, todo = set(), [start]
  while todo:
    for x in reads[todo.pop()]:
      if x in targets:
        return True
      if x not in seen:
        seen.add(x)
        todo.append(x)
  return False


def _compiled_round(algorithm: str, **overrides) -> str:
  """The optimized HLO of `algorithm`'s overlapped program (held sync + local steps), 4
  workers on 4 devices."""
  c = load_config("smoke", algorithm=algorithm, num_workers=4, **{"mesh.replica": 4},
                  **overrides)
  r = train.build(c)
  fns = jitted.jitted_steps(r)
  state, workers = jitted.init_run(r, fns)
  H = c.inner_steps
  batches = [s.next_round(H) for s in r.data.streams]
  workers, _, held = rounds.held_round(r, fns, state, workers, batches, [H])
  placed = jax.device_put(batches[0], mesh_lib.round_batches(r.topology.mesh))
  with jax.set_mesh(r.topology.mesh):
    return rounds.jitted_overlapped(r).lower(
        state, held.deltas_R, held.signals, workers[0], placed, rounds.worker_ids(r, 0),
        metrics=True).compile().as_text()


def _collectives_and_loops(hlo: str):
  ops, reads = _entry_graph(hlo)
  collectives = {n for n, op in ops.items() if op.startswith("all-reduce")}
  loops = {n for n, op in ops.items() if op == "while"}
  assert collectives and loops, (sorted(set(ops.values())))
  return reads, collectives, loops


# (eager's sync is one_step_delay's plain all-reduce; one_step_delay runs with a codec)
@pytest.mark.parametrize("algorithm,extra", [
    ("eager", {}), ("overlap", {}), ("one_step_delay", {"compress.codec": "int8"})])
def test_delayed_syncs_collective_and_the_local_loop_are_independent(algorithm, extra):
  reads, collectives, loops = _collectives_and_loops(_compiled_round(algorithm, **extra))
  for loop in loops:
    assert not _reaches(reads, loop, collectives), f"the local steps wait for {collectives}"
  for c in collectives:
    assert not _reaches(reads, c, loops), f"{c} waits for the local steps"


def test_diloco_in_the_same_program_would_wait_for_its_all_reduce():
  """The check can fail: DiLoCo's next local steps start from the new θ, which needs the
  aggregate (so DiLoCo never runs overlapped)."""
  reads, collectives, loops = _collectives_and_loops(_compiled_round("diloco"))
  assert all(_reaches(reads, loop, collectives) for loop in loops)
  assert rounds.can_overlap(train.build(load_config("smoke")), [2]) is not None


def test_overlapped_runs_train_exactly_as_separate_programs(tmp_path, smoke_config,
                                                            monkeypatch, request):
  if rerun_with_default_compile(request):  # bit-identical as XLA compiles them by default
    return
  config = smoke_config(algorithm="one_step_delay", rounds=7, eval_every=3,
                        checkpoint_every=3, log_every=2)
  used = []
  real = driver.overlapped_round
  monkeypatch.setattr(driver, "overlapped_round",
                      lambda *a, **k: used.append(1) or real(*a, **k))
  train.run(config, tmp_path / "overlapped")
  # Rounds 3 and 6 evaluate and save, 7 ends: their own syncs run at once. The others' are
  # held and run inside the next round's program: in rounds 2, 3, 5 and 6.
  assert len(used) == 4
  config.overlap_sync = False
  train.run(config, tmp_path / "separate")
  assert len(used) == 4

  def rows(name):
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    keep = ("train_loss", "eval_loss", "param_norm", "outer_update_norm")
    return [{k: v for k, v in json.loads(x).items() if k in keep} for x in lines]
  assert rows("overlapped") == rows("separate") and len(rows("separate")) >= 4
  (a, wa), _ = checkpointed_state(config, tmp_path / "overlapped")
  (b, wb), _ = checkpointed_state(config, tmp_path / "separate")
  for x, y in zip(jax.tree.leaves((a, wa)), jax.tree.leaves((b, wb))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_runs_that_cannot_overlap_say_why(smoke_config):
  """(Hosts that differ in tier, batch or H on separate processes are the two-process
  tests'; no delayed algorithm has several segments yet.)"""
  tiers = smoke_config(algorithm="one_step_delay",
                       hosts=[host(tier=1.0, workers=1), host(tier=0.5, workers=1)])
  assert "several hosts" in rounds.can_overlap(train.build(tiers), [2, 2])
  tp = smoke_config(algorithm="one_step_delay", **{"model.tp.size": 2})
  assert rounds.can_overlap(train.build(tp), [2]) == "tensor parallelism"
  assert rounds.can_overlap(train.build(smoke_config(algorithm="eager")), [2]) is None
