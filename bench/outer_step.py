"""Outer-step cost across processes vs a bare psum of the same bytes, and a round's split.

Run under the launcher (one process per worker, gloo over 127.0.0.1):

  python launch/local.py --num_processes 2 --module bench.outer_step -- [--model small]
  python launch/local.py --num_processes 4 --module bench.outer_step -- [--model small]

Measured in the same processes, each the median of --repeats timed calls (after warm-up):
  outer:  the jitted global outer step (nested/plain mean all-reduce + Nesterov update)
  psum:   a bare jitted all-reduce (sum over the replica axis) of one fp32 array with the
          same number of bytes per worker as the pseudo-gradient
and, over --rounds full rounds: per-round compute (local programs), outer step and idle.
Process 0 writes bench/results/outer_step_<N>procs.json. Target: outer / psum <= 1.5.
"""

import argparse
import json
import os
import pathlib
import runpy
import statistics
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))


def _median_seconds(fn, repeats: int) -> float:
  import jax
  jax.block_until_ready(fn())  # warm-up / compile
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="small")
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--inner_steps", type=int, default=5)
  args = p.parse_args()

  config = runpy.run_path(str(REPO / "configs" / "base.py"))["get_config"]()
  from lowcomm_jax.parallel import distributed
  distributed.initialize(config)
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from lowcomm_jax import train
  from lowcomm_jax.parallel import mesh as mesh_lib

  n = jax.process_count()
  config.num_workers = n
  config.inner_steps = args.inner_steps
  config.model.name = args.model
  r = train.build(config)
  fns = train.jitted_steps(r)
  state, workers = train.init_run(r, fns)
  weights = r.worker_weights([h.inner_steps for h in r.hosts])

  # Round split: compute (this process's local program), outer step, idle at the barrier.
  splits = []
  for _ in range(args.rounds + 1):
    batches = [r.streams[0].next_round(args.inner_steps)]
    t0 = time.perf_counter()
    state, workers, metrics, compute = train.train_round(r, fns, state, workers, batches,
                                                         weights, timed=True)
    jax.block_until_ready(metrics)
    total = time.perf_counter() - t0
    every = train._all_hosts(compute)  # noqa: SLF001 - the runner's own gather
    idle = max(every) - compute[0]  # waiting for the slowest host inside the outer step
    splits.append({"compute": compute[0], "idle": idle, "outer": total - compute[0] - idle})
  splits = splits[1:]  # the first round compiles

  # Outer step alone, on fixed inputs.
  deltas, losses = r.abstract_round_inputs()
  zeros = lambda a: jax.make_array_from_callback(
      a.shape, a.sharding, lambda idx: np.zeros(a.shape, a.dtype)[idx])
  deltas, losses = jax.tree.map(zeros, deltas), zeros(losses)
  finish = fns[1]
  with jax.set_mesh(r.mesh):
    hidden, weights = r.replicated_input(r.hidden_per_worker), r.replicated_input(weights)
    outer = _median_seconds(lambda: finish(state, deltas, losses, hidden, weights)[0].params,
                            args.repeats)
    # Bare all-reduce of the same bytes per worker.
    sharding = NamedSharding(r.mesh, P("replica"))
    flat = jax.make_array_from_callback(
        (n, r.param_count), sharding, lambda idx: np.ones((n, r.param_count), np.float32)[idx])
    psum = jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(r.mesh, P()))
    bare = _median_seconds(lambda: psum(flat), args.repeats)

  if jax.process_index() == 0:
    mean = lambda k: statistics.mean(s[k] for s in splits)
    result = {"processes": n, "model": args.model, "params": r.param_count,
              "payload_bytes_per_worker": r.param_bytes, "outer_step_s": outer,
              "bare_psum_s": bare, "ratio": outer / bare,
              "round_compute_s": mean("compute"), "round_outer_s": mean("outer"),
              "round_idle_s": mean("idle"), "inner_steps": args.inner_steps}
    out = REPO / "bench" / "results" / f"outer_step_{n}procs.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2), flush=True)


if __name__ == "__main__":
  main()
