"""Compressed training end to end: DDP + DeMo (DisTrO-style) and DiLoCo + int8 through the
runner, with the packed bytes in metrics.jsonl and summary.json."""

import json

import pytest

from lowcomm_jax import train


@pytest.mark.parametrize("algorithm,codec,extra", [
    ("ddp", "demo", {"compress.value_bits": 1, "optimizer.lr": 3e-3}),
    ("diloco", "int8", {}),
])
def test_compressed_run_learns_and_reports_packed_bytes(tmp_path, smoke_config, algorithm,
                                                       codec, extra):
  config = smoke_config(algorithm=algorithm, rounds=8, log_every=1, eval_every=8,
                        inner_steps=1 if algorithm == "ddp" else 2,
                        **{"compress.codec": codec, **extra})
  summary = train.run(config, tmp_path)
  lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert lines[-1]["train_loss"] < lines[0]["train_loss"]
  r = train.build(config)
  per_round = r.outer_bytes().sent
  assert summary["bytes_sent"] == per_round * 8 == lines[-1]["bytes_sent"]
  assert summary["compression_ratio"] == pytest.approx(r.param_bytes / per_round)
  assert summary["compression_ratio"] > (20 if codec == "demo" else 3)
  assert lines[0]["compression_ratio"] == summary["compression_ratio"]
  assert summary["codec"] == codec
