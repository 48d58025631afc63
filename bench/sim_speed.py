"""Simulator throughput: simulated inner steps per second vs a plain Python loop over workers.

  python bench/sim_speed.py [--workers 4 8 16] [--rounds 20]

Synchronous DiLoCo on the `tiny` model (byte tokens, seq 32, batch 4, H = 8), no
heterogeneity: every round all workers start from the same version, so the simulator runs
them as one vmapped call. The baseline runs the same jitted local round once per worker
(G = 1) in a Python loop, then the same outer step. Both are timed after two compiling
rounds; inner steps per second counts every worker's steps. Writes bench/results/sim_speed.json.
"""

import argparse
import json
import os
import pathlib
import runpy
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from lowcomm_jax.programs import steps  # noqa: E402
from lowcomm_jax.runtimes.simulator.simulate import Simulation  # noqa: E402


def _config(workers: int, rounds: int):
  c = runpy.run_path(str(REPO / "configs" / "smoke.py"))["get_config"]()
  c.update_from_flattened_dict({"num_workers": workers, "rounds": rounds + 2, "inner_steps": 8,
                                "runtime": "simulator"})
  return c


def simulated(workers: int, rounds: int) -> float:
  """Seconds for `rounds` simulated rounds (after the first), event loop included."""
  sim = Simulation(_config(workers, rounds))
  sim.schedule.start(sim.loop)
  sim.flush()
  for _ in range(2):  # rounds 1-2 compile (the outer step's output re-specializes round 2)
    sim.advance()
  jax.block_until_ready(sim.backend.global_params())
  t0 = time.perf_counter()
  while len(sim.loop):
    sim.advance()
  jax.block_until_ready(sim.backend.global_params())
  return time.perf_counter() - t0


def python_loop(workers: int, rounds: int) -> float:
  """The same rounds with one local-round call per worker, in a Python loop."""
  sim = Simulation(_config(workers, rounds))
  r, b = sim.r, sim.backend
  local, finish = b.local_round, b.syncs[0]
  state = steps.TrainState(jnp.zeros((), jnp.int32), b.rng, b.global_params(),
                           b.servers["global"]["opt_state"])
  opt = b.workers

  def one_round(state, opt):
    view = state._replace(outer=())
    deltas, losses, new_opt = [], [], []
    for w in range(workers):
      ids = np.asarray([w], np.int32)
      d, o, loss = local(view, jax.tree.map(lambda x: x[w:w + 1], opt),
                         sim.streams.next_steps(ids, r.config.inner_steps), ids)
      deltas.append(d)
      new_opt.append(o)
      losses.append(loss.mean(axis=1))
    cat = lambda *xs: jnp.concatenate(xs)
    state, _ = finish(state, jax.tree.map(cat, *deltas),
                      r.signals([r.config.inner_steps], cat(*losses)),
                      metrics=False)  # as the simulator calls it
    return state, jax.tree.map(cat, *new_opt)

  for _ in range(2):  # compiles, as in `simulated`
    state, opt = one_round(state, opt)
  jax.block_until_ready(state.params)
  t0 = time.perf_counter()
  for _ in range(rounds):
    state, opt = one_round(state, opt)
  jax.block_until_ready(state.params)
  return time.perf_counter() - t0


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workers", type=int, nargs="+", default=[4, 8, 16])
  parser.add_argument("--rounds", type=int, default=20)
  args = parser.parse_args()
  rows = []
  print("| workers | simulator steps/s | Python loop steps/s | ratio |\n|---|---|---|---|")
  for w in args.workers:
    total = w * 8 * args.rounds
    sim_s, loop_s = simulated(w, args.rounds), python_loop(w, args.rounds)
    rows.append({"workers": w, "inner_steps": total, "simulator_s": sim_s, "loop_s": loop_s,
                 "simulator_steps_per_s": total / sim_s, "loop_steps_per_s": total / loop_s,
                 "ratio": loop_s / sim_s})
    print(f"| {w} | {total / sim_s:,.0f} | {total / loop_s:,.0f} | {loop_s / sim_s:.2f}x |",
          flush=True)
  out = REPO / "bench/results/sim_speed.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"device": str(jax.devices()[0]), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
  main()
