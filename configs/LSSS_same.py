"""Heterogeneous reference: full-width L + three 25%-FFN S workers, all on the same batches."""

import pathlib
import runpy

_hetero = runpy.run_path(str(pathlib.Path(__file__).with_name("diloco_hetero.py")))


def get_config():
  c = _hetero["get_config"]()
  c.data.batch_mode = "same"
  return c
