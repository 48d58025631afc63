"""Is every MatFormer width a usable model after heterogeneous training? (issue 32)

Seed 000's layouts, from configs/: L_only (the full-width host alone), LSSS_diff (L plus
three 25%-FFN hosts, each on its own batches) and LSSS_same (the same on the same batches),
and S_alone: the LSSS_diff layout with all four hosts at 25%, so a 25%-wide model trains
alone on the same tokens as LSSS_diff's 25% sub-model sees. Every run evaluates the trained
widths and the Mix'n'Match widths --widths (eval.widths) at the end; `--seeds` seeds each
(the seed moves the init and the data order).

Reported (mean ± sd over the seeds; paired differences with the 95% t interval and a
verdict, bench/stats.py):
  - the eval loss of each width at the end, per layout;
  - LSSS_diff's and LSSS_same's 25% sub-model against S_alone at width 0.25: does nesting
    cost the small model anything, or help it?
  - LSSS's full width against L_only's (do the narrow hosts help the full model?);
  - monotone in width: in how many runs no wider width has a higher loss than a narrower
    one, and the largest violation.

`--eval_cost` measures instead what evaluating every width costs: LSSS_diff's eval program
with its widths against the full width alone, compiled once each, then timed alternately
(`--repeats` calls each, median), in one process: the ratio, and the eval's share of a
run at the config's eval_every.

  python bench/tier_quality.py [--jobs 2] [--seeds 3] [--rounds 20] [--workdir DIR]
  python bench/tier_quality.py --eval_cost [--repeats 7]
"""

import argparse
import os
import pathlib
import runpy
import shutil
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))

import sim_grid  # noqa: E402
import stats  # noqa: E402
from lowcomm_jax.report import read_summary  # noqa: E402

LAYOUTS = ("L_only", "LSSS_diff", "LSSS_same", "S_alone")
TIE = 1e-4  # losses closer than this are equal (float32 sums in another order)


def config(args, layout: str, seed: int):
  from lowcomm_jax.assemble.hosts import host
  base = "LSSS_diff" if layout == "S_alone" else layout
  c = runpy.run_path(str(REPO / "configs" / f"{base}.py"))["get_config"]()
  if layout == "S_alone":
    c.hosts = [host(tier=0.25) for _ in c.hosts]
  c.update_from_flattened_dict({"seed": seed, "rounds": args.rounds,
                                # every layout evaluates the same widths, L_only's 0.25 too
                                "eval.widths": (0.25, *args.widths), "checkpoint_every": 0})
  if args.model:  # a smaller model (a quick check of the bench): its block size bounds seq
    c.model.name, c.data.seq_len = args.model, min(c.data.seq_len, 32)
  return c


def run_one(args, name: str) -> None:
  from lowcomm_jax.runtimes.spmd import train
  layout, seed = name.rsplit(".s", 1)
  workdir = args.workdir / name
  shutil.rmtree(workdir, ignore_errors=True)  # a run cut off earlier starts again, whole
  train.run(config(args, layout, int(seed)), workdir)
  sim_grid.trim(workdir)


def by_width(workdir: pathlib.Path) -> dict[float, float]:
  return {float(w): v for w, v in read_summary(workdir)["eval_loss_by_width"].items()}


def monotone(losses: dict[float, float]) -> tuple[bool, float]:
  """(no wider width above a narrower one in loss by more than TIE, the largest loss of a
  wider width above a narrower one's)."""
  widths = sorted(losses)
  worst = max((losses[b] - losses[a] for i, a in enumerate(widths) for b in widths[i + 1:]),
              default=0.0)
  return worst <= TIE, max(worst, 0.0)


def report(args) -> str:
  seeds = range(args.seeds)
  runs = {layout: [by_width(args.workdir / f"{layout}.s{s}") for s in seeds]
          for layout in LAYOUTS}
  widths = sorted({w for rows in runs.values() for row in rows for w in row}, reverse=True)
  lines = [f"eval loss at each FFN width, end of training ({args.seeds} seeds, mean ± sd); "
           "trained widths: L 1.0, S 0.25",
           "", "| layout | " + " | ".join(f"{w:g}" for w in widths) + " | monotone |",
           "|---|" + "---|" * (len(widths) + 1)]
  for layout, rows in runs.items():
    cells = []
    for w in widths:
      m, sd = stats.mean_sd(row[w] for row in rows)
      cells.append(f"{m:.4f} ± {sd:.4f}")
    mono = [monotone(row) for row in rows]
    worst = max(v for _, v in mono)
    cells.append(f"{sum(ok for ok, _ in mono)}/{len(rows)}"
                 + (f" (worst +{worst:.4f})" if worst else ""))
    lines.append(f"| {layout} | " + " | ".join(cells) + " |")
  lines += ["", "| comparison (a − b, paired by seed) | mean ± sd | 95% interval | "
                "verdict (a lower?) |", "|---|---|---|---|"]
  for a, b, w in (("LSSS_diff", "S_alone", 0.25), ("LSSS_same", "S_alone", 0.25),
                  ("LSSS_diff", "L_only", 1.0), ("LSSS_same", "L_only", 1.0)):
    p = stats.paired([r[w] for r in runs[a]], [r[w] for r in runs[b]], higher_is_better=False)
    lines.append(f"| {a} − {b} at width {w:g} | {p['mean']:+.4f} ± {p['sd']:.4f} | "
                 f"{p['ci95'][0]:+.4f} to {p['ci95'][1]:+.4f} | {p['verdict']} |")
  return "\n".join(lines)


def eval_cost(args) -> str:
  """The eval program's time with the widths of LSSS_diff (1.0, 0.25 and --widths) against
  the full width alone: one process, alternating calls, the median of each."""
  import statistics
  import time
  import jax
  from lowcomm_jax.runtimes.spmd import train
  runs = {}
  for label, full_only in (("full width only", True), ("every width", False)):
    c = config(args, "LSSS_diff", 0)
    if full_only:  # one host of the full width and no eval.widths: the full width alone
      c.hosts, c.num_workers, c.eval.widths = c.hosts[:1], 1, ()
    r = train.build(c, check_memory=False)
    step = jax.jit(r.programs.eval)
    params = r.state_spec.initial_params()
    with jax.set_mesh(r.topology.mesh):
      jax.block_until_ready(step(params, r.data.eval_windows, frozen=r.frozen))  # compile
    runs[label] = (r, step, params, [])
  for _ in range(args.repeats):
    for r, step, params, times in runs.values():
      with jax.set_mesh(r.topology.mesh):
        t0 = time.perf_counter()
        jax.block_until_ready(step(params, r.data.eval_windows, frozen=r.frozen))
        times.append(time.perf_counter() - t0)
  med = {label: statistics.median(v[3]) for label, v in runs.items()}
  widths = runs["every width"][0].model.eval_widths
  c = runs["every width"][0].config
  return (f"eval program, {c.model.name}, {c.eval_batches} batches of {c.data.batch_size} x "
          f"{c.data.seq_len}: full width only {med['full width only'] * 1e3:.1f} ms, widths "
          f"{', '.join(f'{w:g}' for w in widths)} {med['every width'] * 1e3:.1f} ms "
          f"({med['every width'] / med['full width only']:.2f}x; median of {args.repeats} "
          f"alternating calls each, {jax.devices()[0].device_kind})")


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--jobs", type=int, default=2)
  p.add_argument("--seeds", type=int, default=3)
  p.add_argument("--rounds", type=int, default=20)
  p.add_argument("--widths", type=float, nargs="+", default=[0.375, 0.5, 0.75],
                 help="Mix'n'Match widths no host trains (eval.widths)")
  p.add_argument("--model", default="", help="override the configs' model (e.g. tiny)")
  p.add_argument("--workdir", type=pathlib.Path, default=REPO / "bench/results/tier_quality")
  p.add_argument("--eval_cost", action="store_true",
                 help="time the eval program with every width against the full width alone")
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--only", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.eval_cost:
    print(eval_cost(args))
    return
  if args.only:  # one run, in its own process (sim_grid.run_grid)
    run_one(args, args.only)
    return
  names = [f"{layout}.s{s}" for s in range(args.seeds) for layout in LAYOUTS]
  if failed := sim_grid.run_grid(__file__, names, args.workdir, args.jobs, sys.argv[1:]):
    sys.exit(f"failed: {failed} (logs in {args.workdir / 'logs'})")
  text = report(args)
  (args.workdir / "tier_quality.md").write_text(text + "\n")
  print(text)


if __name__ == "__main__":
  main()
