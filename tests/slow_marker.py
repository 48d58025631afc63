"""The `slow` marker, by a measured rule: a test is slow if it took over SLOW_OVER_S
seconds (setup, call and teardown together) in any of the clean CI runs recorded in
tests/durations.txt, which keeps each test's largest. One run moved tests across the line
from recording to recording (39 of them at 2 s); the largest of several holds. A test with
no recorded duration is quick until the next recording (a new test is small unless its
author marks it `slow`, as the Ray runs over 30 s are). `python -m pytest -q -m "not
slow"` leaves the slow ones out. A run of the quick set alone is recorded too: there a quick
test pays the compiles that, in the whole suite, a slow test ahead of it left in the
persistent compile cache, so its time in the whole suite understates it.

To record one more run (BUILD_NOTES.md, "The slow marker"), run CI with every duration
printed and add its log:

  PYTEST_ADDOPTS="--durations=0 --durations-min=0.5" bash .ci/run > ci.log 2>&1
  python tests/slow_marker.py --from ci.log --commit $(git rev-parse --short HEAD)

and the quick set alone the same way (PYTEST_ADDOPTS as above, `python -m pytest -q -m "not
slow"`), with `--commit "$(git rev-parse --short HEAD) (quick set alone)"`.
"""

import argparse
import collections
import pathlib
import re

SLOW_OVER_S = 1.0  # the quick set's budget: under 3 minutes on 2 cores (BUILD_NOTES)
DURATIONS = pathlib.Path(__file__).with_name("durations.txt")
_LINE = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S.*)$")


def from_log(text: str) -> dict[str, float]:
  """Each test's seconds (its phases added) from pytest's "slowest durations" lines."""
  seconds: dict[str, float] = collections.defaultdict(float)
  for line in text.splitlines():
    if m := _LINE.match(line.strip()):
      seconds[m.group(3).strip()] += float(m.group(1))
  return dict(seconds)


def read(path: pathlib.Path = DURATIONS) -> dict[str, float]:
  """The recorded durations: {node id: seconds}."""
  out = {}
  for line in path.read_text().splitlines():
    if line.strip() and not line.startswith("#"):
      seconds, node = line.split(None, 1)
      out[node.strip()] = float(seconds)
  return out


def slow(durations: dict[str, float], over_s: float = SLOW_OVER_S) -> set[str]:
  return {node for node, seconds in durations.items() if seconds > over_s}


def runs(path: pathlib.Path = DURATIONS) -> list[str]:
  """The commits of the CI runs the file records (its first line names them)."""
  first = path.read_text().splitlines()[0] if path.exists() else ""
  m = re.search(r"runs? at (.+)$", first)
  return [c.strip() for c in m.group(1).split(", ")] if m else []


def merged(recorded: dict[str, float], measured: dict[str, float]) -> dict[str, float]:
  """Each test's largest seconds over the recorded runs and one more."""
  return {node: max(recorded.get(node, 0.0), measured.get(node, 0.0))
          for node in set(recorded) | set(measured)}


def write(durations: dict[str, float], commits: list[str],
          path: pathlib.Path = DURATIONS) -> None:
  header = (f"# Per-test seconds (setup + call + teardown), the largest of the recorded runs "
            f"at {', '.join(commits)}\n"
            "# (clean CI runs, bash .ci/run, and the quick set alone, -m 'not slow'; 2 cores,\n"
            "# pytest-xdist's 2 workers; tests under 0.5 s not listed). Tests over "
            f"{SLOW_OVER_S:g} s are\n# marked slow (tests/slow_marker.py).\n")
  rows = sorted(durations.items(), key=lambda kv: (-kv[1], kv[0]))
  path.write_text(header + "".join(f"{s:.2f} {node}\n" for node, s in rows))


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--from", dest="log", required=True, help="a CI log with durations")
  parser.add_argument("--commit", required=True, help="the commit that run tested (with "
                      "' (quick set alone)' after it for a run of -m 'not slow')")
  args = parser.parse_args()
  measured = from_log(pathlib.Path(args.log).read_text())
  if not measured:
    raise SystemExit(f"--from {args.log}: no 'slowest durations' lines; run pytest with "
                     "--durations=0 --durations-min=0.5")
  recorded = read() if DURATIONS.exists() else {}
  durations = merged(recorded, measured)
  write(durations, runs() + [args.commit])
  moved = slow(durations) - slow(recorded)
  print(f"{len(durations)} tests, {len(slow(durations))} over {SLOW_OVER_S:g} s in one of the "
        f"runs ({len(moved)} more than before): {DURATIONS}")
