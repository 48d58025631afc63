"""Framework overhead: the DiLoCo runner's inner-step throughput vs a bare jax.jit AdamW step.

Both train the same model on the same batch shape in the same process. The bare baselines
are hand-written `jax.jit` AdamW steps fed pre-made device batches (no data pipeline, no
outer step): one call per step, and the same step scanned H times per call. The runner is measured as train.run drives it: grain batches
for a round, device_put, the jitted local program (H scanned inner steps) and the jitted
outer step, metrics read one round late. Runs alternate (bare, runner, bare, ...) and the median of each is reported.

  python bench/overhead.py [--model small] [--inner_steps 20] [--rounds 6] [--repeats 3]

Writes bench/results/overhead.json. Target: runner / (faster bare loop) >= 0.97.
"""

import argparse
import json
import os
import pathlib
import runpy
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from lowcomm_jax.programs import optimizers  # noqa: E402
from lowcomm_jax.runtimes.spmd import train
from lowcomm_jax.model import next_token_loss  # noqa: E402


def bare_steps_per_second(r, config, batches_HxBxL1, rounds: int) -> dict[str, float]:
  """Hand-written AdamW training of the same model, two ways a user would write it.

  'per_step': one jitted value_and_grad + optax step per call (the textbook loop);
  'scanned': the same step under lax.scan, H steps per jitted call (the fast way on CPU,
  where each executable launch costs milliseconds). Both donate params and optimizer state
  and read pre-made device batches.
  """
  tx = optimizers.inner_optimizer(config.optimizer, config.rounds * config.inner_steps)
  h = len(batches_HxBxL1)

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(
        lambda p: next_token_loss(nnx.merge(r.model.graphdef, p), batch))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def scanned(params, opt_state, batches):
    def body(carry, batch):
      params, opt_state, loss = step(*carry, batch)
      return (params, opt_state), loss
    (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), batches)
    return params, opt_state, losses

  per_step, scan = (jax.jit(f, donate_argnums=(0, 1)) for f in (step, scanned))
  batch_list, stacked = list(batches_HxBxL1), jnp.stack(list(batches_HxBxL1))
  out = {}
  for name, fn, calls, arg in (("per_step", per_step, rounds * h, lambda i: batch_list[i % h]),
                               ("scanned", scan, rounds, lambda i: stacked)):
    # The model's tree.
    params = jax.jit(lambda: r.model.layout.unravel(r.state_spec.initial_params()))()
    opt_state = tx.init(params)
    params, opt_state, loss = fn(params, opt_state, arg(0))  # compile
    jax.block_until_ready(loss)
    t0 = time.perf_counter()
    for i in range(calls):
      params, opt_state, loss = fn(params, opt_state, arg(i))
    jax.block_until_ready(loss)
    out[name] = rounds * h / (time.perf_counter() - t0)
  return out


def runner_steps_per_second(r, config, rounds: int) -> float:
  """Inner steps per second per worker, driving the jitted round as train.run does with
  log_every=1 (metrics every round, read a round late)."""
  fns = train.jitted_steps(r)
  inner_steps = [config.inner_steps]  # H per host (one host)
  state, workers = train.init_run(r, fns)
  state, workers, metrics, _ = train.train_round(
      r, fns, state, workers, [r.data.streams[0].next_round(config.inner_steps)],
      inner_steps)  # compile
  jax.block_until_ready(metrics)
  t0 = time.perf_counter()
  pending = None
  for _ in range(rounds):
    batches = [r.data.streams[0].next_round(config.inner_steps)]
    state, workers, metrics, _ = train.train_round(r, fns, state, workers, batches, inner_steps)
    if pending is not None:
      jax.device_get(pending)  # the runner's one-round-late metrics read
    pending = metrics
  jax.device_get(pending)
  return rounds * config.inner_steps / (time.perf_counter() - t0)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="small")
  p.add_argument("--inner_steps", type=int, default=20)
  p.add_argument("--rounds", type=int, default=6)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--batch_size", type=int, default=16)
  p.add_argument("--seq_len", type=int, default=128)
  p.add_argument("--dtype", default="float32")
  args = p.parse_args()

  config = runpy.run_path(str(REPO / "configs" / "base.py"))["get_config"]()
  config.num_workers = 1
  config.inner_steps = args.inner_steps
  config.rounds = args.rounds
  config.model.name = args.model
  config.model.dtype = args.dtype
  config.data.batch_size = args.batch_size
  config.data.seq_len = args.seq_len
  r = train.build(config)
  bare_batches = [jax.device_put(b)  # [H, B, L+1]
                  for b in r.data.streams[0].next_round(args.inner_steps)[0]]

  per_step, scanned, runner = [], [], []
  for _ in range(args.repeats):
    bare = bare_steps_per_second(r, config, bare_batches, args.rounds)
    per_step.append(bare["per_step"])
    scanned.append(bare["scanned"])
    runner.append(runner_steps_per_second(r, config, args.rounds))
  result = {
      "model": args.model, "dtype": args.dtype, "backend": jax.default_backend(),
      "device": str(jax.devices()[0].device_kind), "batch_size": args.batch_size,
      "seq_len": args.seq_len, "inner_steps": args.inner_steps, "rounds": args.rounds,
      "runner_steps_per_s": statistics.median(runner),
      "bare_per_step_steps_per_s": statistics.median(per_step),
      "bare_scanned_steps_per_s": statistics.median(scanned),
      "runner_all": runner, "bare_per_step_all": per_step, "bare_scanned_all": scanned,
  }
  # The target compares against the faster of the two hand-written loops.
  result["ratio"] = result["runner_steps_per_s"] / max(result["bare_per_step_steps_per_s"],
                                                       result["bare_scanned_steps_per_s"])
  result["tokens_per_s_runner"] = result["runner_steps_per_s"] * args.batch_size * args.seq_len
  out = REPO / "bench" / "results" / "overhead.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2) + "\n")
  json.dump(result, sys.stdout, indent=2)
  print()


if __name__ == "__main__":
  main()
