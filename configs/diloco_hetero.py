"""The main job: DiLoCo with 4 workers.

For now the 4 workers run on this machine's devices (vmapped when there is one device);
the heterogeneous host table (MatFormer tiers, per-host H) builds on this file.
On 2 CPU cores it finishes in a few minutes and prints eval loss, tokens and the bytes
each worker sent next to what DDP would have sent.
"""

import pathlib
import runpy

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config():
  c = _base["get_config"]()
  c.algorithm = "diloco"
  c.num_workers = 4
  c.rounds = 15
  c.inner_steps = 20
  c.eval_every = 5
  c.checkpoint_every = 5
  return c
