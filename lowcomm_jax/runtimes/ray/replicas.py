"""The peer form (`forms.among_workers`), the driver's side of it: the driver keeps the
control plane of quorum.py (which contributions make a round, `ray.min_quorum`,
`ray.grace_s`, late contributions, joins and losses), and the round's members move the
bytes among themselves (replica.py): no process holds θ for the others, and no link
carries every worker's payload.

What differs from the server form:
- every worker holds a replica of θ and the outer rules' state, and a job starts from its
  own; a worker behind the open round (one that joined, one whose job outlived a round)
  first adopts a live member's replica (torchft's healing, peer to peer);
- a round closes with a collective among its members, in the form `forms.for_round` picks
  (forms/: around a ring, direct, by region, pair swaps). The driver sends each member one
  message (the version, the attempt, the members, their handles and where each receives,
  the form's plan) and reads one outcome back (the hash of what it staged, its link's
  bytes); every phase between is member to member, so the driver's calls a round are O(W)
  and it never waits between phases. The staged θ's hashes must agree before any member
  commits (a commit each);
- a member that dies, or that the others wait for in vain past `ray.collective_timeout_s`,
  is lost: the others are told to stop waiting (`abort`), and the collective is tried again
  among them from the contributions they kept: nothing is applied twice (a commit is by
  version), and no replica moves without the others. At the start the driver says in one
  line that the timeout covers a round's bytes over sim.network's links, or refuses it;
- evaluation, parameter norms and checkpoints read a live member's replica; a checkpoint's
  global state is a replica's, in the server's layout, and a resumed run's workers adopt it.
"""

import collections
import logging
import time
from typing import NamedTuple

from lowcomm_jax.errors import ConfigError, field_problem
from lowcomm_jax.programs import sync_program
from lowcomm_jax.runtimes.ray import forms
from lowcomm_jax.sim import GLOBAL, collectives


class Attempt(NamedTuple):
  """One attempt of a collective, started: its number (the members' mailboxes key on it),
  its form, and each member's outcome's reference (in member order)."""
  number: int
  form: forms.Form
  refs: list


class Replicas:
  """The driver's side of the workers' replicas, before a progress policy (PeerRounds:
  quorum rounds; peer_epochs.PeerEpochs: collaborative epochs): which version each worker
  holds, the adopts in flight, the open version's contributions (`rows`), and its
  collective among their workers (`_close_collective`)."""

  def __init__(self, d):
    super().__init__(d)
    self.version = 0  # syncs closed: the version the open round's members start from
    self.held: dict[int, int | None] = {}  # worker -> the version its replica holds
    self.rows: dict[int, tuple[dict, object]] = {}  # the open round: worker -> (meta, sent)
    self.adopting: dict[int, object] = {}  # worker -> its adopt's reference, in flight
    self.restored = None  # a resumed run's global state (object ref), for the workers
    self.reduces = sync_program.peer_reduces(d.r.sync)
    self.attempts = 0  # collectives started (each attempt's number: the members key on it)
    self.tallies = collections.Counter()  # rounds closed by form, where the form counts
    self._addresses: dict = {}  # worker -> (its actor, its postbox's address)
    logging.info("ray: %s", timeout_covers_bytes(d.c, d.plan, self.reduces))

  # --- what the driver asks of the global state -------------------------------------------

  def restore_global(self, state: dict | None) -> None:
    """A checkpoint's global state (None: a fresh run, each replica starts at θ₀)."""
    if state is not None:
      self.version = int(state["version"])
      self.restored = self.d.ray.put({k: state[k] for k in ("params", "opt_state", "version")})

  def opened(self) -> None:
    super().opened()
    pool = self.d.pool
    for w in pool.actors:
      if self.restored is None:
        self.held[w] = 0
      else:  # one copy from the driver to each worker, at a resume only
        self.adopting[w] = pool.actors[w].adopt.remote(self._restored_for(w))
        self.held[w] = self.version
    self._settle_adopts(list(self.adopting))

  def _restored_for(self, worker: int):
    """What `worker` adopts at a resume (the reference of the checkpoint's replica)."""
    del worker
    return self.restored

  def _current(self, besides: int | None = None) -> int | None:
    """A live worker whose replica is at the open round's version (the lowest id)."""
    return next((w for w in sorted(self.d.pool.actors)
                 if w != besides and self.held.get(w) == self.version
                 and w not in self.adopting and w not in self.d.pool.joining), None)

  def global_call(self, method: str):
    """`method` (evaluate, param_norm) of a current replica."""
    errors = self.d.ray.exceptions.RayActorError
    while True:
      w = self._current()
      if w is None:
        raise RuntimeError(f"no live worker holds θ of version {self.version}")
      try:
        return self.d.ray.get(getattr(self.d.pool.actors[w], method).remote())
      except errors as e:
        self.d.pool.lose(w, f"{type(e).__name__} answering {method}")

  def global_states(self, in_flight) -> dict:
    """The checkpoint's global state: a current replica's, in the server's layout (no
    snapshots: jobs in flight start from a replica's θ)."""
    del in_flight
    state = self.global_call("share")
    return {GLOBAL: {**state, "snapshots": {}}}

  def summary(self) -> dict:
    tallies = {f.tally: self.tallies[f.tally] for f in forms.FORMS.values() if f.tally}
    return {**super().summary(), "round_form": "peers", "server_bytes_sent": 0, **tallies}

  def _bring_up(self, worker: int):
    """`worker`'s replica at the open round's version: the version (an int), or the
    reference of the adopt that takes a current peer's replica there."""
    if worker in self.adopting:
      return self.adopting[worker]
    if self.held.get(worker) == self.version:
      return self.version
    source = self._current(besides=worker)
    if source is None:
      raise RuntimeError(f"worker {worker} is behind (version {self.held.get(worker)}) and "
                         f"no live worker holds θ of version {self.version}; resume the run "
                         "from its last checkpoint")
    pool = self.d.pool
    self.adopting[worker] = pool.actors[worker].adopt.remote(pool.actors[source].share.remote())
    self.held[worker] = self.version
    return self.adopting[worker]

  def _settle_adopts(self, workers) -> None:
    """Waits for `workers`' adopts in flight (a joiner's first job waits for its own, and
    nobody else does); a worker that died taking one is lost."""
    errors = self.d.ray.exceptions.RayError
    for w in workers:
      ref = self.adopting[w]
      try:
        self.d.ray.get(ref, timeout=self.d.c.ray.recover_timeout_s)
      except errors as e:
        if w in self.d.pool.actors:
          self.d.pool.lose(w, f"{type(e).__name__} adopting a peer's replica")
      self.adopting.pop(w, None)

  def on_lose(self, worker: int) -> None:
    """A lost worker's contribution goes with it (its shards and payloads were its own)."""
    super().on_lose(worker)
    if self.rows.pop(worker, None) is not None:
      self.d.counts.pushes_dropped += 1
    self.held.pop(worker, None)
    self.adopting.pop(worker, None)

  def _mean_among(self, what: str, workers: list[int], method: str, **fields) -> dict | None:
    """A mean of one vector per worker among `workers` (the workers' `method`: mean_state,
    consensus; `fields`: what else it is told): {worker: its outcome}; None after losing the
    workers that died or that the others waited for in vain (then try again)."""
    attempt = self._start(self.version, workers, method, {w: fields for w in workers})
    outcome = self._await(what, self.version, workers, attempt)
    if outcome is None:
      self._lose_failed(what, workers, attempt)
    return outcome

  def _count_wire(self, worker: int, out: dict) -> None:
    n = self.d.counts
    sent, received = n.wire_bytes.get(str(worker), [0, 0])
    n.wire_bytes[str(worker)] = [sent + out["sent"], received + out["received"]]

  # --- a round's close: the collective ----------------------------------------------------

  def _close_collective(self) -> dict:
    """The open version's collective among the workers whose contributions it holds, tried
    again without any that are lost, then committed; the version moves on (every current
    replica's with it if nobody contributed). The rows it applied ({worker: (meta, sent)})."""
    d, n = self.d, self.d.counts
    v = self.version
    self._settle_adopts([w for w in self.rows if w in self.adopting])
    while True:
      members = [w for w in sorted(self.rows) if w in d.pool.actors]
      if not members:
        break
      began = time.time()
      outcome, attempt = self._collective(v, members)
      if outcome is not None:
        self._commit(v, members, outcome, attempt.form)
        d.timeline.collective(v, members, began, outcome, time.time())
        break
      n.collective_retries += 1
    applied, self.rows = self.rows, {}
    if not applied:  # nobody contributed: θ stays, every current replica moves on
      for w in [w for w, h in self.held.items() if h == v and w in d.pool.actors]:
        d.ray.get(d.pool.actors[w].skip.remote(v))
        self.held[w] = v + 1
    self.version = v + 1
    return applied

  def _collective(self, v: int, members: list[int], staged: Attempt | None = None
                  ) -> tuple[dict | None, Attempt]:
    """Round `v`'s collective among `members` (`staged`: its attempt, if it is already
    started): ({worker: {hash, sent, received, moments}}, or None after losing the members
    that died or that the others waited for in vain (then try again); the attempt)."""
    if staged is None:
      staged = self._start_collective(v, members)
    outcome = self._await("a round's collective", v, members, staged)
    if outcome is None:
      self._lose_failed("a round's collective", members, staged)
    return outcome, staged

  def _start_collective(self, v: int, members: list[int]) -> Attempt:
    """Round `v`'s collective among `members`, started: one message to each member, which
    then move the bytes among themselves (forms/: the form `forms.for_round` picks)."""
    rows = self._rows_of(v)
    form = forms.for_round(self, members)
    if form.tally:
      self.tallies[form.tally] += 1
    metas = {w: rows[w][0] for w in members}
    crash, self.d.pool.crash_in_sync = self.d.pool.crash_in_sync, None
    return self._start(v, members, "exchange", form.messages(self, v, members, metas), form,
                       crash)

  def _rows_of(self, v: int) -> dict:
    """The contributions of round `v` (the open one)."""
    del v
    return self.rows

  def _start(self, v: int, members: list[int], method: str, messages: dict,
             form: forms.Form | None = None, crash: int | None = None) -> Attempt:
    """An attempt of a collective among `members`: each member's `method` called once with
    its message and what every member is told (the version, the attempt, the members and
    their handles, the timeout; `crash`: the member chaos kills in it)."""
    pool = self.d.pool
    self.attempts += 1
    common = {"version": v, "attempt": self.attempts, "members": list(members),
              "handles": {w: pool.actors[w] for w in members},
              "timeout_s": self.d.c.ray.collective_timeout_s, "crash": crash}
    if form is not None:
      common["form"] = form.name
    if self.d.c.ray.transport == "sockets":
      common["addresses"] = self._addresses_of()
    refs = [getattr(pool.actors[w], method).remote({**common, **messages[w]})
            for w in members]
    self.d.counts.collective_calls += len(members)
    return Attempt(self.attempts, form, refs)

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

  def _await(self, what: str, version: int, members: list[int], attempt: Attempt
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

  def _lose_failed(self, what: str, members, attempt: Attempt) -> None:
    """After a failed attempt (`_await`'s record of it): the members that died are lost;
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
      raise RuntimeError(f"{what} (version {self.version}, attempt {attempt.number}) failed "
                         f"and members {members} are alive and answered: {outcome}")
    for w in [w for w in lost if w in pool.actors]:
      why = (f"died in {what}" if dead else
             f"was waited for in vain in {what} (ray.collective_timeout_s="
             f"{self.d.c.ray.collective_timeout_s})")
      pool.lose(w, why)
    logging.warning("ray: %s (version %d) is tried again without workers %s", what,
                    self.version, lost)

  def _commit(self, v: int, members: list[int], outcome: dict, form: forms.Form) -> None:
    """Every member commits the staged round, once their hashes agree (where the form's
    members stage the same state)."""
    d = self.d
    hashes = {w: o["hash"] for w, o in outcome.items()}
    if form.same_state and len(set(hashes.values())) != 1:
      raise RuntimeError(f"round {v}: the members' θ differ after the same collective "
                         f"({hashes}); the replicas have diverged")
    refs = {w: d.pool.actors[w].commit.remote(v) for w in members}
    d.counts.collective_calls += len(members)
    for w, ref in refs.items():
      try:
        d.ray.get(ref)
        self.held[w] = v + 1
      except d.ray.exceptions.RayActorError as e:  # the others have the round: it is lost
        d.pool.lose(w, f"{type(e).__name__} committing a round")
    for w, o in outcome.items():
      self._count_wire(w, o)


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

