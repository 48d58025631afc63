"""DiLoCo vs DDP at equal tokens on TinyShakespeare: final eval loss and bytes per worker.

  python bench/diloco_vs_ddp.py [--workdir bench/results/diloco_vs_ddp]

Runs configs/diloco_hetero.py (4 workers, 15 rounds x H=20) and configs/ddp.py (4 workers,
300 steps) through train.run, then prints the report table plus the bytes ratio and the
loss gap, and writes them to <workdir>/result.json. Existing finished runs are reused.
"""

import argparse
import json
import os
import pathlib
import runpy

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))

from lowcomm_jax import report, train  # noqa: E402


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--workdir", type=pathlib.Path, default=REPO / "bench/results/diloco_vs_ddp")
  args = p.parse_args()
  summaries = {}
  for name in ("diloco_hetero", "ddp"):
    config = runpy.run_path(str(REPO / "configs" / f"{name}.py"))["get_config"]()
    summaries[name] = train.run(config, args.workdir / name)
  diloco, ddp = summaries["diloco_hetero"], summaries["ddp"]
  assert diloco["tokens"] == ddp["tokens"], "the comparison needs equal tokens"
  result = {
      "tokens": diloco["tokens"],
      "eval_loss_diloco": diloco["eval_loss"], "eval_loss_ddp": ddp["eval_loss"],
      "loss_gap_diloco_minus_ddp": diloco["eval_loss"] - ddp["eval_loss"],
      "bytes_per_worker_diloco": diloco["bytes_sent"], "bytes_per_worker_ddp": ddp["bytes_sent"],
      "bytes_ratio_ddp_over_diloco": ddp["bytes_sent"] / diloco["bytes_sent"],
      "wall_seconds_diloco": diloco["wall_seconds"], "wall_seconds_ddp": ddp["wall_seconds"],
  }
  (args.workdir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
  print(report.markdown_table([args.workdir / "diloco_hetero", args.workdir / "ddp"]))
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
