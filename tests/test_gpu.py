"""GPU-only checks, skipped with the reason elsewhere: the rest of the suite runs on the CPU
backend even on a GPU host (conftest), so what only a GPU does is checked here: the suite's
own set-up, donation, a run's numerics within a GPU tolerance, the attention kernel picked.

The runs go to a child process with JAX_PLATFORMS=cuda: a run's mesh is over jax.devices(),
the default backend's, which is the CPU in the suite's processes."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO, TEST_PLATFORMS, requires_gpu, xla_flags

pytestmark = requires_gpu

# A round of the smoke run moves its eval loss by 6% (4.949 after 3 rounds, 4.642 after 4);
# on CPU, XLA's fast and default compilations agree to 3e-7. On a GPU, XLA may run float32
# dots in TF32 (unit roundoff 2^-11 = 4.9e-4) and reduces in other orders: a few TF32 units.
GPU_RTOL = 2e-3

_DONATION = """
import json, runpy, jax
from lowcomm_jax.runtimes.spmd import train
r = train.build(runpy.run_path("configs/smoke.py")["get_config"]())
fns = train.jitted_steps(r)  # donation left to the default: on off the CPU
with r.partitioner():
  state, workers = train.init_run(r, fns)
  H = [h.inner_steps for h in r.topology.hosts]
  for _ in range(2):  # the second round reads only what the first returned
    batches = [s.next_round(h) for s, h in zip(r.data.streams, H)]
    old_state, old_workers = state, workers
    state, workers, metrics, _ = train.train_round(r, fns, state, workers, batches, H)
deleted = lambda tree: [x.is_deleted() for x in jax.tree.leaves(tree)]
print(json.dumps({"backend": jax.default_backend(), "workers": deleted(old_workers),
                  "state": deleted(old_state), "loss": float(metrics["train_loss"])}))
"""


def _gpu_env(**extra) -> dict:
  """A child's environment on the GPU alone, compiled as a user's run is (no XLA_FLAGS)."""
  return dict(os.environ, JAX_PLATFORMS="cuda", XLA_FLAGS="", **extra)


def test_the_suite_runs_on_the_cpu_and_reaches_the_gpu():
  if not TEST_PLATFORMS.startswith("cpu"):
    pytest.skip(f"JAX_PLATFORMS={TEST_PLATFORMS!r} was set: the suite runs where it says")
  assert jax.default_backend() == "cpu" and jax.device_count() == 8  # conftest's host devices
  assert jax.devices("cuda")[0].platform == "gpu"
  assert os.environ["JAX_PLATFORMS"] == "cpu"  # what the processes the tests start see


def test_the_local_program_and_the_sync_consume_the_states_they_are_given_on_the_gpu():
  """jitted.jitted_steps donates off the CPU (half the peak memory): the worker states a local
  program took and the state a sync took are deleted, and the run goes on from what they
  returned."""
  proc = subprocess.run([sys.executable, "-c", _DONATION], cwd=REPO, env=_gpu_env(),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["backend"] == "gpu"
  assert out["workers"] and all(out["workers"])
  assert out["state"] and all(out["state"])
  assert np.isfinite(out["loss"]) and out["loss"] < np.log(256)


def test_a_smoke_run_on_the_gpu_ends_at_the_cpu_loss_within_the_gpu_tolerance(tmp_path):
  """The CLI's smoke run, 4 rounds, on the GPU and on one CPU device: the same eval loss to
  GPU_RTOL (it donates and the CPU run does not, so the run loop reads no consumed state)."""
  summaries = {}
  for platform, env in (("cuda", _gpu_env()),
                        ("cpu", dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1)))):
    workdir = tmp_path / platform
    proc = subprocess.run([sys.executable, "-m", "lowcomm_jax.main", "--config=configs/smoke.py",
                           f"--workdir={workdir}", "--config.rounds=4"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summaries[platform] = json.loads((workdir / "summary.json").read_text())
  gpu, cpu = summaries["cuda"]["eval_loss"], summaries["cpu"]["eval_loss"]
  assert gpu == pytest.approx(cpu, rel=GPU_RTOL), (gpu, cpu)
  assert gpu < np.log(256) - 0.5  # it trained


def test_cudnn_attention_is_the_kernel_compiled_and_agrees_with_xla():
  """model.attention='cudnn' on an NVIDIA GPU compiles cuDNN's fused flash attention, forward
  and backward (the custom calls of jax/_src/cudnn/fused_attention_stablehlo.py), which
  'auto' picks for this model there; its loss and gradient agree with XLA's attention in
  bfloat16."""
  from flax import nnx
  from lowcomm_jax.model import GPT, attention, get_preset, next_token_loss
  cfg = get_preset("tiny", vocab_size=256, dtype="bfloat16")  # head dim 16: a multiple of 8
  assert attention.resolve("auto", cfg.dtype, cfg.head_dim, "cuda")[0] == "cudnn"
  gpu = jax.devices("cuda")[0]
  windows = jax.random.randint(jax.random.key(0), (4, cfg.block_size + 1), 0, 256)

  def compiled(implementation):
    graphdef, params = nnx.split(GPT(dataclasses.replace(cfg, attention=implementation),
                                     rngs=nnx.Rngs(0)))
    args = jax.device_put((params, windows), gpu)  # the program runs where its inputs are
    program = jax.jit(jax.value_and_grad(
        lambda p, w: next_token_loss(nnx.merge(graphdef, p), w))).lower(*args).compile()
    targets = re.findall(r'custom_call_target="([^"]*)"', program.as_text())
    return [t for t in targets if "cudnn" in t and "fmha" in t], program(*args)

  fused, (loss, grads) = compiled("cudnn")
  assert any("Backward" in t for t in fused) and any("Backward" not in t for t in fused), fused
  plain, (xla_loss, xla_grads) = compiled("xla")
  assert not plain, plain
  # bfloat16 keeps 8 bits (2^-8 = 3.9e-3); its gradient is 1% off float32's on this model.
  np.testing.assert_allclose(float(loss), float(xla_loss), rtol=4e-3)
  a, b = [np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(g)])
          for g in (grads, xla_grads)]
  assert np.linalg.norm(a - b) / np.linalg.norm(b) < 5e-2
