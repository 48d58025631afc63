"""The simulator's scenarios (issue 6): heterogeneity sweep and geo-distributed regions.

  python bench/sim_scenarios.py [--grid sweep|geo|all] [--model small] [--rounds 10] \
      [--jobs N] [--set FIELD=VALUE ...] [--runs NAME,...] [--workdir DIR]

sweep: configs/sim_sweep.py — DiLoCo, Async (Nesterov per arrival), Async DN, Async DN+DyLU
       at heterogeneity none / slight / moderate / very, equal total inner steps.
geo:   configs/sim_geo.py — 4 regions x 4 workers: DiLoCo, Async DN+DyLU, HALoS.
`--model small` (default) swaps the configs' Pythia-14M/GPT-2 BPE for the byte-level
`small` model and a shorter budget (CPU_MODEL) so the grid fits a 2-core CPU; `--model config` keeps the configs' model. Prints one
markdown table per grid (lowcomm_jax.report), writes <workdir>/<grid>.md, <grid>.png and
result.json. Finished runs are reused.
"""

import argparse
import json
import os
import pathlib
import runpy
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(REPO.parent / "shared" / "data" / "tiktoken"))

import sim_grid  # noqa: E402
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
  parser.add_argument("--only", help=argparse.SUPPRESS)
  args = parser.parse_args()
  overrides = {}
  for item in args.set:
    field, _, value = item.partition("=")
    overrides[field] = json.loads(value) if value[:1] in "-0123456789tfn[" else value

  def config_of(name):
    file, arg = {**_runs("sweep"), **_runs("geo")}[name]
    config = runpy.run_path(str(REPO / "configs" / f"{file}.py"))["get_config"](arg)
    if args.model == "small":
      config.update_from_flattened_dict({**CPU_MODEL, "rounds": args.rounds})
    config.update_from_flattened_dict(overrides)
    return config

  if args.only:
    sim_grid.run_case(config_of(args.only), args.workdir / args.only)
    return
  grids = ("sweep", "geo") if args.grid == "all" else (args.grid,)
  results = {}
  for grid in grids:
    names = [n for n in _runs(grid) if not args.runs or n in args.runs.split(",")]
    failed = sim_grid.run_grid(__file__, names, args.workdir, args.jobs, sys.argv[1:])
    if failed:
      sys.exit(f"failed: {failed} (logs in {args.workdir / 'logs'})")
    dirs = [args.workdir / name for name in names]
    for name, workdir in zip(names, dirs):
      results[name] = json.loads((workdir / "summary.json").read_text())
      print(f"{name}: eval {results[name]['eval_loss']:.4f}, "
            f"{results[name]['virtual_seconds']:.1f} virtual s", flush=True)
    table = report.markdown_table(dirs)
    print(table)
    (args.workdir / f"{grid}.md").write_text(table + "\n")
    report.plot(dirs, args.workdir / f"{grid}.png")
  (args.workdir / "result.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
  main()
