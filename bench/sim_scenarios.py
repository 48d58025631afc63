"""The simulator's scenarios (issue 6): heterogeneity sweep and geo-distributed regions.

  python bench/sim_scenarios.py [--grid sweep|geo|all] [--model small] [--rounds 10] \
      [--jobs N] [--set FIELD=VALUE ...] [--runs NAME,...] [--seeds N] [--workdir DIR]

sweep: configs/sim_sweep.py — DiLoCo, Async (Nesterov per arrival), Async DN, Async DN+DyLU
       at heterogeneity none / slight / moderate / very, equal total inner steps.
geo:   configs/sim_geo.py — 4 regions x 4 workers: DiLoCo, Async DN+DyLU, HALoS.
`--model small` (default) swaps the configs' Pythia-14M/GPT-2 BPE for the byte-level
`small` model and a shorter budget (CPU_MODEL) so the grid fits a 2-core CPU; `--model config` keeps the configs' model. Prints one
markdown table per grid (lowcomm_jax.report), writes <workdir>/<grid>.md, <grid>.png and
result.json. Finished runs are reused.
`--seeds N` (N > 1) runs every case on seeds 0..N-1 (`<name>_s<k>`; the seed moves the init,
the data order and the speeds' assignment to workers) and adds a table of each case's eval
loss against DiLoCo's at the same seed (paired % mean ± sd, 95% t interval, bench/stats.py).
"""

import argparse
import json
import os
import pathlib
import runpy
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(REPO.parent / "shared" / "data" / "tiktoken"))

import sim_grid  # noqa: E402
import stats  # noqa: E402
from lowcomm_jax import report  # noqa: E402

LEVELS = ("none", "slight", "moderate", "very")
# A 2-core CPU budget: byte-level `small`, short windows, 10 rounds of H = 10 (the grid's
# configs otherwise use Pythia-14M on GPT-2 BPE and 15 rounds of H = 20).
CPU_MODEL = {"model.name": "small", "data.tokenizer": "byte", "data.batch_size": 8,
             "data.seq_len": 64, "rounds": 10, "inner_steps": 10, "eval_every": 2,
             "optimizer.warmup_steps": 20}


def _runs(grid: str) -> dict[str, tuple[str, str]]:
  """run name -> (config file, config argument)."""
  if grid == "sweep":
    methods = runpy.run_path(str(REPO / "configs" / "sim_sweep.py"))["METHODS"]
    return {f"{m}_{level}": ("sim_sweep", f"{m},{level}") for level in LEVELS for m in methods}
  methods = runpy.run_path(str(REPO / "configs" / "sim_geo.py"))["METHODS"]
  return {f"geo_{m}": ("sim_geo", m) for m in methods}


def _split_seed(name: str) -> tuple[str, int]:
  case, _, k = name.rpartition("_s")
  return case, int(k)


def paired_table(cases: list[str], seeds: int, results: dict) -> str:
  """Each case's eval loss (mean ± sd over seeds) and virtual seconds, and against DiLoCo's
  at the same seed: the sweep's DiLoCo at the same level, else `diloco_none` (DiLoCo's math
  does not depend on speeds, only its time does); geo: `geo_diloco`."""
  def loss(case):
    return [results[f"{case}_s{k}"]["eval_loss"] for k in range(seeds)]

  lines = ["| case | eval loss | virtual s | vs DiLoCo (paired %) | 95% interval (loss) | "
           "verdict (lower than DiLoCo?) |", "|---|---|---|---|---|---|"]
  for case in cases:
    level = case.rpartition("_")[2]
    ref = next((r for r in (f"diloco_{level}", "diloco_none", "geo_diloco")
                if r in cases), None)
    m, sd = stats.mean_sd(loss(case))
    t, _ = stats.mean_sd(results[f"{case}_s{k}"]["virtual_seconds"] for k in range(seeds))
    cols = ["", "", ""]
    if ref and ref != case:
      d = stats.paired(loss(case), loss(ref), higher_is_better=False)
      pm, psd = stats.mean_sd(stats.percent(loss(case), loss(ref)))
      low, high = d["ci95"]
      cols = [f"{pm:+.2f} ± {psd:.2f}% (vs {ref})", f"{low:+.4f} to {high:+.4f}", d["verdict"]]
    lines.append(f"| {case} | {m:.4f} ± {sd:.4f} | {t:.1f} | " + " | ".join(cols) + " |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--grid", choices=("sweep", "geo", "all"), default="all")
  parser.add_argument("--model", choices=("small", "config"), default="small")
  parser.add_argument("--rounds", type=int, default=CPU_MODEL["rounds"],
                      help="round-equivalents with --model small (budget W·rounds·H)")
  parser.add_argument("--jobs", type=int, default=1, help="cases run at once (sim_grid.py)")
  parser.add_argument("--workdir", type=pathlib.Path, default=REPO / "bench/results/sim")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="override a config field in every run (e.g. outer.momentum=0.0)")
  parser.add_argument("--runs", help="comma-separated run names (default: the whole grid)")
  parser.add_argument("--seeds", type=int, default=1,
                      help="seeds per case; above 1, a paired table against DiLoCo")
  parser.add_argument("--only", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.seeds < 1:
    parser.error(f"--seeds {args.seeds}: give 1 or more")
  overrides = {}
  for item in args.set:
    field, _, value = item.partition("=")
    overrides[field] = json.loads(value) if value[:1] in "-0123456789tfn[" else value

  def config_of(name):
    case, seed = _split_seed(name) if args.seeds > 1 else (name, None)
    file, arg = {**_runs("sweep"), **_runs("geo")}[case]
    config = runpy.run_path(str(REPO / "configs" / f"{file}.py"))["get_config"](arg)
    if args.model == "small":
      config.update_from_flattened_dict({**CPU_MODEL, "rounds": args.rounds})
    config.update_from_flattened_dict(overrides)
    if seed is not None:
      config.seed = seed
    return config

  if args.only:
    sim_grid.run_case(config_of(args.only), args.workdir / args.only)
    return
  grids = ("sweep", "geo") if args.grid == "all" else (args.grid,)
  results = {}
  for grid in grids:
    cases = [n for n in _runs(grid) if not args.runs or n in args.runs.split(",")]
    names = ([f"{n}_s{k}" for n in cases for k in range(args.seeds)] if args.seeds > 1
             else cases)
    failed = sim_grid.run_grid(__file__, names, args.workdir, args.jobs, sys.argv[1:])
    if failed:
      sys.exit(f"failed: {failed} (logs in {args.workdir / 'logs'})")
    dirs = [args.workdir / name for name in names]
    for name, workdir in zip(names, dirs):
      results[name] = report.read_summary(workdir)
      print(f"{name}: eval {results[name]['eval_loss']:.4f}, "
            f"{results[name]['virtual_seconds']:.1f} virtual s", flush=True)
    table = report.markdown_table(dirs)
    print(table)
    if args.seeds > 1:
      paired = paired_table(cases, args.seeds, results)
      print(paired)
      table += "\n\n" + paired
    (args.workdir / f"{grid}.md").write_text(table + "\n")
    report.plot(dirs, args.workdir / f"{grid}.png")
  (args.workdir / "result.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
  main()
