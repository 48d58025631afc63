"""DDP baseline: 4 workers average gradients every step (same tokens as diloco_hetero.py)."""

import pathlib
import runpy

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config():
  c = _base["get_config"]()
  c.algorithm = "ddp"
  c.inner_steps = 1
  c.rounds = 300  # = diloco_hetero's 15 rounds x 20 inner steps
  c.eval_every = 50
  c.checkpoint_every = 100
  c.log_every = 10
  return c
