"""Collaborative epochs: a target batch reached together by unequal peers (hivemind's
Optimizer, on lowcomm_jax's hosts).

Every host (a peer) takes micro-batches of its own batch size at its own speed, summing
B·∇L(θ; batch) per worker at the epoch's θ (steps.make_accumulate), until the
collaboration's samples reach `collab.target_batch_size`. Then each worker's mean gradient
is averaged weighted by its samples (the sync's nested mean with token weights; a codec
compresses it like any other) and the inner optimizer takes one step on the average: an
epoch, which is the run's round (`rounds` counts epochs).

Who steps when:
- Several processes (one host each): progress is counted in the JAX coordination service's
  key-value store (`StoreProgress`): an atomic counter of the epoch's samples, and each
  peer's own count for the monitor. A peer reads the counter before each micro-batch and
  stops once the target is reached; then it publishes its count and reads everyone's, so all
  processes weigh the same numbers. A micro-batch already running when the target is reached
  finishes and counts (its gradient is at the epoch's θ: nothing is stale).
- One process (every host local): hosts take turns on a virtual clock on which host i's
  micro-batch takes 1/speed_i (`VirtualProgress`), under the same rule. It is deterministic,
  so a resumed run equals the uninterrupted one.

A late peer, one that arrives after the target was reached (it was still loading its base
or compiling its programs, which `open` does before the first epoch), computes nothing for
that epoch: it joins the average with weight 0 and takes the same step, so it stays in
sync, and the others wait for its arrival but not for a micro-batch of its. A peer cannot
fall further behind than that: every epoch ends in one collective that all peers enter, so
the slowest peer delays an epoch by at most its one running micro-batch (give a slow GPU a
smaller `batch_size`). A peer that stops answering holds the epoch until
`collab.wait_timeout_s` (or JAX's heartbeat) takes the run down; a restart resumes from the
last checkpoint.

Checkpoints are written at epoch ends. A run stopped mid-epoch loses that epoch's partial
sums and redoes the epoch from the checkpointed data position.

Two switches serve measurements. `collab.static_split` is the baseline without counting:
each peer takes a fixed quota of micro-batches, its share of the target in proportion to
its `speed`. `collab.link_gbps` (with `link_latency_s`) emulates a slow link between
peer processes: each epoch's sync also waits as long as a ring all-reduce of its bytes
would take over that link (`link_seconds`), as `speed` emulates a slower GPU.
"""

import dataclasses
import itertools
import json
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from lowcomm_jax.run import loop
from lowcomm_jax.programs import steps
from lowcomm_jax.programs.epochs import (EpochTally, PeerEpoch, collab_summary, epoch_figures,
                                         reached)
from lowcomm_jax.runtimes.spmd.driver import RoundDriver
from lowcomm_jax.runtimes.spmd.rounds import worker_ids
from lowcomm_jax.run.metrics import JsonlWriter, announce_compile
from lowcomm_jax.parallel import mesh as mesh_lib

PROGRESS_FILE = "collab.jsonl"  # process 0's rows for the monitor (launch/monitor.py)
LIVE_EVERY_S = 1.0  # how often process 0 writes a row within an epoch
# Each driver's keys get their own prefix: a second run in the same jax.distributed session
# (every process creates its drivers in the same order) must not read the first one's.
_INVOCATIONS = itertools.count()


class CollabTimeout(RuntimeError):
  """A peer did not report its epoch's samples in time."""


@dataclasses.dataclass(frozen=True)
class HostEpoch:
  """One host's share of an epoch, as every process agrees on it."""
  samples: int  # all its workers' samples
  loss_sum: float  # Σ over its samples of the train loss
  seconds: float  # its compute time in the epoch


def link_seconds(peers: int, sent_bytes: float, gbps: float, latency_s: float) -> float:
  """A ring all-reduce among `peers` over a link of `gbps` and `latency_s`, each peer
  sending `sent_bytes` in all (2(P−1) steps); 0 without a link or a second peer."""
  if peers <= 1 or gbps <= 0:
    return 0.0
  return 2 * (peers - 1) * latency_s + 8.0 * sent_bytes / (gbps * 1e9)


def quotas(target: int, samples: list[int], speeds: list[float]) -> list[int]:
  """A static split: host i's micro-batches per epoch, its share of the target in proportion
  to its speed (at least one, so every host contributes)."""
  total = sum(speeds)
  return [max(1, math.ceil(target * v / total / n)) for n, v in zip(samples, speeds)]


class VirtualProgress:
  """Turns for the hosts of one process on a virtual clock: host i's k-th micro-batch runs
  from k/speed_i to (k+1)/speed_i; micro-batches that started before the target was reached
  count. `samples[i]`: host i's samples per micro-batch (its workers × batch size). With
  `quota`, host i takes exactly quota[i] micro-batches instead (a static split)."""

  def __init__(self, target: int, samples: list[int], speeds: list[float],
               quota: list[int] | None = None):
    self.target, self.samples, self.speeds, self.quota = target, samples, speeds, quota

  def begin(self, epoch: int) -> None:
    del epoch
    self.micro = [0] * len(self.samples)
    self.tally = EpochTally(self.target)
    self.closed_at = math.inf

  @property
  def total(self) -> int:
    return self.tally.total

  def next_host(self) -> int | None:
    """The local host whose micro-batch ends next, or None: the epoch is full."""
    running = [i for i, m in enumerate(self.micro)
               if (m < self.quota[i] if self.quota else m / self.speeds[i] < self.closed_at)]
    if not running:
      return None
    return min(running, key=lambda i: ((self.micro[i] + 1) / self.speeds[i], i))

  def done(self, host: int) -> None:
    self.micro[host] += 1
    self.tally.add(host, self.samples[host])
    if self.tally.full and self.closed_at == math.inf:
      self.closed_at = self.micro[host] / self.speeds[host]

  def live(self) -> list[int]:
    return [m * s for m, s in zip(self.micro, self.samples)]

  def agree(self, local: list[tuple[float, float]]) -> list[HostEpoch]:
    """Every host's (samples, loss sum, seconds) from the local hosts' (loss sum, seconds)."""
    return [HostEpoch(m * s, loss, sec)
            for m, s, (loss, sec) in zip(self.micro, self.samples, local)]


def _client():
  """The JAX coordination service's client (set by jax.distributed.initialize)."""
  from jax._src import distributed  # no public accessor for the key-value store yet
  if distributed.global_state.client is None:
    raise RuntimeError("collaborative runs across processes need jax.distributed")
  return distributed.global_state.client


class StoreProgress:
  """One peer per process, counting in the coordination service's key-value store: small
  messages beside the run's collectives, never through them."""

  def __init__(self, target: int, samples: int, host: int, num_hosts: int, timeout_s: float,
               client=None, run: int = 0, quota: int | None = None):
    self.target, self.samples, self.host, self.num_hosts = target, samples, host, num_hosts
    self.quota = quota  # a static split: this peer's micro-batches per epoch, not counting
    self.timeout_ms = int(timeout_s * 1000)
    self.client = client or _client()
    self.root = f"lowcomm/collab/{run}/"

  def begin(self, epoch: int) -> None:
    self.epoch, self.prefix = epoch, f"{self.root}{epoch}/"
    self.micro, self.closed = 0, False

  def next_host(self) -> int | None:
    if self.quota is not None:
      return 0 if self.micro < self.quota else None
    if not self.closed:  # an increment by 0 reads the counter (0 before anyone wrote it)
      self.closed = reached(self.client.key_value_increment(self.prefix + "samples", 0),
                            self.target)
    return None if self.closed else 0

  def done(self, host: int) -> None:
    del host
    self.micro += 1
    total = self.client.key_value_increment(self.prefix + "samples", self.samples)
    self.client.key_value_set(f"{self.prefix}peer/{self.host}", str(self.micro * self.samples),
                              allow_overwrite=True)
    self.closed = reached(total, self.target)

  def live(self) -> list[int]:
    counts = dict(self.client.key_value_dir_get(self.prefix + "peer/"))
    return [int(counts.get(f"{self.prefix}peer/{q}", 0)) for q in range(self.num_hosts)]

  def agree(self, local: list[tuple[float, float]]) -> list[HostEpoch]:
    (loss, seconds), = local
    self.client.key_value_set(f"{self.prefix}final/{self.host}",
                              json.dumps([self.micro * self.samples, loss, seconds]))
    out = []
    for q in range(self.num_hosts):
      try:
        value = self.client.blocking_key_value_get(f"{self.prefix}final/{q}", self.timeout_ms)
      except Exception as e:  # jax raises its runtime's error type
        if "DEADLINE_EXCEEDED" not in str(e):
          raise
        raise CollabTimeout(
            f"peer {q} did not report epoch {self.epoch}'s samples within "
            f"{self.timeout_ms / 1000:.0f} s ({str(e).splitlines()[0]}); it is stuck or gone. "
            "Raise --config.collab.wait_timeout_s for slower peers, or restart the run: it "
            "resumes from its last checkpoint") from e
      out.append(HostEpoch(*json.loads(value)))
    if self.host == 0 and self.epoch > 1:  # every peer is past the previous epoch's keys
      self.client.key_value_delete(f"{self.root}{self.epoch - 1}/")
    return out


def make_progress(r):
  """The run's progress counter: the key-value store across processes, else the virtual clock."""
  c, topo = r.config, r.topology
  samples = [len(h.worker_ids) * h.batch_size for h in topo.hosts]
  speeds = [h.speed or 1.0 for h in topo.hosts]
  quota = (quotas(c.collab.target_batch_size, samples, speeds) if c.collab.static_split
           else None)
  if jax.process_count() > 1:
    host = topo.local_hosts[0]
    return StoreProgress(c.collab.target_batch_size, samples[host], host, len(topo.hosts),
                         c.collab.wait_timeout_s, run=next(_INVOCATIONS),
                         quota=quota and quota[host])
  return VirtualProgress(c.collab.target_batch_size, samples, speeds, quota)


class CollabDriver(RoundDriver):
  """The runner's driver for collaborative epochs: a mark per epoch."""

  unit = "epoch"

  def __init__(self, r, stop_after_rounds: int | None, progress=None):
    super().__init__(r, stop_after_rounds)
    self.progress = progress or make_progress(r)
    topo = r.topology
    self.timed = False  # an epoch times its hosts itself
    # Several processes: a peer with a lower `speed` is slowed down to it (its micro-batch
    # takes its measured time × fastest speed / its speed): unequal GPUs emulated on one
    # machine. One process: speeds order turns on the virtual clock, and nothing sleeps.
    fastest = max(h.speed or 1.0 for h in topo.hosts)
    self.stretch = ([fastest / (topo.hosts[i].speed or 1.0) for i in topo.local_hosts]
                    if jax.process_count() > 1 else [1.0] * len(topo.local_hosts))
    self.link_s = 0.0  # the emulated link's seconds per epoch (open)
    self.ids = [worker_ids(r, i) for i in topo.local_hosts]
    self.batch_sharding = NamedSharding(topo.local_mesh, P("replica", "data"))
    self.live = None

  def _zero_sums(self, host: int) -> jax.Array:
    """A host's fresh gradient sums [G, N], split over its replica devices."""
    g = len(self.r.topology.hosts[host].worker_ids)
    return jax.device_put(np.zeros((g, self.r.model.layout.size), np.float32),
                          mesh_lib.per_worker(self.r.topology.local_mesh))

  def open(self, files, latest):
    out = super().open(files, latest)
    if out is not None:
      return out
    # The emulated link (several processes only, like `stretch`): a ring all-reduce of what
    # each worker sends per epoch.
    co = self.c.collab
    if jax.process_count() > 1:
      self.link_s = link_seconds(len(self.r.topology.hosts), self.round_bytes.sent,
                                 co.link_gbps, co.link_latency_s)
    if self.writes_files:
      self.live = JsonlWriter(pathlib.Path(files.workdir) / PROGRESS_FILE)
      if latest is not None:  # rows of epochs after the checkpoint are redone from here
        self.live.write({"resumed_at": latest, "time": time.time()})
    self._compile_micro_batches()
    return None

  def _compile_micro_batches(self) -> None:
    """Each host's micro-batch program, compiled (and run once on zeros) before the first
    epoch: a peer that compiles slowly arrives late and joins that epoch with weight 0,
    rather than counting a micro-batch it has not started."""
    r, topo = self.r, self.r.topology
    view = mesh_lib.local_view(r.local_input(self.state), topo.local_mesh)
    with jax.set_mesh(topo.local_mesh):
      for k, i in enumerate(topo.local_hosts):
        host = topo.hosts[i]
        batch = jax.device_put(
            np.zeros((len(host.worker_ids), host.batch_size, self.c.data.seq_len + 1), np.int32),
            self.batch_sharding)
        announce_compile(self.fns.accumulate[k], f"host {i}'s micro-batch")
        jax.block_until_ready(self.fns.accumulate[k](view, self._zero_sums(i), batch,
                                                     self.ids[k], np.int32(0)))

  def advance(self, due) -> loop.Mark | None:
    if self.round >= self.end:
      return None
    self.round = epoch = self.round + 1
    mark_due = due(epoch, last_of_run=epoch == self.c.rounds, last_of_call=epoch == self.end)
    metrics, extra = self._epoch(epoch, mark_due)
    if mark_due.metrics:
      self.ready.watch(epoch, metrics)
    return loop.Mark(epoch, mark_due, (epoch, metrics, extra))

  def _epoch(self, epoch: int, mark_due: loop.Due):
    r, topo, progress = self.r, self.r.topology, self.progress
    fns = self.fns
    local = topo.local_hosts
    start = time.perf_counter()
    view = mesh_lib.local_view(r.local_input(self.state), topo.local_mesh)
    with jax.set_mesh(topo.local_mesh):
      peers = [PeerEpoch(fns.accumulate[k], view, self._zero_sums(i), self.ids[k])
               for k, i in enumerate(local)]
    last_live = start
    progress.begin(epoch)
    with jax.set_mesh(topo.local_mesh):
      while (k := progress.next_host()) is not None:
        host = topo.hosts[local[k]]
        batch = jax.device_put(r.data.streams[k].next_round(1)[:, 0], self.batch_sharding)
        sums, losses, took = peers[k].run(batch)
        if self.stretch[k] > 1.0:
          time.sleep(took * (self.stretch[k] - 1.0))
          took *= self.stretch[k]
        peers[k].count(sums, losses, host.batch_size, took)
        progress.done(k)
        if self.live is not None and time.perf_counter() - last_live >= LIVE_EVERY_S:
          last_live = time.perf_counter()
          self.live.write({"epoch": epoch, "live": True, "time": time.time(),
                           "samples": progress.live(), "target": self.c.collab.target_batch_size})
    shares = progress.agree([(float(p.loss_sums.sum()), p.seconds) for p in peers])
    if self.link_s:
      time.sleep(self.link_s)  # the sync's transfer over the emulated link
    return self._step(epoch, mark_due, shares, peers, time.perf_counter() - start)

  def _step(self, epoch, mark_due, shares: list[HostEpoch], peers: list[PeerEpoch], wall):
    """The epoch's sample-weighted average and its one optimizer step (the sync)."""
    r, topo, c = self.r, self.r.topology, self.c
    local_mesh, per_worker = topo.local_mesh, mesh_lib.per_worker(topo.local_mesh)
    worker_samples = np.asarray([s.samples // len(h.worker_ids)
                                 for h, s in zip(topo.hosts, shares) for _ in h.worker_ids],
                                np.float32)
    deltas, losses = [], []
    with jax.set_mesh(local_mesh):
      for k, i in enumerate(topo.local_hosts):
        ids = np.asarray(topo.hosts[i].worker_ids)
        deltas.append(peers[k].mean_gradient(jax.device_put(worker_samples[ids], per_worker)))
        losses.append(peers[k].loss_sums / np.maximum(worker_samples[ids], 1.0))
    with jax.set_mesh(local_mesh):
      deltas_local = jnp.concatenate(deltas)
      losses_local = jax.device_put(np.concatenate(losses).astype(np.float32), per_worker)
    R = c.num_workers
    deltas_R = mesh_lib.to_global(deltas_local, topo.mesh, R)
    losses_R = mesh_lib.to_global(losses_local, topo.mesh, R)
    # The weights: samples × seq_len, the same numbers on every process (agreed above, so
    # each process places its own copy: no all-gather to check them).
    signals = steps.Signals(
        r.replicated_input(topo.hidden_per_worker),
        mesh_lib.replicated_from_host(worker_samples * c.data.seq_len, topo.mesh), losses_R)
    announce_compile(self.fns.syncs[0], "the epoch's optimizer step")
    with jax.set_mesh(topo.mesh):
      self.state, metrics = self.fns.syncs[0](self.state, deltas_R, signals,
                                              metrics=mark_due.metrics)
    total = sum(s.samples for s in shares)
    self.sched.tokens += total * c.data.seq_len
    extra = {"tokens": self.sched.tokens, **epoch_figures(total, wall),
             "link_seconds": self.link_s,
             "train_loss": sum(s.loss_sum for s in shares) / max(total, 1)}
    for i, s in enumerate(shares):
      self.sched.compute_seconds[i] += s.seconds
      self.sched.idle_seconds[i] += max(wall - s.seconds, 0.0)  # waiting for the others
      extra.update({f"samples_host_{i}": s.samples, f"compute_s_host_{i}": s.seconds})
    if self.live is not None:
      self.live.write({"epoch": epoch, "rounds": c.rounds, "time": time.time(),
                       "epoch_seconds": wall, "samples": [s.samples for s in shares],
                       "seconds": [s.seconds for s in shares],
                       "train_loss": extra["train_loss"],
                       "target": c.collab.target_batch_size})
    return metrics, extra

  def summary(self, eval_loss: float, scalars: dict, wall: float) -> dict:
    out = super().summary(eval_loss, scalars, wall)
    out["collab"] = collab_summary(self.c.collab.target_batch_size, self.c.rounds,
                                   self.sched.tokens // self.c.data.seq_len)
    return out

  def close(self) -> None:
    if self.live is not None:
      self.live.close()
    super().close()
