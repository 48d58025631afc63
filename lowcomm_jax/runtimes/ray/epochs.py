"""Collaborative epochs on the Ray runtime (`Algorithm.progress` 'epochs': 'ddp' with
`collab.target_batch_size` > 0): the target batch of runtimes/spmd/collab.py reached together by
peers that join, leave or crash while the run goes on.

Each worker actor is a peer. An epoch (here through the server form; the peer form's
differences are said at the end):

1. The driver takes θ from the server once and puts it in the object store; every live
   peer with nothing running starts a micro-batch at that θ (`WorkerProcess.micro`: the
   gradient of its batch, times its samples, is added to sums that stay on the peer).
2. Each finished micro-batch counts its samples, and its peer starts the next one, until
   the epoch's samples reach the target. A peer that joins is counted from its first
   micro-batch; one that dies loses the samples it had not sent (all of this epoch's: it
   sends once, at the end) and the others go on to the target without it.
3. Micro-batches still running when the target is reached count if they finish within
   `ray.grace_s`; after that nobody waits for them (their samples are lost, their peer's
   next micro-batch starts when it is free).
4. Each live peer sends its mean gradient (`collect`, through the codec if there is one),
   and the server takes one step of DDP's rule (the inner optimizer) on the mean weighted
   by samples: the same step as the runner's collaborative epoch.

A mark per epoch; checkpoints at epoch ends (the server's θ and optimizer state, each
peer's data position and codec buffer). A micro-batch running at a checkpoint belongs to an
epoch already closed: it is not kept. A server that dies mid-epoch is rebuilt from the
last checkpoint and the epochs' steps since are replayed (pool.py); the peers' sums are
not the server's, so nothing of the open epoch is lost.

Where θ is and who takes the epoch's step is the policy's form (progress.py): the server
(forms/server.py), or the peers' replicas (replicas.py). Among the peers a micro-batch
starts from its peer's own replica, `collect` keeps the mean gradient on the peer, and the
step is a collective among the peers that counted samples (shards reduced weighted by
samples and all-gathered, each member staging DDP's step, the hashes compared, then
committed); checkpoints hold a replica's θ, and there is no server to die.
"""

import time

from lowcomm_jax.programs.epochs import EpochTally, collab_summary, epoch_figures
from lowcomm_jax.runtimes.ray.progress import Progress


class Epochs(Progress):

  unit = "epoch"
  late_figures = True

  def __init__(self, d, form):
    super().__init__(d, form)
    self.c, self.pool, self.counts, self.ray = d.c, d.pool, d.counts, d.ray
    self.target = d.c.collab.target_batch_size
    self.theta = None  # (version, ObjectRef of θ) of the open epoch, while it takes samples
    self.tally = EpochTally(self.target)  # the open epoch's samples counted, by peer
    self.last_epoch: dict = {}  # the last closed epoch's figures (metrics rows)
    # (peer, version): the peers asked for their sums, every epoch (a micro-batch that ends
    # later was in what its peer sent, or is lost if it was not asked)
    self.asked: set = set()

  # --- an epoch ---------------------------------------------------------------------------

  def start_next(self, worker: int, clock: int | None = None) -> None:
    """`worker`'s next micro-batch, while the open epoch is short of its target."""
    del clock
    if (self.theta is not None and worker in self.pool.actors and worker not in self.pool.jobs
        and not self.tally.full):
      self.form.dispatch_micro(worker, self.theta)

  def on_lose(self, worker: int) -> None:
    """A peer died: its samples of the open epoch are gone with it."""
    self.counts.samples_lost += self.tally.drop(worker)
    self.form.on_lose(worker)

  def _take(self, job) -> bool:
    """A finished micro-batch: its samples counted (if it belongs to the open epoch and
    finished in time), and its peer's next one started."""
    meta = self.pool.result(job)
    if meta is None:  # its peer died (pool.lose counted what it lost)
      self.d.idle_start()
      return False
    n = self.counts
    if meta["counted"] and self.theta is not None and meta["version"] == self.theta[0]:
      self.tally.add(job.worker, meta["samples"])
      n.micro_batches += 1
      n.compute_seconds[str(job.worker)] = (n.compute_seconds.get(str(job.worker), 0.0)
                                            + meta["compute_seconds"])
      self.pool.chaos(n.micro_batches)
    elif not meta["counted"] or (job.worker, meta["version"]) not in self.asked:
      # it finished after its epoch was collected, or its peer was not asked to send
      # (nothing of it had counted by then): its sums never reached the server
      n.samples_lost += meta["samples"]
    self.start_next(job.worker)
    return True

  def work_to_mark(self) -> bool:
    """One epoch: micro-batches to the target, the grace window, the peers' contributions
    and the form's step."""
    pool, n, c = self.pool, self.counts, self.c
    start = time.perf_counter()
    self.theta = self.form.open_theta()
    version = self.theta[0]
    self.tally = EpochTally(self.target)
    self.d.idle_start()
    while not self.tally.full:
      if not pool.jobs:
        self.d.idle_start()  # (a peer that was still finishing an earlier epoch's micro-batch)
        if not pool.jobs:
          raise RuntimeError(f"no live peer can take epoch {n.rounds + 1}'s micro-batches")
      self._take(pool.next_done())
    reached = time.perf_counter() - start
    # Micro-batches running at the target count if they finish within the grace window.
    deadline = time.monotonic() + c.ray.grace_s
    while any(j.version == version for j in pool.jobs.values()):
      job = pool.next_done(max(deadline - time.monotonic(), 0.0))
      if job is None:
        break
      self._take(job)
    self.theta = None
    late = sum(1 for j in pool.jobs.values() if j.version == version)
    by_peer = self._contributions(version)
    applied = self.form.close_epoch(by_peer)  # (a peer lost in it: on_lose counts its samples)
    by_peer = {w: s for w, s in by_peer.items() if w in applied}
    contributed = sum(by_peer.values())
    n.rounds += 1
    n.applied_steps += c.num_workers  # one optimizer step (of every worker's share)
    self.d.timeline.applied(n.applied_steps)
    n.samples += contributed
    wall = time.perf_counter() - start
    self.last_epoch = {**epoch_figures(contributed, wall), "target_reached_s": reached,
                       "micro_batches_late": late,
                       **{f"samples_peer_{w}": s for w, s in sorted(by_peer.items())}}
    return n.rounds >= c.rounds

  def _contributions(self, version: int) -> dict[int, int]:
    """Each live peer's mean gradient into the open epoch's step (its form's); the
    samples in it, by peer.
    A peer that dies or does not answer within ray.recover_timeout_s is lost (and its
    samples with it)."""
    pool, n = self.pool, self.counts
    asked = {w: pool.actors[w].collect.options(num_returns=2).remote(version)
             for w in sorted(self.tally.by_peer) if w in pool.actors}
    self.asked |= {(w, version) for w in asked}
    sent = {}
    for w, (meta_ref, sent_ref) in asked.items():
      try:
        meta = self.ray.get(meta_ref, timeout=self.c.ray.recover_timeout_s)
      except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError) as e:
        if w in pool.actors:
          pool.lose(w, f"collect failed: {type(e).__name__}")
        continue
      # Samples past the driver's count (a micro-batch that ended after the grace window,
      # before the collect) were computed at this θ: they count.
      counted = self.tally.by_peer.get(w, 0)
      n.samples_lost += max(counted - meta["samples"], 0)
      n.micro_batches += (max(meta["samples"] - counted, 0)
                          // meta.get("batch_size", self.c.data.batch_size))
      if meta["samples"] == 0:
        continue
      n.contributed(w, meta, self.form.contribute_epoch(w, meta, sent_ref), None,
                    weight=meta["samples"])
      sent[w] = meta["samples"]
    return sent

  # --- accounts ---------------------------------------------------------------------------

  def mark(self) -> int:
    return self.counts.rounds

  def step_count(self) -> int:
    return self.counts.rounds

  def tokens(self) -> int:
    return self.counts.samples * self.c.data.seq_len

  def figures(self) -> dict:
    # (the last epoch's figures, as the runner's rows name them; the run's samples are in
    # the summary's "collab")
    n = self.counts
    return dict(total_inner_steps=n.rounds, micro_batches=n.micro_batches,
                samples_lost=n.samples_lost, **self.last_epoch)

  def jobs_to_resume(self) -> list:
    return []  # micro-batches of closed epochs: not counted, not started again

  def summary(self) -> dict:
    return {"rounds_closed": self.counts.rounds, **self.form.summary(),
            "collab": collab_summary(self.target, self.counts.rounds, self.counts.samples)}
