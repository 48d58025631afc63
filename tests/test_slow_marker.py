"""The slow marker's measured rule (tests/slow_marker.py): the recorded durations name tests
that exist, and the tests over the threshold are the ones marked."""

import ast
import pathlib

import conftest
import pytest
import slow_marker

TESTS = pathlib.Path(__file__).parent


def test_the_recorded_durations_name_tests_that_exist():
  """A renamed or removed test would silently leave the quick set's rule: each recorded
  node id is a test function (or method) defined in its file."""
  functions: dict[str, set[str]] = {}
  missing = []
  for node in slow_marker.read():
    path, _, name = node.partition("::")
    name = name.split("[")[0].split("::")[-1]
    if path not in functions:
      file = TESTS.parent / path
      tree = ast.parse(file.read_text()) if file.exists() else ast.Module(body=[])
      functions[path] = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
    if name not in functions[path]:
      missing.append(node)
  assert not missing, f"tests/durations.txt names tests that are gone: {missing[:5]}"


def test_tests_over_the_threshold_are_marked_slow():
  durations = slow_marker.read()
  over = max(durations, key=durations.get)
  under = min(durations, key=durations.get)
  assert durations[over] > slow_marker.SLOW_OVER_S >= durations[under]

  class Item:
    def __init__(self, nodeid, markers=()):
      self.nodeid, self.markers = nodeid, list(markers)

    def add_marker(self, marker):
      self.markers.append(marker.name)

    def get_closest_marker(self, name):
      return name if name in self.markers else None

  # (a test marked `quick` stays in the quick set however long it took)
  items = [Item(over), Item(under), Item("tests/test_new.py::test_not_measured_yet"),
           Item(over, ["quick"])]
  conftest.pytest_collection_modifyitems(None, items)
  assert [i.markers for i in items] == [["slow"], [], [], ["quick"]]


def test_a_ci_log_gives_each_tests_phases_added(tmp_path):
  log = ("============ slowest durations ============\n"
         "12.50s call     tests/test_a.py::test_x[p-1]\n"
         "1.25s setup    tests/test_a.py::test_x[p-1]\n"
         "0.75s call     tests/test_b.py::test_y\n"
         "(3 durations < 0.5s hidden.)\n")
  measured = slow_marker.from_log(log)
  assert measured == {"tests/test_a.py::test_x[p-1]": 13.75, "tests/test_b.py::test_y": 0.75}
  slow_marker.write(measured, "abc1234", tmp_path / "d.txt")
  assert slow_marker.read(tmp_path / "d.txt") == measured
  assert slow_marker.slow(measured) == {"tests/test_a.py::test_x[p-1]"}


def test_a_new_recording_keeps_each_tests_largest_and_names_every_run(tmp_path):
  """One run moved tests across the line from recording to recording: the rule takes each
  test's largest over the runs recorded, so a test slow in either stays slow."""
  recorded = {"tests/test_a.py::test_x": 1.8, "tests/test_a.py::test_y": 0.6}
  measured = {"tests/test_a.py::test_x": 0.9, "tests/test_a.py::test_y": 1.7,
              "tests/test_b.py::test_z": 0.7}
  both = slow_marker.merged(recorded, measured)
  assert both == {"tests/test_a.py::test_x": 1.8, "tests/test_a.py::test_y": 1.7,
                  "tests/test_b.py::test_z": 0.7}
  assert slow_marker.slow(both) == {"tests/test_a.py::test_x", "tests/test_a.py::test_y"}
  path = tmp_path / "durations.txt"
  path.write_text("# Per-test seconds (setup + call + teardown) of one clean CI run at 84f9f4b\n")
  assert slow_marker.runs(path) == ["84f9f4b"]  # (the one-run header before this rule)
  slow_marker.write(both, ["84f9f4b", "1a130e9"], path)
  assert slow_marker.runs(path) == ["84f9f4b", "1a130e9"]
  quick = ["84f9f4b", "1a130e9", "3e26b0b (quick set alone)"]  # (a run of -m 'not slow')
  slow_marker.write(both, quick, path)
  assert slow_marker.runs(path) == quick
  assert slow_marker.read(path) == pytest.approx(both, abs=0.005)
