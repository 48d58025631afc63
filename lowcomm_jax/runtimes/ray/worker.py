"""A worker as a Ray actor's class (WorkerProcess): its jobs of local steps, or a
collaborative epoch's micro-batches, and in the peer form its replica (replica.py) and its
part of each collective among the workers: one call a collective (`exchange`, `mean_state`,
`consensus`: the form's member side, forms/), its peers' `deliver` and the driver's
`abort`."""

import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lowcomm_jax.programs import optimizers
from lowcomm_jax.programs import steps
from lowcomm_jax.programs.epochs import PeerEpoch
from lowcomm_jax.runtimes.ray import catch_up, checkpoints, forms, records
from lowcomm_jax.runtimes.ray import replica as replica_lib
from lowcomm_jax.runtimes.ray.actors import built, initial_params
from lowcomm_jax.runtimes.ray.chaos import with_worker_slots
from lowcomm_jax.runtimes.ray.cluster import import_ray
from lowcomm_jax.runtimes.ray.sender import Sender
from lowcomm_jax.parallel.server_names import GLOBAL


class WorkerProcess:
  """One worker: its inner optimizer state, its data stream, its codec's error buffer; a job
  is `steps` local steps from a pulled θ, returned as (meta, what it sends)."""

  def __init__(self, config: ml_collections.ConfigDict, worker: int,
               restored: dict | None = None, step_sleep_s: float = 0.0,
               params0: np.ndarray | None = None, heal: dict | None = None):
    """`restored`: {"data": its stream's state} (a worker that rejoins), or from a
    checkpoint {"part": where its part lies} (checkpoints.at), which it reads itself.
    `params0`: the run's θ₀ (the driver's, sent once through the object store), so that a
    starting worker does not make it again: its initial state (a fresh row) starts from it.
    `heal`: a live peer's `heal_state`, its state from then on (a joiner of the server form)."""
    from lowcomm_jax.parallel import mesh as mesh_lib
    restored = restored or {}
    self.worker, self.step_sleep_s, self.delay_s = worker, step_sleep_s, 0.0
    self.r, programs = r, programs = built(with_worker_slots(config), f"worker {worker}")
    if "part" in restored:
      restored = checkpoints.read_worker(restored["part"], r, worker)
    if heal is not None:
      restored = {**restored, "state": heal["state"]}
    self.rng = jnp.asarray(steps.run_key(r.config.seed))
    # Its host-table row: its tier, batch and H (every host is local to a one-device run).
    self.host = next(h.index for h in r.topology.hosts if worker in h.worker_ids)
    # Its local program per segment of a round (one for most algorithms; Streaming
    # DiLoCo's fragments are several): a job of version v runs segment v % len.
    self.locals = programs.local[self.host]
    self.segments = r.algorithm.segments(r.config, r.config.inner_steps)
    self.mesh = r.topology.local_mesh
    # The peer form of quorum rounds: the worker holds the global state itself (replica.py)
    peers = forms.among_workers(config, r.algorithm)
    if params0 is None and ("state" not in restored or programs.accumulate or peers):
      params0 = initial_params(r)
    self.replica = replica_lib.Replica(r, params0, worker) if peers else None
    self.mailbox = forms.Mailbox()  # what peers sent it in a collective (forms/exchange.py)
    self.postbox = (forms.Postbox(self.mailbox, import_ray().util.get_node_ip_address())
                    if peers and config.ray.transport == "sockets" else None)  # where peers reach it
    # Per segment, where the segment mixes the last sync's fragment in after some steps, the
    # program in two parts (the peer form: the first runs while that sync's collective does)
    self._halves = (programs.local_halves[self.host] if peers and programs.local_halves
                    else [None] * len(self.segments))
    self.programs = programs
    if "state" in restored:
      self.state = jax.tree.map(jnp.asarray, restored["state"])
    else:  # one fresh row of its host's
      with jax.set_mesh(self.mesh):
        init_one = r.programs.init_workers[self.host]  # (unjitted: `workers` is static)
        self.state = jax.jit(lambda params: init_one(params, workers=1))(
            mesh_lib.local_view(jnp.asarray(params0), self.mesh))
    self.batches_on = mesh_lib.round_batches(self.mesh)
    self.ids = jax.device_put(np.asarray([worker], np.int32), mesh_lib.per_worker(self.mesh))
    self.streams = r.data.streams[self.host].of_workers([worker])
    if "data" in restored:
      self.streams.set_state(restored["data"])
    self.sender = Sender(r, self.ids, restored.get("codec"))  # its codec's error buffer
    # The job running (or last run) and what the worker held before it: a checkpoint taken
    # while that job is unpushed keeps these, and the resumed run runs the job again. The
    # lock: a checkpoint (the actor's second thread) reads them while a job runs.
    self.running, self.before, self.before_version = None, None, None
    self._lock = threading.Lock()
    self._job_lock = threading.Lock()  # held by a job: a driver run again waits it out
    self._parts, self._parts_running = threading.Condition(), 0  # its collectives' parts
    self.record = None  # the driver's record of the newest closed round (records.py)
    # its last adopt or heal from a peer's, told in its next contribution's meta
    self.healed = heal and {"how": "state", "bytes": catch_up.nbytes(heal)}
    # A collaborative epoch (micro/collect): its θ's version, the sums of the micro-batches
    # done at that θ, and the last epoch collected (a micro-batch of it that finishes later
    # is not counted).
    self.accumulate = programs.accumulate[self.host] if programs.accumulate else None
    self.epoch, self.collected = None, None
    if self.accumulate is not None:  # compiled before it counts as up: a joining peer's
      self._begin_epoch(-1, params0)  # first micro-batch is not a compile
      zeros = np.zeros((1, r.topology.hosts[self.host].batch_size, r.config.data.seq_len + 1),
                       np.int32)
      with jax.set_mesh(self.mesh):
        jax.block_until_ready(self.epoch.run(zeros)[0])
      self.epoch = None

  def ping(self) -> int:
    return self.worker

  def delay(self, seconds: float) -> None:
    """From now on each push waits `seconds` before it is sent (chaos)."""
    self.delay_s = seconds

  def flip_bit(self) -> None:  # chaos: a bit of the next θ its replica stages flips
    self.replica.flip_next = True

  def _view(self, round_: int, params: np.ndarray, outer=None) -> steps.TrainState:
    """What the local programs read of the global state of round `round_` (`outer`: where
    the workers' rule reads it, (its own rows of the sync's state, the outer rules'))."""
    outer = steps.OuterState(*jax.tree.map(jnp.asarray, outer)) if outer is not None else ()
    return self.r.local_input(steps.TrainState(
        jnp.asarray(round_, jnp.int32), self.rng, jnp.asarray(params), outer))

  # --- a state average (Algorithm.state_sync: DES-LOC's moments), between rounds ---------

  def state_parts(self, parts: tuple[str, ...]) -> tuple[dict, object]:
    """({"bytes": what it sends}, its optimizer state's `parts`) for the server's average."""
    with self._lock:
      sent = jax.device_get(self.r.worker_state_sync.take(self.state.opt_state, parts))
    return {"bytes": catch_up.nbytes(sent)}, sent

  def set_state_parts(self, parts: tuple[str, ...], values) -> None:
    """Its optimizer state with `parts` replaced by the average the server sent back."""
    with self._lock:
      self.state = self.state._replace(opt_state=self.r.worker_state_sync.put(
          self.state.opt_state, parts, jax.tree.map(jnp.asarray, values)))

  def checkpoint_state(self, unpushed_job: int | None) -> dict:
    """Its state for a checkpoint: as before job `unpushed_job` if that is unpushed, else now."""
    with self._lock:
      if unpushed_job is not None and self.running == unpushed_job:
        state, codec_state, data = self.before
      else:  # no job of it started: it is as it was before
        state, codec_state, data = (self.state, self.sender.codec_state,
                                    self.streams.get_state())
    return {"state": jax.device_get(state), "codec": jax.device_get(codec_state), "data": data}

  def save_part(self, where: dict, unpushed_job: int | None) -> int:
    """Writes its part of checkpoint `where` (`checkpoint_state`) here; returns its crc32."""
    return checkpoints.write_worker(where, self.worker, self.checkpoint_state(unpushed_job))

  def save_replica(self, where: dict) -> dict:
    """Writes its replica as the global server's part of checkpoint `where` (the peer
    form: one current member's)."""
    return checkpoints.write_server(where, GLOBAL, self.replica.share())

  def job(self, version: int, params: np.ndarray, outer, lr_step: int, steps_: int,
          order: int) -> tuple[dict, object]:
    """`steps_` local steps from θ of `version` (segment version % segments of round
    version // segments), its lr schedule at `lr_step`: (meta, what it sends)."""
    with self._job_lock:
      return self._job(version, params, outer, lr_step, steps_, order)

  def _job(self, version, params, outer, lr_step, steps_, order):
    start, started_at = time.perf_counter(), time.time()  # (θ is here: Ray fetched it)
    with self._lock:
      self.before = (self.state, self.sender.codec_state, self.streams.get_state())
      self.running, self.before_version = order, version
    round_, segment = divmod(version, len(self.segments))
    halves = None
    if params is None:  # the peer form: from its own replica, which is at that version
      # (or, where the segment runs in two parts, one behind it: the last sync's collective
      # still running; the same two programs either way, compiled once)
      halves = self._halves[segment]
      behind = 1 if halves is not None else 0
      if not version - behind <= self.replica.version <= version:
        raise RuntimeError(f"worker {self.worker}: a job from version {version}, but its "
                           f"replica holds version {self.replica.version}")
      if halves is None:
        params, outer = self.replica.params, self.replica.view_outer()
    workers = self.state  # (DDP's workers keep nothing)
    if self.r.algorithm.local_steps:
      workers = workers._replace(opt_state=optimizers.at_schedule_step(
          workers.opt_state, np.asarray([lr_step], np.int32)))
    batches = jax.device_put(self.streams.next_steps([0], steps_), self.batches_on)
    meta = {"worker": self.worker, "version": int(version), "steps": steps_, "order": order,
            "tokens": int(self.r.tokens(steps_, self.host)), "started_at": started_at}
    with jax.set_mesh(self.mesh):
      if halves is None:
        view = self._view(round_, params, outer)
        deltas, self.state, losses = self.locals[segment](view, workers, batches, self.ids)
      else:  # the steps before the mix, while the collective runs; the rest once it is in
        head, tail = halves
        _, workers, first = head(self._view(round_, self.replica.params), workers, batches,
                                 self.ids)
        jax.block_until_ready(first)
        meta["waited_s"] = self.replica.wait_for(version, self.r.config.ray.collective_timeout_s)
        view = self._view(round_, self.replica.params, self.replica.view_outer())
        deltas, self.state, rest = tail(view, workers, batches, self.ids)
        losses = jnp.concatenate([first, rest], axis=1)
      sent = self.sender.send(view, deltas, meta, segment)
    # Its own seconds, not the collective's it waited for (a segment in two parts): the
    # step times a replay is held against, and what DyLU's speeds are made of
    waited = meta.get("waited_s", 0.0)
    meta.update(loss=float(losses.mean()), compute_seconds=time.perf_counter() - start - waited,
                data=self.streams.get_state())
    time.sleep(self.step_sleep_s * steps_ + self.delay_s)
    meta["job_seconds"] = time.perf_counter() - start - waited
    meta["finished_at"] = time.time()
    meta["healed"], self.healed = self.healed, None
    if self.replica is not None:  # kept for the round's collective (and a retry of it)
      self.replica.keep(int(version), sent, meta)
      if self.replica.reduces or self.replica.scatter:  # its shards go to the members
        sent = None
    return meta, sent

  # --- the peer form of quorum rounds (replica.py: what each step computes) ---------------

  def share(self, behind: int | None = None) -> dict:  # (one round behind: its inputs)
    return catch_up.serve(self.replica, behind)

  def adopt(self, state: dict, heal: dict | None = None) -> int:
    """Takes a peer's replica; with `heal` (a joiner's: `heal_state`) also what its
    algorithm keeps per worker across rounds, the peer's local model and inner optimizer.
    `state` {"part": where}: a checkpoint's replica, read here."""
    if "part" in state:
      state = checkpoints.read_server(state["part"], self.r, GLOBAL)
    else:
      self.healed = {"how": "round" if "round" in state else "replica",
                     "bytes": catch_up.nbytes((state, heal))}
    if heal is not None:
      with self._lock:
        self.state = jax.tree.map(jnp.asarray, heal["state"])
    return self.replica.adopt(state)

  def heal_state(self, version: int | None = None, order: int | None = None) -> dict:
    """Its local model and inner optimizer when its job of `version` (or dispatch `order`)
    started, or as they are if it started none: what a joiner takes, as torchft's heal does."""
    with self._lock:
      began = self.before_version == version if order is None else self.running == order
      state = self.before[0] if began and self.before is not None else self.state
    return {"state": jax.device_get(state)}

  # --- a driver that died, run again (records.py) --------------------------------------

  def keep_record(self, record: dict) -> None:
    """The driver's record of the round just closed: where a driver run again goes on."""
    self.record = record
    if self.replica is not None:  # (the round before is no longer one to step back to)
      self.replica.previous, self.replica.keeps_previous = None, True

  def resume_point(self) -> dict:
    return {"worker": self.worker, "record": self.record}

  def resume_at(self, record: dict) -> int:
    """Back to where `record`'s round left it (a job of the dead driver's ends first): its
    state as before any job begun since, its replica at the record's version where it
    committed one round more (replica.roll_back). Returns its replica's version."""
    with self._parts:  # (one could stage over the round redone)
      self._parts.wait_for(lambda: self._parts_running == 0,
                           timeout=self.r.config.ray.collective_timeout_s)
    with self._job_lock, self._lock:
      if records.began_since(record, self.worker, self.running):
        self.state, self.sender.codec_state, data = self.before
        self.streams.set_state(data)
      self.running, self.record = None, record
    return self.replica.roll_back(record["version"])

  def advance(self, round_version: int, members: list[int], tokens, losses) -> str:
    return self.replica.advance(round_version, members, tokens, losses)

  # A collective among the workers (forms/): one call each, the bytes member to member.

  def exchange(self, message: dict) -> dict:
    """Its part of a round's collective, as the form `message` names: its outcome (the
    hash of what it staged, its link's bytes) or why the attempt failed."""
    form = forms.get(message["form"])
    return self._take_part(message, lambda ex: form.member(self.replica, ex, message))

  def mean_state(self, message: dict) -> dict:
    """Its optimizer state's `parts` replaced by the members' mean (DES-LOC's moments)."""
    parts = tuple(message["parts"])

    def steps(ex):
      with self._lock:
        like = jax.device_get(self.r.worker_state_sync.take(self.state.opt_state, parts))
      vector = replica_lib.flat(like)
      mean, moved = forms.mean_of(ex, vector)
      with self._lock:
        self.state = self.state._replace(opt_state=self.r.worker_state_sync.put(
            self.state.opt_state, parts,
            jax.tree.map(jnp.asarray, replica_lib.unflat(mean, like))))
      return {**moved, "bytes": int(vector.nbytes)}
    return self._take_part(message, steps)

  def consensus(self, message: dict) -> dict:
    """θ, the members' mean φ (a sync of pair swaps: NoLoCo), on every member."""
    def steps(ex):
      mean, moved = forms.mean_of(ex, self.replica.phi())
      self.replica.set_consensus(mean)
      return moved
    return self._take_part(message, steps)

  def address(self):
    """Where its peers send it their values (ray.transport='sockets'), else None."""
    return None if self.postbox is None else self.postbox.address

  def deliver(self, tag: tuple, sender: int, box) -> None:
    """A peer's value in a collective (ray.transport='objects'), kept until it is gathered."""
    self.mailbox.put(tuple(tag), sender, box)

  def abort(self, version: int, attempt: int) -> None:
    """The driver called the attempt off (a member was lost): stop waiting in it."""
    self.mailbox.abort(version, attempt)

  def _take_part(self, message: dict, steps) -> dict:
    transport = forms.transport_for(message, self.postbox, import_ray())
    with self._parts:
      self._parts_running += 1
    try:
      return forms.take_part(self.worker, message, self.mailbox, transport, steps,
                             replica_lib.crash_here)
    finally:
      with self._parts:
        self._parts_running -= 1
        self._parts.notify_all()

  def commit(self, round_version: int) -> int:
    return self.replica.commit(round_version)

  def skip(self, round_version: int) -> int:
    return self.replica.skip(round_version)

  def evaluate(self) -> list[float]:
    """The eval loss of its replica's θ at each of the run's eval widths."""
    windows = jax.device_put(self.r.data.eval_windows)
    with jax.set_mesh(self.r.topology.mesh):
      return [float(x) for x in np.asarray(self.programs.eval(self.replica.params, windows))]

  def param_norm(self) -> float:
    return float(np.linalg.norm(np.asarray(self.replica.params, np.float64)))

  # --- collaborative epochs (runtimes/ray/epochs.py) ---------------------------------------

  def _begin_epoch(self, version: int, params: np.ndarray) -> None:
    sums = jnp.zeros((1, self.r.model.layout.size), jnp.float32)
    self.epoch = PeerEpoch(self.accumulate, self._view(version, params), sums, self.ids,
                           version)

  def micro(self, version: int, params) -> dict:
    """One micro-batch of the epoch at θ of `version` (`params`; in the peer form its own
    replica's, which is then at that version: `params` is what it waited for, its adopt or
    the version): its gradient times its samples is added to the peer's sums, which stay
    here until `collect`. "counted" is False if that epoch was collected while it ran (its
    samples are lost)."""
    start = time.perf_counter()
    with self._lock:  # (a checkpoint reads the stream's position)
      if self.epoch is None or self.epoch.version != version:
        if self.replica is not None:
          if self.replica.version != version:
            raise RuntimeError(f"peer {self.worker}: a micro-batch at version {version}, but "
                               f"its replica holds version {self.replica.version}")
          params = self.replica.params
        self._begin_epoch(version, params)
      epoch = self.epoch
      batch = self.streams.next_round(1)[:, 0]
    with jax.set_mesh(self.mesh):
      sums, losses, _ = epoch.run(batch)
    took = time.perf_counter() - start
    time.sleep(self.step_sleep_s + self.delay_s)
    samples = batch.shape[1]
    with self._lock:
      counted = self.epoch is epoch and self.collected != version
      if counted:
        epoch.count(sums, losses, samples, took)
    return {"worker": self.worker, "version": int(version), "counted": counted,
            "samples": samples, "compute_seconds": took,
            "job_seconds": time.perf_counter() - start}

  def collect(self, version: int) -> tuple[dict, object]:
    """The epoch's contribution: (meta, its mean gradient Σ B·g / Σ B, or the codec's
    payload of it) over the micro-batches done at θ of `version`; samples 0 (and nothing
    to send) if none is. A micro-batch still running is not waited for, and not counted."""
    with self._lock:
      self.collected = version
      epoch, self.epoch = self.epoch, None
    meta = {"worker": self.worker, "version": int(version), "samples": 0, "tokens": 0,
            "steps": 0}
    if epoch is None or epoch.version != version or epoch.samples == 0:
      return meta, None
    with jax.set_mesh(self.mesh):
      sent = self.sender.send(epoch.view, epoch.mean_gradient(), meta)
    meta.update(samples=epoch.samples, tokens=epoch.samples * self.r.config.data.seq_len,
                loss=float(epoch.loss_sums[0]) / epoch.samples, micro=epoch.micro,
                batch_size=self.r.topology.hosts[self.host].batch_size,
                compute_seconds=epoch.seconds, data=self.streams.get_state(), healed=self.healed)
    self.healed = None
    if self.replica is not None:  # kept for the epoch's collective (and a retry of it)
      self.replica.keep(int(version), sent, meta)
      if self.replica.reduces or self.replica.scatter:
        sent = None
    return meta, sent
