"""Tensor-parallel sync-plan sweep: one model (`small12`: 12 layers, d=128), 4 shards on the
'model' axis, trained alone (ddp with one worker) for 300 steps. Pick the plan after a colon:

  XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
      python -m lowcomm_jax.main --config=configs/tp_sweep.py:grouped_k3

Plans: standard (24 all-reduces per forward), spd (12), grouped_k2 / _k3 / _k4 / _k6 (6, 4,
3, 2), selective (spd + attention syncs in blocks 0 and 11: 14). `bench/tp_plans.py` runs
them all and tabulates final val loss, syncs and all-reduces per train step.
"""

import pathlib
import runpy

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config(plan: str = "standard"):
  c = _base["get_config"]()
  c.algorithm = "ddp"
  c.num_workers = 1
  c.inner_steps = 1
  c.rounds = 300
  c.eval_every = 50
  c.checkpoint_every = 100
  c.log_every = 10
  c.model.name = "small12"
  c.model.tp.size = 4
  if plan.startswith("grouped_k"):
    c.model.tp.sync, c.model.tp.layers_per_group = "grouped", int(plan.removeprefix("grouped_k"))
  elif plan == "selective":
    c.model.tp.sync, c.model.tp.attn_sync_layers = "selective", (0, 11)
  else:
    c.model.tp.sync = plan
  return c
