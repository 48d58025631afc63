"""The attempts of a collective among the workers, the driver's side (replicas.py asks): one
message to each member, one outcome back from each, and who is lost when an attempt fails.
What a member does with its message is its collective form's (forms/)."""

import collections
import logging
import time
from typing import NamedTuple

from lowcomm_jax.errors import ConfigError, field_problem
from lowcomm_jax.runtimes.ray import forms
from lowcomm_jax.sim import collectives


class Attempt(NamedTuple):
  """One attempt of a collective, started: its number (the members' mailboxes key on it),
  its form, and each member's outcome's reference (in member order)."""
  number: int
  form: forms.Form
  refs: list


class Attempts:
  """The collectives' attempts of one run (`d`: the driver)."""

  def __init__(self, d):
    self.d = d
    self.count = 0  # attempts started (each attempt's number: the members key on it)
    self._addresses: dict = {}  # worker -> (its actor, its postbox's address)
    self.failures = ({}, [])  # the last failed attempt's outcomes, and who never answered

  def start(self, v: int, members: list[int], method: str, messages: dict,
            form: forms.Form | None = None, chaos: dict | None = None) -> Attempt:
    """An attempt of a collective among `members`: each member's `method` called once with
    its message and what every member is told (the version, the attempt, the members and
    their handles, the timeout; `chaos`: {"crash": the member it kills}, the same once it
    staged ("crash_staged"), or {"stall": [the member it holds back, seconds]})."""
    pool = self.d.pool
    self.count += 1
    common = {"version": v, "attempt": self.count, "members": list(members),
              "handles": {w: pool.actors[w] for w in members},
              "timeout_s": self.d.c.ray.collective_timeout_s, **(chaos or {})}
    if form is not None:
      common["form"] = form.name
    if self.d.c.ray.transport == "sockets":
      common["addresses"] = self._addresses_of()
      common["sends_in_flight"] = self.d.c.ray.sends_in_flight
    refs = [getattr(pool.actors[w], method).remote({**common, **messages[w]})
            for w in members]
    self.d.counts.collective_calls += len(members)
    return Attempt(self.count, form, refs)

  def _addresses_of(self) -> dict:
    """Every live worker's postbox address (forms/sockets.py), asked once per process."""
    pool, ray = self.d.pool, self.d.pool.ray
    asked = {w: actor.address.remote() for w, actor in pool.actors.items()
             if self._addresses.get(w, (None,))[0] is not actor}
    timeout = self.d.c.ray.recover_timeout_s
    for w, ref in asked.items():
      try:
        self._addresses[w] = (pool.actors[w], ray.get(ref, timeout=timeout))
      except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        self._addresses.pop(w, None)  # (gone: its attempt fails, and it is lost there)
    return {w: self._addresses[w][1] for w in pool.actors if w in self._addresses}

  def outcome(self, what: str, version: int, members: list[int], attempt: Attempt
              ) -> dict | None:
    """Every member's outcome of `attempt` ({worker: outcome}), or None where some member
    died, failed its part (the outcome names whom it waited for) or did not answer within
    ray.collective_timeout_s (and ray.recover_timeout_s more to report). At the first
    failure the others are told to stop waiting (`abort`). A member's own error, not a
    death, stops the run."""
    d = self.d
    errors = d.ray.exceptions
    deadline = time.monotonic() + d.c.ray.collective_timeout_s + d.c.ray.recover_timeout_s
    waiting = dict(zip(attempt.refs, members))
    outcome, failed = {}, False
    while waiting:
      ready, _ = d.ray.wait(list(waiting), num_returns=1,
                            timeout=max(0.0, deadline - time.monotonic()))
      if not ready:
        break
      w = waiting.pop(ready[0])
      try:
        outcome[w] = d.ray.get(ready[0])
      except errors.RayTaskError as e:
        if not isinstance(e.cause, (errors.RayActorError, errors.ObjectLostError)):
          raise RuntimeError(f"{what} (version {version}) failed: {e}") from e
        outcome[w] = {"failed": str(e.cause), "missing": []}
      except errors.RayError:  # it died
        outcome[w] = None
      if not failed and (outcome[w] is None or "failed" in outcome[w]):
        failed = True  # the others stop waiting and report at once
        for other in waiting.values():
          if other in d.pool.actors:
            d.pool.actors[other].abort.remote(version, attempt.number)
            d.counts.collective_calls += 1
        deadline = min(deadline, time.monotonic() + d.c.ray.recover_timeout_s)
    self.failures = (outcome, list(waiting.values()))
    return None if failed or waiting else outcome

  def lose_failed(self, what: str, version: int, members, attempt: Attempt) -> None:
    """After a failed attempt (`outcome`'s record of it): the members that died are lost;
    else those the others waited for in vain (where members wait in a chain, those the
    earliest waits named), and those that never answered."""
    pool = self.d.pool
    outcome, unanswered = self.failures
    dead = [w for w in members if w in pool.actors
            and (outcome.get(w, {}) is None or not pool.worker_alive(w))]
    reports = [out for out in outcome.values() if out is not None and "failed" in out]
    chained = [out["waited_at"] for out in reports if "waited_at" in out]
    if chained:  # (a ring: the others wait behind the earliest wait, next to the stall)
      reports = [out for out in reports if out.get("waited_at") == min(chained)]
    named = collections.Counter(m for out in reports for m in out["missing"] if m in members)
    most = max(named.values(), default=0)
    waited_for = sorted({w for w, k in named.items() if k == most} | set(unanswered))
    lost = dead or waited_for
    if not lost:
      raise RuntimeError(f"{what} (version {version}, attempt {attempt.number}) failed "
                         f"and members {members} are alive and answered: {outcome}")
    for w in [w for w in lost if w in pool.actors]:
      why = (f"died in {what}" if dead else
             f"was waited for in vain in {what} (ray.collective_timeout_s="
             f"{self.d.c.ray.collective_timeout_s})")
      pool.lose(w, why)
    logging.warning("ray: %s (version %d) is tried again without workers %s", what,
                    version, lost)


def timeout_covers_bytes(c, plan, reduces: bool) -> str:
  """One line saying that `ray.collective_timeout_s` covers a round's bytes among every
  worker over the links `sim.network` describes (the simulator's time of the direct form:
  a dense mean's reduce-scatter and all-gather, or the payloads all-gathered), with twice
  that to spare for compute and a retry; a ConfigError naming the field where it does not."""
  members = list(range(c.num_workers))
  nbytes = plan.delta_bytes * plan.network.bytes_scale
  seconds = (collectives.direct_allreduce_seconds if reduces
             else collectives.direct_allgather_seconds)(plan.network, members, nbytes)
  timeout = c.ray.collective_timeout_s
  what = (f"a round's bytes among {len(members)} workers take {seconds:.1f} s over "
          f"sim.network's links ({nbytes / 1e6:.1f} MB a member)")
  if timeout < 2 * seconds:
    raise ConfigError([field_problem(c, "ray.collective_timeout_s",
                                     f"{what}; use at least {2 * seconds:.0f}")])
  return f"ray.collective_timeout_s={timeout:g} covers the collective: {what}"
