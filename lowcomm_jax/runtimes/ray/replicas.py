"""The peer form (`checks.round_form` 'peers'), the driver's side of it: the driver keeps the
control plane of quorum.py (which contributions make a round, `ray.min_quorum`,
`ray.grace_s`, late contributions, joins and losses), and the round's members move the
bytes among themselves (replica.py): no process holds θ for the others, and no link
carries every worker's payload.

What differs from the server form:
- every worker holds a replica of θ and the outer rules' state, and a job starts from its
  own; a worker behind the open round (one that joined, one whose job outlived a round)
  first adopts a live member's replica (torchft's healing, peer to peer);
- a round closes with a collective among its members: its shards reduced and all-gathered
  (by region, where the simulator's model says that is faster or the config asks for it),
  or its rows all-gathered (replica.py), each member staging the outer step. The staged θ's
  hashes must agree before any member commits;
- a member that dies or does not finish within `ray.collective_timeout_s` is lost, and the
  collective is tried again among the others from the contributions they kept: nothing is
  applied twice (a commit is by version), and no replica moves without the others;
- evaluation, parameter norms and checkpoints read a live member's replica; a checkpoint's
  global state is a replica's, in the server's layout, and a resumed run's workers adopt it.
"""

import logging
import time

from lowcomm_jax.programs import sync_program
from lowcomm_jax.sim import GLOBAL, collectives


class Replicas:
  """The driver's side of the workers' replicas, before a progress policy (PeerRounds:
  quorum rounds; peer_epochs.PeerEpochs: collaborative epochs): which version each worker
  holds, the adopts in flight, the open version's contributions (`rows`), and its
  collective among their workers (`_close_collective`)."""

  same_state = True  # every member's staged state is the same (its hash is compared)

  def __init__(self, d):
    super().__init__(d)
    self.version = 0  # syncs closed: the version the open round's members start from
    self.held: dict[int, int | None] = {}  # worker -> the version its replica holds
    self.rows: dict[int, tuple[dict, object]] = {}  # the open round: worker -> (meta, sent)
    self.adopting: dict[int, object] = {}  # worker -> its adopt's reference, in flight
    self.restored = None  # a resumed run's global state (object ref), for the workers
    self.reduces = sync_program.peer_reduces(d.r.sync)
    self.robust_shards = sync_program.robust_shards(d.r.sync)
    self.hierarchical = 0  # collectives reduced by region (since this driver started)

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
    return {**super().summary(), "round_form": "peers", "server_bytes_sent": 0,
            "hierarchical_collectives": self.hierarchical}

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

  def _mean_among(self, what: str, workers: list[int], shards, put):
    """A mean of one vector per worker, reduced among `workers` (`shards(actor, M)`: its
    ({"bytes"}, M shards) references; `put(actor, reduced shards)`: the reference of its
    taking the mean): (each worker's {"bytes"}, {worker: its put}); None after losing the
    workers that died or did not finish their shard within ray.collective_timeout_s."""
    pool, m = self.d.pool, len(workers)
    actors = [pool.actors[w] for w in workers]
    outs = [list(shards(a, m)) for a in actors]
    reduced = [a.mean_state_shard.options(num_returns=2).remote(*[out[1 + j] for out in outs])
               for j, a in enumerate(actors)]
    checks = [out[0] for out in outs] + [done for done, _ in reduced]
    values, ready = self._gather(what, self.version, checks)
    if values is not None:
      return values[:m], {w: put(a, [r for _, r in reduced]) for w, a in zip(workers, actors)}
    # the workers whose shards did not come, else those whose shard's mean did not
    pending = checks[:m] if not set(checks[:m]) <= set(ready) else checks[m:]
    self._lose_failed(what, workers, pending, ready)
    return None

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
      outcome = self._collective(v, members)
      if outcome is not None:
        self._commit(v, members, outcome)
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

  def _collective(self, v: int, members: list[int], staged=None) -> dict | None:
    """Round `v`'s collective among `members` (`staged`: its references, if it is already
    started): {worker: {hash, sent, received}}, or None after losing the members that died
    or did not finish in time (then try again)."""
    pool = self.d.pool
    if staged is None:
      crash, pool.crash_in_sync = pool.crash_in_sync, None
      staged = self._start_collective(v, members, crash)
    values, ready = self._gather("a round's collective", v, staged)
    if values is not None:
      return dict(zip(members, values))
    self._lose_failed("a round's collective", members, staged, ready)
    return None

  def _gather(self, what: str, version: int, refs: list) -> tuple[list | None, list]:
    """(`refs`' values, or None if some member died or did not finish within
    ray.collective_timeout_s; the references that are ready). A member's own error, not
    its death, stops the run."""
    d = self.d
    ready, _ = d.ray.wait(refs, num_returns=len(refs), timeout=d.c.ray.collective_timeout_s)
    try:
      if len(ready) == len(refs):
        return d.ray.get(refs), ready
    except d.ray.exceptions.RayTaskError as e:
      if not isinstance(e.cause, (d.ray.exceptions.RayActorError,
                                  d.ray.exceptions.ObjectLostError)):
        raise RuntimeError(f"{what} (version {version}) failed: {e}") from e
    except d.ray.exceptions.RayError:
      pass
    return None, ready

  def _start_collective(self, v: int, members: list[int], crash: int | None) -> list:
    """Round `v`'s collective among `members` (worker `crash` dies in it: chaos), started:
    the reference of each member's staged outcome."""
    pool, rows = self.d.pool, self._rows_of(v)
    actors = [pool.actors[w] for w in members]
    metas = {w: rows[w][0] for w in members}
    groups = self._regions_of(members) if self.reduces else None
    if groups is not None:
      return self._start_hierarchical(v, members, groups, metas, crash)
    if self.robust_shards:
      return self._start_robust(v, members, metas, crash)
    if self.reduces:
      tokens, losses = _signals_of(metas, members)
      shards = self._scatter(members, metas)
      reduced = [actor.reduce_shard.remote(v, j, members, tokens, w == crash,
                                           *[row[j] for row in shards])
                 for j, (w, actor) in enumerate(zip(members, actors))]
      staged = [actor.apply_reduced.remote(v, members, tokens, losses, *reduced)
                for actor in actors]
    else:
      small = {w: {k: metas[w][k] for k in ("tokens", "loss", "codec_key") if k in metas[w]}
               for w in members}
      staged = [actor.apply_gathered.remote(v, small, w == crash,
                                            *[rows[i][1] for i in members])
                for w, actor in zip(members, actors)]
    return staged

  def _scatter(self, members: list[int], metas) -> list[list]:
    """Each member's contribution cut into one shard per member: [member][shard] refs."""
    m = len(members)
    out = [self.d.pool.actors[w].scatter.options(num_returns=m).remote(metas[w]["version"], m)
           for w in members]
    return [list(refs) if m > 1 else [refs] for refs in out]

  def _start_robust(self, v: int, members: list[int], metas, crash) -> list:
    """Round `v`'s robust rule shard by shard (replica.py): member j takes shard j of every
    member's contribution (an all-to-all, a reduce-scatter's bytes) and returns its part of
    the rows' statistics over the whole update; with every member's parts, its shard of the
    result (centered clipping: each further iteration one more exchange of the rows'
    distances); the result all-gathered and the outer step staged on every member."""
    actors = [self.d.pool.actors[w] for w in members]
    tokens, losses = _signals_of(metas, members)
    shards = self._scatter(members, metas)
    statistics = [actor.robust_statistics.remote(v, j, members, w == crash,
                                                 *[row[j] for row in shards])
                  for j, (w, actor) in enumerate(zip(members, actors))]
    outs = [actor.robust_shard.remote(v, j, members, tokens, losses, *statistics)
            for j, actor in enumerate(actors)]
    rule = self.d.c.aggregate
    for _ in range(rule.clip_iters - 1 if rule.rule == "centered_clip" else 0):
      outs = [actor.robust_clip.remote(j, *outs) for j, actor in enumerate(actors)]
    return [actor.apply_robust.remote(v, members, tokens, losses, *statistics, *outs)
            for actor in actors]

  def _regions_of(self, members: list[int]) -> list[list[int]] | None:
    """The members by region, where the round reduces hierarchically: `sim.network.collective`
    'hierarchical', or 'auto' where the simulator's model of the network says it is faster
    for these members than one direct exchange (`sim/collectives`: the two forms Ray runs);
    None: one direct exchange."""
    how, net = self.d.c.sim.network.collective, self.d.plan.network
    if how not in ("auto", "hierarchical") or max(members) >= len(net.worker_region):
      return None  # (a joined worker's id is past the network's placement: flat)
    by_region = {}
    for w in members:
      by_region.setdefault(net.worker_region[w], []).append(w)
    if len(by_region) < 2:
      return None
    if how == "auto":
      nbytes = 4 * self.d.r.model.layout.size * net.bytes_scale
      if (collectives.hierarchical_allreduce_seconds(net, members, nbytes)
          >= collectives.direct_allreduce_seconds(net, members, nbytes)):
        return None
    return [by_region[k] for k in sorted(by_region)]

  def _start_hierarchical(self, v: int, members: list[int], groups, metas, crash) -> list:
    """Round `v`'s dense mean reduced by region (replica.hierarchical_bytes: inside each
    region a reduce-scatter and its sums to the leader; the leaders' reduce-scatter and
    all-gather; the mean's shards back out and all-gathered in each region), then the outer
    step on every member: the reference of each member's staged outcome, in `members`'
    order."""
    self.hierarchical += 1
    actor = self.d.pool.actors.__getitem__
    tokens, losses = _signals_of(metas, members)
    refs = lambda out, k: list(out) if k > 1 else [out]  # (num_returns=1: one reference)
    count = len(groups)
    pieces = []  # each region's sums, cut into the leaders' pieces (at its leader)
    for group in groups:
      k = len(group)
      shards = {w: refs(actor(w).scatter.options(num_returns=k).remote(metas[w]["version"], k),
                        k) for w in group}
      sums = [actor(w).sum_shard.remote(v, j, group, [float(metas[i]["tokens"]) for i in group],
                                        w == crash, *[shards[i][j] for i in group])
              for j, w in enumerate(group)]
      pieces.append(refs(actor(group[0]).cut.options(num_returns=count).remote(count, *sums),
                         count))
    means = [actor(groups[h][0]).divide_piece.remote(v, h, count, members, tokens,
                                                     *[p[h] for p in pieces])
             for h in range(count)]
    staged = {}
    for group in groups:
      k = len(group)
      spread = refs(actor(group[0]).cut.options(num_returns=k).remote(k, *means), k)
      relayed = [actor(w).relay.remote(spread[j]) for j, w in enumerate(group)]
      for w in group:
        staged[w] = actor(w).apply_hierarchical.remote(v, members, tokens, losses, groups,
                                                       *relayed)
    return [staged[w] for w in members]

  def _rows_of(self, v: int) -> dict:
    """The contributions of round `v` (the open one)."""
    del v
    return self.rows

  def _lose_failed(self, what: str, members, pending, ready) -> None:
    """After a failed collective (`what`: a round's collective, a state average): the
    members that died, else those whose `pending` reference did not finish within
    ray.collective_timeout_s, are lost (their contributions with them)."""
    pool = self.d.pool
    dead = [w for w in members if not pool.worker_alive(w)]
    done = set(ready)
    slow = [w for w, ref in zip(members, pending) if ref not in done]
    lost = dead or slow
    if not lost:
      raise RuntimeError(f"{what} (version {self.version}) failed and members {members} "
                         "are alive and finished")
    for w in lost:
      why = (f"died in {what}" if dead else
             f"did not finish {what} within ray.collective_timeout_s="
             f"{self.d.c.ray.collective_timeout_s}")
      pool.lose(w, why)
    logging.warning("ray: %s (version %d) is tried again without workers %s", what,
                    self.version, lost)

  def _commit(self, v: int, members: list[int], outcome: dict) -> None:
    """Every member commits the staged round, once their hashes agree."""
    d = self.d
    hashes = {w: o["hash"] for w, o in outcome.items()}
    if self.same_state and len(set(hashes.values())) != 1:
      raise RuntimeError(f"round {v}: the members' θ differ after the same collective "
                         f"({hashes}); the replicas have diverged")
    refs = {w: d.pool.actors[w].commit.remote(v) for w in members}
    for w, ref in refs.items():
      try:
        d.ray.get(ref)
        self.held[w] = v + 1
      except d.ray.exceptions.RayActorError as e:  # the others have the round: it is lost
        d.pool.lose(w, f"{type(e).__name__} committing a round")
    for w, o in outcome.items():
      self._count_wire(w, o)


def _signals_of(metas: dict, members: list[int]) -> tuple[list[float], list[float]]:
  """The members' tokens and train losses, in member order (what each member's outer step
  weighs and its signals read)."""
  return ([float(metas[w]["tokens"]) for w in members],
          [float(metas[w].get("loss", 0.0)) for w in members])
