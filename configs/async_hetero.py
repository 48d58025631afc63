"""Simulated asynchronous Local-SGD on unequal workers: Delayed Nesterov + Dynamic Local Updates.

Eight virtual workers at 'moderate' heterogeneity (speeds evenly spread over [0.5, 1]) in
two regions, behind one global parameter server. Each worker pulls the latest global model,
takes H_w = ceil(H * speed_w / max speed) AdamW steps on its own data, and sends its
pseudo-gradient; the server applies each on arrival with Delayed Nesterov (momentum once
per N = 8 arrivals). The default model is Pythia-14M's shape on GPT-2 BPE, as in the
reference experiments:

    python -m lowcomm_jax.main --config=configs/async_hetero.py

On a CPU, the byte-level `small` model (configs/base.py, SIZES):

    python -m lowcomm_jax.main --config=configs/async_hetero.py:cpu

or the smaller `tiny` model (its windows are at most 64 tokens) in its own workdir:

    python -m lowcomm_jax.main --config=configs/async_hetero.py --config.model.name=tiny \
        --config.data.tokenizer=byte --config.data.seq_len=64 --workdir=runs/async_hetero_tiny
"""

import pathlib
import runpy

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config(size: str = "pythia"):
  c = _base["get_config"]()
  c.algorithm = "async_dn"
  c.num_workers = 8
  c.rounds = 20  # budget: num_workers * rounds * inner_steps inner steps in all
  c.inner_steps = 20
  c.eval_every = 5  # round-equivalents (num_workers * inner_steps steps applied)
  c.checkpoint_every = 5
  c.outer.dylu = True
  _base["sized"](c, size, size)
  c.data.seq_len = 128
  c.data.batch_size = 8
  c.runtime = "simulator"
  c.sim.heterogeneity = "moderate"
  c.sim.step_seconds = 0.1
  c.sim.network.regions = 2
  c.sim.network.inter_gbps = 1.0
  return c
