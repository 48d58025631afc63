"""DiLoCo vs DDP at equal tokens on TinyShakespeare: final eval loss and bytes per worker.

  python bench/diloco_vs_ddp.py [--workdir bench/results/diloco_vs_ddp]

Runs DiLoCo with 4 full-width workers (configs/diloco_hetero.py without its host table:
15 rounds x H=20), the heterogeneous main job itself (1 full + 3 quarter-width FFN workers)
and configs/ddp.py (4 workers, 300 steps) through train.run, then prints the report table
plus the bytes ratio and the loss gap of homogeneous DiLoCo vs DDP, and writes them to
<workdir>/result.json. Existing finished runs are reused.
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


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--workdir", type=pathlib.Path, default=REPO / "bench/results/diloco_vs_ddp")
  args = p.parse_args()
  summaries = {}
  runs = (("diloco", "diloco_hetero", {"hosts": []}), ("diloco_hetero", "diloco_hetero", {}),
          ("ddp", "ddp", {}))
  for name, config_file, overrides in runs:
    config = runpy.run_path(str(REPO / "configs" / f"{config_file}.py"))["get_config"]()
    config.update(overrides)
    summaries[name] = train.run(config, args.workdir / name)
  diloco, ddp = summaries["diloco"], summaries["ddp"]
  assert diloco["tokens"] == ddp["tokens"], "the comparison needs equal tokens"
  result = {
      "tokens": diloco["tokens"],
      "eval_loss_diloco": diloco["eval_loss"], "eval_loss_ddp": ddp["eval_loss"],
      "loss_gap_diloco_minus_ddp": diloco["eval_loss"] - ddp["eval_loss"],
      "bytes_per_worker_diloco": diloco["bytes_sent"], "bytes_per_worker_ddp": ddp["bytes_sent"],
      "bytes_ratio_ddp_over_diloco": ddp["bytes_sent"] / diloco["bytes_sent"],
      "wall_seconds_diloco": diloco["wall_seconds"], "wall_seconds_ddp": ddp["wall_seconds"],
  }
  result["eval_loss_diloco_hetero"] = summaries["diloco_hetero"]["eval_loss"]
  (args.workdir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
  print(report.markdown_table([args.workdir / name for name, _, _ in runs]))
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
