"""Watch a collaborative run (collab.target_batch_size > 0): epoch, samples/s per peer and in
all, loss and ETA, printed and written to TensorBoard.

  python launch/monitor.py --workdir=DIR [--interval=1]

It reads the rows process 0 appends to DIR/collab.jsonl (lowcomm_jax/runtimes/spmd/collab.py): one
per finished epoch, within an epoch one a second with every peer's samples so far, and one where a
restart resumed (the epochs after that checkpoint are redone and appear again). It joins no
collective and holds no device, so it can start before the peers, restart at any time, and run on
any machine that sees DIR. TensorBoard events go to DIR/monitor. It stops once DIR/summary.json
exists (the run finished) and every row is read, or on SIGTERM / Ctrl-C. `launch/local.py --monitor`
starts one beside the peers and stops it with them.
"""

import argparse
import json
import pathlib
import signal
import sys
import time

from lowcomm_jax.run.metrics import EventWriter, format_eta

PROGRESS_FILE = "collab.jsonl"  # = lowcomm_jax.runtimes.spmd.collab.PROGRESS_FILE (no training code here)
ETA_EPOCHS = 5  # the ETA extrapolates the mean of the last few epochs


class Monitor:
  """Turns new rows of a run's progress file into status lines and TensorBoard scalars."""

  def __init__(self, workdir: pathlib.Path, writer: EventWriter | None = None):
    self.path = pathlib.Path(workdir) / PROGRESS_FILE
    self.offset = 0
    self.epoch_seconds: list[float] = []
    self.writer = writer

  def poll(self) -> list[str]:
    """Status lines for the complete rows written since the last call."""
    if not self.path.exists():
      return []
    with self.path.open("rb") as f:
      f.seek(self.offset)
      data = f.read()
    end = data.rfind(b"\n") + 1  # a row still being written waits for the next poll
    self.offset += end
    lines = []
    for raw in data[:end].splitlines():
      try:
        row = json.loads(raw)
      except json.JSONDecodeError:  # a row cut short by a crash, ended by the restart
        continue
      if "resumed_at" in row:  # a restart: later epochs are redone, the ETA starts over
        self.epoch_seconds = []
        lines.append(f"resumed from the checkpoint of epoch {row['resumed_at']}")
      else:
        lines.append(self.live(row) if row.get("live") else self.epoch(row))
    return lines

  def live(self, row: dict) -> str:
    samples = row["samples"]
    peers = ", ".join(f"peer {i}: {n}" for i, n in enumerate(samples))
    return f"epoch {row['epoch']}: {sum(samples)}/{row['target']} samples ({peers})"

  def epoch(self, row: dict) -> str:
    wall = row["epoch_seconds"]
    self.epoch_seconds = (self.epoch_seconds + [wall])[-ETA_EPOCHS:]
    per_peer = [n / wall if wall else 0.0 for n in row["samples"]]
    total = sum(per_peer)
    eta = (row["rounds"] - row["epoch"]) * sum(self.epoch_seconds) / len(self.epoch_seconds)
    if self.writer is not None:
      scalars = {"samples_per_s": total, "train_loss": row["train_loss"],
                 "epoch_seconds": wall, "eta_s": eta, "samples": sum(row["samples"])}
      scalars.update({f"samples_per_s_peer_{i}": v for i, v in enumerate(per_peer)})
      self.writer.write_scalars(row["epoch"], scalars)
    peers = ", ".join(f"peer {i}: {v:,.1f}" for i, v in enumerate(per_peer))
    return (f"epoch {row['epoch']}/{row['rounds']}  loss {row['train_loss']:.4f}  "
            f"{total:,.1f} samples/s ({peers})  {wall:.2f} s/epoch  ETA {format_eta(eta)}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True, help="the run's --workdir")
  parser.add_argument("--interval", type=float, default=1.0, help="seconds between reads")
  args = parser.parse_args(argv)
  workdir = pathlib.Path(args.workdir)
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the launcher's stop: a clean exit
  writer = EventWriter(workdir / "monitor")
  monitor = Monitor(workdir, writer)
  print(f"watching {workdir / PROGRESS_FILE}", flush=True)
  summary = workdir / "summary.json"
  before = summary.stat().st_mtime_ns if summary.exists() else None  # an earlier finish
  try:
    while True:
      # Checked before reading, so no row written before the summary is missed.
      finished = summary.exists() and summary.stat().st_mtime_ns != before
      for line in monitor.poll():
        print(line, flush=True)
      if finished:
        print("the run finished", flush=True)
        return 0
      time.sleep(args.interval)
  except KeyboardInterrupt:
    return 0
  finally:
    writer.close()


if __name__ == "__main__":
  sys.exit(main())
