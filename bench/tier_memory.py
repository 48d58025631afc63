"""Memory by MatFormer tier: what one worker of each FFN width holds while it trains.

A tier of fraction f trains the first m = round(f * d_ff) hidden units of every block's FFN
(model/matformer.py): its worker holds a model of FFN width m, that model's inner optimizer
state and one training step's temporaries. Per model and tier, one row:

  params        the tier's parameters (float32 master copy)
  optimizer     its inner optimizer's state (the run's AdamW: two float32 moments)
  temporaries   XLA's buffer assignment of the compiled training step (memory_analysis
                temp_size): the activations kept for backprop, the gradients and the
                update's intermediates. Parameters and optimizer state are donated on
                accelerators, so the step needs no second copy of them there.
  estimate      the runner's pre-flight estimate of the temporaries
                (memory.step_temporaries, as memory.estimate counts them)
  total         params + optimizer + temporaries: what the device must hold for the step
  peak          GPUs only: the device's peak_bytes_in_use after two steps of this tier. One
                process per model, tiers from narrow to wide: the peak is a running one
                (XLA cannot reset it), so each tier's is its own only because it is the
                largest yet.

On a GPU the numbers are measured there (its buffer assignment, cuDNN attention, bf16 matmuls);
on a CPU they are XLA:CPU's buffer assignment of the same program, computed without running
it (bf16 is emulated there, so the temporaries differ from a GPU's). The activations scale
with batch x seq; params and optimizer do not.

  python bench/tier_memory.py [--models gpt2_124m smollm2_135m] [--tiers 1 0.75 0.5 0.25]
                              [--batch 16] [--seq 1024] [--dtype bfloat16] [--json PATH]
"""

import argparse
import dataclasses
import json
import os
import pathlib
import runpy
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # peaks are allocations

import jax  # noqa: E402

from lowcomm_jax.assemble import memory  # noqa: E402
from lowcomm_jax.data import TOKENIZER_VOCAB  # noqa: E402
from lowcomm_jax.model import get_preset  # noqa: E402
from lowcomm_jax.model import attention  # noqa: E402
from lowcomm_jax.model.cross_entropy import chunk_of  # noqa: E402
from lowcomm_jax.model.matformer import hidden_units  # noqa: E402
from lowcomm_jax.parallel import ledger  # noqa: E402
from mfu import bare_step, memory_of  # noqa: E402

TOKENIZER = {"gpt2_124m": "gpt2", "smollm2_135m": "gpt2"}  # smollm2's preset has its own vocab


def tier_row(model: str, fraction: float, batch: int, seq: int, dtype: str) -> dict:
  """One tier's bytes (see the module docstring); runs two steps where the backend is a GPU."""
  config = runpy.run_path(str(REPO / "configs" / "base.py"))["get_config"]()
  preset = get_preset(model, tokenizer_vocab=TOKENIZER_VOCAB[TOKENIZER.get(model, "byte")],
                      dtype=dtype)
  impl, _ = attention.resolve("auto", dtype, preset.head_dim, attention.platform())
  m = hidden_units(preset.d_ff, fraction)
  cfg = dataclasses.replace(preset, d_ff=m, attention=impl,
                            loss_chunk=chunk_of(config.model.loss_chunk, dtype))
  params, tx, _, train_step = bare_step(cfg, config, 1000)  # bench/mfu.py's AdamW step
  opt_state = tx.init(params)
  on_gpu = jax.default_backend() == "gpu"
  windows = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, cfg.vocab_size)
  step = jax.jit(train_step, donate_argnums=(0,) if on_gpu else ()).lower(
      (params, opt_state), windows).compile()
  row = {"model": model, "tier": fraction, "hidden_units": m, "d_ff": preset.d_ff,
         "param_bytes": ledger.tree_bytes(params), "optimizer_bytes": ledger.tree_bytes(opt_state),
         "temp_estimate_bytes": memory.step_temporaries(cfg, ledger.tree_bytes(params),
                                                        batch, seq, 1),
         "attention": impl, "compiled": memory_of(step)}
  row["temp_bytes"] = row["compiled"].get("temp_bytes")
  row["total_bytes"] = row["param_bytes"] + row["optimizer_bytes"] + (row["temp_bytes"] or 0)
  if on_gpu:
    state = (params, opt_state)
    for _ in range(2):
      state, loss = step(state, windows)
    jax.block_until_ready(loss)
    row["peak_bytes_in_use"] = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    del state
  return row


def _mib(n) -> str:
  return "n/a" if n is None else f"{n / 2**20:,.0f}"


def report(rows: list[dict], meta: dict) -> None:
  print(f"# memory per worker by tier: batch {meta['batch']} x seq {meta['seq']}, {meta['dtype']} "
        f"compute, float32 parameters, AdamW; {meta['device']} ({meta['backend']}), "
        f"jax {meta['jax']}. MiB.")
  print(f"{'model':<13} {'tier':>5} {'m':>5} {'params':>7} {'optim':>7} {'temps':>7} "
        f"{'estim.':>7} {'total':>7} {'peak':>7}")
  for r in rows:
    print(f"{r['model']:<13} {r['tier']:>5g} {r['hidden_units']:>5} {_mib(r['param_bytes']):>7} "
          f"{_mib(r['optimizer_bytes']):>7} {_mib(r['temp_bytes']):>7} "
          f"{_mib(r['temp_estimate_bytes']):>7} {_mib(r['total_bytes']):>7} "
          f"{_mib(r.get('peak_bytes_in_use')):>7}")


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--models", nargs="+", default=["gpt2_124m", "smollm2_135m"])
  p.add_argument("--tiers", nargs="+", type=float, default=[1.0, 0.75, 0.5, 0.25])
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq", type=int, default=1024)
  p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
  p.add_argument("--json", default="", help="also write the rows to this file")
  p.add_argument("--one_model", help=argparse.SUPPRESS)  # the per-model child process
  args = p.parse_args()
  tiers = sorted(args.tiers)  # narrow to wide: see `peak` in the docstring
  meta = {"batch": args.batch, "seq": args.seq, "dtype": args.dtype,
          "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
          "jax": jax.__version__}
  if args.one_model:  # one JSON line per tier, as soon as it is measured
    for f in tiers:
      print(json.dumps(tier_row(args.one_model, f, args.batch, args.seq, args.dtype)), flush=True)
    return
  rows = []
  for model in args.models:  # one process each, so one model's peak is not another's
    child = subprocess.Popen([sys.executable, __file__, "--one_model", model, "--batch",
                              str(args.batch), "--seq", str(args.seq), "--dtype", args.dtype,
                              "--tiers", *map(str, tiers)], stdout=subprocess.PIPE, text=True)
    for line in child.stdout:  # kept as they come: a run cut short still reports its rows
      rows.append(json.loads(line))
      print(f"measured {model} tier {rows[-1]['tier']:g}", file=sys.stderr, flush=True)
      if args.json:
        pathlib.Path(args.json).write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    if child.wait():
      sys.exit(f"{model}: the child process failed (its error is above)")
  rows.sort(key=lambda r: (args.models.index(r["model"]), -r["tier"]))
  report(rows, meta)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
  main()
