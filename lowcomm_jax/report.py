"""Tables and plots from finished workdirs.

  python -m lowcomm_jax.report runs/diloco_hetero runs/ddp [--plot curves.png]

prints a markdown table from each workdir's summary.json, then the config fields that differ
between the runs (from each workdir's config.json). With --plot it draws, from
metrics.jsonl, eval loss against bytes sent per worker beside eval loss against tokens, and
train loss against tokens (needs matplotlib: pip install -e ".[plot]"). Simulated runs
(summary "simulated") get the simulator's columns (virtual time, staleness, drift, idle),
and their plot's third panel is eval loss against virtual seconds.
"""

import argparse
import json
import pathlib

from lowcomm_jax.run import identity
from lowcomm_jax.config.doc import host_row
from lowcomm_jax.run.metric_names import widths_of

COLUMNS = [("run", "{}"), ("algorithm", "{}"), ("num_workers", "{}"), ("inner_steps", "{}"),
           ("rounds", "{}"), ("eval_loss", "{:.4f}"), ("tokens", "{:,}"),
           ("MiB sent/worker", "{:,.1f}"), ("DDP/this bytes", "{:.1f}"), ("wall_seconds", "{:.0f}"),
           ("peak MiB/sync", "{:,.2f}")]


SIM_COLUMNS = [("run", "{}"), ("algorithm", "{}"), ("heterogeneity", "{}"), ("dylu", "{}"),
               ("num_workers", "{}"), ("total_inner_steps", "{:,}"), ("eval_loss", "{:.4f}"),
               ("virtual_seconds", "{:,.1f}"), ("mean_staleness", "{:.2f}"),
               ("mean_drift", "{:.4f}"), ("mean idle", "{:.2f}"), ("MiB sent/worker", "{:,.1f}"),
               ("peak MiB/sync", "{:,.2f}")]


def read_metrics(workdir: pathlib.Path) -> list[dict]:
  """The metric rows of metrics.jsonl as the run trained: a resume under a changed config
  (an `"event": "resume"` row at step s) supersedes the rows logged before it past s; a
  line a crash cut short is skipped."""
  rows = []
  for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines():
    try:
      row = json.loads(line)
    except ValueError:
      continue
    if not isinstance(row, dict) or "step" not in row:
      continue
    if "event" in row:
      rows = [r for r in rows if r["step"] <= row["step"]]
    else:
      rows.append(row)
  return rows


def has_summary(workdir: pathlib.Path) -> bool:
  """Whether the run in `workdir` finished: a run writes summary.json as it ends."""
  return (pathlib.Path(workdir) / "summary.json").is_file()


def read_summary(workdir: pathlib.Path) -> dict:
  """The finished run's summary.json (benches and tables read runs through here)."""
  return json.loads((pathlib.Path(workdir) / "summary.json").read_text())


def summary_row(workdir: pathlib.Path) -> dict:
  s = read_summary(workdir)
  sent = s["bytes_sent"]  # 0 for a lone worker: it talks to nobody
  row = {**s, "run": pathlib.Path(workdir).name, "MiB sent/worker": sent / 2**20,
         # The largest single sync (runs from before it was recorded: unknown).
         "peak MiB/sync": s.get("bytes_sent_peak_sync", float("nan")) / 2**20,
         "DDP/this bytes": s["bytes_sent_ddp_equivalent"] / sent if sent else float("nan")}
  if s.get("simulated"):
    row["mean idle"] = sum(w["idle_fraction"] for w in s["workers"]) / len(s["workers"])
  return row


def markdown_table(workdirs) -> str:
  rows = [{**summary_row(w), "run": name} for name, w in zip(labels(workdirs), workdirs)]
  columns = SIM_COLUMNS if rows and all(r.get("simulated") for r in rows) else COLUMNS
  lines = ["| " + " | ".join(name for name, _ in columns) + " |",
           "|" + "---|" * len(columns)]
  for row in rows:
    lines.append("| " + " | ".join(fmt.format(row[name]) for name, fmt in columns) + " |")
  return "\n".join(lines)


def read_config(workdir: pathlib.Path) -> dict | None:
  """The run's config as a nested dict (config.json's "config", written by the runner);
  None without a readable config.json (runs from before it was written)."""
  try:
    return json.loads((pathlib.Path(workdir) / "config.json").read_text())["config"]
  except (OSError, ValueError, KeyError):
    return None


MISSING = object()  # a field one run's config lacks (written by another version)


def _cell(value) -> str:
  if value is MISSING:
    return "—"
  if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
    text = "[" + ", ".join(host_row(v) for v in value) + "]"
  else:
    text = repr(value)
  return text.replace("|", "\\|")


def labels(workdirs) -> list[str]:
  """Each run's name: its workdir's last part, or the whole path where two would clash."""
  names = [pathlib.Path(w).name for w in workdirs]
  return names if len(set(names)) == len(names) else [str(w) for w in workdirs]


def config_diff(workdirs) -> str:
  """A markdown table of the config fields whose values differ between the runs (one row
  per field, a column per run), and a note naming runs without config.json."""
  names = labels(workdirs)
  configs = {n: read_config(w) for n, w in zip(names, workdirs)}
  flat = {n: identity.flatten(c) for n, c in configs.items() if c is not None}
  lines = []
  if len(flat) >= 2:
    fields = list(dict.fromkeys(f for c in flat.values() for f in c))
    differ = [f for f in fields if len({json.dumps(c[f], sort_keys=True) if f in c else None
                                        for c in flat.values()}) > 1]
    if differ:
      lines += ["| field | " + " | ".join(flat) + " |", "|" + "---|" * (len(flat) + 1)]
      lines += ["| " + " | ".join([f] + [_cell(c.get(f, MISSING)) for c in flat.values()])
                + " |" for f in differ]
    else:
      lines.append(f"The configs of {', '.join(flat)} are identical.")
  missing = [n for n, c in configs.items() if c is None]
  if missing:
    note = f"No readable config.json (not compared): {', '.join(missing)}."
    lines += [""] * bool(lines) + [note]  # a blank line: the note is no table row
  return "\n".join(lines)


def _bytes_unit(largest: float) -> tuple[str, int]:
  return ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)


def _last_by_width(records) -> dict[float, float]:
  """{width: eval loss} of the last row that has per-width eval losses (Run.evaluation's
  `eval_loss/tier_<w>`), widths ascending; {} where none has."""
  for row in reversed(records):
    found = {float(w): v for w, v in widths_of(row).items()}
    if found:
      return dict(sorted(found.items()))
  return {}


def plot(workdirs, out: pathlib.Path):
  """Writes the PNG and returns the matplotlib figure. Panels: eval loss vs bytes sent per
  worker (log x when the runs' totals differ more than tenfold), eval loss vs tokens, and
  train loss vs tokens, or for simulated runs eval loss vs virtual seconds; where a run
  evaluated several MatFormer widths, also its last eval loss vs FFN width."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError as e:
    raise SystemExit('plotting needs matplotlib: pip install -e ".[plot]"') from e
  runs = {name: read_metrics(w) for name, w in zip(labels(workdirs), workdirs)}
  simulated = all(records and "virtual_seconds" in records[-1] for records in runs.values())
  # Log x when the runs' totals differ by more than 10x (DDP vs DiLoCo vs a codec).
  totals = [max(r.get("bytes_sent", 0) for r in records) for records in runs.values() if records]
  unit, scale = _bytes_unit(max(totals, default=0))
  log_bytes = min(totals, default=0) > 0 and max(totals) > 10 * min(totals)
  # (x field, y field, x label, title)
  panels = [("bytes_sent", "eval_loss", f"bytes sent per worker ({unit}"
             + (", log scale)" if log_bytes else ")"), "eval loss vs bytes sent per worker"),
            ("tokens", "eval_loss", "tokens (all workers)", "eval loss vs tokens")]
  panels.append(("virtual_seconds", "eval_loss", "virtual seconds", "eval loss vs virtual time")
                if simulated else
                ("tokens", "train_loss", "tokens (all workers)",
                 "train loss (mean over workers) vs tokens"))
  widths = {name: _last_by_width(records) for name, records in runs.items()}
  if any(widths.values()):
    panels.append(("width", "eval_loss", "FFN width (fraction of the full model's)",
                   "last eval loss vs MatFormer width"))
  fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2))
  for name, records in runs.items():
    if widths[name]:
      ax = axes[-1]
      ax.plot(list(widths[name]), list(widths[name].values()), marker="o", label=name)
    for ax, (x, y, _, _) in zip(axes, panels):
      if x == "width":  # drawn above, from the last evaluation
        continue
      points = [r for r in records if y in r and x in r]
      if x == "bytes_sent":
        points = [r for r in points if r[x] > 0 or not log_bytes]  # log axes drop zeros
      xs = [r[x] / scale if x == "bytes_sent" else r[x] for r in points]
      ax.plot(xs, [r[y] for r in points], marker="o" if y == "eval_loss" else None, label=name)
  for ax, (x, y, xlabel, title) in zip(axes, panels):
    if x == "bytes_sent" and log_bytes:
      ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(y.replace("_", " "))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  return fig


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdirs", nargs="+", type=pathlib.Path)
  parser.add_argument("--plot", type=pathlib.Path,
                      help="write eval loss vs bytes sent and vs tokens to this PNG")
  args = parser.parse_args(argv)
  print(markdown_table(args.workdirs))
  diff = config_diff(args.workdirs)
  if diff:
    print("\nConfig fields that differ:\n" if diff.startswith("|") else "")
    print(diff)
  if args.plot:
    plot(args.workdirs, args.plot)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
  main()
