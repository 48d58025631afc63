"""Tensor-parallel sync plans: loss vs number of syncs, and train-step time per plan.

  python bench/tp_plans.py sweep [--steps 300] [--devices 4]    # train every plan, table + plot
  python bench/tp_plans.py timing --devices 4                   # step time per plan vs standard

One model trained with AdamW on TinyShakespeare (byte tokens), tensor-parallel over
`--devices` forced host devices on the 'model' axis, once per plan: standard (24 syncs for
12 layers), spd (12), grouped k = 2, 3, 4, 6 (6, 4, 3, 2). Same seed, data and schedule for
every plan. The sweep writes bench/results/tp_plans/<plan>.jsonl (val loss every
--eval_every steps), result.json (final val loss, syncs, all-reduces per compiled train step,
median step time) and loss_vs_steps.png. The reference question: the fewest syncs whose final
val loss stays within 2% of standard's.
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def _parse():
  p = argparse.ArgumentParser()
  p.add_argument("mode", choices=["sweep", "timing"])
  p.add_argument("--devices", type=int, default=4)
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--eval_every", type=int, default=50)
  p.add_argument("--layers", type=int, default=12)
  p.add_argument("--d_model", type=int, default=128)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq_len", type=int, default=128)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--out", type=pathlib.Path, default=REPO / "bench/results/tp_plans")
  return p.parse_args()


ARGS = _parse()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={ARGS.devices}")
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from lowcomm_jax.data import (eval_windows, get_tokenizer, load_tokens, resolve_corpus,  # noqa: E402
                              split_train_val)
from lowcomm_jax.data.pipeline import window_dataset  # noqa: E402
from lowcomm_jax.model import GPT, get_preset  # noqa: E402
from lowcomm_jax.model.tp import (SyncPlan, count_all_reduces, plan_problems,  # noqa: E402
                                  tp_loss)
from lowcomm_jax.parallel import mesh as mesh_lib  # noqa: E402

PLANS = {"standard": SyncPlan("standard"), "spd": SyncPlan("spd"),
         **{f"grouped_k{k}": SyncPlan("grouped", layers_per_group=k) for k in (2, 3, 4, 6)}}


def _setup():
  cfg = get_preset("small", vocab_size=0, tokenizer_vocab=256, dtype="float32", dropout=0.0)
  cfg = dataclasses.replace(cfg, n_layer=ARGS.layers, d_model=ARGS.d_model, n_head=ARGS.heads,
                            d_ff=4 * ARGS.d_model)
  params = nnx.to_pure_dict(nnx.state(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param))
  mesh = mesh_lib.make_mesh(1, 1, ARGS.devices)
  for name, plan in list(PLANS.items()):
    if problems := plan_problems(plan, cfg, ARGS.devices):
      print(f"skipping {name}: {'; '.join(problems)}", file=sys.stderr)
      del PLANS[name]
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      optax.warmup_cosine_decay_schedule(0.0, ARGS.lr, 30, max(ARGS.steps, 31), ARGS.lr / 10),
      b1=0.9, b2=0.95, weight_decay=0.1))
  return cfg, params, mesh, tx


def _train_step(cfg, plan, mesh, tx):
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: tp_loss(p, batch, cfg, plan, mesh))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return jax.jit(step)


def sweep():
  cfg, params0, mesh, tx = _setup()
  tokens = load_tokens(resolve_corpus(""), get_tokenizer("byte"))
  train_tokens, val_tokens = split_train_val(tokens, 0.1)
  val = eval_windows(val_tokens, seq_len=ARGS.seq_len, batch_size=ARGS.batch, num_batches=8,
                     seed=0)
  ARGS.out.mkdir(parents=True, exist_ok=True)
  results = {}
  for name, plan in PLANS.items():
    batches = iter(window_dataset(train_tokens, seq_len=ARGS.seq_len, batch_size=ARGS.batch,
                                  seed=1))
    with jax.set_mesh(mesh):
      step = _train_step(cfg, plan, mesh, tx)
      evaluate = jax.jit(lambda p, w: tp_loss(p, w, cfg, plan, mesh))
      params, opt_state = params0, tx.init(params0)
      first = next(batches)
      all_reduces = count_all_reduces(step.lower(params, opt_state, first).compile().as_text())
      curve, times = [], []
      for i in range(1, ARGS.steps + 1):
        batch = first if i == 1 else next(batches)
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batch)
        loss = float(loss)
        times.append(time.perf_counter() - t0)
        if i % ARGS.eval_every == 0 or i == ARGS.steps:
          val_loss = float(np.mean([float(evaluate(params, w)) for w in val]))
          curve.append({"step": i, "train_loss": loss, "val_loss": val_loss})
          print(f"{name:>12} step {i:4d} train {loss:.4f} val {val_loss:.4f}", flush=True)
    (ARGS.out / f"{name}.jsonl").write_text("".join(json.dumps(c) + "\n" for c in curve))
    results[name] = {"syncs_forward": plan.syncs_forward(cfg.n_layer),
                     "all_reduces_train_step": all_reduces,
                     "final_val_loss": curve[-1]["val_loss"],
                     "step_time_s": statistics.median(times[min(5, len(times) - 1):])}
  base = results["standard"]["final_val_loss"]
  for r in results.values():
    r["val_loss_vs_standard"] = r["final_val_loss"] / base - 1
  within = [n for n, r in results.items() if r["val_loss_vs_standard"] <= 0.02]
  answer = min(within, key=lambda n: results[n]["syncs_forward"])
  (ARGS.out / "result.json").write_text(json.dumps(
      {"devices": ARGS.devices, "steps": ARGS.steps, "layers": ARGS.layers,
       "d_model": ARGS.d_model, "plans": results, "fewest_syncs_within_2pct": answer},
      indent=2) + "\n")
  print("| plan | syncs (forward) | all-reduces / train step | final val loss | vs standard |"
        " step s |")
  print("|---|---|---|---|---|---|")
  for n, r in results.items():
    print(f"| {n} | {r['syncs_forward']} | {r['all_reduces_train_step']} | "
          f"{r['final_val_loss']:.4f} | {r['val_loss_vs_standard']:+.2%} | "
          f"{r['step_time_s']:.3f} |")
  print(f"fewest syncs within 2% of standard: {answer}")
  _plot(results)


def _plot(results):
  try:
    import matplotlib  # noqa: PLC0415 - optional
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    print("matplotlib not installed: no plot", file=sys.stderr)
    return
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, r in results.items():
    curve = [json.loads(l) for l in (ARGS.out / f"{name}.jsonl").read_text().splitlines()]
    ax.plot([c["step"] for c in curve], [c["val_loss"] for c in curve],
            label=f"{name} ({r['syncs_forward']} syncs)")
  ax.set_xlabel("step")
  ax.set_ylabel("val loss")
  ax.legend()
  fig.tight_layout()
  fig.savefig(ARGS.out / "loss_vs_steps.png", dpi=120)


def timing(repeats: int = 20):
  cfg, params, mesh, tx = _setup()
  batch = np.random.default_rng(0).integers(0, 256, (ARGS.batch, ARGS.seq_len + 1), np.int32)
  times = {}
  with jax.set_mesh(mesh):
    for name, plan in PLANS.items():
      step = _train_step(cfg, plan, mesh, tx)
      state = (params, tx.init(params))
      for _ in range(3):
        jax.block_until_ready(step(*state, batch))
      samples = []
      for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(*state, batch))
        samples.append(time.perf_counter() - t0)
      times[name] = statistics.median(samples)
  print(f"| plan | step s ({ARGS.devices} devices) | vs standard | tokens/s |")
  print("|---|---|---|---|")
  for name, t in times.items():
    print(f"| {name} | {t:.4f} | {t / times['standard']:.2f} | "
          f"{ARGS.batch * ARGS.seq_len / t:,.0f} |")
  ARGS.out.mkdir(parents=True, exist_ok=True)
  (ARGS.out / f"timing_{ARGS.devices}dev_{jax.default_backend()}.json").write_text(
      json.dumps(times, indent=2) + "\n")


if __name__ == "__main__":
  sweep() if ARGS.mode == "sweep" else timing()
