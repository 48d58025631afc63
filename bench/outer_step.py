"""Outer-step cost across processes vs a bare psum of the same bytes, and a round's split.

Run under the launcher (one process per worker, gloo over 127.0.0.1):

  python launch/local.py --num_processes 2 --module bench.outer_step -- [--model small]
  python launch/local.py --num_processes 4 --module bench.outer_step -- [--model small]

Measured in the same processes, interleaved (every repeat times each program once, so a
slow spell of the shared machine hits all of them alike), medians of --repeats calls:
  outer:       the runner's jitted global outer step (mean all-reduce + Nesterov update on
               the flat θ and momentum + the per-round metrics: train losses of every
               worker, parameter and update norms)
  outer_lean:  the same program on a round that logs, evaluates and checkpoints nothing:
               no metrics (the runner's other rounds)
  flat_floor:  a bare all-reduce of one flat fp32 buffer followed by the Nesterov update on
               flat parameters and momentum, written directly: what any implementation that
               keeps the update after the all-reduce costs at least (no metrics)
  psum:        a bare jitted all-reduce (sum over the replica axis) of one fp32 array with the
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


def _interleaved_medians(programs: dict, repeats: int) -> dict[str, float]:
  """Median seconds per call of each zero-argument program, timed in turn every repeat."""
  import jax
  for fn in programs.values():  # warm-up / compile
    jax.block_until_ready(fn())
  times = {name: [] for name in programs}
  for _ in range(repeats):
    for name, fn in programs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - t0)
  return {name: statistics.median(t) for name, t in times.items()}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="small")
  p.add_argument("--repeats", type=int, default=50)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--inner_steps", type=int, default=5)
  args = p.parse_args()

  config = runpy.run_path(str(REPO / "configs" / "base.py"))["get_config"]()
  from lowcomm_jax.parallel import distributed
  distributed.initialize(config)
  import jax
  import numpy as np
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from lowcomm_jax import outer
  from lowcomm_jax.runtimes.spmd import driver
  from lowcomm_jax.runtimes.spmd import train

  n = jax.process_count()
  config.num_workers = n
  config.inner_steps = args.inner_steps
  config.model.name = args.model
  r = train.build(config)
  fns = train.jitted_steps(r)
  state, workers = train.init_run(r, fns)
  inner_steps = [h.inner_steps for h in r.topology.hosts]

  # Round split: compute (this process's local program), outer step, idle at the barrier.
  splits = []
  for _ in range(args.rounds + 1):
    batches = [r.data.streams[0].next_round(args.inner_steps)]
    t0 = time.perf_counter()
    state, workers, metrics, compute = train.train_round(r, fns, state, workers, batches,
                                                         inner_steps, timed=True)
    jax.block_until_ready(metrics)
    total = time.perf_counter() - t0
    every = driver.all_hosts(compute)  # the runner's own gather
    idle = max(every) - compute[0]  # waiting for the slowest host inside the outer step
    splits.append({"compute": compute[0], "idle": idle, "outer": total - compute[0] - idle})
  splits = splits[1:]  # the first round compiles

  # Outer step alone, on fixed inputs.
  deltas, signals = r.abstract_sync_inputs(0)
  host_array = lambda shape, dtype, sharding, fill=0: jax.make_array_from_callback(
      shape, sharding, lambda idx: np.full(shape, fill, dtype)[idx])
  zeros = lambda a: host_array(a.shape, a.dtype, a.sharding)
  deltas, losses = zeros(deltas), zeros(signals.loss)
  finish = fns.syncs[0]
  mesh = r.topology.mesh
  rep, per_worker = NamedSharding(mesh, P()), NamedSharding(mesh, P("replica"))
  rule = outer.diloco_outer(config.outer.lr, config.outer.momentum, config.outer.nesterov)

  def flat_step(flat_R, params, momentum):
    updates, momentum = rule.update(flat_R.sum(0) / n, momentum, params)
    return optax.apply_updates(params, updates), momentum

  with jax.set_mesh(r.topology.mesh):
    signals = r.signals(inner_steps, losses)
    flat_R = host_array((n, r.model.param_count), np.float32, per_worker, 1)
    flat_params = host_array((r.model.param_count,), np.float32, rep, 1)
    flat_momentum = jax.jit(rule.init, out_shardings=rep)(flat_params)
    flat = jax.jit(flat_step, out_shardings=rep)
    psum = jax.jit(lambda x: x.sum(0), out_shardings=rep)  # bare all-reduce, same bytes
    timings = _interleaved_medians({
        "outer": lambda: finish(state, deltas, signals)[0].params,
        "outer_lean": lambda: finish(state, deltas, signals, metrics=False)[0].params,
        "flat_floor": lambda: flat(flat_R, flat_params, flat_momentum),
        "psum": lambda: psum(flat_R)}, args.repeats)

  if jax.process_index() == 0:
    mean = lambda k: statistics.mean(s[k] for s in splits)
    result = {"processes": n, "model": args.model, "params": r.model.param_count,
              "payload_bytes_per_worker": r.model.param_bytes, "repeats": args.repeats,
              "outer_step_s": timings["outer"], "outer_lean_s": timings["outer_lean"],
              "flat_floor_s": timings["flat_floor"], "bare_psum_s": timings["psum"],
              "ratio": timings["outer"] / timings["psum"],
              "ratio_lean": timings["outer_lean"] / timings["psum"],
              "ratio_flat_floor": timings["flat_floor"] / timings["psum"],
              "round_compute_s": mean("compute"), "round_outer_s": mean("outer"),
              "round_idle_s": mean("idle"), "inner_steps": args.inner_steps}
    out = REPO / "bench" / "results" / f"outer_step_{n}procs.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2), flush=True)


if __name__ == "__main__":
  main()
