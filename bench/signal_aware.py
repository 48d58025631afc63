"""Signal-aware and robust aggregation against bad data and bad intent (issue 18).

  python bench/signal_aware.py [--part seed|diloco|eight|robust|all] [--jobs 2] [--workdir DIR]
                               [--signals loss_ema probe_loss ...] [--report]

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


def _seed_grid(prefix: str, extra: dict, signals=SIGNALS) -> dict:
  grid = {}
  for data in ("iid", "noniid"):
    for clean in (False, True):
      group = f"{prefix}_{data}{'_clean' if clean else ''}"
      fields = {**extra, **({"data.corrupt_workers": ()} if clean else {})}
      grid[f"{group}_uniform"] = (f"{data}_uniform", fields, group, "uniform")
      for s in signals:
        grid[f"{group}_{s}"] = (f"{data}_weighted", {**fields, "aggregate.signal": s}, group, s)
  return grid


def cases(part: str, signals=SIGNALS) -> dict[str, tuple[str, dict, str, str]]:
  """name -> (configs/sadp.py case, overrides, group, label within the group)."""
  out = {}
  if part in ("seed", "all"):
    out.update(_seed_grid("ddp2", {}, signals))
  if part in ("diloco", "all"):
    out.update(_seed_grid("diloco2", {"algorithm": "diloco", "inner_steps": 10,
                                      "rounds": 30, "eval_every": 3, "log_every": 1,
                                      "checkpoint_every": 10}, signals))
  if part in ("eight", "all"):
    out.update(_seed_grid("ddp8", {**EIGHT, "data.corrupt_workers": (6, 7)}, signals))
  if part in ("robust", "all"):
    for rule in RULES:
      for attack in ATTACKS:
        fields = {**EIGHT, "data.corrupt_workers": (), "aggregate.rule": rule,
                  "aggregate.trim": 1}
        if attack != "none":
          fields.update({"attack.workers": (0,), "attack.kind": attack, "attack.scale": 100.0})
        out[f"robust8_{rule}_{attack}"] = ("iid_uniform", fields, f"robust8_{attack}", rule)
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


def _summary(workdir: pathlib.Path, name: str) -> dict:
  s = json.loads((workdir / name / "summary.json").read_text())
  config = json.loads((workdir / name / "config.json").read_text())["config"]
  bad = set(config["data"]["corrupt_workers"])
  w = s.get("worker_weights")
  s["clean_weight"] = (sum(x for i, x in enumerate(w) if i not in bad) if w
                       else (s["num_workers"] - len(bad)) / s["num_workers"])
  s["effective"] = s.get("effective_workers", float(s["num_workers"]))
  return s


def report(grid: dict, workdir: pathlib.Path) -> str:
  """A table per group (vs the group's uniform run; a robust rule vs its run without the
  attacker), then the seed's success test for each signal: the clean workers' weight above
  their uniform share (0.5 of 2), weighted beats uniform when corrupted, matches it (within
  1%) on clean data."""
  groups: dict[str, list[str]] = {}
  for name, (_, _, group, _) in grid.items():
    groups.setdefault(group, []).append(name)
  out = []
  for group, names in groups.items():
    ref = next((n for n in names if grid[n][3] in ("uniform", "mean")), None)
    base = _summary(workdir, ref)["eval_loss"] if ref else None
    if group.startswith("robust8_"):  # each rule against its own run without an attacker
      base = None
    out += [f"**{group}**", "",
            "| run | final eval loss | vs reference | clean workers' weight | effective N | wall s |",
            "|---|---|---|---|---|---|"]
    for n in names:
      s = _summary(workdir, n)
      ref_loss = base
      if group.startswith("robust8_"):
        ref_loss = _summary(workdir, f"robust8_{grid[n][3]}_none")["eval_loss"]
      vs = f"{100 * (s['eval_loss'] / ref_loss - 1):+.1f}%" if ref_loss else ""
      out.append(f"| {grid[n][3]} | {s['eval_loss']:.4f} | {vs} | {s['clean_weight']:.3f} | "
                 f"{s['effective']:.2f} | {s['wall_seconds']:.0f} |")
    out.append("")
  verdicts = []
  for group in groups:
    if group.endswith("_clean") or group.startswith("robust8_"):
      continue
    clean_group = f"{group}_clean"
    if clean_group not in groups:
      continue
    uni = _summary(workdir, f"{group}_uniform")["eval_loss"]
    uni_clean = _summary(workdir, f"{clean_group}_uniform")["eval_loss"]
    for n in groups[group]:
      label = grid[n][3]
      if label == "uniform" or f"{clean_group}_{label}" not in grid:
        continue
      s, c = _summary(workdir, n), _summary(workdir, f"{clean_group}_{label}")
      # "Clean weight above 0.5" of two workers: above the clean workers' uniform share.
      share = _summary(workdir, f"{group}_uniform")["clean_weight"]
      ok = (s["clean_weight"] > share and s["eval_loss"] < uni
            and abs(c["eval_loss"] / uni_clean - 1) <= 0.01)
      verdicts.append(f"| {group} | {label} | {s['clean_weight']:.3f} | "
                      f"{100 * (s['eval_loss'] / uni - 1):+.2f}% | "
                      f"{100 * (c['eval_loss'] / uni_clean - 1):+.2f}% | "
                      f"{'yes' if ok else 'no'} |")
  if verdicts:
    out += ["**The seed's success test** (clean weight above its uniform share; corrupted: "
            "weighted below uniform; clean data: within 1% of uniform)", "",
            "| setting | signal | clean workers' weight | corrupted vs uniform | "
            "clean data vs uniform | passes |", "|---|---|---|---|---|---|", *verdicts]
  return "\n".join(out)


def plot(grid: dict, workdir: pathlib.Path, path: pathlib.Path) -> None:
  """Eval loss against tokens, one panel per group, one line per signal or rule."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  groups: dict[str, list[str]] = {}
  for name, (_, _, group, _) in grid.items():
    groups.setdefault(group, []).append(name)
  cols = min(4, len(groups))
  rows = -(-len(groups) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
  for ax, (group, names) in zip(axes.flat, groups.items()):
    for n in names:
      tokens, loss = zip(*_curve(workdir / n))
      ax.plot(tokens, loss, label=grid[n][3], lw=1.2 if grid[n][3] in ("uniform", "mean") else 1)
    ax.set_title(group, fontsize=9)
    ax.set_xlabel("tokens")
    ax.set_ylabel("eval loss")
    low = min(min(l for _, l in _curve(workdir / n)) for n in names)
    ax.set_ylim(low - 0.05, low + 1.2)
    ax.legend(fontsize=7)
  for ax in axes.flat[len(groups):]:
    ax.axis("off")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--part", choices=("seed", "diloco", "eight", "robust", "all"), default="seed")
  p.add_argument("--jobs", type=int, default=2)
  p.add_argument("--workdir", type=pathlib.Path, default=REPO / "bench/results/signal_aware")
  p.add_argument("--signals", nargs="+", choices=SIGNALS, default=list(SIGNALS),
                 help="the signals of the seed/diloco/eight grids (default: all)")
  p.add_argument("--report", action="store_true", help="only write the report and plot")
  p.add_argument("--only", help=argparse.SUPPRESS)
  args = p.parse_args()
  grid = cases("all" if args.only else args.part, signals=SIGNALS if args.only else args.signals)
  if args.only:
    run_one(config_of(*grid[args.only][:2]), args.workdir / args.only)
    return
  if not args.report:
    failed = sim_grid.run_grid(__file__, list(grid), args.workdir, args.jobs, sys.argv[1:])
    if failed:
      sys.exit(f"failed: {failed} (logs in {args.workdir / 'logs'})")
  table = report(grid, args.workdir)
  print(table)
  (args.workdir / f"signal_aware_{args.part}.md").write_text(table + "\n")
  plot(grid, args.workdir, args.workdir / f"signal_aware_{args.part}.png")


if __name__ == "__main__":
  main()
