"""A logged row's train metrics as one `clu.metrics.Collection`, and the parameter overview.

Why clu here: the Collection declares what a row's train metrics are, in the form Flax code
reads, and is read (`compute()`, on the device) once per logged row. Today a row is one
round, so the Collection holds that round's value; merging rounds (`merge`) is where a
longer log period would add them up. `clu.metrics` and
`clu.parameter_overview` import only absl, flax, jax and numpy; `clu.metric_writers` imports
TensorFlow, so it is reached only through `metrics.writer='clu'` (run/metrics.py), which
the config check refuses where TensorFlow is missing.

Why the round's mean goes in, not the workers' losses: the numbers stay the ones the run
wrote before clu, bit for bit. The sync program merges the workers' losses (each the mean
over its inner steps) into the round's mean inside its own all-reduce (`sync_program`);
an Average of those R values, in another program, sums them in another order (on CPU,
with R >= 3, up to half of rounds differ by 1-3 float32 ulps). So each round's mean enters
the Average with count 1, and compute() returns it exactly (x·1/1). The simulator and the
Ray runtime average the jobs of a log period on the host in float64 (their checkpointed
accounts); they are left so rather than rounded to float32.
"""

import flax
import jax
from clu import metrics as clu_metrics
from clu import parameter_overview


@flax.struct.dataclass
class TrainMetrics(clu_metrics.Collection):
  """A synchronous round's train metrics (the runner's rounds; collaborative epochs report
  their host-side mean instead)."""
  train_loss: clu_metrics.Average.from_output("train_loss")


def of_round(train_loss) -> TrainMetrics:
  """One round's collection: its train loss, the mean over the workers of each worker's
  mean over its inner steps, as the sync program computed it, counted once."""
  return TrainMetrics.single_from_model_output(train_loss=train_loss)


@jax.jit
def _computed(train_loss) -> dict:
  return of_round(train_loss).compute()


def train_scalars(metrics: dict) -> dict:
  """A round's device metrics (the sync's) with the collection's values in their place, on
  the device: the caller fetches them with the rest of the row."""
  return {**metrics, **_computed(metrics["train_loss"])}


def overview(abstract_params) -> str:
  """`clu.parameter_overview`'s table (name, shape, dtype, size; one line per array) of a
  parameter tree whose leaves need only `shape` and `dtype`: nothing is computed or fetched."""
  flat = {jax.tree_util.keystr(path, simple=True, separator="/"): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
  return parameter_overview.get_parameter_overview(flat, include_stats=False)
