"""DiLoCo + SparseLoCo: 4 full-width workers send each round's pseudo-gradient as chunked
top-64 of 4096 with 2-bit values and a decayed error buffer (β = 0.95); outer SGD lr 1.0
without momentum, as in SparseLoCo. Same tokens as ddp.py and diloco_hetero.py."""

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
  c.outer.lr = 1.0
  c.outer.momentum = 0.0
  c.compress.codec = "sparseloco"
  c.compress.beta = 0.95
  c.compress.chunk = 64
  c.compress.k = 64
  return c
