"""A driver that can die (issue 71, runtimes/ray/records.py): on a Ray cluster started apart
from the driver (`ray start`, `ray.address`), the driver is killed (SIGKILL) mid-round, the
same command is run again, and it goes on from the newest closed round the live workers
hold a record of (no checkpoint was written before the kill). It ends bit-equal to a run
never interrupted, which is what a replay that lost only the round in flight computes
(`ray.apply_order='dispatch'`: the redone round starts from the same states and data), and
nothing of the run is left on the cluster."""

import ast
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

from conftest import REPO, load_config, ray_checkpoint

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

FIELDS = {"runtime": "ray", "algorithm": "diloco", "num_workers": 2, "rounds": 7,
          "inner_steps": 2, "eval_every": 7, "checkpoint_every": 100, "log_every": 1,
          "mesh.replica": 1, "ray.apply_order": "dispatch",
          "ray.step_sleep_s": (0.5, 0.5)}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env() -> dict:
  return dict(os.environ, RAY_AUTH_MODE="disabled", RAY_worker_niceness="0")


@pytest.fixture(scope="module")
def cluster():
  """A Ray head started apart from any driver (`ray start --head --block`, its own process
  group), stopped at the end; shared by the module's tests (each run is in a namespace of
  its own workdir, and each test checks that nothing of its run is left)."""
  port, temp = _free_port(), tempfile.mkdtemp(prefix="rd", dir="/tmp")
  head = subprocess.Popen(
      [str(os.path.join(os.path.dirname(sys.executable), "ray")), "start", "--head",
       f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=4",
       "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}", "--block"],
      env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
      start_new_session=True)
  address = f"127.0.0.1:{port}"
  deadline = time.time() + 60
  while time.time() < deadline:
    try:
      socket.create_connection(("127.0.0.1", port), timeout=1).close()
      break
    except OSError:
      time.sleep(0.5)
  time.sleep(3)  # (the GCS answers before the raylet has joined)
  yield address
  os.killpg(head.pid, signal.SIGKILL)  # the head and every Ray process it started
  head.wait()
  shutil.rmtree(temp, ignore_errors=True)


def _command(address: str, workdir) -> list[str]:
  flags = [f"--config.{k}={v if not isinstance(v, tuple) else ','.join(map(str, v))}"
           for k, v in FIELDS.items()]
  return [sys.executable, "-m", "lowcomm_jax.main", "--config=configs/smoke.py", *flags,
          f"--config.ray.address={address}", f"--workdir={workdir}"]


class _Lines:
  """A process's stderr, read as it comes (a thread): its log lines so far."""

  def __init__(self, process):
    self.lines = []
    self._thread = threading.Thread(target=lambda: self.lines.extend(process.stderr),
                                    daemon=True)
    self._thread.start()

  def rounds(self) -> int:
    """The rounds the driver has logged (`round k/n`)."""
    done = [int(m.group(1)) for line in list(self.lines)
            if (m := re.search(r"round (\d+)/\d+ ", line))]
    return max(done, default=0)


def _named_actors(address: str, workdir, kill_one: bool = False) -> list[str]:
  """The run's actors still on the cluster (asked from a process of its own); with
  `kill_one`, the first of them killed first."""
  from lowcomm_jax.runtimes.ray.cluster import namespace
  probe = ("import ray, sys; ray.init(address=sys.argv[1], namespace=sys.argv[2], "
           "log_to_driver=False); names = sorted(ray.util.list_named_actors()); "
           "sys.argv[3] == 'kill' and ray.kill(ray.get_actor(names.pop(0))); print(names)")
  out = subprocess.run([sys.executable, "-c", probe, address, namespace(workdir),
                        "kill" if kill_one else "-"],
                       env=_env(), capture_output=True, text=True, timeout=120, check=True)
  return ast.literal_eval(out.stdout.strip().splitlines()[-1])  # (a list of names)


def _killed_at_round_4(address: str, workdir) -> None:
  """The command started, then killed (SIGKILL) inside round 4."""
  first = subprocess.Popen(_command(address, workdir), cwd=REPO, env=_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  log, deadline = _Lines(first), time.time() + 300
  while log.rounds() < 3 and time.time() < deadline and first.poll() is None:
    time.sleep(0.05)
  assert first.poll() is None and log.rounds() == 3, "".join(log.lines)[-3000:]
  time.sleep(0.5)  # inside round 4's jobs (each sleeps 1 s)
  first.send_signal(signal.SIGKILL)
  first.wait()


def test_a_worker_that_dies_while_no_driver_runs_is_lost_and_the_run_goes_on(
    cluster, tmp_path):
  """The take-up's other path: a worker its record counts is gone (killed while the
  driver was dead), so it is lost with its job in flight, and the others go on."""
  workdir = tmp_path / "killed"
  _killed_at_round_4(cluster, workdir)
  assert len(_named_actors(cluster, workdir, kill_one=True)) == 1
  again = subprocess.run(_command(cluster, workdir), cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  assert [r["round"] for r in summary["recoveries"] if r["what"] == "driver"] == [4]
  assert summary["workers_lost"] == 1 and summary["rounds_closed"] == FIELDS["rounds"]
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert any(r.get("event") == "worker_lost" for r in rows)
  assert _named_actors(cluster, workdir) == []


def test_a_driver_killed_mid_round_is_taken_up_by_the_same_command_run_again(
    cluster, ray_cluster, tmp_path):
  workdir = tmp_path / "killed"
  command, env = _command(cluster, workdir), _env()
  _killed_at_round_4(cluster, workdir)
  assert len(_named_actors(cluster, workdir)) == 2  # the workers outlived their driver
  assert not (workdir / "summary.json").exists()

  started = time.time()
  again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  taken = [r for r in summary["recoveries"] if r["what"] == "driver"]
  assert len(taken) == 1 and taken[0]["round"] >= 4, summary["recoveries"]
  assert "taken up" in again.stderr and "resuming from" not in again.stderr
  assert summary["rounds_closed"] == FIELDS["rounds"]
  assert _named_actors(cluster, workdir) == []  # nothing of the run left on the cluster

  # The run never interrupted (a local Ray, in this process): the same θ, bit for bit
  from lowcomm_jax.runtimes.ray import driver
  config = load_config("smoke", **FIELDS)
  plain = driver.run(config, tmp_path / "plain")
  taken_up = load_config("smoke", **FIELDS, **{"ray.address": cluster})
  np.testing.assert_array_equal(ray_checkpoint(taken_up, workdir)[0]["global"]["params"],
                                ray_checkpoint(config, tmp_path / "plain")[0]["global"]["params"])
  assert summary["eval_loss"] == plain["eval_loss"]
  print(f"the command run again to its first committed round: "
        f"{taken[0]['at'] - started:.2f} s, of which {taken[0]['seconds']:.2f} s from its "
        f"connect (round {taken[0]['round']}; its jobs sleep 1 s)")
