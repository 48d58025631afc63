"""Loss against bytes at a fixed token budget: how many fewer bytes than a tuned DDP does each
method need to reach DDP's loss (+1%, +3%), within the same inner-optimizer family?

Every run trains the same tokens through the runner (train.run): `--workers` workers,
`--steps` inner steps each, byte-level TinyShakespeare, model `--model` (`small` on a CPU;
`gpt2_124m` on a GPU). Bytes are what one worker sends in the whole run, counted by the byte
ledger (parameters' Δ, codec payloads, DES-LOC's moment averages).

1. Tuning, seed 0, the same grid size for DDP and for the method compared with it:
   - DDP, AdamW and Muon: inner lr × schedule (cosine to 10%, or held: min_lr_ratio 1);
   - DiLoCo at H = 50, AdamW and Muon: inner lr × outer (lr, momentum) ∈ {(0.7, 0.9), (1.0, 0.5)}.
   The DiLoCo family's points below use their optimizer's tuned DiLoCo settings.
2. The frontier, `--seeds` seeds each:
   - AdamW and Muon alike: DDP; DiLoCo H ∈ {10, 20, 50, 100}; Streaming DiLoCo (H 50, P 2,
     τ 1); every codec on DiLoCo H 50, and int4 at H 100; Pier at H 20 (its schedules need
     rounds);
   - AdamW only: DDP + DeMo; DES-LOC (K_u 3H, K_v 6H, plain average; its moments are Adam's)
     at H 50;
   - Muon only: MuLoCo (H 50, its 2-bit codec, outer 0.81 / 0.8: MuLoCo's 0.9 with its
     lr-scaled buffer, BUILD_NOTES.md).
3. The report: per point, final eval loss and bytes per worker (mean ± sd over seeds), its
   family's tuned DDP's bytes over its own, the loss gap paired by seed (bench/stats.py),
   whether its mean loss is within 1% / 3% of DDP's, and the bytes at which the eval loss
   first reaches DDP's mean final loss +1% / +3% (interpolated between evaluations); the goal
   check (within 1% with ≥ 500× fewer bytes; within 3% with ≥ 1,000×); a PNG of loss
   against log bytes with each family's DDP loss as a line.

  python bench/frontier.py [--jobs 2] [--seeds 3] [--steps 400] [--workdir DIR]
  python bench/frontier.py --model gpt2_124m --workers 4 --steps 2000 --jobs 1   # on a GPU
  python bench/frontier.py --steps 800 --picks bench/results/frontier_small_4x400_b8_l32/picks.json --points diloco_muon_h10 diloco_muon_h50

The last is a trend in the token budget: the named points (and their family's DDP) at
another --steps with the 400-step run's settings, not tuned again.

Finished runs are reused (bench/sim_grid.py's runner: each in its own process).
"""

import argparse
import itertools
import json
import os
import pathlib
import runpy
import shutil
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))

import sim_grid  # noqa: E402
import stats  # noqa: E402
from lowcomm_jax.report import read_metrics, read_summary  # noqa: E402

TARGETS = (1.01, 1.03)  # × the family's tuned DDP mean final eval loss
LEVELS = (10, 100, 500, 1000)  # compression levels (DDP's bytes over a point's) for recipes
# bench/stats.py's verdict on "A is better than B" (A − B of a loss), in words: the table's
# point against its DDP, and --compare's pairs.
LOSS_VERDICT = {"holds": "better", "reversed": "worse",
                "not distinguishable": "not distinguishable"}
GOALS = {1.01: 500, 1.03: 1000}  # bytes ratio the issue asks for at each target
LRS = {"adamw": (1e-3, 2e-3, 5e-3, 1e-2), "muon": (0.01, 0.02, 0.05)}
OUTERS = {"o07m09": (0.7, 0.9), "o10m05": (1.0, 0.5)}
SCHEDULES = {"cos": 0.1, "flat": 1.0}  # min_lr_ratio
H_TUNE = 50
CODECS = ("int8", "fp8", "int4", "topk", "randomk", "sparseloco", "muloco")


def inner(opt: str, lr: float) -> dict:
  if opt == "adamw":
    return {"optimizer.name": "adamw", "optimizer.lr": lr}
  # Muon's lr is its hidden matrices'; the embeddings, head, norms and biases train with
  # AdamW at 5e-3 (the AdamW grid's middle), the same on every point.
  return {"optimizer.name": "muon", "optimizer.lr": lr, "optimizer.adam_lr": 5e-3}


def ddp(steps: int, evals: int, opt: str, lr: float, schedule: str) -> dict:
  return {"algorithm": "ddp", "inner_steps": 1, "rounds": steps,
          "eval_every": max(steps // evals, 1), "log_every": max(steps // evals, 1),
          "optimizer.min_lr_ratio": SCHEDULES[schedule], **inner(opt, lr)}


def local(steps: int, algorithm: str, h: int, opt: str, lr: float, outer: tuple,
          **fields) -> dict:
  return {"algorithm": algorithm, "inner_steps": h, "rounds": steps // h, "eval_every": 1,
          "log_every": 1, "outer.lr": outer[0], "outer.momentum": outer[1], **inner(opt, lr),
          **fields}


def tuning_grid(steps: int, evals: int) -> dict[str, dict]:
  """Seed-0 points: name -> fields, for DDP and DiLoCo (H 50) with each optimizer."""
  out = {}
  for opt in LRS:
    for lr, sched in itertools.product(LRS[opt], SCHEDULES):
      out[f"ddp_{opt}.lr{lr:g}_{sched}"] = ddp(steps, evals, opt, lr, sched)
    for lr, o in itertools.product(LRS[opt], OUTERS):
      out[f"diloco_{opt}.lr{lr:g}_{o}"] = local(steps, "diloco", H_TUNE, opt, lr, OUTERS[o])
  return out


def frontier_points(steps: int, evals: int, picks: dict) -> dict[str, tuple[str, dict]]:
  """name -> (family, fields) of every frontier point, at the tuned settings."""
  out = {}
  for opt in LRS:
    d, lo = picks[f"ddp_{opt}"], picks[f"diloco_{opt}"]
    lr, outer = lo["lr"], OUTERS[lo["outer"]]
    out[f"ddp_{opt}"] = (opt, ddp(steps, evals, opt, d["lr"], d["schedule"]))
    for h in (10, 20, 50, 100):
      out[f"diloco_{opt}_h{h}"] = (opt, local(steps, "diloco", h, opt, lr, outer))
    # Pier at H 20: its schedules need rounds (production, then one per decay momentum).
    rounds = steps // 20
    out[f"pier_{opt}_h20"] = (opt, local(steps, "pier", 20, opt, lr, outer,
                                         **{"pier.warmup": max(0.1, 2 / rounds)}))
  for opt in LRS:
    lr, outer = picks[f"diloco_{opt}"]["lr"], OUTERS[picks[f"diloco_{opt}"]["outer"]]
    out[f"streaming_{opt}_h50"] = (opt, local(
        steps, "streaming", 50, opt, lr, outer, **{"streaming.fragments": 2,
                                                   "streaming.overlap_steps": 1}))
    for codec in CODECS:
      out[f"diloco_{opt}_h50_{codec}"] = (opt, local(steps, "diloco", 50, opt, lr, outer,
                                                     **{"compress.codec": codec}))
    # The lossless 4-bit codec at the longest H: the densest point past 500x.
    out[f"diloco_{opt}_h100_int4"] = (opt, local(steps, "diloco", 100, opt, lr, outer,
                                                 **{"compress.codec": "int4"}))
  lr, outer = picks["diloco_adamw"]["lr"], OUTERS[picks["diloco_adamw"]["outer"]]
  d = picks["ddp_adamw"]
  out["ddp_adamw_demo"] = ("adamw", {**ddp(steps, evals, "adamw", d["lr"], d["schedule"]),
                                     "compress.codec": "demo"})
  # DES-LOC's parameter sync is its plain average (desloc.plain_average): outer lr 1, no momentum.
  out["desloc_adamw_h50"] = ("adamw", local(steps, "desloc", 50, "adamw", lr, (1.0, 0.0)))
  lr = picks["diloco_muon"]["lr"]
  out["muloco_h50"] = ("muon", local(steps, "diloco", 50, "muon", lr, (0.81, 0.8),
                                     **{"compress.codec": "muloco"}))
  return out


def config(args, fields: dict, seed: int):
  c = runpy.run_path(str(REPO / "configs" / "base.py"))["get_config"]()
  c.update_from_flattened_dict({
      "num_workers": args.workers, "model.name": args.model, "data.tokenizer": "byte",
      "data.batch_size": args.batch_size, "data.seq_len": args.seq_len,
      "optimizer.warmup_steps": args.steps // 20, "eval_batches": 8, "checkpoint_every": 0,
      "seed": seed})
  c.update_from_flattened_dict(fields)
  return c


def run_one(args, name: str, fields: dict, seed: int) -> None:
  """One run; a diverged one leaves a summary with an infinite loss (a grid point that
  is too aggressive is a result, not a failure of the bench)."""
  from lowcomm_jax.runtimes.spmd import train
  from lowcomm_jax.run.files import TrainingDiverged
  workdir = args.workdir / name
  shutil.rmtree(workdir, ignore_errors=True)  # a run cut off earlier starts again, whole
  try:
    train.run(config(args, fields, seed), workdir)
  except TrainingDiverged as e:
    sent = max((r.get("bytes_sent", 0) for r in read_metrics(workdir)), default=0)
    (workdir / "summary.json").write_text(json.dumps(
        {"eval_loss": float("inf"), "bytes_sent": sent, "diverged": str(e)}))
  sim_grid.trim(workdir)


def _rows(workdir: pathlib.Path, name: str) -> list[dict]:
  return [r for r in read_metrics(workdir / name) if "eval_loss" in r]


def _summary(workdir: pathlib.Path, name: str) -> dict:
  return read_summary(workdir / name)


def pick(workdir: pathlib.Path, grid: dict) -> dict:
  """Each family's best seed-0 point by final eval loss."""
  picks = {}
  for family in ("ddp_adamw", "ddp_muon", "diloco_adamw", "diloco_muon"):
    names = [n for n in grid if n.startswith(family + ".")]
    best = min(names, key=lambda n: _summary(workdir, n + ".s0")["eval_loss"])
    point = best.split(".", 1)[1]
    lr, rest = point[2:].split("_", 1)
    picks[family] = {"point": point, "lr": float(lr),
                     **({"schedule": rest} if family.startswith("ddp") else {"outer": rest})}
  return picks


def per_seed(workdir: pathlib.Path, point: str, seeds: int, goals: list[float]) -> list[dict]:
  """Per seed: final loss, bytes per worker, and the bytes where each goal is first reached."""
  out = []
  for seed in range(seeds):
    name = f"{point}.s{seed}"
    rows, summary = _rows(workdir, name), _summary(workdir, name)
    hits = [stats.crossing(rows, g, ("bytes_sent",)) for g in goals]
    out.append({"eval_loss": summary["eval_loss"], "bytes_sent": summary["bytes_sent"],
                "bytes_to": [h[0] if h else None for h in hits]})
  return out


def _fmt_bytes(values) -> str:
  if any(v is None for v in values):
    reached = sum(v is not None for v in values)
    return f"never ({reached}/{len(values)})" if reached else "never"
  m, sd = stats.mean_sd(v / 2**20 for v in values)
  return f"{m:,.3f} ± {sd:,.3f}"


def _bytes_ratio(results: dict, name: str, family: str) -> float:
  """The family's DDP's mean bytes per worker over the point's."""
  sent = stats.mean_sd(r["bytes_sent"] for r in results[name])[0]
  return stats.mean_sd(r["bytes_sent"] for r in results[f"ddp_{family}"])[0] / sent \
      if sent else float("nan")


def report(points: dict, results: dict, goals: dict) -> tuple[str, list[str]]:
  """The markdown table and the goal check's lines. A point is within x% of its family's
  tuned DDP when its mean final loss over the seeds is at most DDP's mean × (1 + x); its
  ratio is DDP's bytes over its own for the whole run (the same tokens)."""
  lines = ["| point | eval loss | − its DDP's, paired (mean ± sd, 95% CI, verdict) | "
           "MiB per worker | DDP bytes / bytes | within +1% / +3% | MiB to DDP +1% | "
           "MiB to DDP +3% |", "|---|---|---|---|---|---|---|---|"]
  checks, best = [], {t: None for t in TARGETS}
  for name, (family, _) in points.items():
    runs, ddp = results[name], results[f"ddp_{family}"]
    loss, sd = stats.mean_sd(r["eval_loss"] for r in runs)
    sent = stats.mean_sd(r["bytes_sent"] for r in runs)[0]
    ratio = _bytes_ratio(results, name, family)
    is_ddp = name == f"ddp_{family}"
    gap = "—"
    if not is_ddp:
      d = stats.paired([r["eval_loss"] for r in runs], [r["eval_loss"] for r in ddp],
                       higher_is_better=False)
      gap = (f"{d['mean']:+.4f} ± {d['sd']:.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}], "
             f"{LOSS_VERDICT[d['verdict']]}")
    within = [loss <= g for g in goals[family]]
    for t, ok in zip(TARGETS, within):
      if ok and not is_ddp and (best[t] is None or ratio > best[t][1]):
        best[t] = (name, ratio, loss)
    lines.append(f"| {name} | {loss:.4f} ± {sd:.4f} | {gap} | {sent / 2**20:,.3f} | "
                 f"{ratio:,.0f} | {'yes' if within[0] else 'no'} / "
                 f"{'yes' if within[1] else 'no'} | "
                 f"{_fmt_bytes([r['bytes_to'][0] for r in runs])} | "
                 f"{_fmt_bytes([r['bytes_to'][1] for r in runs])} |")
  for t in TARGETS:
    pct, goal = round((t - 1) * 100), GOALS[t]
    if best[t] is None:
      checks.append(f"- Within +{pct}% of its DDP: no point other than DDP (goal: ≥ "
                    f"{goal:,}× fewer bytes).")
      continue
    name, ratio, loss = best[t]
    verdict = "met" if ratio >= goal else "not met"
    checks.append(f"- Within +{pct}% of its DDP, the fewest bytes: **{name}** ({loss:.4f}), "
                  f"{ratio:,.0f}× fewer than DDP; goal ≥ {goal:,}×: {verdict}.")
  return "\n".join(lines), checks


def best_by_level(points: dict, results: dict) -> list[str]:
  """Per compression level, the point with the lowest mean final loss among those sending at
  least that many times fewer bytes than their family's DDP, any family: the recipes
  (configs/recipe_*.py) are these points. Its loss is also put against the best DDP's, paired
  by seed, as a user choosing between them would."""
  ddps = {f: results[f"ddp_{f}"] for f in {family for family, _ in points.values()}}
  best_ddp = min(ddps, key=lambda f: stats.mean_sd(r["eval_loss"] for r in ddps[f])[0])
  rows = {name: (stats.mean_sd(r["eval_loss"] for r in results[name])[0],
                  _bytes_ratio(results, name, family))
          for name, (family, _) in points.items()}
  lines = [f"| compression level | best point | eval loss | DDP bytes / bytes | − ddp_{best_ddp}"
           " (best DDP), paired |", "|---|---|---|---|---|"]
  for level in LEVELS:
    eligible = [n for n, (_, ratio) in rows.items() if ratio >= level]
    if not eligible:
      lines.append(f"| ≥ {level:,}× | none | | | |")
      continue
    name = min(eligible, key=lambda n: rows[n][0])
    ddp_losses = [r["eval_loss"] for r in ddps[best_ddp]]
    d = stats.paired([r["eval_loss"] for r in results[name]], ddp_losses,
                     higher_is_better=False)
    pct = 100 * d["mean"] / stats.mean_sd(ddp_losses)[0]
    lines.append(f"| ≥ {level:,}× | {name} | {rows[name][0]:.4f} | {rows[name][1]:,.0f} | "
                 f"{d['mean']:+.4f} ± {d['sd']:.4f} ({pct:+.1f}%), "
                 f"{LOSS_VERDICT[d['verdict']]} |")
  return lines


def compare(workdir: pathlib.Path, pairs: list[str], seeds: int) -> list[str]:
  """`A:B` -> A's final eval loss minus B's, paired by seed (points already run)."""
  lines = []
  for pair in pairs:
    a, b = pair.split(":")
    x, y = ([_summary(workdir, f"{n}.s{s}")["eval_loss"] for s in range(seeds)] for n in (a, b))
    d = stats.paired(x, y, higher_is_better=False)
    lines.append(f"{a} − {b}: {d['mean']:+.4f} ± {d['sd']:.4f} [{d['ci95'][0]:+.4f}, "
                 f"{d['ci95'][1]:+.4f}] ({100 * d['mean'] / stats.mean_sd(y)[0]:+.2f}%), "
                 f"{LOSS_VERDICT[d['verdict']]}")
  return lines


def plot(points: dict, results: dict, path: pathlib.Path) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib missing (pip install -e '.[plot]'): no PNG", flush=True)
    return
  fig, ax = plt.subplots(figsize=(9, 6))
  colors = {"adamw": "tab:blue", "muon": "tab:orange"}
  for name, (family, _) in points.items():
    runs = results[name]
    x = stats.mean_sd(r["bytes_sent"] for r in runs)[0]
    y, sd = stats.mean_sd(r["eval_loss"] for r in runs)
    if name == f"ddp_{family}":
      ax.axhline(y, color=colors[family], ls="--", lw=1, label=f"DDP ({family}) {y:.4f}")
    ax.errorbar(x, y, yerr=sd, fmt="o", color=colors[family], ms=4, capsize=2)
    ax.annotate(name, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
  ax.set_xscale("log")
  ax.set_xlabel("bytes sent per worker (whole run)")
  ax.set_ylabel("final eval loss (mean ± sd over seeds)")
  ax.set_title("loss against bytes at equal tokens")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=130)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seeds", type=int, default=3)
  p.add_argument("--jobs", type=int, default=2)
  p.add_argument("--steps", type=int, default=400, help="inner steps per worker (tokens)")
  p.add_argument("--workers", type=int, default=4)
  p.add_argument("--model", default="small")
  p.add_argument("--batch_size", type=int, default=8)
  p.add_argument("--seq_len", type=int, default=32)
  p.add_argument("--evals", type=int, default=20, help="DDP's evaluations per run")
  p.add_argument("--workdir", type=pathlib.Path, default=None,
                 help="default bench/results/frontier_<model>_<workers>x<steps>")
  p.add_argument("--picks", type=pathlib.Path,
                 help="another run's picks.json: skip tuning, use its settings (a trend in "
                      "--steps at fixed hyperparameters)")
  p.add_argument("--points", nargs="*", help="only these frontier points (with each "
                 "family's DDP)")
  p.add_argument("--compare", nargs="*", metavar="A:B",
                 help="print A − B's final loss, paired by seed, for points already run")
  p.add_argument("--only", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.workdir is None:  # runs are reused by name: one directory per setup
    args.workdir = (REPO / "bench/results" /
                    f"frontier_{args.model}_{args.workers}x{args.steps}_b{args.batch_size}"
                    f"_l{args.seq_len}")
  grid = tuning_grid(args.steps, args.evals)
  picks_path = args.workdir / "picks.json"
  if args.compare:
    print("\n".join(compare(args.workdir, args.compare, args.seeds)))
    return
  if args.only:  # one run, in its own process (sim_grid.run_grid)
    point, seed = args.only.rsplit(".s", 1)
    if point in grid:
      fields = grid[point]
    else:
      fields = frontier_points(args.steps, args.evals,
                               json.loads(picks_path.read_text()))[point][1]
    run_one(args, args.only, fields, int(seed))
    return
  forward = sys.argv[1:]
  args.workdir.mkdir(parents=True, exist_ok=True)
  if args.picks:  # settings tuned elsewhere: no tuning runs, no aliases to them
    picks, grid = json.loads(args.picks.read_text()), {}
  else:  # 1. Tuning on seed 0.
    if failed := sim_grid.run_grid(__file__, [f"{n}.s0" for n in grid], args.workdir,
                                   args.jobs, forward):
      sys.exit(f"failed: {failed} (logs in {args.workdir / 'logs'})")
    picks = pick(args.workdir, grid)
  picks_path.write_text(json.dumps(picks, indent=1))
  print("tuned:", picks, flush=True)
  # 2. The frontier on every seed; seed 0 of a tuned point is its tuning run.
  points = frontier_points(args.steps, args.evals, picks)
  if args.points:
    unknown = sorted(set(args.points) - set(points))
    if unknown:
      sys.exit(f"--points: unknown {unknown}; known: {sorted(points)}")
    keep = set(args.points) | {f"ddp_{points[n][0]}" for n in args.points}
    points = {n: v for n, v in points.items() if n in keep}
  for family in () if args.picks else ("ddp_adamw", "ddp_muon", "diloco_adamw", "diloco_muon"):
    alias = family if family.startswith("ddp") else f"{family}_h{H_TUNE}"
    link, target = args.workdir / f"{alias}.s0", f"{family}.{picks[family]['point']}.s0"
    if link.is_symlink() and os.readlink(link) != target:
      link.unlink()  # the picks changed: the old alias names another run
    if not link.exists() and not link.is_symlink():
      link.symlink_to(target)
  names = [f"{n}.s{s}" for n in points for s in range(args.seeds)]
  if failed := sim_grid.run_grid(__file__, names, args.workdir, args.jobs, forward):
    sys.exit(f"failed: {failed} (logs in {args.workdir / 'logs'})")
  results = {}
  goals = {}
  for family in {family for family, _ in points.values()}:
    ddp_loss = stats.mean_sd(_summary(args.workdir, f"ddp_{family}.s{s}")["eval_loss"]
                             for s in range(args.seeds))[0]
    goals[family] = [ddp_loss * t for t in TARGETS]
  for name, (family, _) in points.items():
    results[name] = per_seed(args.workdir, name, args.seeds, goals[family])
  table, checks = report(points, results, goals)
  tuning = ["| tuning point (seed 0) | eval loss |", "|---|---|"] + [
      f"| {n} | {_summary(args.workdir, n + '.s0')['eval_loss']:.4f} |" for n in grid
  ] if grid else [f"Settings from {args.picks} (not tuned at this budget)."]
  text = "\n".join([table, "", *checks, "", *best_by_level(points, results), "",
                    "Tuned: " + json.dumps(picks), "",
                    "Targets (tuned DDP's mean final loss × 1.01, 1.03): " + json.dumps(
                        {f: [round(g, 4) for g in v] for f, v in goals.items()}), "",
                    *tuning])
  print(text)
  (args.workdir / "frontier.md").write_text(text + "\n")
  (args.workdir / "result.json").write_text(json.dumps(
      {"picks": picks, "goals": goals, "results": results}, indent=1))
  plot(points, results, args.workdir / "frontier.png")


if __name__ == "__main__":
  main()
