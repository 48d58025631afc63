"""Every configuration field with its default: the schema the package ships
(lowcomm_jax/config/defaults.py, where each field's meaning is written). Other config files
start from `get_config()` here and change a few fields; any field can be overridden on the
command line, e.g. `--config.outer.lr=0.5`. `--print_config` lists them all.
"""

from lowcomm_jax.config.defaults import get_config  # noqa: F401 - what config files load

# The simulator's study configs (sim_geo, sim_sweep, async_hetero) take a size as their last
# argument: the model their studies use, or a byte-level stand-in a 2-core CPU runs in under
# 3 minutes (BENCHMARKS.md, issue 52). Only the model and its tokenizer change.
SIZES = {
    "pythia": {"model.name": "pythia_14m", "data.tokenizer": "gpt2"},
    "cpu": {"model.name": "small", "data.tokenizer": "byte"},
}


def sized(c, size: str, arg: str):
  """`c` at `size` (a key of SIZES); `arg` is the config argument, for the error."""
  if size not in SIZES:
    raise ValueError(f"config argument {arg!r}: size {size!r} is not one of {sorted(SIZES)}")
  c.update_from_flattened_dict(SIZES[size])
  return c
