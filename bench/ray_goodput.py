"""Goodput under failures (issue 29): 8 workers, each killed once and back after a delay, and
the server (the lockstep run's process 0, its coordinator) killed once, on the Ray runtime
and on the lockstep runtime (`launch/local.py --restarts`), against the same runs without
failures.

  python bench/ray_goodput.py [--parts ray_free,ray_chaos,spmd_free,spmd_chaos]
      [--rounds 40] [--seed 0] [--standby_server] [--out ray_goodput.jsonl]
  python bench/ray_goodput.py --parts peer_free,peer_chaos ...   # the peer form (issue 71)

Both run DiLoCo (H = 10, `small` model on bytes, batch 8 × 64) for the same budget of
`rounds` rounds of 8 workers; on Ray in quorum rounds of every live worker that is up
(`ray.min_quorum=0`, no grace). The schedule, in rounds: worker k is killed in round 3 + 4k
(Ray: after push 8·(3 + 4k) + 1) and comes back 2 rounds later (Ray: `rejoin_worker`
16 pushes later; lockstep: the launcher restarts every process at once, at its cost); the
server is killed in round 18 (lockstep: process 0). Checkpoints every 4 rounds.

`peer_*` (issue 71): the Ray runtime's rounds among the workers (`collective_form=auto`,
no server) on a Ray cluster this script starts apart from the driver (`ray start --head
--block`, `ray.address`), with the same worker kills and rejoins, and instead of the
server the driver killed (SIGKILL) once in round 18 and the same command run again at
once: it takes the run up from its live workers' newest record (records.py). Its wall
time is both commands' and the gap between them.

Two definitions of goodput, both reported:
- this project's (the "goodput" column): useful compute / total compute, where the compute
  is this machine's cores, busy throughout either way (a dead worker's share goes to the
  others); so it is the rate of applied tokens with failures over the rate without, on the
  same runtime, over the training window (from the run's first metrics row to its end: the
  first start-up, the same for both, is left out; restarts are in), stale contributions
  counted as useful;
- the field's (Decoupled DiLoCo's "productive compute time over total elapsed time across
  all workers"; Ray only, from the workers' own clocks): Σ over workers of the seconds
  their applied jobs computed (`compute_seconds_per_worker`) over workers × the run's whole
  wall time (launch to exit, start-up included). On 2 shared cores a worker's job seconds
  are wall seconds while it shares the CPU with the others. Each run is a subprocess (the Ray driver too); a
thread stamps every metrics.jsonl row with the seconds since launch, so the loss reached at
any wall time is read off the eval rows. Each runtime first runs 2 rounds unrecorded, so no
recorded run compiles what another loads from the compilation cache. A JSON row per run is
appended to --out; `--report` prints the table from it.
"""

import argparse
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from lowcomm_jax.report import has_summary, read_summary

REPO = pathlib.Path(__file__).resolve().parents[1]
WORKERS, H = 8, 10


def run_args(rounds: int, workdir: pathlib.Path, seed: int) -> list[str]:
  """The run, as main.py's flags (the same on both runtimes)."""
  return [f"--config={REPO / 'configs' / 'base.py'}", f"--workdir={workdir}",
          "--config.algorithm=diloco", f"--config.num_workers={WORKERS}",
          f"--config.inner_steps={H}", f"--config.rounds={rounds}", f"--config.seed={seed}",
          "--config.model.name=small", "--config.data.seq_len=64", "--config.data.batch_size=8",
          "--config.eval_every=4", "--config.checkpoint_every=4", "--config.log_every=1",
          "--config.eval_batches=4", "--config.optimizer.warmup_steps=20"]


def ray_chaos(rounds: int) -> list[str]:
  events = []
  for k in range(WORKERS):
    kill = WORKERS * (3 + 4 * k) + 1
    events += [f"kill_worker={k}@{kill}", f"rejoin_worker={k}@{kill + 2 * WORKERS}"]
  events.append(f"kill_server@{WORKERS * 18 + 3}")
  assert 3 + 4 * (WORKERS - 1) + 2 < rounds, "the schedule needs more rounds"
  return events


def spmd_kills() -> list[tuple[int, int]]:
  """(round, process): the lockstep run's kills, the Ray schedule's in rounds."""
  return sorted([(3 + 4 * k, k) for k in range(WORKERS)] + [(18, 0)])


class Rows:
  """Tails workdir/metrics.jsonl, stamping each row with seconds since `start`."""

  def __init__(self, workdir: pathlib.Path, start: float):
    self.path, self.start, self.rows = workdir / "metrics.jsonl", start, []
    self.stop = threading.Event()
    self.thread = threading.Thread(target=self._tail, daemon=True)
    self.thread.start()

  def _tail(self) -> None:
    offset = 0
    while not self.stop.is_set():
      if self.path.exists():
        with open(self.path) as f:
          f.seek(offset)
          chunk = f.read()
        complete = chunk[:chunk.rfind("\n") + 1]
        offset += len(complete.encode())
        now = time.time() - self.start
        for line in complete.splitlines():
          row = json.loads(line)
          row["_t"] = now
          self.rows.append(row)
      time.sleep(0.2)

  def close(self) -> list[dict]:
    self.stop.set()
    self.thread.join()
    return self.rows

  def round(self) -> int:
    steps = [r["step"] for r in self.rows if "step" in r and "event" not in r]
    return max(steps, default=0) // H


def launch(cmd: list[str], workdir: pathlib.Path, kills=(), env=None,
           driver_killed_in: int | None = None):
  """Runs `cmd`, killing launcher process k (SIGKILL) when round r is first reached, for
  each (r, k) in `kills`; with `driver_killed_in`, the command itself is killed (SIGKILL)
  when that round is first reached and run again at once. (seconds, rows, the output's
  tail)."""
  start = time.time()
  rows, pids, tail = Rows(workdir, start), {}, []

  def started():
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def read():
      for line in proc.stdout:
        tail.append(line)
        del tail[:-40]
        if m := re.match(r"\[launcher\] process (\d+): pid (\d+)", line):
          pids[int(m.group(1))] = int(m.group(2))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return proc, reader
  proc, reader = started()
  pending = list(kills)
  while proc.poll() is None:
    if pending and rows.round() >= pending[0][0] and pending[0][1] in pids:
      r, k = pending.pop(0)
      print(f"  killing process {k} (pid {pids[k]}) in round {rows.round()}", flush=True)
      try:
        os.kill(pids.pop(k), signal.SIGKILL)
      except ProcessLookupError:
        pass
    if driver_killed_in is not None and rows.round() >= driver_killed_in:
      print(f"  killing the driver in round {rows.round()}, then running it again", flush=True)
      proc.kill()
      proc.wait()
      reader.join(timeout=10)
      driver_killed_in = None
      proc, reader = started()
    time.sleep(0.2)
  reader.join(timeout=10)
  seconds = time.time() - start
  time.sleep(0.5)  # the last rows
  return proc.returncode, seconds, rows.close(), "".join(tail)


def evals(rows: list[dict]) -> list[tuple[float, float]]:
  return [(r["_t"], r["eval_loss"]) for r in rows if "eval_loss" in r]


def loss_at(run: dict, t: float) -> float | None:
  """The last eval loss reported by wall time t (seconds since launch)."""
  seen = [loss for when, loss in run["evals"] if when <= t]
  return seen[-1] if seen else None


def field_goodput(run: dict) -> float:
  """Decoupled DiLoCo's goodput: the seconds the workers' applied jobs computed, summed, over
  workers × the run's whole wall time."""
  return sum(run["compute_seconds_per_worker"].values()) / (WORKERS * run["seconds"])


def _mean_sd(xs: list[float]) -> str:
  sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
  return f"{statistics.mean(xs):.3f} ± {sd:.3f} (n={len(xs)})"


def report(path: str) -> None:
  """Each seed's table, then over the seeds: mean ± sd of each runtime's goodput and of
  the paired difference Ray − lockstep (a Ray run with a standby server is its own row)."""
  runs = {}
  for line in open(path):
    row = json.loads(line)
    runtime = row["part"].split("_")[0] + ("+standby" if row.get("standby_server") else "")
    runs[(row["seed"], runtime, row["part"].split("_")[1])] = row
  goodputs = {}  # runtime -> {seed: goodput}
  fields = {}  # (runtime, free|chaos) -> {seed: the field's goodput}
  for seed in sorted({s for s, _, _ in runs}):
    print(f"seed {seed}:")
    for runtime in sorted({r for _, r, _ in runs}):
      free, chaos = runs.get((seed, runtime, "free")), runs.get((seed, runtime, "chaos"))
      if not (free and chaos):
        continue
      rate = lambda r: r["tokens"] / (r["seconds"] - r["first_row_s"])
      goodputs.setdefault(runtime, {})[seed] = rate(chaos) / rate(free)
      print(f"  {runtime}: free {free['seconds']:.0f} s (training {free['seconds'] - free['first_row_s']:.0f} s)"
            f", chaos {chaos['seconds']:.0f} s (training {chaos['seconds'] - chaos['first_row_s']:.0f} s); "
            f"tokens {free['tokens']} / {chaos['tokens']}; goodput {rate(chaos) / rate(free):.3f}; "
            f"eval loss free {free['eval_loss']:.4f}, chaos {chaos['eval_loss']:.4f}")
      for name, run in (("free", free), ("chaos", chaos)):
        if "compute_seconds_per_worker" in run:
          field = field_goodput(run)
          fields.setdefault((runtime, name), {})[seed] = field
          print(f"    the field's goodput ({name}): {field:.3f}")
      ups = [e["seconds"] for e in chaos["events"] if e["event"] == "worker_up"]
      servers = [e["seconds"] for e in chaos["events"] if e["event"] == "server_restarted"]
      if ups or servers:
        print(f"    start-up of {len(ups)} rejoined workers: mean "
              f"{sum(ups) / max(len(ups), 1):.1f} s; server recovery {servers} s")
      drivers = [round(r["seconds"], 2) for r in chaos.get("recoveries", [])
                 if r["what"] == "driver"]
      if drivers:
        print(f"    driver taken up, its first committed round after {drivers} s")
      if runtime != "spmd" and (seed, "spmd", "chaos") in runs:
        t = min(chaos["seconds"], runs[(seed, "spmd", "chaos")]["seconds"])
        print(f"    at {t:.0f} s (the first chaos run's end): eval loss {runtime} "
              f"{loss_at(chaos, t)}, spmd {loss_at(runs[(seed, 'spmd', 'chaos')], t)}")
  print("over seeds:")
  for (runtime, name), by_seed in sorted(fields.items()):
    print(f"  {runtime} the field's goodput, {name}: {_mean_sd(list(by_seed.values()))}")
  for runtime, by_seed in sorted(goodputs.items()):
    print(f"  {runtime} goodput {_mean_sd(list(by_seed.values()))}")
    if runtime != "spmd" and "spmd" in goodputs:
      paired = [g - goodputs["spmd"][s] for s, g in by_seed.items() if s in goodputs["spmd"]]
      if paired:
        print(f"  {runtime} − spmd, paired: {_mean_sd(paired)}")


def ray_head():
  """A Ray cluster of this machine started apart from any driver (its own process group,
  token authentication off, the actors at normal priority): (its process, its address)."""
  import socket
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_worker_niceness="0")
  head = subprocess.Popen(
      [str(pathlib.Path(sys.executable).with_name("ray")), "start", "--head", f"--port={port}",
       "--node-ip-address=127.0.0.1", f"--num-cpus={os.cpu_count()}",
       "--include-dashboard=false", "--disable-usage-stats",
       f"--temp-dir={tempfile.mkdtemp(prefix='rg', dir='/tmp')}", "--block"],
      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
  time.sleep(10)  # its GCS and raylet up
  return head, f"127.0.0.1:{port}"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--parts", default="ray_free,ray_chaos,spmd_free,spmd_chaos")
  parser.add_argument("--rounds", type=int, default=40)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--standby_server", action="store_true",
                      help="Ray: keep a server process built and idle (ray.standby_server)")
  parser.add_argument("--out", default="ray_goodput.jsonl")
  parser.add_argument("--report", action="store_true", help="print the table of --out")
  args = parser.parse_args()
  if args.report:
    return report(args.out)
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  env.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))
  env.pop("XLA_FLAGS", None)
  parts = args.parts.split(",")
  warm = [f"{p}_warmup" for p in ("ray_free", "peer_free", "spmd_free") if p in parts or
          p.replace("free", "chaos") in parts]
  head, address = ray_head() if any(p.startswith("peer") for p in parts) else (None, "")
  env["RAY_AUTH_MODE"] = "disabled"
  try:
    for part in warm + parts:
      one_part(part, args, env, address)
  finally:
    if head is not None:
      os.killpg(head.pid, signal.SIGKILL)  # the head and every Ray process it started


def one_part(part: str, args, env: dict, address: str) -> None:
  """Runs `part` (its warm-up: 2 rounds, not recorded) and appends its row to --out."""
  workdir = pathlib.Path(tempfile.mkdtemp(prefix=f"goodput_{part}_"))
  flags = run_args(2 if part.endswith("warmup") else args.rounds, workdir, args.seed)
  kills, driver_killed_in = (), None
  if part.startswith("peer"):
    flags += ["--config.runtime=ray", "--config.mesh.replica=1",
              "--config.ray.apply_order=arrival", "--config.ray.min_quorum=0",
              "--config.collective_form=auto", f"--config.ray.address={address}"]
    if part == "peer_chaos":
      flags.append("--config.ray.chaos=" + repr(tuple(
          e for e in ray_chaos(args.rounds) if not e.startswith("kill_server"))))
      driver_killed_in = 18
    cmd = [sys.executable, "-m", "lowcomm_jax.main", *flags]
  elif part.startswith("ray"):
    flags += ["--config.runtime=ray", "--config.mesh.replica=1",
              "--config.ray.apply_order=arrival", "--config.ray.min_quorum=0",
              f"--config.ray.standby_server={args.standby_server}",
              # issue 29's measurement: rounds through a server, which its chaos kills
              "--config.collective_form=server"]
    if part == "ray_chaos":
      flags.append("--config.ray.chaos=" + repr(tuple(ray_chaos(args.rounds))))
    cmd = [sys.executable, "-m", "lowcomm_jax.main", *flags]
  else:
    restarts = len(spmd_kills()) if part == "spmd_chaos" else 0
    kills = spmd_kills() if part == "spmd_chaos" else ()
    cmd = [sys.executable, "launch/local.py", "--num_processes", str(WORKERS),
           "--restarts", str(restarts), "--", *flags]
  print(f"{part}: {' '.join(cmd[:4])} ...", flush=True)
  code, seconds, rows, tail = launch(cmd, workdir, kills, env, driver_killed_in)
  summary = read_summary(workdir) if has_summary(workdir) else {}
  first = min((r["_t"] for r in rows if "step" in r and "event" not in r), default=None)
  out = {"part": part, "seed": args.seed, "rounds": args.rounds, "returncode": code,
         "standby_server": part.startswith("ray") and args.standby_server,
         "seconds": seconds, "first_row_s": first, "eval_loss": summary.get("eval_loss"),
         "evals": evals(rows),
         "events": [{k: v for k, v in r.items() if k in ("event", "worker", "seconds", "_t",
                                                        "round", "replayed")}
                    for r in rows if "event" in r]}
  for key in ("workers_lost", "workers_joined", "pushes_dropped", "server_restarts",
              "pushes_replayed", "recoveries", "late_contributions", "mean_staleness",
              "rounds_closed", "total_inner_steps", "tokens", "compute_seconds_per_worker"):
    if key in summary:
      out[key] = summary[key]
  if code != 0:
    out["tail"] = tail[-3000:]
  print(json.dumps({k: v for k, v in out.items() if k not in ("evals", "tail")}), flush=True)
  if part.endswith("warmup"):
    return
  with open(args.out, "a") as f:
    f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
  main()
