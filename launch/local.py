"""Start N processes of one run on 127.0.0.1, stream their logs, stop them all together.

  python launch/local.py --num_processes 4 [--restarts K] [--heartbeat_timeout S] \
      [--devices_per_process D] [--monitor] -- --config=configs/diloco_hetero.py [--workdir=...]

Each process gets JAX_COORDINATOR_ADDRESS (a free port on 127.0.0.1), JAX_NUM_PROCESSES and
JAX_PROCESS_ID, and D forced CPU devices. Every log line is printed with a "[pI]" prefix.
When a process dies, the others are killed at once and the launcher exits non-zero naming
it and showing its last lines — or, with --restarts K, relaunches all of them (the run
resumes from its last checkpoint) up to K times. With --monitor, launch/monitor.py watches
the run's workdir beside them (a collaborative run's progress) and stops with them.
"""

import argparse
import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time

TAIL_LINES = 15
MONITOR_GRACE_S = 10  # seconds the monitor gets to read the last rows and close its files


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _pump(i: int | str, proc: subprocess.Popen, tail: collections.deque, lock: threading.Lock):
  for line in proc.stdout:
    tail.append(line.rstrip("\n"))
    with lock:
      sys.stdout.write(f"[{'p' if isinstance(i, int) else ''}{i}] {line}")
      sys.stdout.flush()


def workdir_of(main_args: list[str]) -> str | None:
  """The run's --workdir among the processes' arguments."""
  for i, arg in enumerate(main_args):
    if arg.startswith("--workdir="):
      return arg.split("=", 1)[1]
    if arg == "--workdir" and i + 1 < len(main_args):
      return main_args[i + 1]
  return None


def start_monitor(workdir: str, lock: threading.Lock) -> subprocess.Popen:
  """launch/monitor.py on the run's workdir, its lines prefixed "[monitor]"."""
  proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "monitor.py"),
                           f"--workdir={workdir}"], env=dict(os.environ, PYTHONUNBUFFERED="1"),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
  print(f"[launcher] monitor: pid {proc.pid}", flush=True)
  threading.Thread(target=_pump, args=("monitor", proc, collections.deque(maxlen=1), lock),
                   daemon=True).start()
  return proc


def stop_monitor(proc: subprocess.Popen, *, finished: bool) -> None:
  """After a finished run the monitor reads the last rows and exits by itself; otherwise, or if
  it does not, it is stopped (SIGTERM: it closes its TensorBoard file)."""
  if finished:
    try:
      proc.wait(timeout=MONITOR_GRACE_S)
      return
    except subprocess.TimeoutExpired:
      pass
  if proc.poll() is None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
      proc.wait(timeout=MONITOR_GRACE_S)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()


def launch_once(args, main_args: list[str]) -> tuple[int, int | None, list[str]]:
  """Runs all processes (and the monitor, with --monitor) to the end. Returns (exit code,
  failed process or None, its tail)."""
  port = free_port()
  procs, tails, threads = [], [], []
  lock = threading.Lock()
  monitor = start_monitor(workdir_of(main_args), lock) if args.monitor else None
  for i in range(args.num_processes):
    env = dict(os.environ,
               JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES=str(args.num_processes), JAX_PROCESS_ID=str(i),
               LOWCOMM_HEARTBEAT_TIMEOUT=str(args.heartbeat_timeout),
               PYTHONUNBUFFERED="1")
    if args.devices_per_process:
      env["JAX_PLATFORMS"] = "cpu"
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                          f"{args.devices_per_process}").strip()
    proc = subprocess.Popen([sys.executable, "-m", args.module, *main_args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    print(f"[launcher] process {i}: pid {proc.pid}", flush=True)
    tail = collections.deque(maxlen=TAIL_LINES)
    thread = threading.Thread(target=_pump, args=(i, proc, tail, lock), daemon=True)
    thread.start()
    procs.append(proc)
    tails.append(tail)
    threads.append(thread)

  failed = None
  try:
    while True:
      codes = [p.poll() for p in procs]
      failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
      if failed is not None or all(code == 0 for code in codes):
        break
      time.sleep(0.2)
  except KeyboardInterrupt:
    failed = -1
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)  # a survivor may be stuck in a collective
    for p in procs:
      p.wait()
    for t in threads:
      t.join(timeout=5)
    if monitor is not None:
      stop_monitor(monitor, finished=failed is None)
  if failed is None:
    return 0, None, []
  if failed == -1:
    return 130, None, []
  return procs[failed].returncode, failed, list(tails[failed])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--num_processes", type=int, required=True)
  parser.add_argument("--restarts", type=int, default=0,
                      help="relaunch everything from the last checkpoint up to K times")
  parser.add_argument("--heartbeat_timeout", type=int, default=60,
                      help="seconds before JAX's coordinator declares a silent process dead")
  parser.add_argument("--devices_per_process", type=int, default=1,
                      help="forced CPU devices per process (0: use the real accelerators)")
  parser.add_argument("--module", default="lowcomm_jax.main",
                      help="python module each process runs (e.g. bench.outer_step)")
  parser.add_argument("--monitor", action="store_true",
                      help="also run launch/monitor.py on the run's --workdir (collab runs)")
  args, rest = parser.parse_known_args(argv)
  main_args = rest[1:] if rest[:1] == ["--"] else rest
  if args.monitor and workdir_of(main_args) is None:
    parser.error("--monitor watches the run's workdir: pass --workdir=DIR to the run")
  for attempt in range(args.restarts + 1):
    started = time.time()
    code, failed, tail = launch_once(args, main_args)
    if code == 0:
      print(f"[launcher] all {args.num_processes} processes finished", flush=True)
      return 0
    if failed is None:
      return code
    print(f"[launcher] process {failed} exited with code {code} after "
          f"{time.time() - started:.1f}s; stopped the others. Its last lines:\n  "
          + "\n  ".join(tail), file=sys.stderr, flush=True)
    if attempt < args.restarts:
      print(f"[launcher] restart {attempt + 1} of {args.restarts}: resuming from the last "
            "checkpoint", file=sys.stderr, flush=True)
  return 1


if __name__ == "__main__":
  sys.exit(main())
