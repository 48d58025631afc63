"""Round time of one-step-delay DiLoCo with and without the overlapped program.

N processes (one worker each) join on 127.0.0.1 through jax.distributed, so the sync's
all-reduce is a real collective between processes (gloo on CPU devices, NCCL where each
process has its own GPU). Each process times, side by side in one run:

  local      a round's local steps alone (rounds.held_round)
  sync       the held sync alone (rounds.run_held): the all-reduce and the outer step
  separate   the two as separate programs, round after round (overlap_sync = False)
  overlapped the held sync inside the next round's program (rounds.overlapped_round)

With full overlap `overlapped` ≈ max(local, sync); without any, ≈ local + sync. Reported:
hidden = (separate − overlapped) / sync, the fraction of the sync that the overlap hid.

  python bench/overlap_round.py [--model small] [--inner_steps 4] [--batch_size 4] \
      [--num_processes 2] [--rounds 5] [--repeats 3] [--out bench/results/overlap_round.json]
"""

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))


def _config(args):
  import runpy
  c = runpy.run_path(str(REPO / "configs" / "base.py"))["get_config"]()
  c.algorithm = "one_step_delay"
  c.num_workers = args.num_processes
  c.model.name = args.model
  c.inner_steps = args.inner_steps
  c.data.batch_size = args.batch_size
  c.data.seq_len = args.seq_len
  c.rounds = 1000
  c.eval_batches = 1
  return c


def _child(args) -> None:
  import jax
  import numpy as np
  from lowcomm_jax.assemble import jitted
  from lowcomm_jax.runtimes.spmd import rounds
  from lowcomm_jax.runtimes.spmd import train
  from lowcomm_jax.parallel import distributed

  c = _config(args)
  distributed.initialize(c)
  r = train.build(c)
  fns = jitted.jitted_steps(r)
  overlapped = rounds.jitted_overlapped(r)
  state, workers = jitted.init_run(r, fns)
  H = c.inner_steps
  Hs = [H] * len(r.topology.hosts)  # every host's H
  stream = r.data.streams[0]
  batches = [stream.next_round(H) for _ in range(4)]  # reused: data is not what is timed

  def local_only(n):
    nonlocal workers
    for k in range(n):
      workers, _, held = rounds.held_round(r, fns, state, workers, [batches[k % 4]], Hs)
    return held.deltas_R

  def sync_only(n, held):
    nonlocal state
    for _ in range(n):
      state, m = rounds.run_held(r, fns, state, held)
    return state.params

  def separate(n):
    nonlocal state, workers
    held = None
    for k in range(n):
      if held is not None:
        state, _ = rounds.run_held(r, fns, state, held)
      workers, _, held = rounds.held_round(r, fns, state, workers, [batches[k % 4]], Hs,
                                           metrics=False)
    state, _ = rounds.run_held(r, fns, state, held)
    return state.params

  def overlapping(n):
    nonlocal state, workers
    workers, _, held = rounds.held_round(r, fns, state, workers, [batches[0]], Hs,
                                         metrics=False)
    for k in range(1, n):
      state, workers, _, _, _, held = rounds.overlapped_round(
          r, fns, overlapped, state, workers, held, batches[k % 4], H, metrics=False,
          hold=True)
    state, _ = rounds.run_held(r, fns, state, held)
    return state.params

  def timed(fn, *a):
    jax.block_until_ready(state.params)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*a))
    return time.perf_counter() - t0

  workers, _, held = rounds.held_round(r, fns, state, workers, [batches[0]], Hs, metrics=False)
  for fn in (lambda: local_only(2), lambda: sync_only(2, held), lambda: separate(2),
             lambda: overlapping(3)):  # compile everything first
    timed(fn)
  n = args.rounds
  runs = {"local": [], "sync": [], "separate": [], "overlapped": []}
  for _ in range(args.repeats):  # alternated, so drift in the machine hits all alike
    runs["local"].append(timed(local_only, n) / n)
    runs["sync"].append(timed(sync_only, n, held) / n)
    runs["separate"].append(timed(separate, n) / n)  # n local phases and n syncs each
    runs["overlapped"].append(timed(overlapping, n) / n)
  result = {k: statistics.median(v) for k, v in runs.items()}
  if jax.process_index() == 0:
    result.update(
        hidden=(result["separate"] - result["overlapped"]) / result["sync"],
        ratio_separate_over_overlapped=result["separate"] / result["overlapped"],
        delta_mbytes=r.model.param_bytes / 2**20, params=r.model.param_count,
        backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
        num_processes=jax.process_count(), model=c.model.name, inner_steps=H,
        batch_size=c.data.batch_size, seq_len=c.data.seq_len, runs=runs)
    print("RESULT " + json.dumps(result), flush=True)
  del np


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="small")
  p.add_argument("--inner_steps", type=int, default=4)
  p.add_argument("--batch_size", type=int, default=4)
  p.add_argument("--seq_len", type=int, default=128)
  p.add_argument("--num_processes", type=int, default=2)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--out", default=str(REPO / "bench/results/overlap_round.json"))
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    return _child(args)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = []
  for i in range(args.num_processes):
    env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES=str(args.num_processes), JAX_PROCESS_ID=str(i))
    procs.append(subprocess.Popen([sys.executable, __file__, "--child", *sys.argv[1:]],
                                  env=env, stdout=subprocess.PIPE, text=True))
  outs = [proc.communicate()[0] for proc in procs]
  if any(proc.returncode for proc in procs):
    sys.exit(f"a process failed: return codes {[proc.returncode for proc in procs]}")
  line = next(l for l in outs[0].splitlines() if l.startswith("RESULT "))
  result = json.loads(line[len("RESULT "):])
  pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
  print(f"{result['model']} ({result['delta_mbytes']:.1f} MiB Δ), {result['num_processes']} "
        f"processes on {result['backend']} ({result['device']}), H={result['inner_steps']}")
  for k in ("local", "sync", "separate", "overlapped"):
    print(f"  {k:10s} {result[k] * 1e3:9.1f} ms/round")
  print(f"  hidden: {result['hidden']:.0%} of the sync; separate/overlapped = "
        f"{result['ratio_separate_over_overlapped']:.3f}")


if __name__ == "__main__":
  main()
