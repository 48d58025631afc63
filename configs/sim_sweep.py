"""Heterogeneity sweep in the simulator: one method at one heterogeneity level.

    python -m lowcomm_jax.main --config=configs/sim_sweep.py:async_dn_dylu,very
    python -m lowcomm_jax.main --config=configs/sim_sweep.py:async_dn_dylu,very,cpu

Methods, all at the same budget of num_workers x rounds x inner_steps inner steps:
  diloco         synchronous DiLoCo (rounds wait for the slowest worker)
  async          asynchronous Local-SGD, outer Nesterov applied per arrival (lr / W)
  async_dn       asynchronous, Delayed Nesterov (N = num_workers)
  async_dn_dylu  asynchronous, Delayed Nesterov + Dynamic Local Updates
Levels: none | slight | moderate | very (lowcomm_jax/sim/speeds.py). The default model is
Pythia-14M's shape on GPT-2 BPE; the size `cpu` trains the byte-level `small` model instead
(configs/base.py, SIZES). bench/sim_scenarios.py runs the whole grid.
"""

import pathlib
import runpy

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))

LEVELS = ("none", "slight", "moderate", "very")  # lowcomm_jax/sim/speeds.py
METHODS = {
    "diloco": {"algorithm": "diloco"},
    "async": {"algorithm": "async"},
    "async_dn": {"algorithm": "async_dn"},
    "async_dn_dylu": {"algorithm": "async_dn", "outer.dylu": True},
}


def get_config(arg: str = "async_dn_dylu,moderate"):
  method, _, rest = arg.partition(",")
  level, _, size = rest.partition(",")
  if method not in METHODS or level not in LEVELS:
    raise ValueError(f"config argument {arg!r}: use METHOD,LEVEL[,SIZE] with METHOD one of "
                     f"{sorted(METHODS)}, LEVEL one of {list(LEVELS)}, SIZE one of "
                     f"{sorted(_base['SIZES'])}, e.g. configs/sim_sweep.py:diloco,very,cpu")
  c = _base["get_config"]()
  c.num_workers = 4
  c.rounds = 15
  c.inner_steps = 20
  c.eval_every = 3
  c.checkpoint_every = 5
  _base["sized"](c, size or "pythia", arg)
  c.data.batch_size = 8
  c.runtime = "simulator"
  c.sim.heterogeneity = level
  c.sim.step_seconds = 0.1
  c.update_from_flattened_dict(METHODS[method])
  return c
