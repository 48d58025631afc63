"""End to end: the CLI's outputs, exact resume, finished re-runs, divergence, bad configs."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO, checkpointed_state as _checkpointed_state, xla_flags
from lowcomm_jax.config import check
from lowcomm_jax.runtimes.spmd import train


def _main(*args, cwd=REPO):
  env = dict(os.environ, XLA_FLAGS=xla_flags(1))
  return subprocess.run([sys.executable, "-m", "lowcomm_jax.main", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=300)


def test_main_writes_tensorboard_jsonl_checkpoint_and_summary(tmp_path):
  workdir = tmp_path / "run"
  proc = _main("--config=configs/smoke.py", f"--workdir={workdir}", "--config.rounds=4")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
  lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [l["step"] for l in lines] == [2, 4, 6, 8]  # inner steps, H=2
  assert all({"train_loss", "tokens", "bytes_sent"} <= l.keys() for l in lines)
  assert "eval_loss" in lines[1] and "eval_loss" in lines[3]
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) \
      == [2, 4]
  summary = json.loads((workdir / "summary.json").read_text())
  for key in ("eval_loss", "tokens", "bytes_sent", "bytes_sent_ddp_equivalent", "wall_seconds"):
    assert key in summary
  assert summary["bytes_sent_ddp_equivalent"] == 2 * summary["bytes_sent"]  # H = 2
  assert summary["eval_loss"] < np.log(256)
  assert "DDP would have sent" in proc.stdout

  # Same command again: finishes at once, summary kept as it was.
  again = _main("--config=configs/smoke.py", f"--workdir={workdir}", "--config.rounds=4")
  assert again.returncode == 0
  assert json.loads((workdir / "summary.json").read_text()) == summary
  assert len((workdir / "metrics.jsonl").read_text().splitlines()) == 4
  # A larger `rounds` resumes from round 4 and only adds the new rounds.
  more = _main("--config=configs/smoke.py", f"--workdir={workdir}", "--config.rounds=6")
  assert more.returncode == 0, more.stderr[-3000:]
  steps = [json.loads(l)["step"] for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert steps == [2, 4, 6, 8, 10, 12]


def test_a_second_run_of_a_config_compiles_nothing(tmp_path):
  """JAX's persistent compilation cache, on by default in compile_cache_dir: the second run
  of the same config (in another workdir) loads every program (issue 28)."""
  cache = tmp_path / "cache"
  summaries = []
  for name in ("first", "second"):
    proc = _main("--config=configs/smoke.py", f"--workdir={tmp_path / name}",
                 "--config.rounds=2", f"--config.compile_cache_dir={cache}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries.append(json.loads((tmp_path / name / "summary.json").read_text()))
  first, second = summaries
  assert first["programs_compiled"] > 0 and first["programs_from_cache"] == 0
  assert second["programs_compiled"] == 0
  assert second["programs_from_cache"] == first["programs_compiled"]
  assert f"0 program(s) compiled, {first['programs_compiled']} loaded from the cache" in proc.stderr
  # (No wall-time comparison: on a loaded 2-core machine a second start of this tiny model
  # took 2.52 s against the first's 2.21 s. The start-up goal is timed in bench/.)
  assert second["eval_loss"] == first["eval_loss"]
  blocked = tmp_path / "a_file"
  blocked.write_text("")
  proc = _main("--config=configs/smoke.py", f"--workdir={tmp_path / 'third'}",
               f"--config.compile_cache_dir={blocked / 'cache'}")
  assert proc.returncode != 0
  assert f"compile_cache_dir='{blocked / 'cache'}': cannot create it" in proc.stderr


# one_step_delay with a codec: error buffers and the average in flight are resumed state,
# and rounds 2 and 4 run the overlapped program (round 1's and 3's syncs held into them).
@pytest.mark.parametrize("algorithm,codec", [("diloco", "none"), ("ddp", "none"),
                                             ("one_step_delay", "sparseloco")])
def test_resume_mid_run_is_bit_identical_to_an_uninterrupted_run(tmp_path, smoke_config,
                                                                 algorithm, codec):
  # With a codec the per-worker error-feedback buffers are part of the resumed state.
  config = smoke_config(algorithm=algorithm, rounds=4, checkpoint_every=2, **{
      "model.dropout": 0.1, "inner_steps": 1 if algorithm == "ddp" else 2,
      "compress.codec": codec})
  train.run(config, tmp_path / "straight")
  stopped = train.run(config, tmp_path / "resumed", stop_after_rounds=2)
  assert stopped == {"stopped_at_round": 2}
  train.run(config, tmp_path / "resumed")
  a, meta_a = _checkpointed_state(config, tmp_path / "straight")
  b, meta_b = _checkpointed_state(config, tmp_path / "resumed")
  assert int(a[0].round) == int(b[0].round) == 4
  jax.tree.map(np.testing.assert_array_equal, a, b)  # every leaf, bit for bit
  assert meta_a["streams"] == meta_b["streams"]
  # Logged curves agree too (all but the timing).
  def curves(workdir):
    lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in l.items() if k != "steps_per_second"} for l in lines]
  assert curves(tmp_path / "straight") == curves(tmp_path / "resumed")
  assert len(curves(tmp_path / "straight")) == 4


def test_divergence_stops_with_the_last_good_checkpoint_intact(tmp_path, smoke_config):
  config = smoke_config(rounds=2)
  train.run(config, tmp_path)
  good, _ = _checkpointed_state(config, tmp_path)
  exploding = smoke_config(rounds=4, resume_allow="outer.lr",
                           **{"outer.lr": 1e30})  # resume, then blow up
  with pytest.raises(train.TrainingDiverged, match="round 3.*last good checkpoint.*round 2"):
    train.run(exploding, tmp_path)
  after, _ = _checkpointed_state(config, tmp_path)
  assert int(after[0].round) == 2
  jax.tree.map(np.testing.assert_array_equal, good, after)
  # The CLI says the same in one line and exits 2, without a traceback.
  proc = _main("--config=configs/smoke.py", f"--workdir={tmp_path}", "--config.rounds=4",
               "--config.outer.lr=1e30", "--config.resume_allow=outer.lr")
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "non-finite training at round 3" in proc.stderr and "Traceback" not in proc.stderr


def test_divergence_on_a_round_that_logs_nothing_is_caught_before_the_next_checkpoint(
    tmp_path, smoke_config):
  """Rounds that neither log, evaluate nor checkpoint skip θ's norm: an exploded θ after
  round 3 shows as round 4's non-finite loss, before round 4's checkpoint is written."""
  config = smoke_config(rounds=2)
  train.run(config, tmp_path)
  good, _ = _checkpointed_state(config, tmp_path)
  exploding = smoke_config(rounds=4, log_every=100, eval_every=0, resume_allow="outer.lr",
                           **{"outer.lr": 1e30})
  with pytest.raises(train.TrainingDiverged, match="round 4.*last good checkpoint.*round 2"):
    train.run(exploding, tmp_path)
  after, _ = _checkpointed_state(config, tmp_path)
  assert int(after[0].round) == 2
  jax.tree.map(np.testing.assert_array_equal, good, after)


def test_rounds_without_metrics_train_the_same_and_only_due_rounds_are_logged(
    tmp_path, smoke_config):
  fields = {"rounds": 4, "eval_every": 0, "checkpoint_every": 0}
  every, sparse = smoke_config(**fields), smoke_config(log_every=3, **fields)
  a, b = train.run(every, tmp_path / "every"), train.run(sparse, tmp_path / "sparse")
  assert a["eval_loss"] == b["eval_loss"]
  jax.tree.map(np.testing.assert_array_equal, _checkpointed_state(every, tmp_path / "every"),
               _checkpointed_state(sparse, tmp_path / "sparse"))
  # Rounds 1-2 computed no metrics; 3 (log_every) and 4 (the last) logged theirs in full.
  rows = [json.loads(line)
          for line in (tmp_path / "sparse" / "metrics.jsonl").read_text().splitlines()]
  assert [row["round"] for row in rows] == [3, 4]
  assert all(np.isfinite(row["param_norm"]) and "train_loss_worker_1" in row for row in rows)


BAD_CONFIGS = [
    ({"algorithm": "fedavg"}, "algorithm='fedavg'"),
    ({"inner_steps": 0}, "inner_steps=0: H must be >= 1"),
    ({"algorithm": "ddp", "inner_steps": 5}, "set --config.inner_steps=1"),
    ({"num_workers": 3, "mesh.replica": 2}, "num_workers=3: must be a multiple of mesh.replica"),
    ({"mesh.replica": 16}, "only 8 devices"),
    ({"mesh.data": 3}, "data.batch_size=4: must be divisible by mesh.data=3"),
    ({"data.seq_len": 65}, "data.seq_len=65: must be in [1, 64]"),
    ({"data.tokenizer": "sentencepiece"}, "data.tokenizer='sentencepiece'"),
    ({"data.batch_mode": "mixed"}, "data.batch_mode='mixed'"),
    ({"model.vocab_size": 100}, "model.vocab_size=100"),
    ({"compress.codec": "zip"}, "compress.codec='zip': use one of"),
    ({"compress.codec": "demo", "compress.value_bits": 2}, "compress.value_bits=2: demo sends"),
    ({"compress.density": 0.0}, "compress.density=0.0: must be in (0, 1]"),
    ({"compress.codec": "demo"}, "algorithm='diloco': compress.codec=demo is a per-step "
                                 "optimizer"),
    ({"compress.mean_over_senders": True, "aggregate.weighting": "tokens"},
     "compress.mean_over_senders=True: averaging over senders replaces"),
    ({"compress.codec": "fp8", "compress.stochastic_rounding": True},
     "compress.stochastic_rounding=True"),
]


@pytest.mark.parametrize("overrides,message", BAD_CONFIGS)
def test_bad_config_names_field_and_fix(smoke_config, overrides, message):
  with pytest.raises(check.ConfigError) as e:
    check.validate(smoke_config(**overrides), num_devices=8)
  assert message in str(e.value)


def test_cli_reports_bad_config_and_missing_corpus_without_a_traceback(tmp_path):
  proc = _main("--config=configs/smoke.py", f"--workdir={tmp_path}", "--config.inner_steps=0")
  assert proc.returncode == 2
  assert "inner_steps=0: H must be >= 1" in proc.stderr and "Traceback" not in proc.stderr
  proc = _main("--config=configs/smoke.py", f"--workdir={tmp_path}",
               f"--config.data.path={tmp_path}/missing.txt")
  assert proc.returncode == 2
  assert "no such file or folder" in proc.stderr and "Traceback" not in proc.stderr
  assert not (tmp_path / "checkpoints").exists()  # failed before any work
