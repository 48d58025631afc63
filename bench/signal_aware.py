"""Signal-aware and robust aggregation against bad data and bad intent (issue 18).

  python bench/signal_aware.py [--part seed|diloco|eight|robust|all] [--jobs 2] [--workdir DIR]

seed    configs/sadp.py as the original ran it: DDP, 2 workers, worker 1 reading text with 30%
        of its tokens swapped; iid / noniid data; uniform weights or each signal; and the
        same runs on clean data (weighted must match uniform there).
diloco  the same with DiLoCo (H = 10, the same tokens).
eight   8 workers of which 2 (6 and 7) are corrupted, DDP.
robust  8 workers, DDP, one attacker (worker 0: scale ×100, sign flip, random of the same
        norm) against every rule (mean, median, trimmed mean, centered clipping), and each
        rule without the attacker. Goal: the robust rules within 5% of their clean run.

Reported per run: final eval loss, the clean workers' total weight, effective N (1/Σw²),
wall seconds; tables in <workdir>/signal_aware.md, eval-loss curves in signal_aware.png.
Finished runs are reused (bench/sim_grid.py runs each in its own process).
"""

import argparse
import json
import os
import pathlib
import runpy
import shutil
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))

import sim_grid  # noqa: E402

SIGNALS = ("loss_ema", "grad_norm_stability", "cosine", "probe_loss")
RULES = ("mean", "median", "trimmed_mean", "centered_clip")
ATTACKS = ("none", "scale", "sign_flip", "random")
# 8 workers at the 2-worker runs' global batch (8 x 4 windows a step instead of 2 x 16), so
# a run costs about what a 2-worker run does on a CPU.
EIGHT = {"num_workers": 8, "data.batch_size": 4}


def _seed_grid(prefix: str, extra: dict) -> dict[str, tuple[str, dict]]:
  grid = {}
  for data in ("iid", "noniid"):
    for clean in (False, True):
      tag = f"{prefix}_{data}{'_clean' if clean else ''}"
      fields = {**extra, **({"data.corrupt_workers": ()} if clean else {})}
      grid[f"{tag}_uniform"] = (f"{data}_uniform", fields)
      for s in SIGNALS:
        grid[f"{tag}_{s}"] = (f"{data}_weighted", {**fields, "aggregate.signal": s})
  return grid


def cases(part: str) -> dict[str, tuple[str, dict]]:
  """name -> (configs/sadp.py case, overrides)."""
  out = {}
  if part in ("seed", "all"):
    out.update(_seed_grid("ddp2", {}))
  if part in ("diloco", "all"):
    out.update(_seed_grid("diloco2", {"algorithm": "diloco", "inner_steps": 10,
                                      "rounds": 30, "eval_every": 3, "log_every": 1,
                                      "checkpoint_every": 10}))
  if part in ("eight", "all"):
    out.update(_seed_grid("ddp8", {**EIGHT, "data.corrupt_workers": (6, 7)}))
  if part in ("robust", "all"):
    for rule in RULES:
      for attack in ATTACKS:
        fields = {**EIGHT, "data.corrupt_workers": (), "aggregate.rule": rule,
                  "aggregate.trim": 1}
        if attack != "none":
          fields.update({"attack.workers": (0,), "attack.kind": attack, "attack.scale": 100.0})
        out[f"robust8_{rule}_{attack}"] = ("iid_uniform", fields)
  return out


def config_of(case: str, fields: dict):
  c = runpy.run_path(str(REPO / "configs" / "sadp.py"))["get_config"](case)
  c.update_from_flattened_dict(fields)
  return c


def run_one(config, workdir: pathlib.Path) -> None:
  from lowcomm_jax import train
  train.run(config, workdir)
  for heavy in ("checkpoints", "tensorboard"):
    shutil.rmtree(workdir / heavy, ignore_errors=True)


def _curve(workdir: pathlib.Path):
  rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [(r["tokens"], r["eval_loss"]) for r in rows if "eval_loss" in r]


def report(names, workdir: pathlib.Path) -> str:
  lines = ["| run | final eval loss | clean workers' weight | effective N | wall s |",
           "|---|---|---|---|---|"]
  for n in names:
    s = json.loads((workdir / n / "summary.json").read_text())
    config = json.loads((workdir / n / "config.json").read_text())["config"]
    bad = set(config["data"]["corrupt_workers"])
    w = s.get("worker_weights")
    clean = (f"{sum(x for i, x in enumerate(w) if i not in bad):.3f}" if w
             else f"{(s['num_workers'] - len(bad)) / s['num_workers']:.3f} (uniform)")
    eff = f"{s['effective_workers']:.2f}" if "effective_workers" in s else f"{s['num_workers']}"
    lines.append(f"| {n} | {s['eval_loss']:.4f} | {clean} | {eff} | {s['wall_seconds']:.0f} |")
  return "\n".join(lines)


def plot(names, workdir: pathlib.Path, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(10, 6))
  for n in names:
    tokens, loss = zip(*_curve(workdir / n))
    ax.plot(tokens, loss, label=n, lw=1)
  ax.set_xlabel("tokens")
  ax.set_ylabel("eval loss")
  ax.legend(fontsize=5, ncol=3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--part", choices=("seed", "diloco", "eight", "robust", "all"), default="seed")
  p.add_argument("--jobs", type=int, default=2)
  p.add_argument("--workdir", type=pathlib.Path, default=REPO / "bench/results/signal_aware")
  p.add_argument("--only", help=argparse.SUPPRESS)
  args = p.parse_args()
  grid = cases("all" if args.only else args.part)
  if args.only:
    run_one(config_of(*grid[args.only]), args.workdir / args.only)
    return
  failed = sim_grid.run_grid(__file__, list(grid), args.workdir, args.jobs, sys.argv[1:])
  if failed:
    sys.exit(f"failed: {failed} (logs in {args.workdir / 'logs'})")
  table = report(list(grid), args.workdir)
  print(table)
  (args.workdir / f"signal_aware_{args.part}.md").write_text(table + "\n")
  plot(list(grid), args.workdir, args.workdir / f"signal_aware_{args.part}.png")


if __name__ == "__main__":
  main()
