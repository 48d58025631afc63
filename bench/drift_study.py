"""Does parameter drift explain what the overlapped and asynchronous variants lose?

At equal inner steps, the same data and the same slow network (every worker in its own
region, 1 Gb/s and 50 ms between regions), 4 workers at `moderate` speeds: DiLoCo,
Streaming DiLoCo (P = 2, τ = 1, 2, 5), one-step-delay, eager, Overlap Local-SGD, async,
async DN, async DN + DyLU and HALoS, three seeds each. Drift of a contribution is
‖θ_apply − θ_pull‖ / ‖θ_apply‖: how far the global model moved between the state the
contribution was computed from and the state it is applied to (BUILD_NOTES.md).

Reported per method (mean ± sd over the seeds): final eval loss, its degradation relative
to DiLoCo paired by seed (with the 95% t interval and a verdict, bench/stats.py), mean and
90th-percentile drift, mean staleness, virtual time; the Spearman rank correlation (ties
at their mean rank, with its p-value: scipy.stats.spearmanr) between degradation and each
of mean drift, p90 drift and staleness; a scatter plot of degradation against drift and
the per-worker drift distributions (PNG).

  python bench/drift_study.py [--jobs 16] [--rounds 20] [--workdir DIR]
"""

import argparse
import json
import os
import pathlib
import runpy
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))

import sim_grid  # noqa: E402
import stats  # noqa: E402
from lowcomm_jax.report import read_summary  # noqa: E402

SEEDS = (0, 1, 2)
METHODS = {
    "diloco": {"algorithm": "diloco"},
    **{f"streaming_tau{t}": {"algorithm": "streaming", "streaming.fragments": 2,
                             "streaming.overlap_steps": t} for t in (1, 2, 5)},
    # Without outer momentum: with DiLoCo's 0.9 the delayed steps diverge (BENCHMARKS.md).
    "one_step_delay": {"algorithm": "one_step_delay", "outer.momentum": 0.0},
    "eager": {"algorithm": "eager", "outer.momentum": 0.0},
    "overlap": {"algorithm": "overlap"},
    "async": {"algorithm": "async"},
    "async_dn": {"algorithm": "async_dn"},
    "async_dn_dylu": {"algorithm": "async_dn", "outer.dylu": True},
    "halos": {"algorithm": "halos", "outer.halos.sync_every": 2},  # an LPS per worker's region
}


def cases() -> dict[str, dict]:
  return {f"{m}_s{seed}": {**fields, "seed": seed} for m, fields in METHODS.items()
          for seed in SEEDS}


def config(fields: dict, args):
  c = runpy.run_path(str(REPO / "configs" / "base.py"))["get_config"]()
  c.update_from_flattened_dict({
      "num_workers": 4, "rounds": args.rounds, "inner_steps": args.inner_steps,
      "model.name": "small", "data.tokenizer": "byte", "data.batch_size": 8,
      "data.seq_len": 64, "optimizer.warmup_steps": 20, "eval_every": 5, "eval_batches": 8,
      "checkpoint_every": 0, "log_every": 5, "runtime": "simulator",
      "sim.heterogeneity": "moderate", "sim.step_seconds": 0.1,
      "sim.network.regions": 4, "sim.network.inter_gbps": 1.0,
      "sim.network.inter_latency_s": 0.05})
  c.update_from_flattened_dict(fields)
  return c


def report(args) -> tuple[str, dict]:
  s = {n: read_summary(args.workdir / n) for n in cases()}
  rows = {}
  base = [s[f"diloco_s{seed}"]["eval_loss"] for seed in SEEDS]
  for m in METHODS:
    per_seed = [s[f"{m}_s{seed}"] for seed in SEEDS]
    pick = lambda k: [r[k] if r[k] is not None else np.nan for r in per_seed]
    rows[m] = {"loss": pick("eval_loss"),
               "degradation": [r["eval_loss"] / b - 1 for r, b in zip(per_seed, base)],
               "drift": pick("mean_drift"), "drift_p90": pick("drift_p90"),
               "staleness": pick("mean_staleness"), "virtual_s": pick("virtual_seconds"),
               "per_worker": [r["drift_per_worker"] for r in per_seed]}
  def pm(values, f="{:.4f}"):
    mean, sd = stats.mean_sd(values)
    return f"{f.format(mean)} ± {f.replace('+', '').format(sd)}"

  lines = ["| method | eval loss | degradation vs DiLoCo (paired) | 95% interval | verdict "
           "(worse than DiLoCo?) | mean drift | p90 drift | mean staleness | virtual s |",
           "|---|---|---|---|---|---|---|---|---|"]
  for m, r in rows.items():
    if m == "diloco":
      cells = ["", "", ""]
    else:  # the claim tested: the method is worse (a higher loss) than DiLoCo
      d = stats.paired(np.asarray(r["loss"]), base, higher_is_better=True)
      pct = np.asarray(r["degradation"]) * 100
      cells = [f"{pm(pct, '{:+.1f}')} %",
               f"{d['ci95'][0]:+.4f} to {d['ci95'][1]:+.4f}",
               {"holds": "worse", "reversed": "better"}.get(d["verdict"], d["verdict"])]
    lines.append(f"| {m} | {pm(r['loss'])} | " + " | ".join(cells) + f" | {pm(r['drift'])} | "
                 f"{pm(r['drift_p90'])} | {np.mean(r['staleness']):.2f} | "
                 f"{np.mean(r['virtual_s']):.1f} |")
  others = [m for m in rows if m != "diloco"]
  deg = [np.mean(rows[m]["degradation"]) for m in others]
  rho = {k: stats.spearman([np.nanmean(rows[m][k]) for m in others], deg)
         for k in ("drift", "drift_p90", "staleness")}
  # Streaming's drift is the whole model's: it counts the other fragments' syncs, which
  # move parameters its fragment's pseudo-gradient does not touch.
  whole = [m for m in others if not m.startswith("streaming")]
  rho_whole = stats.spearman([np.mean(rows[m]["drift"]) for m in whole],
                             [np.mean(rows[m]["degradation"]) for m in whole])
  fmt = lambda rp: f"ρ = {rp[0]:+.2f} (p = {rp[1]:.2g})"
  lines += ["", f"Spearman rank correlation with the degradation, over the {len(others)} "
            f"non-DiLoCo methods (their means over {len(SEEDS)} seeds): mean drift "
            f"{fmt(rho['drift'])}, p90 drift {fmt(rho['drift_p90'])}, staleness "
            f"{fmt(rho['staleness'])}; mean drift without the Streaming rows "
            f"({len(whole)} methods): {fmt(rho_whole)}. A p above 0.05 is not "
            "distinguishable from no correlation."]
  return "\n".join(lines), {"rows": rows, "spearman": {**rho, "drift_without_streaming":
                                                         rho_whole}}


def plot(rows: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
  for i, (m, r) in enumerate(rows.items()):  # 11 methods: more than one colour cycle
    a.scatter(r["drift"], np.asarray(r["degradation"]) * 100, label=m, marker="os^Dv"[i % 5])
  a.set_xlabel("mean relative drift")
  a.set_ylabel("eval loss degradation vs DiLoCo (%)")
  a.legend(fontsize=7)
  labels, boxes = [], []
  for m, r in rows.items():
    for w in r["per_worker"][0]:
      if w["drift_p10_p50_p90"] is not None:
        labels.append(f"{m} w{w['worker']}")
        boxes.append(w["drift_p10_p50_p90"])
  y = np.arange(len(boxes))
  lo, mid, hi = np.asarray(boxes).T
  b.errorbar(mid, y, xerr=[mid - lo, hi - mid], fmt="o", ms=3)
  b.set_yticks(y, labels, fontsize=5)
  b.set_xlabel("relative drift per contribution: 10th / 50th / 90th percentile (seed 0)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rounds", type=int, default=20)
  p.add_argument("--inner_steps", type=int, default=20)
  p.add_argument("--jobs", type=int, default=2)
  p.add_argument("--workdir", type=pathlib.Path, default=REPO / "bench/results/drift")
  p.add_argument("--only", help=argparse.SUPPRESS)
  args = p.parse_args()
  grid = cases()
  if args.only:
    sim_grid.run_case(config(grid[args.only], args), args.workdir / args.only)
    return
  failed = sim_grid.run_grid(__file__, list(grid), args.workdir, args.jobs, sys.argv[1:])
  if failed:
    sys.exit(f"failed: {failed} (logs in {args.workdir / 'logs'})")
  table, data = report(args)
  print(table)
  (args.workdir / "drift.md").write_text(table + "\n")
  (args.workdir / "result.json").write_text(json.dumps(data, indent=1, default=float) + "\n")
  plot(data["rows"], args.workdir / "drift.png")


if __name__ == "__main__":
  main()
