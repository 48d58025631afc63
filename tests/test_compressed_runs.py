"""Compressed training end to end: DDP + DeMo (DisTrO-style) and DiLoCo + int8 through the
runner, with the packed bytes in metrics.jsonl and summary.json."""

import json
import math

import jax
import jax.numpy as jnp
import pytest

from conftest import all_gathered_bytes
from lowcomm_jax import compress
from lowcomm_jax.runtimes.spmd import train


def _tiny_shapes(m):
  """The tiny GPT's parameter shapes, written out from its preset (not read from the model)."""
  d, f = m.d_model, m.d_ff
  block = [(d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d,), (d,), (d, f), (f,), (f, d),
           (d,)]
  return block * m.n_layer + [(d,), (d,), (m.block_size, d), (m.vocab_size, d)]


def _int8_bytes(shapes):
  """int8 with one fp32 scale per row (last axis): a byte per entry, 4 per row."""
  total = 0
  for s in shapes:
    rows = s[0] if len(s) == 2 else 1
    total += rows * s[-1] + 4 * rows
  return total


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
  # Expected bytes without the ledger: every round each worker sends its packed payload once
  # (all-gathered). int8 from the shapes by hand; DeMo's by encoding a real tree.
  r = train.build(config)
  shapes = _tiny_shapes(r.model.cfg)
  assert sorted(shapes) == sorted(x.shape for x in jax.tree.leaves(r.model.layout.abstract))
  dense = 4 * sum(math.prod(s) for s in shapes)  # fp32
  if codec == "int8":
    per_round = _int8_bytes(shapes)
  else:
    tree = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), r.model.layout.abstract)
    tx = compress.make_codec(config.compress, lr=config.optimizer.lr)
    # One program (encoding op by op would compile each of its hundreds of ops)
    payload = jax.jit(lambda t: tx.encode(t, tx.init(t), jax.random.key(0))[0])(tree)
    per_round = sum(x.nbytes for x in jax.tree.leaves(payload))
  assert [l["bytes_sent"] for l in lines] == [per_round * (i + 1) for i in range(8)]
  assert summary["bytes_sent"] == per_round * 8
  assert summary["compression_ratio"] == pytest.approx(dense / per_round)
  assert summary["compression_ratio"] > (20 if codec == "demo" else 3)
  assert lines[0]["compression_ratio"] == summary["compression_ratio"]
  assert summary["codec"] == codec
  # And on the wire: the run's compiled sync all-gathers exactly the workers' payloads
  # (each device encodes its own; left to XLA, DeMo's chunk top-k gathered dense Δ).
  deltas, signals = r.abstract_sync_inputs(0)
  with jax.set_mesh(r.topology.mesh):
    hlo = jax.jit(r.programs.syncs[0], static_argnames="metrics").lower(
        r.state_spec.abstract, deltas, signals, metrics=False).compile().as_text()
  assert all_gathered_bytes(hlo) == config.num_workers * per_round


# A codec's error buffers (per worker) come back with the checkpoint: DiLoCo with
# error-feedback top-k, and Streaming DiLoCo with 4-bit per fragment, stopped after round 1
# with the last fragment's update in flight (τ = 1).
RESUMED = [("diloco", {"compress.codec": "topk"}),
           ("streaming", {"compress.codec": "int4", "inner_steps": 4, "streaming.fragments": 2,
                          "streaming.overlap_steps": 1, "streaming.mix": 0.5})]


@pytest.mark.parametrize("algorithm,extra", RESUMED, ids=[a for a, _ in RESUMED])
def test_a_compressed_run_resumes_exactly(tmp_path, smoke_config, algorithm, extra):
  import numpy as np
  from conftest import assert_run_resumes_exactly
  config = smoke_config(algorithm=algorithm, rounds=2, checkpoint_every=1, **extra)
  _, a = assert_run_resumes_exactly(config, tmp_path, stop_after_rounds=1)
  buffers = jax.tree.leaves(a.outer.per_worker)
  assert buffers and any(np.abs(np.asarray(x)).max() > 0 for x in buffers)  # a codec's memory
