"""DDP + DeMo (DisTrO-style): 4 workers, every step each sends the top-32 DCT coefficients of
every 64x64 chunk of its momentum (β = 0.999, scaled by lr); the decoded average's sign is the
update (lr on the warmup-cosine schedule, decoupled weight decay). `--config.compress.value_bits=1`
sends signs only. Same tokens as ddp.py."""

import pathlib
import runpy

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config():
  c = _base["get_config"]()
  c.algorithm = "ddp"
  c.num_workers = 4
  c.inner_steps = 1
  c.rounds = 300
  c.eval_every = 50
  c.checkpoint_every = 100
  c.log_every = 10
  c.optimizer.lr = 1e-3  # per-coordinate step of sign descent
  c.compress.codec = "demo"
  c.compress.beta = 0.999
  c.compress.chunk = 64
  c.compress.k = 32
  return c
