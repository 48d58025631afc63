"""Inner-step throughput and MFU (model FLOPs utilization) of one worker, by variant.

For one model, batch, sequence length and compute dtype, one row per variant (--variants):
  configured    the bare step: a hand-written jitted AdamW step (GPT, next_token_loss, the run's
                inner_optimizer), the model settled as assemble/build.py settles it on this backend
                (model.attention 'auto' through attention.resolve, model.loss_chunk 0 through
                cross_entropy.chunk_of), one call per step on pre-made random device batches.
  xla, cudnn    the same step with that attention kernel; cudnn only where
                attention.cudnn_problem is None, else a row "n/a: <reason>".
  plain_loss    the same step with loss_chunk 0 (whole-sequence float32 logits).
  no_optimizer  value_and_grad only (forward + backward, no AdamW update).
  forward       the loss only; its TFLOP/s and MFU count forward FLOPs (train FLOPs / 3).
  scanned       H = 10 configured steps under one lax.scan per call (at least 3 calls timed):
                the runner's inner program without the runner's host work.
  runner        lowcomm_jax.runtimes.spmd.train.run, one DiLoCo worker (inner_steps 10, model.attention and
                loss_chunk auto, no evaluation or checkpoints between rounds): the median
                steps_per_second of metrics.jsonl after the first two rounds (which compile).
                If it fails, its error is reported and the bare rows kept.
A variant whose program is the configured one (xla on CPU, plain_loss in float32) is not timed
again: its row says so. Each bare variant is compiled ahead (jit lower/compile), warmed up,
then timed as the median rate over chunks of 10 steps, --steps in all (params and optimizer
state donated on accelerators). Beside it: XLA's memory_analysis of the compiled program
(temporaries, arguments; CPU too); on GPUs the JSON also has the device's peak_bytes_in_use
after each variant (a running peak over the process: it cannot be reset).

Peaks: the datasheet bf16 dense peak of the device kind (DATASHEET_BF16; "n/a" on CPU and on
kinds not in it) and the measured matmul rate (jitted a @ b, bf16 8192^2 on GPUs, float32
2048^2 on CPU, 2n^3 FLOPs each, best of several timed runs after warm-up). MFU is given
against both ("MFU": the datasheet's; "MFU msr": the measured peak's); the JSON's `mfu` is the
datasheet's where there is one. tokens/s = steps/s * batch * seq, MFU = tokens/s * FLOPs per
token / peak, FLOPs from lowcomm_jax/model/flops.py (train: 6N + 12 * n_layer * seq *
d_model, causal mask not discounted, as PaLM and nanoGPT). "vs conf": steps/s over the
configured bare step's; the runner's is issue 28's "runner >= 0.97x bare" goal. On XLA:CPU
H steps scanned in one program beat one call per step (BENCHMARKS.md, framework overhead),
so there scanned and the runner may beat the bare step.

  python bench/mfu.py [--model tiny|small|gpt2_124m] [--dtype float32|bfloat16] [--batch N]
                      [--seq N] [--steps N] [--variants configured,cudnn,...] [--json PATH]
  bash bench/gpu_goals.sh [OUT_DIR]    # on a GPU: gpt2_124m bf16 at batch 16 and 64
"""

import argparse
import dataclasses
import json
import math
import os
import pathlib
import runpy
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))
os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(os.environ["LOWCOMM_DATA_DIR"], "tiktoken"))

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from lowcomm_jax.report import read_metrics  # noqa: E402
from lowcomm_jax.programs import optimizers  # noqa: E402
from lowcomm_jax.runtimes.spmd import train
from lowcomm_jax.data import TOKENIZER_VOCAB  # noqa: E402
from lowcomm_jax.model import GPT, count_params, get_preset, next_token_loss  # noqa: E402
from lowcomm_jax.model import attention  # noqa: E402
from lowcomm_jax.model.cross_entropy import chunk_of  # noqa: E402
from lowcomm_jax.model.flops import forward_flops_per_token, train_flops_per_token  # noqa: E402

# Datasheet dense bf16 peaks (FLOP/s), matched in order against jax's device_kind.
DATASHEET_BF16 = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))
INNER_STEPS = 10  # the runner's H
# name: (label, mode). Modes: train (AdamW step), grad (value_and_grad), forward (loss),
# scanned (H train steps in one lax.scan), runner (train.run).
VARIANTS = {"configured": ("as configured", "train"), "xla": ("attention=xla", "train"),
            "cudnn": ("attention=cudnn", "train"), "plain_loss": ("plain loss", "train"),
            "no_optimizer": ("no optimizer", "grad"), "forward": ("forward only", "forward"),
            "scanned": ("scanned (H per call)", "scanned"), "runner": ("runner", "runner")}


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


def peaks() -> dict:
  """The datasheet peak (None where unknown) and the measured matmul rate, with sources."""
  kind = jax.devices()[0].device_kind
  if jax.default_backend() == "cpu":
    measured, source = matmul_rate(jnp.float32, 2048, calls=2), "float32 matmul 2048^2"
  else:
    measured, source = matmul_rate(jnp.bfloat16, 8192, calls=20), "bf16 matmul 8192^2"
  sheet = [(name, flops) for name, flops in DATASHEET_BF16
           if name in kind and jax.default_backend() != "cpu"][:1]
  return {"peak_datasheet": sheet[0][1] if sheet else None,
          "peak_datasheet_source": f"bf16 dense, {sheet[0][0]}" if sheet else "n/a",
          "peak_measured": measured, "peak_measured_source": source}


def memory_of(compiled) -> dict:
  """XLA's own count of a compiled program's memory, in bytes ({} where unsupported)."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001  not every backend implements it
    return {}
  return {} if m is None else {
      "temp_bytes": m.temp_size_in_bytes, "argument_bytes": m.argument_size_in_bytes,
      "output_bytes": m.output_size_in_bytes, "alias_bytes": m.alias_size_in_bytes}


def bare_step(cfg, config, total_steps: int):
  """(params, tx, loss_of, train_step) of the bare step: the GPT of `cfg` seeded with
  config.seed, the run's inner optimizer over `total_steps`, loss_of(params, windows), and
  train_step((params, opt_state), windows) -> (state, loss), to be jitted by the caller
  (bench/tier_memory.py compiles the same step per tier)."""
  graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(config.seed)))
  tx = optimizers.inner_optimizer(config.optimizer, total_steps)
  loss_of = lambda p, windows: next_token_loss(nnx.merge(graphdef, p), windows)  # noqa: E731

  def train_step(state, windows):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_of)(params, windows)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return params, tx, loss_of, train_step


def bare_variant(cfg, config, mode: str, batch: int, seq: int, steps: int) -> tuple[float, dict]:
  """(steps/s, compiled memory) of one bare variant (`mode`: train, grad, forward, scanned)
  on pre-made batches: no data pipeline, no outer step."""
  params, tx, loss_of, train_step = bare_step(cfg, config, steps + 4 * INNER_STEPS)

  # A few distinct batches, so no step can reuse another's result.
  batches = [jax.random.randint(jax.random.key(i), (batch, seq + 1), 0, cfg.vocab_size)
             for i in range(4)]
  per_call = INNER_STEPS if mode == "scanned" else 1
  if mode == "scanned":  # [H, batch, seq + 1] per call, as the runner feeds its inner scan
    batches = [jnp.stack([batches[(i + j) % 4] for j in range(INNER_STEPS)]) for i in range(2)]
  if mode in ("grad", "forward"):  # params are read, not updated: nothing to carry or donate
    fn = jax.value_and_grad(loss_of) if mode == "grad" else loss_of
    step = jax.jit(fn).lower(params, batches[0]).compile()
    # The loss alone is kept: the gradients are freed once their call is done.
    run = (lambda i: step(params, batches[i % 4])[0]) if mode == "grad" else (
        lambda i: step(params, batches[i % 4]))
  else:
    fn = train_step if mode == "train" else (lambda s, w: jax.lax.scan(train_step, s, w))
    state = [(params, tx.init(params))]
    # Donation lets accelerators update params and optimizer state in place.
    donate = (0,) if jax.default_backend() != "cpu" else ()
    step = jax.jit(fn, donate_argnums=donate).lower(state[0], batches[0]).compile()

    def run(i):
      state[0], loss = step(state[0], batches[i % len(batches)])
      return loss
  calls, chunk = math.ceil(steps / per_call), max(1, INNER_STEPS // per_call)
  if mode == "scanned":  # at least 3 timed calls, as the runner times at least 3 rounds
    calls = max(3, calls)
  jax.block_until_ready([run(i) for i in range(max(1, 3 // per_call))])  # warm up
  # Timed in chunks of the runner's H steps; the median chunk, like the runner's median
  # round, shrugs off a chunk slowed by other work on the machine. Every call's loss is
  # waited for: calls with no data between them may run concurrently on XLA:CPU.
  rates = []
  for start in range(0, calls, chunk):
    n = min(chunk, calls - start)
    t0 = time.perf_counter()
    jax.block_until_ready([run(i) for i in range(start, start + n)])
    rates.append(n * per_call / (time.perf_counter() - t0))
  return statistics.median(rates), memory_of(step)


def bare_steps_per_second(cfg, config, batch: int, seq: int, steps: int) -> float:
  """The bare AdamW step's steps/s for `cfg` as given (bench/data_speed.py uses it)."""
  return bare_variant(cfg, config, "train", batch, seq, steps)[0]


def runner_steps_per_second(config, steps: int) -> float:
  """train.run for one worker; the median steps/s of metrics.jsonl after two rounds."""
  config = config.copy_and_resolve_references()
  config.update(num_workers=1, algorithm="diloco", inner_steps=INNER_STEPS,
                rounds=2 + max(3, math.ceil(steps / INNER_STEPS)), eval_every=0,
                eval_batches=1, checkpoint_every=0, log_every=1)
  with tempfile.TemporaryDirectory(prefix="mfu_") as workdir:
    train.run(config, workdir)
    rows = read_metrics(workdir)
  rates = [row["steps_per_second"] for row in rows
           if "steps_per_second" in row and row.get("round", 0) > 2]
  if not rates:
    raise RuntimeError(f"no steps_per_second after round 2 in metrics.jsonl ({len(rows)} rows)")
  return statistics.median(rates)


def _pct(x) -> str:
  return "n/a" if x is None else f"{x:.1%}"


def _mib(row: dict, key: str) -> str:
  return f"{row['memory'][key] / 2**20:.1f}" if key in row.get("memory", {}) else ""


def git_commit() -> dict:
  """HEAD and whether tracked files differ from it (None outside a git checkout)."""
  git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True,  # noqa: E731
                                  text=True, check=True).stdout.strip()
  try:
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain",
                                                                  "--untracked-files=no"))}
  except (OSError, subprocess.CalledProcessError):
    return {"commit": None, "dirty": None}


def rates(rows: dict, flops: dict, tokens_per_step: int, pk: dict):
  """Adds each measured row's rates, MFUs and its ratio to the configured bare step."""
  base = rows.get("configured", {}).get("steps_per_s")
  sheet, measured = pk["peak_datasheet"], pk["peak_measured"]
  for name, row in rows.items():
    if "steps_per_s" in row:
      flop = row["steps_per_s"] * tokens_per_step * flops[
          "forward" if VARIANTS[name][1] == "forward" else "train"]
      row.update(label=VARIANTS[name][0], ms_per_step=1e3 / row["steps_per_s"],
                 tokens_per_s=row["steps_per_s"] * tokens_per_step, tflops=flop / 1e12,
                 mfu_datasheet=flop / sheet if sheet else None, mfu_measured=flop / measured,
                 mfu=flop / (sheet or measured),
                 vs_as_configured=row["steps_per_s"] / base if base else None)


def report(r: dict):
  print(f"\n{r['model']} {r['dtype']} on {r['device']} ({r['platform']}, jax {r['jax']}): "
        f"{r['params'] / 1e6:.2f}M params, batch {r['batch']} x seq {r['seq']}, "
        f"{r['train_flops_per_token'] / 1e6:.3g} MFLOP/token (train)")
  chunk = r["loss_chunk"]
  print(f"as configured: attention {r['attention']} ({r['attention_why']}); loss_chunk {chunk}"
        + ("" if 0 < chunk < r["seq"] else ": the plain whole-sequence loss"))
  sheet = r["peak_datasheet"]
  print("peak (datasheet): " + (f"{sheet / 1e12:.4g} TFLOP/s, {r['peak_datasheet_source']}"
                                if sheet else f"n/a ({r['device']})"))
  print(f"peak (measured):  {r['peak_measured'] / 1e12:.4g} TFLOP/s, "
        f"{r['peak_measured_source']}")
  print(f"{'variant':21} {'ms/step':>8} {'steps/s':>8} {'tokens/s':>10} {'TFLOP/s':>8} "
        f"{'MFU':>6} {'MFU msr':>7} {'vs conf':>7} {'temp MiB':>8} {'args MiB':>8}")
  for name, row in r["rows"].items():
    label = VARIANTS[name][0]
    if "na" in row:
      print(f"{label:21} n/a: {row['na']}")
      continue
    vs = f"{row['vs_as_configured']:.2f}" if row["vs_as_configured"] else ""
    same = "  (= as configured)" if "same_as" in row else ""
    print(f"{label:21} {row['ms_per_step']:8.1f} {row['steps_per_s']:8.2f} "
          f"{row['tokens_per_s']:10.0f} {row['tflops']:8.4g} {_pct(row['mfu_datasheet']):>6} "
          f"{_pct(row['mfu_measured']):>7} {vs:>7} {_mib(row, 'temp_bytes'):>8} "
          f"{_mib(row, 'argument_bytes'):>8}{same}")
  if "forward" in r["rows"]:
    print("forward only: TFLOP/s and MFU of forward FLOPs (train / 3)")


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default="tiny", choices=("tiny", "small", "gpt2_124m"))
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq", type=int, default=0, help="0: the preset's block_size")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--variants", default=",".join(VARIANTS),
                 help=f"comma-separated subset of {','.join(VARIANTS)} (default: all)")
  p.add_argument("--json", default="", help="also write the numbers to this file")
  args = p.parse_args()
  asked = [v.strip() for v in args.variants.split(",") if v.strip()]
  if unknown := [v for v in asked if v not in VARIANTS]:
    p.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
  chosen = [v for v in VARIANTS if v in asked]  # the configured step first: the others' ratio

  tokenizer = "gpt2" if args.model == "gpt2_124m" else "byte"
  preset = get_preset(args.model, tokenizer_vocab=TOKENIZER_VOCAB[tokenizer], dtype=args.dtype)
  seq = args.seq or preset.block_size
  config = runpy.run_path(str(REPO / "configs" / "base.py"))["get_config"]()
  config.model.name, config.model.dtype = args.model, args.dtype
  config.data.tokenizer, config.data.batch_size, config.data.seq_len = tokenizer, args.batch, seq
  # As assemble/build.py's _runtime_choices settles the model for this backend.
  where = attention.platform()
  impl, why = attention.resolve(config.model.attention, args.dtype, preset.head_dim, where)
  cfg = dataclasses.replace(preset, attention=impl,
                            loss_chunk=chunk_of(config.model.loss_chunk, args.dtype))
  cfgs = {"xla": dataclasses.replace(cfg, attention="xla"),
          "cudnn": dataclasses.replace(cfg, attention="cudnn"),
          "plain_loss": dataclasses.replace(cfg, loss_chunk=0)}
  cudnn_problem = attention.cudnn_problem(args.dtype, preset.head_dim, where)
  flops = {"train": train_flops_per_token(cfg, seq), "forward": forward_flops_per_token(cfg, seq)}
  n_params = count_params(nnx.state(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))),
                                    nnx.Param))

  def program(c):  # what decides the compiled program: a chunk >= seq runs the plain loss
    return c.attention, c.loss_chunk if 0 < c.loss_chunk < seq else 0

  pk = peaks()
  result = {"model": args.model, "dtype": args.dtype, "batch": args.batch, "seq": seq,
            "params": n_params, "train_flops_per_token": flops["train"],
            "forward_flops_per_token": flops["forward"], "attention": impl,
            "attention_why": why, "loss_chunk": cfg.loss_chunk, "steps": args.steps,
            "backend": jax.default_backend(), "platform": where,
            "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "flax": flax.__version__, **git_commit(), **pk, "rows": {}}
  rows = result["rows"]
  for name in chosen:
    label, mode = VARIANTS[name]
    c = cfgs.get(name, cfg)
    if name == "cudnn" and cudnn_problem:
      rows[name] = {"na": cudnn_problem}
    elif name in cfgs and "configured" in rows and program(c) == program(cfg):
      rows[name] = {**rows["configured"], "same_as": "configured"}
    elif mode == "runner":
      try:
        rows[name] = {"steps_per_s": runner_steps_per_second(config, args.steps)}
      except Exception as e:  # noqa: BLE001  the benchmark still reports the bare rows
        print(f"runner failed: {type(e).__name__}: {e}", file=sys.stderr)
        rows[name] = {"na": f"failed: {type(e).__name__}: {e}"}
    else:
      try:
        rate, memory = bare_variant(c, config, mode, args.batch, seq, args.steps)
      except jax.errors.JaxRuntimeError as e:  # e.g. XLA attention at batch 64 on an H200
        if "RESOURCE_EXHAUSTED" not in str(e):
          raise
        print(f"{name}: out of device memory", file=sys.stderr)
        rows[name] = {"na": "out of device memory"}
        continue
      rows[name] = {"steps_per_s": rate, "memory": memory}
      stats = jax.devices()[0].memory_stats() or {}
      if "peak_bytes_in_use" in stats:  # a running peak: XLA cannot reset it
        rows[name]["device_peak_bytes_in_use_so_far"] = stats["peak_bytes_in_use"]

  rates(rows, flops, args.batch * seq, pk)
  report(result)
  if args.json:
    pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
  main()
