"""Tables and plots from finished workdirs.

  python -m lowcomm_jax.report runs/diloco_hetero runs/ddp [--plot curves.png]

prints a markdown table from each workdir's summary.json and, with --plot, draws eval and
train loss against tokens from metrics.jsonl (needs matplotlib: pip install -e ".[plot]").
"""

import argparse
import json
import pathlib

COLUMNS = [("run", "{}"), ("algorithm", "{}"), ("num_workers", "{}"), ("inner_steps", "{}"),
           ("rounds", "{}"), ("eval_loss", "{:.4f}"), ("tokens", "{:,}"),
           ("MiB sent/worker", "{:,.1f}"), ("DDP/this bytes", "{:.1f}"), ("wall_seconds", "{:.0f}")]


def read_metrics(workdir: pathlib.Path) -> list[dict]:
  path = pathlib.Path(workdir) / "metrics.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary_row(workdir: pathlib.Path) -> dict:
  s = json.loads((pathlib.Path(workdir) / "summary.json").read_text())
  sent = s["bytes_sent"]  # 0 for a lone worker: it talks to nobody
  return {**s, "run": pathlib.Path(workdir).name, "MiB sent/worker": sent / 2**20,
          "DDP/this bytes": s["bytes_sent_ddp_equivalent"] / sent if sent else float("nan")}


def markdown_table(workdirs) -> str:
  rows = [summary_row(w) for w in workdirs]
  lines = ["| " + " | ".join(name for name, _ in COLUMNS) + " |",
           "|" + "---|" * len(COLUMNS)]
  for row in rows:
    lines.append("| " + " | ".join(fmt.format(row[name]) for name, fmt in COLUMNS) + " |")
  return "\n".join(lines)


def plot(workdirs, out: pathlib.Path) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError as e:
    raise SystemExit('plotting needs matplotlib: pip install -e ".[plot]"') from e
  fig, (ax_eval, ax_train) = plt.subplots(1, 2, figsize=(11, 4))
  for w in workdirs:
    records = read_metrics(w)
    evals = [r for r in records if "eval_loss" in r]
    ax_eval.plot([r["tokens"] for r in evals], [r["eval_loss"] for r in evals], marker="o",
                 label=pathlib.Path(w).name)
    ax_train.plot([r["tokens"] for r in records], [r["train_loss"] for r in records],
                  label=pathlib.Path(w).name)
  for ax, title in ((ax_eval, "eval loss"), (ax_train, "train loss (mean over workers)")):
    ax.set_xlabel("tokens (all workers)")
    ax.set_title(title)
    ax.legend()
  fig.tight_layout()
  fig.savefig(out, dpi=120)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdirs", nargs="+", type=pathlib.Path)
  parser.add_argument("--plot", type=pathlib.Path, help="write a loss-vs-tokens PNG here")
  args = parser.parse_args(argv)
  print(markdown_table(args.workdirs))
  if args.plot:
    plot(args.workdirs, args.plot)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
  main()
