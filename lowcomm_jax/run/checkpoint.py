"""Checkpoints through orbax (the only module that imports it).

A checkpoint of round r has a global part, written by all processes together through
orbax, and parts that one process writes alone (run/checkpoint_parts.py: numpy + JSON, a
manifest, renamed into place). The lockstep runtime writes a part per process (its hosts'
tiers have their own shapes):

  <dir>/<r>/state, meta          orbax: TrainState (θ_global, outer optimizer state, round,
                                 base RNG key) with shardings; JSON run metadata
  <dir>/process_<p>/<r>/         that process's worker states (workers.npz: own parameters
                                 where the algorithm keeps them, inner optimizer states, steps)
                                 and its data streams' iterator states (data.json)

orbax 0.12's managers restricted to one process (`active_processes`) commit the step but
write item contents only on process 0 (BUILD_NOTES.md), hence the parts. A Ray run
(`commit`) has no global arrays: each actor writes the part it holds (runtimes/ray/
checkpoints.py), and the driver's orbax step holds the meta alone, listing those parts and
their manifests' crc32. In a run of several processes or machines <dir> must be storage
every process can reach (a shared file system). Global saves are asynchronous; `wait()`
blocks until the last one is durable.

Damage vs mismatch. Each part carries a manifest of its files (size and crc32):
<part>/<r>/manifest.json, written with the part before it is renamed into place, and
<r>/lowcomm_manifest.json, written by process 0 from orbax's post-finalization callback,
after every process's files are written and before orbax commits the step. `recover()`
checks the newest rounds against them (and a listed part's manifest against the crc32 its
commit recorded): a round whose files differ from what was written is damaged, is moved to
<dir>/damaged/<r>-<time>/ with its parts (never deleted) with a warning, and the round
before it is tried. A round that verifies is intact, so any failure to restore it means it
does not fit the config: CheckpointMismatch. Rounds written before manifests existed
(neither part has one) are trusted as before.
"""

import logging
import os
import pathlib
import shutil
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from lowcomm_jax.run import checkpoint_parts
from lowcomm_jax.run.workdir import WorkdirError, storage_reason

_GLOBAL_MANIFEST = "lowcomm_manifest.json"  # in orbax's step directory


class _StorageFailuresInOneLine(logging.Filter):
  """orbax logs a failed background write with its traceback, once from each thread it
  passes through; a storage failure (disk full, read-only) is reported as one WorkdirError
  instead, so orbax's records of it keep their first line only."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.exc_info and "orbax" in record.pathname and storage_reason(record.exc_info[1]):
      record.exc_info, record.exc_text = None, None
    return True


logging.getLogger("absl").addFilter(_StorageFailuresInOneLine())


class CheckpointMismatch(RuntimeError):
  """The checkpoint in a workdir was written by an incompatible config."""


class Checkpointer:

  def __init__(self, directory: pathlib.Path, *, max_to_keep: int, read_only: bool = False):
    """`read_only`: only restores (an export of a run that may still be training): nothing
    is created, and no save in flight is mistaken for a stale one and removed."""
    self.directory = pathlib.Path(directory).absolute()
    self.max_to_keep = max_to_keep
    self._sealing = None  # the round whose orbax save is in flight
    self._closed = False
    self._global = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=not read_only, read_only=read_only,
            cleanup_tmp_directories=not read_only,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._seal)),
        item_names=("state", "meta"))
    self._local = checkpoint_parts.PartStore(
        self.directory / f"process_{jax.process_index()}", max_to_keep, read_only=read_only)

  def latest_round(self) -> int | None:
    """The newest round whose global part and every process's own part were all written.

    A process killed mid-save leaves its part of the last round missing; all processes
    must then agree on the round before it, or they would resume differently.
    """
    whole = self._whole()
    mine = whole[0] if whole else -1
    if jax.process_count() > 1:
      mine = int(np.min(multihost_utils.process_allgather(np.asarray(mine, np.int64))))
    return mine if mine >= 0 else None

  def recover(self) -> int | None:
    """The newest round every process can resume from, like `latest_round`, after moving
    newer damaged rounds aside (see the module docstring). Process 0 checks the global
    part, every process its own part; all take the oldest round any of them verified."""
    me = jax.process_index()
    mine = -1
    for step in self._whole():
      problem = self._damage(step)
      if problem is None:
        mine = step
        break
      self._move_aside(step, problem, with_global=me == 0)
    agreed = mine
    if jax.process_count() > 1:
      agreed = int(np.min(multihost_utils.process_allgather(np.asarray(mine, np.int64))))
      # A round whose global part process 0 moved aside: this process's part goes with it.
      for step in self._local.steps():
        if step > agreed and list(self._damaged.glob(f"{step}-*/global")):
          self._move_aside(step, "its global part is damaged", with_global=False)
    if agreed < 0:
      # No round is whole: what is left are parts of saves cut short (or parts whose
      # partner is gone). Set them aside, never delete: orbax would decline to save round 1
      # beside them.
      cut_short = set(self._global.all_steps()) | set(self._local.steps())
      for store in self._other_parts():
        cut_short |= set(store.steps())
      for step in sorted(cut_short):
        self._move_aside(step, "incomplete (a save cut short)", with_global=me == 0)
    self._global.reload()  # steps moved aside are gone from orbax's view
    return agreed if agreed >= 0 else None

  def _whole(self) -> list[int]:
    """The rounds, newest first, whose orbax step is committed and whose parts are all
    there: this process's own, or (a Ray run's) the parts its meta lists."""
    own, whole = set(self._local.steps()), []
    for step in sorted(self._global.all_steps(), reverse=True):
      listed = {} if step in own else self._listed(step)
      if step in own or (listed and all((self.directory / name / str(step)).is_dir()
                                        for name in listed)):
        whole.append(step)
    return whole

  def _listed(self, step: int) -> dict[str, int]:
    """The parts other processes wrote that round `step`'s meta lists (`commit`): name ->
    its manifest's crc32. {} for a round of this process's own part (or no readable meta)."""
    try:
      return dict(self.restore_meta(step).get("parts", {}))
    except Exception:  # noqa: BLE001 - a meta orbax cannot read: not a round to resume
      return {}

  def _other_parts(self) -> list[checkpoint_parts.PartStore]:
    """The stores of parts other processes write (a Ray run's workers and servers), not
    the lockstep processes' own (each moves and drops its own)."""
    if not self.directory.is_dir():
      return []
    return [checkpoint_parts.PartStore(d, 0, read_only=True)
            for d in sorted(self.directory.iterdir())
            if d.is_dir() and not (d.name.isdigit() or d.name == "damaged"
                                   or d.name.startswith("process_") or "." in d.name)]

  @property
  def _damaged(self) -> pathlib.Path:
    return self.directory / "damaged"

  def _damage(self, step: int) -> str | None:
    """What is damaged in round `step` as this process sees it, or None if it verifies."""
    global_dir, local_dir = self.directory / str(step), self._local.directory / str(step)
    if not ((global_dir / _GLOBAL_MANIFEST).exists()
            or (local_dir / checkpoint_parts.MANIFEST).exists()):
      return None  # written before manifests existed: trusted, as it always was
    if jax.process_index() == 0:
      problem = checkpoint_parts.verify(global_dir, _GLOBAL_MANIFEST)
      if problem:
        return problem
    listed = self._listed(step)
    for name, crc in listed.items():  # each as written, and the one this round committed
      part = self.directory / name / str(step)
      problem = checkpoint_parts.verify(part, checkpoint_parts.MANIFEST)
      if problem is None and checkpoint_parts.crc32(part / checkpoint_parts.MANIFEST) != crc:
        problem = f"{part} is not the part round {step} committed (its manifest differs)"
      if problem:
        return problem
    return None if listed else checkpoint_parts.verify(local_dir, checkpoint_parts.MANIFEST)

  def _move_aside(self, step: int, problem: str, *, with_global: bool) -> None:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    me = jax.process_index()
    if with_global:  # a new folder for the round
      dest, n = self._damaged / f"{step}-{stamp}", 0
      while dest.exists():
        n += 1
        dest = self._damaged / f"{step}-{stamp}.{n}"
    else:  # beside the global part, if process 0 moved it
      found = sorted(self._damaged.glob(f"{step}-*/global"))
      dest = found[-1].parent if found else self._damaged / f"{step}-{stamp}-process_{me}"
    dest.mkdir(parents=True, exist_ok=True)
    parts = [(self._local.directory / str(step), dest / f"process_{me}")]
    if with_global:
      parts.append((self.directory / str(step), dest / "global"))
      parts += [(store.directory / str(step), dest / store.directory.name)
                for store in self._other_parts()]
    for src, dst in parts:
      if src.exists():
        os.rename(src, dst)
    logging.warning("checkpoint round %d in %s is damaged: %s. Moved it to %s (kept for "
                    "inspection); resuming from an earlier round", step, self.directory,
                    problem, dest)

  def discard_after(self, round_: int) -> None:
    """Drops every part newer than the round all processes agreed to resume from, so the
    rounds redone are saved again (orbax skips steps at or below its newest one)."""
    for step in self._global.all_steps():
      if step > round_:
        self._global.delete(step)
    for store in [self._local, *self._other_parts()]:
      for step in store.steps():
        if step > round_:
          shutil.rmtree(store.directory / str(step), ignore_errors=True)

  def save(self, round_: int, state, meta: dict, workers, data: dict) -> None:
    """Saves round `round_`; a failure to write storage raises WorkdirError, and leaves no
    part a resume would trust (a part is only trusted once complete)."""
    self._save(round_, ocp.args.Composite(state=ocp.args.StandardSave(state),
                                          meta=ocp.args.JsonSave(meta)),
               lambda: self._local.save(round_, workers, data))

  def commit(self, round_: int, meta: dict, parts: dict[str, int]) -> None:
    """Commits round `round_` whose arrays other processes wrote where they hold them
    (`parts`: name -> its manifest's crc32, what checkpoint_parts.PartStore.save returned;
    each under <dir>/<name>/<round_>/): the meta alone through orbax, listing them. orbax's
    commit of the step is the round's: a part is read only once it is listed, and only as
    the commit recorded it."""
    self._save(round_, ocp.args.Composite(meta=ocp.args.JsonSave({**meta, "parts": parts})))

  def _save(self, round_: int, args, then=lambda: None) -> None:
    try:
      self._global.wait_until_finished()  # orbax would too; the callback seals that one
      self._sealing = round_
      if not self._global.save(round_, args=args):
        raise RuntimeError(f"orbax declined to save round {round_} in {self.directory}")
      then()
    except Exception as e:
      self._raise_if_storage(e, round_)
      raise

  def _seal(self) -> None:
    """orbax's post-finalization callback (process 0, orbax's thread): every process's
    files of the save in flight are written and orbax has not committed the step yet, so
    the manifest is committed with it."""
    tmp = sorted(self.directory.glob(f"{self._sealing}.orbax-checkpoint-tmp*"),
                 key=lambda p: p.stat().st_mtime)
    checkpoint_parts.write_manifest(tmp[-1] if tmp else self.directory / str(self._sealing),
                                    _GLOBAL_MANIFEST)

  def _raise_if_storage(self, e: Exception, round_: int | None) -> None:
    reason = storage_reason(e)
    if reason is None:
      return
    self._shutdown()
    what = f"checkpoint round {round_}" if round_ is not None else "a checkpoint"
    raise WorkdirError(
        f"cannot write {what} in {self.directory} ({reason}); earlier complete "
        "checkpoints there are intact: free space or fix the storage, then rerun the same "
        "command to resume from the newest") from e

  def restore_state(self, round_: int, abstract_state):
    """Only the global TrainState of `round_` (e.g. to inspect a finished run)."""
    return self._global.restore(round_, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state))).state

  def restore_meta(self, round_: int) -> dict:
    """Only the JSON metadata of `round_` (e.g. to learn the shapes of what else to restore)."""
    return self._global.restore(round_, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore())).meta

  def restore(self, round_: int, abstract_state, abstract_workers):
    """(state, meta, workers, data) of `round_`; abstract trees carry shapes and shardings."""
    try:
      g = self._global.restore(round_, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
      workers, data = self._local.restore(round_, abstract_workers)
    except (ValueError, KeyError, TypeError) as e:
      raise CheckpointMismatch(
          f"the checkpoint at {self.directory} (round {round_}) does not fit this config "
          f"({type(e).__name__}: {str(e)[:300]}). Resume with the config and host table that "
          "wrote it, or start fresh with another --workdir. (Checkpoints written before "
          "lowcomm_jax stored θ as one flat vector, 2026-11-22, or before its named outer "
          "and worker states, 2026-11-24, do not restore.)") from e
    return g.state, g.meta, workers, data

  def wait(self) -> None:
    try:
      self._global.wait_until_finished()
    except Exception as e:
      self._raise_if_storage(e, self._sealing)
      raise

  def _shutdown(self) -> None:
    """Stops orbax's threads after a failed write, so the error ends the process."""
    try:
      self.close()
    except Exception:  # the write error is being reported; this one would repeat it
      pass

  def close(self) -> None:
    if not self._closed:
      self._closed = True
      self._global.close()


def abstract_with_shardings(abstract_tree, shardings_tree):
  """ShapeDtypeStructs carrying the shardings to restore onto."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract_tree, shardings_tree)
