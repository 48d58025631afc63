"""The reference heterogeneous experiments: L-only, LSSS-diff, LSSS-same (single process).

  python bench/hetero_reference.py [--workdir bench/results/hetero]

Runs the three configs, prints the report table, per-tier memory (parameter + optimizer
bytes per worker) and the full-width worker's train loss and the eval loss per round, and
writes <workdir>/result.json. Loss curves: python -m lowcomm_jax.report <workdir>/* --plot x.png
"""

import argparse
import json
import os
import pathlib
import runpy

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))

from lowcomm_jax import report  # noqa: E402
from lowcomm_jax.runtimes.spmd import train

EXPERIMENTS = ("L_only", "LSSS_diff", "LSSS_same")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--workdir", type=pathlib.Path, default=REPO / "bench/results/hetero")
  args = p.parse_args()
  result = {}
  for name in EXPERIMENTS:
    config = runpy.run_path(str(REPO / "configs" / f"{name}.py"))["get_config"]()
    summary = train.run(config, args.workdir / name)
    curve = report.read_metrics(args.workdir / name)
    result[name] = {
        "eval_loss": summary["eval_loss"], "tokens": summary["tokens"],
        "bytes_sent": summary["bytes_sent"], "tiers": summary["tiers"],
        "idle_fraction": [w["idle_fraction"] for w in summary["workers"]],
        "L_train_loss": [round(l["train_loss_worker_0"], 4) for l in curve],
        "eval_curve": [(l["step"], round(l["eval_loss"], 4)) for l in curve if "eval_loss" in l],
    }
  (args.workdir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
  print(report.markdown_table([args.workdir / n for n in EXPERIMENTS]))
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
