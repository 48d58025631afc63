"""The plain mean over workers: where a round's communication happens."""

import optax

from lowcomm_jax.parallel import collectives


def replica_mean(axis_name: str = "replica") -> optax.GradientTransformation:
  """Stateless transform: the mean of the updates over all workers on `axis_name`.

  An all-reduce across devices/processes (and a plain mean over vmapped workers). After it
  every worker holds the same value, so whatever follows in the chain runs identically on
  all of them.
  """

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    return collectives.mean(updates, axis_name), state

  return optax.GradientTransformation(init_fn, update_fn)
