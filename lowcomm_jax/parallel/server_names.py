"""The names of a run's parameter servers: one vocabulary for the schedules that decide
when a server is pulled from and pushed to (sim/), the algorithms that declare servers
(HALoS's regional ones) and the runtimes that host them (the simulator's backend, the Ray
runtime's server actors, and its peer form, whose replicas stand for the global one)."""

GLOBAL = "global"  # the one server every algorithm has: θ and the outer state


def region_server(region: int) -> str:
  """A region's local server (HALoS's LPS)."""
  return f"region{region}"
