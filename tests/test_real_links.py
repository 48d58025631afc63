"""bench/real_links.py: network namespaces behind tbf-limited links (issue 54). Runs where
root, iproute2 and namespaces are available (CI runs as root); skipped elsewhere, saying why."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, bench_module

real_links = bench_module("real_links")


def _why_not() -> str | None:
  try:
    real_links.preflight()
  except real_links.LinksError as e:
    return str(e)
  return None


needs_links = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


@needs_links
def test_a_transfer_takes_its_bytes_over_the_rate_and_nothing_is_left():
  with real_links.Links(2, 80) as links:
    seconds = real_links.probe(links, 0, 1, 10_000_000)
    made = links.leftovers()
  ideal = 10_000_000 * 8 / 80e6  # 1.0 s
  # tbf lets one bucket (10 ms of traffic) through at once; headers add ~4% on the wire
  assert 0.95 * ideal <= seconds <= 1.5 * ideal, seconds
  assert len(made) == 2 + 2 + 1  # two namespaces, two bridge-side veths, the bridge
  assert links.leftovers() == []


@needs_links
def test_an_error_inside_takes_the_links_and_their_processes_down():
  with pytest.raises(ValueError, match="boom"):
    with real_links.Links(2, 50) as links:
      sleeper = links.run(1, ["sleep", "60"])
      raise ValueError("boom")
  assert sleeper.wait(timeout=10) != 0  # killed with its namespace
  assert links.leftovers() == []


@needs_links
def test_sigterm_tears_the_links_down():
  proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "real_links.py"), "--nodes",
                           "2", "--", "sleep", "60"])
  links = real_links.Links(2, 50, tag=f"{proc.pid % 100000:05d}")
  deadline = time.time() + 20
  while len(links.leftovers()) < 5 and time.time() < deadline:
    time.sleep(0.1)
  assert len(links.leftovers()) == 5, links.leftovers()
  proc.send_signal(signal.SIGTERM)
  proc.wait(timeout=30)
  assert links.leftovers() == []


def test_without_root_it_refuses_in_one_line(monkeypatch):
  monkeypatch.setattr(os, "geteuid", lambda: 1000)
  with pytest.raises(real_links.LinksError, match="needs root") as e:
    real_links.preflight()
  assert "\n" not in str(e.value)


_MOVE = """
import os, time, numpy as np, ray
ray.init(address=os.environ["RAY_ADDRESS"])
make = ray.remote(resources={"node0": 0.01})(lambda: np.ones(10_000_000, np.uint8))
take = ray.remote(resources={"node1": 0.01})(lambda x: int(x.sum()))
ref = make.remote()
ray.wait([ref])
t = time.perf_counter()
assert ray.get(take.remote(ref)) == 10_000_000
print(time.perf_counter() - t)
"""


@needs_links
def test_a_ray_object_crosses_the_link_at_no_more_than_its_rate():
  """10 MB made on node 0 and read on node 1 moves over node 0's uplink and node 1's
  downlink, 80 Mb/s each: at least 1.0 s."""
  with real_links.Links(2, 80) as links:
    env = dict(real_links.ray_env(), RAY_ADDRESS=links.start_ray())
    driver = links.run(0, [sys.executable, "-c", _MOVE], env=env, stdout=subprocess.PIPE,
                       text=True)
    out, _ = driver.communicate(timeout=120)
    assert driver.returncode == 0, out
  assert float(out.split()[-1]) >= 0.95 * 10_000_000 * 8 / 80e6
  assert links.leftovers() == []
