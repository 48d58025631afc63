"""Inner-step throughput and MFU (model FLOPs utilization) of one worker.

For one model, batch, sequence length and compute dtype it measures:
  peak    CPU: the measured float32 matmul rate (jitted a @ b on 2048 x 2048 matrices, 2n^3
          FLOPs each, best of several timed runs after warm-up). GPU: the datasheet bf16 dense
          peak of the device kind (table below); the measured bf16 matmul rate is shown beside it.
  bare    a hand-written jitted AdamW step (GPT, next_token_loss, the run's inner_optimizer)
          on pre-made random device batches, one call per step, after warm-up: the median
          rate over chunks of 10 steps, --steps in all (args donated on accelerators).
  runner  lowcomm_jax.train.run for one DiLoCo worker (inner_steps 10, no evaluation or
          checkpoints between rounds): the median steps_per_second of metrics.jsonl's rows
          after the first two rounds (which compile).
tokens/s = steps/s * batch * seq, MFU = tokens/s * train_flops_per_token / peak, with the
FLOPs of lowcomm_jax/model/flops.py (6N + 12 * n_layer * seq * d_model, causal mask not
discounted, as in PaLM and nanoGPT). On XLA:CPU the runner's H steps scanned in one program
run faster than one call per step (BENCHMARKS.md, framework overhead), so there the runner
may beat the bare step.

  python bench/mfu.py [--model tiny|small|gpt2_124m] [--dtype float32|bfloat16] [--batch N]
                      [--seq N] [--steps N] [--json PATH]
  python bench/mfu.py --model gpt2_124m --dtype bfloat16    # on a GPU
"""

import argparse
import json
import math
import os
import pathlib
import runpy
import statistics
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))
os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(os.environ["LOWCOMM_DATA_DIR"], "tiktoken"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from lowcomm_jax import optimizers, train  # noqa: E402
from lowcomm_jax.data import TOKENIZER_VOCAB  # noqa: E402
from lowcomm_jax.model import GPT, count_params, get_preset, next_token_loss  # noqa: E402
from lowcomm_jax.model.flops import train_flops_per_token  # noqa: E402

# Datasheet dense bf16 peaks (FLOP/s), matched in order against jax's device_kind.
DATASHEET_BF16 = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))
INNER_STEPS = 10  # the runner's H


def matmul_rate(dtype, n: int, calls: int, trials: int = 5) -> float:
  """Best FLOP/s of `calls` back-to-back n x n products, over `trials` timed runs."""
  ka, kb = jax.random.split(jax.random.key(0))
  a, b = jax.random.normal(ka, (n, n), dtype), jax.random.normal(kb, (n, n), dtype)
  matmul = jax.jit(lambda a, b: a @ b)
  jax.block_until_ready(matmul(a, b))  # compile
  best = 0.0
  for _ in range(trials):
    t0 = time.perf_counter()
    outs = [matmul(a, b) for _ in range(calls)]
    jax.block_until_ready(outs)
    best = max(best, 2 * n**3 * calls / (time.perf_counter() - t0))
  return best


def peak_flops() -> tuple[float, str, dict]:
  """(peak FLOP/s for MFU, where it comes from, measured matmul rates)."""
  if jax.default_backend() == "cpu":
    rate = matmul_rate(jnp.float32, 2048, calls=2)
    return rate, "measured float32 matmul 2048^2 (cpu)", {"matmul_float32": rate}
  kind = jax.devices()[0].device_kind
  measured = {"matmul_bfloat16": matmul_rate(jnp.bfloat16, 8192, calls=20)}
  for name, flops in DATASHEET_BF16:
    if name in kind:
      return flops, f"datasheet bf16 dense, {name} ({kind})", measured
  return measured["matmul_bfloat16"], f"measured bf16 matmul 8192^2 ({kind}: not in table)", measured


def bare_steps_per_second(cfg, config, batch: int, seq: int, steps: int) -> float:
  """One worker's jitted AdamW step on pre-made batches: no data pipeline, no outer step."""
  graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(config.seed)))
  tx = optimizers.inner_optimizer(config.optimizer, steps + 3)
  opt_state = tx.init(params)

  def step(params, opt_state, windows):
    loss, grads = jax.value_and_grad(
        lambda p: next_token_loss(nnx.merge(graphdef, p), windows))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  # Donation lets accelerators update params and optimizer state in place.
  step = jax.jit(step, donate_argnums=(0, 1) if jax.default_backend() != "cpu" else ())
  # A few distinct batches, so no step can reuse another's result.
  batches = [jax.random.randint(jax.random.key(i), (batch, seq + 1), 0, cfg.vocab_size)
             for i in range(4)]
  for i in range(3):  # compile and warm up
    params, opt_state, loss = step(params, opt_state, batches[i % 4])
  jax.block_until_ready((params, loss))
  # Timed in chunks of the runner's H steps; the median chunk, like the runner's median
  # round, shrugs off a chunk slowed by other work on the machine.
  rates = []
  for start in range(0, steps, INNER_STEPS):
    n = min(INNER_STEPS, steps - start)
    t0 = time.perf_counter()
    for i in range(start, start + n):
      params, opt_state, loss = step(params, opt_state, batches[i % 4])
    jax.block_until_ready((params, loss))
    rates.append(n / (time.perf_counter() - t0))
  return statistics.median(rates)


def runner_steps_per_second(config, steps: int) -> float:
  """train.run for one worker; the median steps/s of metrics.jsonl after two rounds."""
  config = config.copy_and_resolve_references()
  config.update(num_workers=1, algorithm="diloco", inner_steps=INNER_STEPS,
                rounds=2 + max(3, math.ceil(steps / INNER_STEPS)), eval_every=0,
                eval_batches=1, checkpoint_every=0, log_every=1)
  with tempfile.TemporaryDirectory(prefix="mfu_") as workdir:
    train.run(config, workdir)
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
  rows = [json.loads(line) for line in lines if line.strip()]
  rates = [row["steps_per_second"] for row in rows
           if "steps_per_second" in row and row.get("round", 0) > 2]
  if not rates:
    raise RuntimeError(f"no steps_per_second after round 2 in metrics.jsonl ({len(rows)} rows)")
  return statistics.median(rates)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default="tiny", choices=("tiny", "small", "gpt2_124m"))
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq", type=int, default=0, help="0: the preset's block_size")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--json", default="", help="also write the numbers to this file")
  args = p.parse_args()

  tokenizer = "gpt2" if args.model == "gpt2_124m" else "byte"
  cfg = get_preset(args.model, tokenizer_vocab=TOKENIZER_VOCAB[tokenizer], dtype=args.dtype)
  seq = args.seq or cfg.block_size
  config = runpy.run_path(str(REPO / "configs" / "base.py"))["get_config"]()
  config.model.name, config.model.dtype = args.model, args.dtype
  config.data.tokenizer, config.data.batch_size, config.data.seq_len = tokenizer, args.batch, seq
  flops_per_token = train_flops_per_token(cfg, seq)
  n_params = count_params(nnx.state(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))),
                                    nnx.Param))

  peak, peak_source, measured = peak_flops()
  result = {"model": args.model, "dtype": args.dtype, "batch": args.batch, "seq": seq,
            "params": n_params, "train_flops_per_token": flops_per_token,
            "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
            "peak_flops": peak, "peak_source": peak_source, **measured}
  rows = {"bare step": bare_steps_per_second(cfg, config, args.batch, seq, args.steps)}
  try:
    rows["runner"] = runner_steps_per_second(config, args.steps)
  except Exception as e:  # the benchmark still reports the bare step
    print(f"runner failed: {type(e).__name__}: {e}", file=sys.stderr)
    result["runner_error"] = f"{type(e).__name__}: {e}"

  print(f"\n{args.model} {args.dtype}: {n_params / 1e6:.2f}M params, batch {args.batch} x seq "
        f"{seq}, {flops_per_token / 1e6:.3g} MFLOP/token (train)")
  print(f"peak {peak / 1e12:.4g} TFLOP/s: {peak_source}")
  for name, rate in measured.items():
    print(f"  {name}: {rate / 1e12:.4g} TFLOP/s")
  print(f"{'':10} {'steps/s':>9} {'tokens/s':>11} {'TFLOP/s':>9} {'MFU':>7} {'vs bare':>8}")
  for name, steps_per_s in rows.items():
    tokens_per_s = steps_per_s * args.batch * seq
    key = name.replace(" ", "_")
    result.update({f"{key}_steps_per_s": steps_per_s, f"{key}_tokens_per_s": tokens_per_s,
                   f"{key}_mfu": tokens_per_s * flops_per_token / peak})
    ratio = steps_per_s / rows["bare step"]
    print(f"{name:10} {steps_per_s:9.3f} {tokens_per_s:11.0f} "
          f"{tokens_per_s * flops_per_token / 1e12:9.4f} {result[f'{key}_mfu']:7.2%} {ratio:8.2f}")
  if "runner" in rows:
    result["runner_vs_bare"] = rows["runner"] / rows["bare step"]
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
  main()
