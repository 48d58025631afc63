"""Which collective forms a config's rounds have on Ray, from `collective_form` and the
algorithm's declarations: plain Python, asked by the config checks (runtimes/ray/checks.py)
and by the driver and workers at start-up (`among_workers`)."""

import ml_collections

SERVER = "server"  # the server form: rounds through a parameter-server actor (server.py)
# What collective_form may say on Ray: the forms that run a dense mean among the workers,
# 'auto' (direct, by region or around a ring, as the simulator's model says), the server.
ON_RAY = ("auto", "direct", "ring", "hierarchical", SERVER)


def peer_capable(c: ml_collections.ConfigDict, algorithm) -> str:
  """Why `algorithm`'s rounds have no form among the workers on Ray ('': they have one)."""
  if not algorithm.synchronous:
    return f"{c.algorithm}'s parameter server is the algorithm (asynchronous pushes)"
  rule = algorithm.worker_rule(c)
  if rule is not None and rule.reads_sync_state and not getattr(rule, "swaps_with_a_peer", False):
    return (f"{c.algorithm}'s workers read their own rows of the sync's state, which the "
            "server keeps")
  return ""


def no_dense_mean(c: ml_collections.ConfigDict, algorithm) -> str:
  """Why the rounds of `algorithm` have no hierarchical or ring form ('': they have): both
  add partial sums of a dense mean, where payloads all-gathered whole (a codec's, an
  attack's), a robust rule's rows (combined coordinate by coordinate, not summed) or a
  pair swap have none."""
  from lowcomm_jax.programs.sync import robust_combination  # (plain Python: no jax)
  if c.compress.codec != "none" or robust_combination(c) or list(c.attack.workers):
    return ("a codec or an attack all-gathers the members' payloads whole, and a robust "
            "rule or signal weights combine every member's rows, not region sums "
            "(compress.codec, aggregate.*, attack.workers)")
  rule = algorithm.worker_rule(c)
  if rule is not None and getattr(rule, "swaps_with_a_peer", False):
    return f"{c.algorithm}'s rounds are swaps between two workers"
  return ""


def among_workers(c: ml_collections.ConfigDict, algorithm) -> bool:
  """Whether a Ray run's rounds close among their workers, each holding θ (replicas.py;
  the summary's round_form 'peers'), rather than through the server actor: where the
  algorithm has such rounds and `collective_form` is not 'server'."""
  return c.collective_form != SERVER and not peer_capable(c, algorithm)


def config_problems(c: ml_collections.ConfigDict, check, algorithm) -> None:
  """`collective_form` against the forms Ray has, and those `algorithm`'s rounds have."""
  form = c.collective_form
  check(form in ON_RAY, "collective_form", f"Ray's rounds run one of {list(ON_RAY)}")
  why = ""
  if algorithm is not None:
    why = peer_capable(c, algorithm)
    check(not (why and form in ("hierarchical", "ring", "direct")), "collective_form",
          f"{why}: it has no collective form on Ray; use 'auto' or 'server'")
  regions = max(c.sim.network.regions, len(set(c.sim.network.worker_regions)))
  check(form != "hierarchical" or regions > 1, "collective_form",
        "'hierarchical' reduces inside each region, then across them, and the network has "
        "one region: use 'direct', or give sim.network.regions > 1")
  if c.compress.reduce == "scatter":  # (a reduce-scatter's owners are the round's members)
    check(form not in (SERVER, "hierarchical", "ring") and not why, "compress.reduce",
          "a reduce-scatter runs among the round's members (the direct form): use "
          "collective_form 'auto' or 'direct', or compress.reduce='gather'")
    check(not list(c.attack.workers), "compress.reduce",
          "on Ray an attack's rows are all-gathered whole: use 'gather'")
  if algorithm is not None and form in ("hierarchical", "ring") and not why:
    flat = no_dense_mean(c, algorithm)
    check(not flat, "collective_form",
          f"{flat}: {form!r} is for a dense mean on Ray; use 'direct' or 'auto'")
