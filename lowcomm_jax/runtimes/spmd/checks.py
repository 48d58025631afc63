"""The lockstep runtime's config problems (`runtime='spmd'`), each 'field=value: fix'.
Plain Python: a bad config fails in a second."""

import ml_collections

from lowcomm_jax.errors import Problems


def problems(c: ml_collections.ConfigDict, num_processes: int, algorithm) -> list[str]:
  """Problems of `runtime='spmd'` with `algorithm` (None: an unknown name, reported
  elsewhere). What every runtime shares is config/check.py's."""
  out = Problems(c)
  if algorithm is not None:
    # Lockstep processes run rounds together; a parameter server's arrivals need their
    # own clocks (the simulator's) or their own processes (Ray's).
    out.check(not algorithm.simulated_only, "algorithm",
              f"{c.algorithm} applies each worker's update as it arrives at a parameter "
              "server, which lockstep processes have not; set --config.runtime=simulator "
              "or --config.runtime=ray")
  return list(out)
