"""Tensor-parallel sync plans: loss vs number of syncs, and train-step time per plan.

  python bench/tp_plans.py sweep [--steps 300] [--devices 4]    # train every plan, table + plot
  python bench/tp_plans.py timing --devices 4                   # step time per plan vs standard

sweep: configs/tp_sweep.py:<plan> through the runner (`small12`: 12 layers, d=128; one
worker; tensor-parallel over `--devices` forced host devices), once per plan: standard (24
syncs), spd (12), grouped k = 2, 3, 4, 6 (6, 4, 3, 2), selective (spd + attention syncs in blocks 0
and 11: 14). Same seed, data and schedule for every
plan. Writes each run's workdir under bench/results/tp_plans/<plan>/, result.json (final val
loss, syncs, all-reduces per compiled train step, step time) and loss_vs_steps.png. The
reference question: the fewest syncs whose final val loss stays within 2% of standard's.

timing: the bare jitted train step (loss, grads, AdamW) per plan, median of 20.
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
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq_len", type=int, default=128)
  p.add_argument("--out", type=pathlib.Path, default=REPO / "bench/results/tp_plans")
  return p.parse_args()


ARGS = _parse()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={ARGS.devices}")
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from lowcomm_jax.model import GPT, get_preset  # noqa: E402
from lowcomm_jax.model.tp import SyncPlan, plan_problems, tp_loss  # noqa: E402
from lowcomm_jax.parallel import mesh as mesh_lib  # noqa: E402

PLANS = {"standard": SyncPlan("standard"), "spd": SyncPlan("spd"),
         **{f"grouped_k{k}": SyncPlan("grouped", layers_per_group=k) for k in (2, 3, 4, 6)},
         "selective": SyncPlan("selective", attn_sync_layers=(0, 11))}


def _runnable(cfg):
  """PLANS minus those that cannot run `cfg` on --devices (named on stderr)."""
  for name, plan in list(PLANS.items()):
    if problems := plan_problems(plan, cfg, ARGS.devices):
      print(f"skipping {name}: {'; '.join(problems)}", file=sys.stderr)
      del PLANS[name]


def _setup():
  cfg = get_preset("small12", vocab_size=0, tokenizer_vocab=256, dtype="float32", dropout=0.0)
  params = nnx.to_pure_dict(nnx.state(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param))
  mesh = mesh_lib.make_mesh(1, 1, ARGS.devices)
  _runnable(cfg)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      optax.warmup_cosine_decay_schedule(0.0, 3e-3, 30, 300, 3e-4),
      b1=0.9, b2=0.95, weight_decay=0.1))
  return cfg, params, mesh, tx


def _train_step(cfg, plan, mesh, tx):
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: tp_loss(p, batch, cfg, plan, mesh))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return jax.jit(step)


def sweep():
  """Every plan of configs/tp_sweep.py through the runner (ddp, one worker, 4 shards)."""
  import runpy  # noqa: PLC0415
  from lowcomm_jax.report import read_metrics  # noqa: PLC0415
  from lowcomm_jax.runtimes.spmd import train  # noqa: PLC0415
  get_config = runpy.run_path(str(REPO / "configs" / "tp_sweep.py"))["get_config"]
  _runnable(get_preset("small12", vocab_size=0, tokenizer_vocab=256))
  results = {}
  for name in PLANS:
    config = get_config(name)
    config.rounds, config.eval_every = ARGS.steps, ARGS.eval_every
    config.model.tp.size = ARGS.devices
    summary = train.run(config, ARGS.out / name)
    rows = read_metrics(ARGS.out / name)
    speeds = [r["steps_per_second"] for r in rows[1:]] or [rows[0]["steps_per_second"]]
    results[name] = {"syncs_forward": summary["tp_syncs_forward"],
                     "all_reduces_train_step": summary["tp_allreduces_train_step"],
                     "final_val_loss": summary["eval_loss"],
                     "step_time_s": 1.0 / statistics.median(speeds),
                     "curve": [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]}
  base = results["standard"]["final_val_loss"]
  for r in results.values():
    r["val_loss_vs_standard"] = r["final_val_loss"] / base - 1
  within = [n for n, r in results.items() if r["val_loss_vs_standard"] <= 0.02]
  answer = min(within, key=lambda n: results[n]["syncs_forward"])
  (ARGS.out / "result.json").write_text(json.dumps(
      {"devices": ARGS.devices, "steps": ARGS.steps, "plans": results,
       "fewest_syncs_within_2pct": answer}, indent=2) + "\n")
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
    ax.plot(*zip(*r["curve"]), label=f"{name} ({r['syncs_forward']} syncs)")
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
