"""What a run writes, read back by tensorboard's own reader (no TensorFlow): every scalar of
the event files is metrics.jsonl's (TensorBoard stores float32). The run's clu Collection
(run/run_metrics.py) gives the numbers the rows show; metrics.writer='clu' is refused
before any work where TensorFlow is missing, and otherwise writes the rows' scalars."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, load_config, xla_flags
from lowcomm_jax.config import check
from lowcomm_jax.config.check import ConfigError
from lowcomm_jax.run import metrics, run_metrics
from lowcomm_jax.runtimes.simulator import simulate
from lowcomm_jax.runtimes.spmd import train

HAS_TF = importlib.util.find_spec("tensorflow") is not None


def _rows(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _jsonl_scalars(workdir) -> dict[tuple[str, int], float]:
  """{(tag, step): value} of metrics.jsonl's numeric values (JSON's 'nan'/'inf' as floats)."""
  out = {}
  for row in _rows(workdir):
    for tag, value in row.items():
      if tag != "step":
        out[(tag, row["step"])] = float(value)
  return out


def _event_scalars(workdir) -> dict[tuple[str, int], float]:
  from tensorboard.backend.event_processing import event_accumulator
  acc = event_accumulator.EventAccumulator(
      str(workdir / "tensorboard"), size_guidance={event_accumulator.SCALARS: 0}).Reload()
  out = {}
  for tag in acc.Tags()["scalars"]:
    for event in acc.Scalars(tag):
      assert (tag, event.step) not in out, f"{tag} at step {event.step} written twice"
      out[(tag, event.step)] = event.value
  return out


def _same_as_float32(a: float, b: float) -> bool:
  a, b = np.float32(a), np.float32(b)
  return (np.isnan(a) and np.isnan(b)) or a == b


@pytest.fixture(scope="module")
def runner_run(tmp_path_factory):
  """The smoke run, 3 rounds (H = 2), evaluated at rounds 2 and 3: its workdir. Every row's
  train metrics must have gone through the run's clu Collection (counted here)."""
  workdir = tmp_path_factory.mktemp("runner")
  calls = []
  real = run_metrics.train_scalars
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(run_metrics, "train_scalars", lambda m: calls.append(1) or real(m))
    train.run(load_config("smoke", rounds=3, eval_every=2, checkpoint_every=3), workdir)
  assert len(calls) == 3  # one per logged round
  return workdir


@pytest.mark.parametrize("runtime", ["runner", "simulator"])
def test_every_scalar_in_the_event_files_is_the_jsonl_value(runtime, request, tmp_path):
  if runtime == "runner":
    workdir = request.getfixturevalue("runner_run")
  else:
    workdir = tmp_path
    simulate.run(load_config("smoke", rounds=2, eval_every=1, checkpoint_every=2,
                             **{"runtime": "simulator", "mesh.replica": 1}), workdir)
  rows, events = _jsonl_scalars(workdir), _event_scalars(workdir)
  assert rows.keys() == events.keys()
  assert {"train_loss", "eval_loss", "tokens"} <= {tag for tag, _ in rows}
  different = {k: (rows[k], events[k]) for k in rows if not _same_as_float32(rows[k], events[k])}
  assert not different


def test_the_collection_gives_the_numbers_the_rows_show(runner_run):
  """train_loss is the run's clu Collection: the round's mean, counted once, read back
  exactly; the workers' losses merged by the Collection (an Average across workers) give it
  too (two workers: a sum of two is the same in any order), and merging rounds averages
  their means."""
  rows = [r for r in _rows(runner_run) if "train_loss" in r]
  assert len(rows) == 3 and all(r.keys() >= {"train_loss_worker_0", "train_loss_worker_1"}
                                for r in rows)
  per_round = []
  for row in rows:
    loss = jnp.float32(row["train_loss"])
    assert float(run_metrics.of_round(loss).compute()["train_loss"]) == row["train_loss"]
    workers = [run_metrics.of_round(jnp.float32(row[f"train_loss_worker_{w}"])) for w in (0, 1)]
    merged = workers[0].merge(workers[1]).compute()["train_loss"]
    assert float(merged) == row["train_loss"]
    per_round.append(run_metrics.of_round(loss))
  whole = per_round[0].merge(per_round[1]).merge(per_round[2]).compute()["train_loss"]
  assert float(whole) == pytest.approx(np.mean([r["train_loss"] for r in rows]), rel=1e-6)


def test_a_round_mean_goes_through_the_collection_unchanged():
  """Counted once, compute() is x·1/1: the same float32, NaN included (the divergence stop
  reads it)."""
  for x in (0.0, 1e-30, 2.5, 3.3333333, 1e30, float("inf"), float("nan")):
    got = run_metrics.train_scalars({"train_loss": jnp.float32(x), "param_norm": 1.0})
    assert np.asarray(got["train_loss"]).tobytes() == np.float32(x).tobytes()
    assert got["param_norm"] == 1.0


@pytest.mark.skipif(HAS_TF, reason="TensorFlow is installed: metrics.writer='clu' is allowed")
def test_the_clu_writer_without_tensorflow_is_refused_with_its_field_and_fix():
  with pytest.raises(ConfigError) as e:
    check.validate(load_config("smoke", **{"metrics.writer": "clu"}), num_devices=8)
  assert ("metrics.writer='clu': needs TensorFlow (pip install tensorflow-cpu), or use "
          "'tensorboard'") in e.value.problems


def test_an_unknown_writer_is_refused():
  with pytest.raises(ConfigError) as e:
    check.validate(load_config("smoke", **{"metrics.writer": "wandb"}), num_devices=8)
  assert any(p.startswith("metrics.writer='wandb': use 'tensorboard'") for p in e.value.problems)


@pytest.mark.skipif(HAS_TF, reason="TensorFlow is installed: metrics.writer='clu' is allowed")
def test_the_command_refuses_the_clu_writer_before_any_work(tmp_path):
  workdir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "-m", "lowcomm_jax.main", "--config=configs/smoke.py",
       f"--workdir={workdir}", "--config.metrics.writer=clu"], cwd=REPO, capture_output=True,
      text=True, timeout=120, env={**os.environ, "XLA_FLAGS": xla_flags(1)})
  assert proc.returncode != 0
  assert "metrics.writer='clu': needs TensorFlow (pip install tensorflow-cpu)" in proc.stderr
  assert not workdir.exists()


def test_the_clu_writer_gets_the_rows_scalars(tmp_path, monkeypatch):
  """metrics.writer='clu' routes each row's scalars to clu.metric_writers' default writer
  (a stand-in here: the real one imports TensorFlow); metrics.jsonl is written as ever."""
  made = []

  class Recorder:
    def __init__(self, logdir, **kwargs):
      self.logdir, self.kwargs, self.rows, self.flushes, self.closed = logdir, kwargs, [], 0, False
      made.append(self)

    def write_scalars(self, step, scalars):
      self.rows.append((step, scalars))

    def flush(self):
      self.flushes += 1

    def close(self):
      self.closed = True

  fake = types.ModuleType("clu.metric_writers")
  fake.create_default_writer = Recorder
  import clu
  monkeypatch.setitem(sys.modules, "clu.metric_writers", fake)
  monkeypatch.setattr(clu, "metric_writers", fake, raising=False)
  logger = metrics.MetricsLogger(tmp_path, rounds=2, writer="clu")
  logger.write(2, {"train_loss": 1.5, "train_loss_per_worker": np.asarray([1.0, 2.0])})
  logger.write(4, {"train_loss": float("nan")})
  logger.close()
  (writer,) = made
  assert writer.logdir == str(tmp_path / "tensorboard") and writer.closed
  assert writer.rows[0] == (2, {"train_loss": 1.5, "train_loss_worker_0": 1.0,
                                "train_loss_worker_1": 2.0})
  assert writer.rows[1][0] == 4 and math.isnan(writer.rows[1][1]["train_loss"])
  assert writer.flushes == 2
  assert _rows(tmp_path) == [{"step": 2, "train_loss": 1.5, "train_loss_worker_0": 1.0,
                              "train_loss_worker_1": 2.0}, {"step": 4, "train_loss": "nan"}]
