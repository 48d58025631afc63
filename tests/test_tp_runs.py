"""Tensor parallelism inside DiLoCo/DDP workers, through the CLI: the command a user runs,
on 4 virtual devices of its own (the GSPMD partitioner it needs is scoped to the run,
model/tp.partitioner, so in-process runs would work too)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, xla_flags
from lowcomm_jax.config import check
from lowcomm_jax.runtimes.spmd import train


def _run(workdir, *overrides):
  env = dict(os.environ, XLA_FLAGS=xla_flags(4))
  proc = subprocess.run([sys.executable, "-m", "lowcomm_jax.main", "--config=configs/smoke.py",
                         f"--workdir={workdir}", *overrides], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads((workdir / "summary.json").read_text())


def test_standard_tp_matches_the_unsharded_run_and_reports_its_all_reduces(tmp_path,
                                                                          smoke_config):
  # 2 workers x 2 model shards = 4 devices; the same run without TP as the reference.
  sharded = _run(tmp_path / "tp", "--config.model.tp.size=2")
  plain = train.run(smoke_config(), tmp_path / "plain")
  assert sharded["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-4)
  # tiny: 2 blocks x 2 syncs; train step 2F + 1 (tests/model/test_tp.py derives it).
  assert sharded["tp_syncs_forward"] == 4 and sharded["tp_allreduces_train_step"] == 9
  assert sharded["tp_allgathers_train_step"] >= 1  # replicated params: sharded grads gathered
  assert "tp_syncs_forward" not in plain


@pytest.mark.parametrize("overrides,message", [
    ({"model.tp.size": 3}, "model.tp.size=3: must divide n_head=2"),
    ({"model.tp.size": 2, "model.tp.sync": "grouped", "model.tp.layers_per_group": 3},
     "model.tp.layers_per_group=3: must divide n_layer=2"),
    ({"model.tp.size": 2, "model.tp.sync": "selective", "model.tp.attn_sync_layers": (5,)},
     "layers [5] are outside 0..1"),
    ({"model.tp.size": 2, "model.dropout": 0.1}, "model.dropout=0.1: tensor-parallel"),
    ({"model.tp.size": 2, "model.dtype": "bfloat16"}, "model.dtype='bfloat16': tensor-parallel"),
    ({"model.tp.size": 2, "model.tp.sync": "spd", "model.tp.attn_sync_layers": (99,)},
     "only the 'selective' plan reads it"),
])
def test_bad_tp_plans_fail_at_start_up(smoke_config, overrides, message):
  with pytest.raises(check.ConfigError) as e:
    check.validate(smoke_config(**overrides), num_devices=8)
  assert message in str(e.value)
