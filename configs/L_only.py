"""Heterogeneous reference, baseline: the full-width (L) worker alone, no narrow helpers."""

import pathlib
import runpy

from lowcomm_jax.assemble.hosts import host

_hetero = runpy.run_path(str(pathlib.Path(__file__).with_name("diloco_hetero.py")))


def get_config():
  c = _hetero["get_config"]()
  c.hosts = [host(tier=1.0)]
  c.num_workers = 1
  return c
