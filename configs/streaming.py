"""Streaming DiLoCo on unequal hosts: the model's blocks in 2 fragments that sync in turn,
every 10 of a round's 20 inner steps, each fragment's update landing one inner step after
it was sent (τ = 1: that step is the transfer's time to hide). A full-width host, and a
half-width one with half the batch and half the steps (its segments are 5 steps: per-host H
must be a multiple of the fragments). Each worker's largest single send is about half of
DiLoCo's (summary.json: bytes_sent_peak_sync); total bytes are DiLoCo's.

    python -m lowcomm_jax.main --config=configs/streaming.py
"""

import pathlib
import runpy

from lowcomm_jax.assemble.hosts import host

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config():
  c = _base["get_config"]()
  c.algorithm = "streaming"
  c.hosts = [host(tier=1.0), host(tier=0.5, batch_size=8, inner_steps=10)]
  c.num_workers = 2
  c.rounds = 15
  c.inner_steps = 20
  c.eval_every = 5
  c.checkpoint_every = 5
  c.streaming.fragments = 2
  c.streaming.overlap_steps = 1
  c.streaming.mix = 0.0
  return c
