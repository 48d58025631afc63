"""Training speed with pauses: steps/s on rounds that evaluate and checkpoint against plain
rounds, with the real runner (a timing check, so a benchmark rather than a test; the logic
is tested with a scripted clock in tests/test_run_loop.py).

  python bench/pause_timing.py [--eval_sleep_s 3] [--inner_steps 256]

Each evaluation is made 3 s slower (as real evaluations take a while): it must not count as
training. Rounds of ~0.5 s (smoke config, H = 256) keep re-dispatching after a pause small
beside them. Prints every round's steps/s and the ratio paused/plain (medians); exits 1
unless it lies in [0.5, 2]. Run it alone on the machine.
"""

import argparse
import json
import os
import pathlib
import runpy
import statistics
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))

from lowcomm_jax import report  # noqa: E402
from lowcomm_jax.runtimes.spmd import driver  # noqa: E402
from lowcomm_jax.runtimes.spmd import train


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--eval_sleep_s", type=float, default=3.0)
  parser.add_argument("--inner_steps", type=int, default=256)
  args = parser.parse_args()
  config = runpy.run_path(str(REPO / "configs" / "smoke.py"))["get_config"]()
  config.rounds, config.inner_steps = 6, args.inner_steps
  config.eval_every, config.checkpoint_every = 2, 2
  evaluate = driver.RoundDriver.evaluate
  driver.RoundDriver.evaluate = lambda self: (time.sleep(args.eval_sleep_s), evaluate(self))[1]
  with tempfile.TemporaryDirectory() as workdir:
    train.run(config, workdir)
    rows = report.read_metrics(workdir)
  speed = {r["round"]: r["steps_per_second"] for r in rows if "steps_per_second" in r}
  plain = statistics.median(speed[k] for k in (3, 5))  # round 1 compiles
  paused = statistics.median(speed[k] for k in (2, 4, 6))
  print(json.dumps({"steps_per_second": speed, "paused_over_plain": paused / plain}))
  return 0 if 0.5 < paused / plain < 2 else 1


if __name__ == "__main__":
  sys.exit(main())
