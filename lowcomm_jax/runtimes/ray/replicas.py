"""The peer form (`forms.among_workers`), the driver's side of it: the `form` a progress
policy is given (progress.py) where every worker holds a replica. The policy keeps the
control plane (quorum.py: which contributions make a round, `ray.min_quorum`,
`ray.grace_s`, late contributions, joins and losses; epochs.py: a collaborative epoch's
samples), and the round's members move the bytes among themselves (replica.py): no process
holds θ for the others, and no link carries every worker's payload.

What differs from the server form:
- every worker holds a replica of θ and the outer rules' state, and a job starts from its
  own; a worker behind the open round first adopts a live member's (heals.py);
- a round closes with a collective among its members, in the form `forms.for_round` picks
  (forms/: around a ring, direct, by region, pair swaps). The driver sends each member one
  message (the version, the attempt, the members, their handles and where each receives,
  the form's plan) and reads one outcome back (the hash of what it staged, its link's
  bytes); every phase between is member to member, so the driver's calls a round are O(W)
  and it never waits between phases (attempts.py: an attempt's messages and outcomes).
  The staged θ's hashes must agree before any member commits (a commit each);
- a member that dies, or that the others wait for in vain past `ray.collective_timeout_s`,
  is lost: the others are told to stop waiting (`abort`), and the collective is tried again
  among them from the contributions they kept: nothing is applied twice (a commit is by
  version), and no replica moves without the others (the start checks the timeout covers
  a round's bytes over sim.network's links);
- evaluation, parameter norms and checkpoints read a live member's replica; a checkpoint's
  global state is a replica's, in the server's layout, and a resumed run's workers adopt it.
"""

import collections
import logging
import time

from lowcomm_jax.programs import scatter_program, sync_program
from lowcomm_jax.runtimes.ray import forms
from lowcomm_jax.runtimes.ray.attempts import Attempt, Attempts, timeout_covers_bytes
from lowcomm_jax.runtimes.ray.forms.base import signals_of
from lowcomm_jax.runtimes.ray.heals import Heals
from lowcomm_jax.parallel.server_names import GLOBAL


class Replicas:
  """The driver's side of the workers' replicas (`d`: the driver): which version each
  worker holds, the adopts in flight, the open version's contributions (`rows`), and its
  collective among their workers (`_close_collective`), or in flight beside the next jobs
  (`pending`: `close_segment` says when)."""

  def __init__(self, d):
    self.d = d
    r = d.r
    self.version = 0  # syncs closed: the version the open round's members start from
    self.held: dict[int, int | None] = {}  # worker -> the version its replica holds
    self.rows: dict[int, tuple[dict, object]] = {}  # the open round: worker -> (meta, sent)
    self.adopting: dict[int, object] = {}  # worker -> its adopt's reference, in flight
    self.heals = Heals(d)  # whom an adopt takes from, and a fresh worker's own state
    self.restored = None  # a resumed run's global state: where its part lies, for the workers
    self.reduces = sync_program.peer_reduces(r.sync)
    self.attempts = Attempts(d)
    self.tallies = collections.Counter()  # rounds closed by form, where the form counts
    segments = len(r.algorithm.segments(d.c, d.c.inner_steps))
    self.overlaps = r.algorithm.delayed_sync and self.reduces and segments == 1
    # A mix inside every segment (Streaming's τ > 0): a segment's collective runs while the
    # next segment's first τ steps compute (`Programs.local_halves`: they read nothing of θ)
    halves = r.programs.local_halves
    self.streams = segments > 1 and bool(halves) and all(p is not None for p in halves[0])
    # a round whose collective runs beside the next jobs: (v, rows, members, staged, began)
    self.pending = None
    logging.info("ray: %s", timeout_covers_bytes(
        d.c, d.plan, self.reduces or scatter_program.scatters(r.sync)))

  # --- what the driver asks of the global state -------------------------------------------

  def restore_global(self, state: dict | None) -> None:
    """A checkpoint's global state, {"part": where, "version"}: each worker reads the
    replica there; the live workers' own, {"held": their versions, "version"} (a driver run
    again: records.py); None: a fresh run, each replica starts at θ₀."""
    if state is not None:
      self.version, self.held = int(state["version"]), dict(state.get("held", {}))
      self.restored = state if "part" in state else None

  def opened(self) -> None:
    pool = self.d.pool
    for w in pool.actors:
      if self.restored is None:
        self.held.setdefault(w, 0)
      else:  # each reads the checkpoint's replica where it lies
        self.adopting[w] = pool.actors[w].adopt.remote(self._restored_for(w))
        self.held[w] = self.version
    self._settle_adopts(list(self.adopting))

  def _restored_for(self, worker: int):
    """What `worker` adopts at a resume (the reference of the checkpoint's replica)."""
    del worker
    return self.restored

  def _currents(self, besides: int | None = None) -> list[int]:
    """The live workers whose replicas are at the open round's version, by id."""
    return [w for w in sorted(self.d.pool.actors)
            if w != besides and self.held.get(w) == self.version
            and w not in self.adopting and w not in self.d.pool.joining]

  def global_call(self, method: str, *args):
    """`method` (evaluate, param_norm, save_replica) of a current replica."""
    self._settle()
    errors = self.d.ray.exceptions.RayActorError
    while True:
      w = next(iter(self._currents()), None)
      if w is None:
        raise RuntimeError(f"no live worker holds θ of version {self.version}")
      try:
        return self.d.ray.get(getattr(self.d.pool.actors[w], method).remote(*args))
      except errors as e:
        self.d.pool.lose(w, f"{type(e).__name__} answering {method}")

  def global_parts(self, where: dict, in_flight) -> dict:
    """The checkpoint's global state: a current replica's, written by its worker in the
    server's layout (no snapshots: jobs in flight start from a replica's θ)."""
    del in_flight
    return {GLOBAL: self.global_call("save_replica", where)}

  def resume_job(self, job: dict) -> None:
    """A checkpoint's job in flight, started again (from the restored θ: a job that had
    started from an older one starts from it too)."""
    self.d.pool.dispatch_own(job["worker"], self.version, job["lr_step"], job["steps"],
                             job["order"])

  def summary(self) -> dict:
    tallies = {f.tally: self.tallies[f.tally] for f in forms.FORMS.values() if f.tally}
    return {"round_form": "peers", "server_bytes_sent": 0, **tallies, **self.heals.summary()}

  def _bring_up(self, worker: int):
    """`worker`'s replica at the open round's version: the version (an int), or the
    reference of the adopt that takes a current peer's replica there."""
    if worker in self.adopting:
      return self.adopting[worker]
    if self.held.get(worker) == self.version:
      return self.version
    self._settle()  # (a peer's replica is copied whole: with the round in flight applied)
    fresh = worker not in self.held  # (a new process: no state of its own)
    source = self.heals.source(self._currents(besides=worker), worker, fresh)
    if source is None:
      raise RuntimeError(f"worker {worker} is behind (version {self.held.get(worker)}) and "
                         f"no live worker holds θ of version {self.version}; resume the run "
                         "from its last checkpoint")
    self.adopting[worker] = self.heals.adopt(worker, source, fresh, self.version,
                                             self.held.get(worker))
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
    if self.rows.pop(worker, None) is not None:
      self.d.counts.pushes_dropped += 1
    self.held.pop(worker, None)
    self.adopting.pop(worker, None)

  # --- a quorum round ----------------------------------------------------------------------

  def dispatch(self, worker: int, lr_step: int, steps: int) -> None:
    """A job from the worker's own replica, brought up to the open round first."""
    self.d.pool.dispatch_own(worker, self._bring_up(worker), lr_step, steps)

  def contribute(self, worker: int, meta: dict, sent, segments: int) -> int | None:
    """Keeps the contribution's reference in the open round (the bytes stay with its
    worker); a late one's replica is brought to the open round's θ before it closes."""
    self.adopting.pop(worker, None)  # (its job waited for its adopt)
    self.heals.count(meta)
    staleness = self.version - meta["version"]
    if staleness % segments:  # another segment's fragment: no round of it is open
      return None
    if staleness:
      self._bring_up(worker)
    self.rows[worker] = (meta, sent)
    return staleness

  def close_segment(self, steps: int) -> None:
    """The open segment's collective (`steps`: the server form's count; here each applied
    contribution's own steps are counted, when its collective commits).

    Streaming's τ > 0 (a mix inside every segment): the collective and the next segment's
    jobs start at once; each job runs its τ steps (they read nothing of θ:
    `Programs.local_halves`), then waits for its replica's commit and mixes the new
    fragment in, as the lockstep runtime's τ defines it.
    A delayed sync (`Algorithm.delayed_sync`: one-step delay, eager), a dense mean and one
    segment: θ' on every member at once (`advance`: θ', and what a worker rule reads of the
    outer state, do not depend on the round's own mean), the next jobs start from it, and
    the collective runs while they compute, as the lockstep runtime runs it in the next
    round's program. Either is settled (`_settle`: waited for, tried again without members
    lost, committed) before the next close and before anything reads or copies a replica
    (evaluation, a checkpoint, a heal)."""
    del steps
    self._settle()
    if self.overlaps:  # (its steps are counted when its collective is settled)
      self._advance()
    elif self.streams:  # the next jobs start now; their first τ steps read nothing of θ
      self._settle_adopts([w for w in self.rows if w in self.adopting])
      self._start_pending(self.version,
                          [w for w in sorted(self.rows) if w in self.d.pool.actors])
    else:
      self._applied(self._close_collective().values())

  def after_start(self) -> None:
    """The next jobs started: a streamed segment's collective is settled meanwhile (each
    job waits for its replica's commit to mix it in)."""
    if self.streams:
      self._settle()

  def finish(self) -> None:
    self._settle()

  def _settle(self) -> None:
    """The round in flight's collective, waited for (tried again among its members left)
    and committed."""
    if self.pending is not None:
      v, rows, members, staged, began = self.pending
      members = self._until_committed(v, members, staged, began)
      self.pending = None
      self._applied(rows[w] for w in members)

  def _applied(self, rows) -> None:
    """Counts the inner steps of the contributions a round's collective applied."""
    d, n = self.d, self.d.counts
    n.applied_steps += sum(meta["steps"] for meta, _ in rows)
    d.timeline.applied(n.applied_steps)

  def _advance(self) -> None:
    """The open round's θ' on each of its members (`advance`), its collective started. A
    member that dies taking θ' is lost with its contribution."""
    d, pool = self.d, self.d.pool
    v = self.version
    self._settle_adopts([w for w in self.rows if w in self.adopting])
    members = [w for w in sorted(self.rows) if w in pool.actors]
    tokens, losses = signals_of({w: self.rows[w][0] for w in members}, members)
    refs = {w: pool.actors[w].advance.remote(v, members, tokens, losses) for w in members}
    d.counts.collective_calls += len(members)
    hashes = pool.answers(refs, f"taking round {v}'s θ'")
    if len(set(hashes.values())) > 1:
      raise RuntimeError(f"round {v}: the members' θ' differ ({hashes}); the replicas have "
                         "diverged")
    self._start_pending(v, [w for w in members if w in hashes and w in pool.actors])

  def _start_pending(self, v: int, members: list[int]) -> None:
    """Round `v`'s collective among `members` started, not waited for (`_settle` does); the
    version moves on."""
    rows, self.rows = self.rows, {}
    for w in members:
      self.held[w] = v + 1
    if members:
      began = time.time()
      self.pending = (v, rows, members, None, began)  # (_rows_of(v) finds its rows now)
      self.pending = (v, rows, members, self._start_collective(v, members), began)
    else:
      self._skip(v)
    self.version = v + 1

  # --- a state average between rounds (DES-LOC's moments), among the workers ------------

  def state_average(self, workers: list[int], parts) -> int | None:
    """Each worker's parts in M shards, member j's mean of shard j, all-gathered into each
    (forms.mean_of): no link carries every worker's parts. The bytes of the parts."""
    outcome = self._mean_among("a state average", workers, "mean_state", parts=parts)
    if outcome is None:
      return None
    for w, out in outcome.items():
      self.d.counts.wire(w, out)
    return sum(out["bytes"] for out in outcome.values())

  # --- a collaborative epoch among the peers ----------------------------------------------

  def open_theta(self) -> tuple[int, None]:
    return self.version, None  # (each peer's own replica)

  def dispatch_micro(self, worker: int, theta) -> None:
    """A micro-batch from the peer's own replica (its adopt first, where it is behind)."""
    del theta
    self.d.pool.dispatch_micro(worker, self.version, self._bring_up(worker))

  def contribute_epoch(self, worker: int, meta: dict, sent) -> int:
    """Its mean gradient stays with it (the replica kept it) until the epoch's collective."""
    self.adopting.pop(worker, None)  # (its micro-batches waited for its adopt)
    self.heals.count(meta)
    self.rows[worker] = (meta, sent)
    return 0

  def close_epoch(self, by_peer: dict[int, int]) -> set:
    """The epoch's step: the collective among the peers whose mean gradients it holds
    (weighted by samples: the tokens of each peer's meta); the peers it applied."""
    del by_peer  # (the rows are the contributions)
    return set(self._close_collective())

  # --- a round's close: the collective ----------------------------------------------------

  def _mean_among(self, what: str, workers: list[int], method: str, **fields) -> dict | None:
    """A mean of one vector per worker among `workers` (the workers' `method`: mean_state,
    consensus; `fields`: what else it is told): {worker: its outcome}; None after losing the
    workers that died or that the others waited for in vain (then try again)."""
    attempt = self.attempts.start(self.version, workers, method, {w: fields for w in workers})
    outcome = self.attempts.outcome(what, self.version, workers, attempt)
    if outcome is None:
      self.attempts.lose_failed(what, self.version, workers, attempt)
    return outcome

  def _close_collective(self) -> dict:
    """The open version's collective among the workers whose contributions it holds, tried
    again without any that are lost, then committed; the version moves on (every current
    replica's with it if nobody contributed). The rows it applied ({worker: (meta, sent)})."""
    d, v = self.d, self.version
    self._settle_adopts([w for w in self.rows if w in self.adopting])
    self._until_committed(v, [w for w in sorted(self.rows) if w in d.pool.actors])
    applied, self.rows = self.rows, {}
    if not applied:
      self._skip(v)
    self.version = v + 1
    return applied

  def _skip(self, v: int) -> None:
    """Nobody contributed to round `v`: θ stays, every current replica moves on."""
    pool = self.d.pool
    for w in [w for w, h in self.held.items() if h == v and w in pool.actors]:
      self.d.ray.get(pool.actors[w].skip.remote(v))
      self.held[w] = v + 1

  def _until_committed(self, v: int, members: list[int], staged: Attempt | None = None,
                       began: float | None = None) -> list[int]:
    """Round `v`'s collective among `members` (`staged`: its attempt, if started, at
    `began`), tried again among those left after each failed attempt until one commits:
    the members it committed (none: every one was lost)."""
    d = self.d
    while members:
      at = time.time() if began is None else began
      outcome, attempt = self._collective(v, members, staged)
      if outcome is not None:
        self._commit(v, members, outcome, attempt.form)
        d.timeline.collective(v, members, at, outcome, time.time())
        return members
      d.counts.collective_retries += 1
      members, staged = [w for w in members if w in d.pool.actors], None
    return []

  def _collective(self, v: int, members: list[int], staged: Attempt | None = None
                  ) -> tuple[dict | None, Attempt]:
    """Round `v`'s collective among `members` (`staged`: its attempt, if it is already
    started): ({worker: {hash, sent, received, moments}}, or None after losing the members
    that died or that the others waited for in vain (then try again); the attempt)."""
    if staged is None:
      staged = self._start_collective(v, members)
    outcome = self.attempts.outcome("a round's collective", v, members, staged)
    if outcome is None:
      self.attempts.lose_failed("a round's collective", v, members, staged)
    return outcome, staged

  def _start_collective(self, v: int, members: list[int]) -> Attempt:
    """Round `v`'s collective among `members`, started: one message to each member, which
    then move the bytes among themselves (forms/: the form `forms.for_round` picks)."""
    rows = self._rows_of(v)
    form = forms.for_round(self, members)
    if form.tally:
      self.tallies[form.tally] += 1
    metas = {w: rows[w][0] for w in members}
    chaos, self.d.pool.in_sync = self.d.pool.in_sync, {}
    return self.attempts.start(v, members, "exchange", form.messages(self, v, members, metas),
                               form, chaos)

  def _rows_of(self, v: int) -> dict:
    """The contributions of round `v` (the one in flight, or the open one)."""
    if self.pending is not None and self.pending[0] == v:
      return self.pending[1]
    return self.rows

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
    for w in d.pool.answers(refs, "committing a round"):  # (one lost: the others have it)
      self.held[w] = v + 1
    for w, o in outcome.items():
      d.counts.wire(w, o)
