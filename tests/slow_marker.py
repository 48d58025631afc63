"""The `slow` marker, by a measured rule: a test is slow if it took over SLOW_OVER_S
seconds (setup, call and teardown together) in one clean CI run, whose per-test durations
are kept in tests/durations.txt. `python -m pytest -q -m "not slow"` leaves them out.

To measure again (BUILD_NOTES.md, "The slow marker"), run CI with every duration printed
and rewrite the file from its log:

  PYTEST_ADDOPTS="--durations=0 --durations-min=0.5" bash .ci/run > ci.log 2>&1
  python tests/slow_marker.py --from ci.log --commit $(git rev-parse --short HEAD)
"""

import argparse
import collections
import pathlib
import re

SLOW_OVER_S = 1.5  # the quick set's budget: under 3 minutes on 2 cores (BUILD_NOTES)
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


def write(durations: dict[str, float], commit: str, path: pathlib.Path = DURATIONS) -> None:
  header = (f"# Per-test seconds (setup + call + teardown) of one clean CI run at {commit}\n"
            "# (bash .ci/run, 2 cores, pytest-xdist's 2 workers; tests under 0.5 s not\n"
            f"# listed). Tests over {SLOW_OVER_S:g} s are marked slow (tests/slow_marker.py).\n")
  rows = sorted(durations.items(), key=lambda kv: (-kv[1], kv[0]))
  path.write_text(header + "".join(f"{s:.2f} {node}\n" for node, s in rows))


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--from", dest="log", required=True, help="a CI log with durations")
  parser.add_argument("--commit", required=True, help="the commit that CI run tested")
  args = parser.parse_args()
  measured = from_log(pathlib.Path(args.log).read_text())
  if not measured:
    raise SystemExit(f"--from {args.log}: no 'slowest durations' lines; run pytest with "
                     "--durations=0 --durations-min=0.5")
  write(measured, args.commit)
  print(f"{len(measured)} tests, {len(slow(measured))} over {SLOW_OVER_S:g} s: {DURATIONS}")
