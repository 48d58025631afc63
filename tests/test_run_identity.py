"""A workdir knows its config: config.json at the start, resumes under another config
refused before any work (or allowed and recorded), metrics.jsonl rows never lost."""

import json
import sys

import pytest

from lowcomm_jax import report
from lowcomm_jax.run import identity
from lowcomm_jax.runtimes.simulator import simulate
from lowcomm_jax.runtimes.spmd import train
from lowcomm_jax.run.identity import ResumeRefused


def _files(workdir):
  """Every file under the workdir with its bytes (to show nothing was touched)."""
  return {str(p.relative_to(workdir)): p.read_bytes()
          for p in sorted(workdir.rglob("*")) if p.is_file()}


def _rows(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_config_is_stored_and_a_changed_config_is_refused_before_any_work(
    tmp_path, smoke_config):
  train.run(smoke_config(rounds=2), tmp_path, stop_after_rounds=2)
  stored = json.loads((tmp_path / "config.json").read_text())
  assert stored["config"]["rounds"] == 2 and stored["config"]["model"]["name"] == "tiny"
  assert stored["config"]["optimizer"]["lr"] == 3e-3 and stored["command"] == sys.argv
  before = _files(tmp_path)

  changed = smoke_config(rounds=4, inner_steps=3, **{
      "outer.lr": 0.5, "model.name": "small", "compress.codec": "int8"})
  with pytest.raises(ResumeRefused) as refused:
    train.run(changed, tmp_path)
  message = str(refused.value)
  for change in ('inner_steps: 2 -> 3', 'outer.lr: 0.7 -> 0.5', 'model.name: "tiny" -> "small"',
                 'compress.codec: "none" -> "int8"'):
    assert change in message
  assert "rounds" not in message.replace("--config.resume_allow", "")  # rounds may grow
  assert "another --workdir" in message
  # Only outer.lr can be allowed: the others change what the checkpoint holds.
  assert message.endswith("--config.resume_allow=outer.lr")
  assert "strict" not in message and "partial_restore" not in message  # not orbax's advice
  assert _files(tmp_path) == before  # nothing written, nothing deleted


def test_extending_rounds_keeps_every_metrics_row_and_resume_allow_records_the_change(
    tmp_path, smoke_config):
  train.run(smoke_config(rounds=2, checkpoint_every=1), tmp_path)
  first = _rows(tmp_path)
  # More rounds and another cadence: allowed without asking.
  train.run(smoke_config(rounds=3, checkpoint_every=3, eval_every=3), tmp_path)
  rows = _rows(tmp_path)
  assert rows[:len(first)] == first and [r["step"] for r in rows] == [2, 4, 6]
  # As if the run had logged round 4 and died before saving it.
  with (tmp_path / "metrics.jsonl").open("a") as f:
    f.write(json.dumps({"step": 8, "train_loss": 99.0}) + "\n")

  allowed = smoke_config(rounds=4, resume_allow="outer.lr", **{"outer.lr": 0.5})
  summary = train.run(allowed, tmp_path)
  rows = _rows(tmp_path)
  assert rows[:4] == [*first, rows[2], {"step": 8, "train_loss": 99.0}]  # nothing deleted
  assert rows[4] == {"step": 6, "event": "resume", "round": 3,
                     "changed": {"outer.lr": [0.7, 0.5]}}
  # Round 4 under the new lr is written after the note; readers take it.
  assert rows[5]["step"] == 8 and rows[5]["train_loss"] != 99.0 and len(rows) == 6
  assert [r["step"] for r in report.read_metrics(tmp_path)] == [2, 4, 6, 8]
  assert report.read_metrics(tmp_path)[-1] == rows[5]
  (change,) = summary["config_changes"]
  assert change["round"] == 3 and change["changed"] == {"outer.lr": [0.7, 0.5]}
  stored = json.loads((tmp_path / "config.json").read_text())
  assert stored["config"]["outer"]["lr"] == 0.5 and stored["first_config"]["outer"]["lr"] == 0.7
  assert stored["resumes"] == summary["config_changes"]
  # The lr now in force is the stored one: going back is a change again.
  with pytest.raises(ResumeRefused, match="outer.lr: 0.5 -> 0.7"):
    train.run(smoke_config(rounds=5), tmp_path)
  # Fields a checkpoint cannot continue under cannot be allowed.
  with pytest.raises(ResumeRefused, match="resume_allow names inner_steps: a checkpoint "
                     "cannot continue"):
    train.run(smoke_config(rounds=5, inner_steps=3, resume_allow="inner_steps,outer.lr",
                           **{"outer.lr": 0.5}), tmp_path)


def test_a_run_that_died_before_its_first_checkpoint_restarts_under_a_new_config(
    tmp_path, smoke_config):
  identity.write(tmp_path, smoke_config(seed=1))
  (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 2, "train_loss": 99.0}) + "\n")
  summary = train.run(smoke_config(rounds=1), tmp_path)
  assert summary["config_changes"][0]["changed"] == {"seed": [1, 0]}
  assert [r["train_loss"] for r in report.read_metrics(tmp_path)] != [99.0]
  assert _rows(tmp_path)[0] == {"step": 2, "train_loss": 99.0}  # kept in the file


def test_resume_allow_must_name_config_fields(tmp_path, smoke_config):
  train.run(smoke_config(rounds=1), tmp_path)
  with pytest.raises(ResumeRefused, match="resume_allow names outer.learning_rate"):
    train.run(smoke_config(rounds=2, resume_allow="outer.learning_rate"), tmp_path)


def test_fields_added_since_the_run_started_are_not_compared(tmp_path, smoke_config):
  config = smoke_config()
  identity.write(tmp_path, config)
  stored = json.loads((tmp_path / "config.json").read_text())
  del stored["config"]["seed"]  # as if written before `seed` existed
  (tmp_path / "config.json").write_text(json.dumps(stored))
  assert identity.changes(tmp_path, smoke_config(seed=3)) == {}


def test_the_simulator_refuses_a_changed_config_too(tmp_path, smoke_config):
  config = smoke_config(**{"runtime": "simulator", "algorithm": "async"})
  identity.write(tmp_path, config)
  (tmp_path / "checkpoints" / "1").mkdir(parents=True)  # stands for a saved simulation
  other = smoke_config(**{"runtime": "simulator", "algorithm": "async",
                          "sim.heterogeneity": "very"})
  with pytest.raises(ResumeRefused, match='sim.heterogeneity: "none" -> "very"'):
    simulate.run(other, tmp_path)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "config.json"]
