"""The main job: heterogeneous DiLoCo with MatFormer tiers.

Host table: one full-width host (tier 1.0, e.g. an A100) and three narrow hosts training
25% of every FFN (e.g. a 4090 and two A6000s), one worker each. The outer step averages
each FFN hidden unit over the workers that trained it (aggregate/nested.py), so the
full-width worker is never diluted by the narrow ones' zeros.

Without a launcher it runs in one process with 4 local workers; on 2 CPU cores it finishes
in a few minutes and prints eval loss, tokens and bytes sent next to what DDP would send.

The argument is the host table's tiers, one per host (process), so the same job runs on
any number of hosts; a row's other fields can then be set on the command line (below).

    python -m lowcomm_jax.main --config=configs/diloco_hetero.py
    python launch/local.py --num_processes 2 -- --config=configs/diloco_hetero.py:1.0,0.25
    python launch/local.py --num_processes 4 -- --config=configs/diloco_hetero.py:1.0,0.25,0.25,0.25 --config.hosts[1].batch_size=8
"""

import pathlib
import runpy

from lowcomm_jax.assemble.hosts import host

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config(tiers: str = "1.0,0.25,0.25,0.25"):
  try:
    table = [host(tier=float(t)) for t in tiers.split(",")]
  except ValueError:
    raise ValueError(f"config argument {tiers!r}: give each host's tier, comma-separated, "
                     "e.g. configs/diloco_hetero.py:1.0,0.25") from None
  c = _base["get_config"]()
  c.algorithm = "diloco"
  c.hosts = table
  c.num_workers = len(table)
  c.rounds = 15
  c.inner_steps = 20
  c.eval_every = 5
  c.checkpoint_every = 5
  return c
