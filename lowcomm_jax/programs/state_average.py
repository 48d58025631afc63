"""The workers' state average (`Algorithm.state_sync`: DES-LOC's Adam moments): every
worker's chosen parts of its inner-optimizer state replaced by their mean over all workers,
one all-reduce per part. The runner runs `make_state_sync` as a global program; the Ray
runtime's server task and peers average the rows they hold with `rows_mean`, the same
all-reduce over stacked rows, so one program averages them on every runtime."""

import jax

from lowcomm_jax.parallel import collectives


def make_state_sync(state_sync):
  """`average(opt_states[R, ...], parts)` -> the workers' inner-optimizer states with `parts`
  averaged over all workers (algorithms.base.StateSync; an all-reduce per part)."""
  def average(opt_state_R, parts: tuple[str, ...]):
    return jax.vmap(lambda s: state_sync.average(s, parts, "replica"), axis_name="replica",
                    spmd_axis_name="replica")(opt_state_R)
  return average


@jax.jit
def rows_mean(rows_R):
  """The mean of stacked rows (a tree, leaves [R, ...]) by the all-reduce a state average
  runs (collectives.mean over the vmapped rows, as `make_state_sync`'s StateSync.average
  does): the Ray runtime's server and peers average the parts they hold with it, so a
  state average is one program on every runtime. Leaves [...]."""
  mean_R = jax.vmap(lambda row: collectives.mean(row, "replica"), axis_name="replica")(rows_R)
  return jax.tree.map(lambda x: x[0], mean_R)
