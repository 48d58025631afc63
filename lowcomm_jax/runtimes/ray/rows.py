"""Each Ray worker's host-table row (its MatFormer tier and configured H) and the H its jobs
take under DyLU (`outer.dylu`): what the pool (pool.py) asks about a worker, apart from
its process and its jobs."""

import logging
from typing import Callable

import ml_collections

from lowcomm_jax.assemble.hosts import settle_inner_steps


class WorkerRows:
  """`hosts`: the host table with a row for every worker id the run may use (chaos's joiners
  too); none given: every worker full width, of the config's batch and H. `note(event,
  **fields)` records an event (a metrics.jsonl row)."""

  def __init__(self, config: ml_collections.ConfigDict, hosts, note: Callable[..., None]):
    self.c, self.note = config, note
    self.host_of = {w: h for h in hosts for w in h.worker_ids}
    self.inner_steps: dict[int, int] = {}  # H per worker where DyLU settled one
    self.speeds: dict[int, float] = {}  # DyLU: steps per second, per worker

  # --- tiers ------------------------------------------------------------------------------

  def tier_fields(self, worker: int, live) -> dict:
    """A membership event's tier fields: the worker's tier, and the `live` workers per
    tier."""
    if not self.host_of:
      return {}
    per_tier: dict[str, int] = {}
    for w in live:
      key = f"{self.host_of[w].tier:g}"
      per_tier[key] = per_tier.get(key, 0) + 1
    return {"tier": self.host_of[worker].tier, "live_per_tier": per_tier}

  def say_untrained(self, live) -> None:
    """Says so when no `live` worker trains the widest FFN units (every worker of the
    widest tier is gone): until one joins, the server's rounds leave those units as they
    are."""
    if not self.host_of:
      return
    trained = max((self.host_of[w].hidden for w in live), default=0)
    widest = max(h.hidden for h in self.host_of.values())
    if trained < widest:
      logging.warning("ray: no live worker trains FFN units %d..%d (the widest live tier "
                      "trains %d); the server leaves them as they are until one joins",
                      trained, widest - 1, trained)
      self.note("units_untrained", first=trained, last=widest - 1)

  # --- H ----------------------------------------------------------------------------------

  def configured_inner_steps(self, worker: int) -> int:
    """H of `worker`'s host-table row (the config's inner_steps without a table)."""
    host = self.host_of.get(worker)
    return host.inner_steps if host is not None else self.c.inner_steps

  def inner_steps_of(self, worker: int) -> int:
    """The H its next job takes: DyLU's where it settled one, else its row's."""
    return self.inner_steps.get(worker, self.configured_inner_steps(worker))

  def measured(self, worker: int, meta: dict, live) -> None:
    """DyLU: a worker's speed is its steps per second of job (the caller leaves out its
    first job, which compiles); H is settled again from the `live` workers' speeds once all
    are known, and whenever membership changes."""
    if not self.c.outer.dylu:
      return
    first = worker not in self.speeds
    self.speeds[worker] = meta["steps"] / max(meta["job_seconds"], 1e-9)
    if first:
      self.settle("speed measured", live)

  def settle(self, why: str, live) -> None:
    if not self.c.outer.dylu:
      return
    live = sorted(live)
    speeds = [self.speeds.get(w, 0.0) for w in live]
    settled = dict(zip(live, settle_inner_steps(
        self.c, [self.configured_inner_steps(w) for w in live], speeds)))
    if settled != {w: self.inner_steps_of(w) for w in live}:
      self.inner_steps.update(settled)
      self.note("inner_steps", why=why, inner_steps={str(w): h for w, h in settled.items()})
