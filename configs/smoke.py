"""Seconds-long end-to-end run: tiny model, 2 workers, 3 rounds of 2 inner steps."""

import pathlib
import runpy

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config():
  c = _base["get_config"]()
  c.num_workers = 2
  c.rounds = 3
  c.inner_steps = 2
  c.eval_every = 2
  c.eval_batches = 2
  c.checkpoint_every = 2
  c.optimizer.warmup_steps = 2
  c.model.name = "tiny"
  c.data.seq_len = 32
  c.data.batch_size = 4
  return c
