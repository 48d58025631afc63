"""Geo-distributed training in the simulator: 4 regions x 4 workers on slow, unequal links.

    python -m lowcomm_jax.main --config=configs/sim_geo.py:halos

trains pythia_14m on GPT-2 BPE; `halos,cpu` the byte-level `small` model (configs/base.py,
SIZES), which a 2-core CPU runs in under 3 minutes:

    python -m lowcomm_jax.main --config=configs/sim_geo.py:halos,cpu

Inside a region 100 Gb/s; between regions 0.1-1 Gb/s and 30-150 ms (the matrix below);
worker speeds 'moderate' (0.5-1x). The global server sits in a fifth region of its own,
1 Gb/s and 50 ms from each (sim.network.inter_gbps, inter_latency_s); transfers share the
links (sim/flows.py). Methods at the same budget of inner steps:
  diloco         synchronous DiLoCo, one all-reduce across all regions per round (ring or
                 hierarchical, the faster)
  async_dn_dylu  asynchronous Delayed Nesterov + DyLU behind one global server
  halos          HALoS: a local server per region, and the global one
"""

import pathlib
import runpy

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))

METHODS = {
    "diloco": {"algorithm": "diloco"},
    "async_dn_dylu": {"algorithm": "async_dn", "outer.dylu": True},
    "halos": {"algorithm": "halos", "outer.dylu": True},
}

# Gb/s and seconds between regions 0..3 (symmetric; the diagonal is the intra-region link).
INTER_GBPS = ((100.0, 1.0, 0.5, 0.1),
              (1.0, 100.0, 0.25, 0.1),
              (0.5, 0.25, 100.0, 0.5),
              (0.1, 0.1, 0.5, 100.0))
INTER_LATENCY_S = ((0.0, 0.03, 0.08, 0.15),
                   (0.03, 0.0, 0.08, 0.15),
                   (0.08, 0.08, 0.0, 0.1),
                   (0.15, 0.15, 0.1, 0.0))


def get_config(arg: str = "halos"):
  method, _, size = arg.partition(",")
  if method not in METHODS:
    raise ValueError(f"config argument {arg!r}: use METHOD[,SIZE] with METHOD one of "
                     f"{sorted(METHODS)}, SIZE one of {sorted(_base['SIZES'])}")
  c = _base["get_config"]()
  c.num_workers = 16
  c.rounds = 10
  c.inner_steps = 10
  c.eval_every = 2
  c.checkpoint_every = 5
  _base["sized"](c, size or "pythia", arg)
  c.data.batch_size = 8
  c.runtime = "simulator"
  c.sim.heterogeneity = "moderate"
  c.sim.step_seconds = 0.05
  c.sim.network.regions = 4
  c.sim.network.intra_gbps = 100.0
  c.sim.network.inter_gbps_matrix = INTER_GBPS
  c.sim.network.inter_latency_matrix = INTER_LATENCY_S
  c.outer.halos.sync_every = 4
  c.update_from_flattened_dict(METHODS[method])
  return c
