"""The main job: heterogeneous DiLoCo with MatFormer tiers.

Host table: one full-width host (tier 1.0, e.g. an A100) and three narrow hosts training
25% of every FFN (e.g. a 4090 and two A6000s), one worker each. The outer step averages
each FFN hidden unit over the workers that trained it (aggregate/nested.py), so the
full-width worker is never diluted by the narrow ones' zeros.

Without a launcher it runs in one process with 4 local workers; on 2 CPU cores it finishes
in a few minutes and prints eval loss, tokens and bytes sent next to what DDP would send.
"""

import pathlib
import runpy

from lowcomm_jax.assemble.hosts import host

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config():
  c = _base["get_config"]()
  c.algorithm = "diloco"
  c.hosts = [host(tier=1.0), host(tier=0.25), host(tier=0.25), host(tier=0.25)]
  c.num_workers = 4
  c.rounds = 15
  c.inner_steps = 20
  c.eval_every = 5
  c.checkpoint_every = 5
  return c
