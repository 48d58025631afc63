"""Joining processes (issue 14): a process that never starts is named within
distributed.join_timeout_s, and the coordinator listens only on its own address."""

import ipaddress
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, xla_flags
from lowcomm_jax.parallel import distributed, roll_call


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(port: int, num: int, pid: int) -> dict:
  env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
             JAX_NUM_PROCESSES=str(num), JAX_PROCESS_ID=str(pid), JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags())  # one device per process
  return env


def _main(port: int, num: int, pid: int, *args: str) -> subprocess.Popen:
  return subprocess.Popen(
      [sys.executable, "-m", "lowcomm_jax.main", "--config=configs/smoke.py",
       "--workdir=/nonexistent/never_written", *args],
      cwd=REPO, env=_env(port, num, pid), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True)


def _error_line(err: str) -> str:
  lines = [l for l in err.splitlines() if l.startswith("lowcomm_jax: error:")]
  assert len(lines) == 1, err[-3000:]
  return lines[0]


def test_a_process_that_never_starts_is_named_within_the_join_timeout():
  port = _free_port()
  t0 = time.time()
  proc = _main(port, 2, 0, "--config.distributed.join_timeout_s=5")  # process 1 never starts
  _, err = proc.communicate(timeout=180)
  elapsed = time.time() - t0
  assert proc.returncode == 2, err[-3000:]
  assert _error_line(err) == (
      f"lowcomm_jax: error: process 1 of 2 did not join 127.0.0.1:{port} within "
      "distributed.join_timeout_s=5; start it with the same coordinator_address and "
      "num_processes, or raise join_timeout_s")
  # A 5 s join timeout plus start-up (import and backend: up to ~30 s beside another
  # CPU-heavy job); JAX alone: 300 s of silence, then "another task died".
  assert elapsed < 120, elapsed
  # While it waits it says whom for, and for how long (after 2 s, then every 10 s).
  assert (f"process 0: waiting on 127.0.0.1:{port} for process 1 of 2 (giving up in "
          in err), err[-3000:]


def test_a_process_whose_coordinator_never_starts_says_so():
  port = _free_port()
  proc = _main(port, 2, 1, "--config.distributed.join_timeout_s=3")
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 2, err[-3000:]
  assert _error_line(err).startswith(
      f"lowcomm_jax: error: process 1 could not reach process 0 (the coordinator) at "
      f"127.0.0.1:{port} within distributed.join_timeout_s=3")
  assert (f"process 1: waiting for process 0 (the coordinator) at 127.0.0.1:{port} (giving "
          "up in" in err), err[-3000:]


def _roll_call(num, pids, timeout_s, port):
  """roll_call for `pids` in threads: {pid: None (joined) or the DistributedError's text}."""
  out = {}

  def one(pid):
    try:
      roll_call.roll_call(f"127.0.0.1:{port}", f"127.0.0.1:{port}", num, pid, timeout_s)
      out[pid] = None
    except distributed.DistributedError as e:
      out[pid] = str(e)
  threads = [threading.Thread(target=one, args=(p,)) for p in pids]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=timeout_s + 20)
  return out


def test_roll_call_releases_everyone_once_all_are_present():
  assert _roll_call(4, [3, 1, 0, 2], 10, _free_port()) == {0: None, 1: None, 2: None, 3: None}


def test_the_others_hear_which_process_is_missing():
  port = _free_port()
  out = _roll_call(4, [0, 2, 3], 2, port)
  reason = f"process 1 of 4 did not join 127.0.0.1:{port} within distributed.join_timeout_s=2"
  assert out[0].startswith(reason), out
  assert out[2].startswith(f"process 2: process 0 stopped the join: {reason}"), out
  assert out[3].startswith("process 3: process 0 stopped the join: "), out


def _in_background(out: dict, name: str, num: int, pids: list[int], timeout_s: float,
                   port: int) -> threading.Thread:
  """_roll_call in a thread (result in out[name]), given a moment to start listening."""
  thread = threading.Thread(
      target=lambda: out.update({name: _roll_call(num, pids, timeout_s, port)}))
  thread.start()
  time.sleep(0.3)
  return thread


def test_a_process_started_with_another_count_is_refused_and_named():
  port = _free_port()
  out = {}
  zero = _in_background(out, "zero", 2, [0], 2, port)
  with pytest.raises(distributed.DistributedError, match="process 0 runs 2 processes, not 3"):
    roll_call.roll_call(f"127.0.0.1:{port}", "", 3, 1, 5)
  zero.join()
  assert "refused a process: process 0 runs 2 processes, not 3" in out["zero"][0]


def _listening(port: int) -> set[str]:
  """Addresses in LISTEN state on `port`, from /proc/net/tcp{,6} (IPv4-mapped as IPv4)."""
  found = set()
  for name in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
      rows = pathlib.Path(name).read_text().splitlines()[1:]
    except OSError:
      continue
    for row in rows:
      fields = row.split()
      address, hex_port = fields[1].split(":")
      if fields[3] != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
        continue
      raw = bytes.fromhex(address)
      raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
      ip = ipaddress.ip_address(raw)
      found.add(str(getattr(ip, "ipv4_mapped", None) or ip))
  return found


_JOIN = """
import runpy, sys, jax
from lowcomm_jax.parallel import distributed
distributed.initialize(runpy.run_path("configs/smoke.py")["get_config"]())
if jax.process_index() == 0:
  print("LISTENING", sys.argv[1], flush=True)
  sys.stdin.readline()  # the test reads the sockets, then lets it finish
jax.distributed.shutdown()
"""


@pytest.mark.skipif(not pathlib.Path("/proc/net/tcp").exists(), reason="needs /proc/net/tcp")
def test_two_processes_join_and_the_coordinator_listens_on_its_address_only():
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, "-c", _JOIN, str(port)], cwd=REPO,
                            env=_env(port, 2, pid), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for pid in (0, 1)]
  try:
    line = procs[0].stdout.readline()
    assert line.startswith("LISTENING"), procs[0].stderr.read()[-3000:]
    # JAX's default would be every interface ('::', IPv4 and IPv6).
    assert _listening(port) == {"127.0.0.1"}, _listening(port)
    procs[0].stdin.write("\n")
    procs[0].stdin.flush()
    for p in procs:
      assert p.wait(timeout=60) == 0, p.stderr.read()[-3000:]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


def test_the_bind_address_defaults_to_the_coordinator_and_can_be_set(monkeypatch, smoke_config):
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:4321")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAX_PROCESS_ID", "0")
  monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
  args = distributed.settings(smoke_config(**{"distributed.join_timeout_s": 7}))
  assert args["coordinator_bind_address"] == "127.0.0.1:4321"
  assert args["initialization_timeout"] == 7
  args = distributed.settings(smoke_config(
      **{"distributed.coordinator_bind_address": "0.0.0.0:4321"}))
  assert args["coordinator_bind_address"] == "0.0.0.0:4321"


def test_slurm_settings_get_the_same_default_bind(monkeypatch, smoke_config):
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
               "JAX_COORDINATOR_BIND_ADDRESS"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("SLURM_NTASKS", "2")
  monkeypatch.setenv("SLURM_PROCID", "1")
  monkeypatch.setenv("SLURM_LOCALID", "0")
  monkeypatch.setenv("SLURM_STEP_NODELIST", "node[07-08]")
  monkeypatch.setenv("SLURM_JOB_ID", "4242")
  args = distributed.settings(smoke_config())
  assert args["coordinator_address"].startswith("node07:")
  assert (args["num_processes"], args["process_id"]) == (2, 1)
  assert args["coordinator_bind_address"] == args["coordinator_address"]


def test_a_host_name_on_loopback_binds_everywhere_rather_than_shut_out_the_others(monkeypatch):
  def resolves_to(ip):
    monkeypatch.setattr(distributed.socket, "getaddrinfo",
                        lambda *a, **k: [(socket.AF_INET, 1, 6, "", (ip, 1234))])
  # Debian maps the machine's own name to 127.0.1.1: binding there would refuse other hosts.
  resolves_to("127.0.1.1")
  assert distributed._own_address("myhost:1234") == "[::]:1234"
  resolves_to("10.1.2.3")
  assert distributed._own_address("myhost:1234") == "myhost:1234"
  assert distributed._own_address("127.0.0.1:1234") == "127.0.0.1:1234"
  assert distributed._own_address("[::1]:1234") == "[::1]:1234"


def test_a_process_that_died_mid_join_can_rejoin_but_a_live_duplicate_id_is_refused():
  port = _free_port()
  out = {}
  zero = _in_background(out, "zero", 3, [0], 10, port)
  # Process 1 says hello, then dies (its connection closes) and is started again.
  with socket.create_connection(("127.0.0.1", port)) as dead:
    dead.sendall(b"lowcomm-join-v1 1 3\n")
    time.sleep(0.3)
  # A second live process claiming id 1 beside the restarted one is refused.
  first = _in_background(out, "one", 3, [1], 10, port)
  with pytest.raises(distributed.DistributedError, match="process id 1 is taken"):
    roll_call.roll_call(f"127.0.0.1:{port}", "", 3, 1, 5)
  assert _roll_call(3, [2], 10, port) == {2: None}
  first.join()
  zero.join()
  assert out["one"] == {1: None} and out["zero"] == {0: None}
