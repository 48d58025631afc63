"""Every configuration field with its default: the schema the package ships
(lowcomm_jax/config/defaults.py, where each field's meaning is written). Other config files
start from `get_config()` here and change a few fields; any field can be overridden on the
command line, e.g. `--config.outer.lr=0.5`. `--print_config` lists them all.
"""

from lowcomm_jax.config.defaults import get_config  # noqa: F401 - what config files load
