"""Checkpoints through orbax (the only module that imports it).

A checkpoint of round r has a global part, written by all processes together through
orbax, and a part per process, written by each process alone (its hosts' tiers have their
own shapes):

  <dir>/<r>/state, meta          orbax: TrainState (θ_global, outer optimizer state, round,
                                 base RNG key) with shardings; JSON run metadata
  <dir>/process_<p>/<r>/         that process's worker states (workers.npz: own parameters
                                 where the algorithm keeps them, inner optimizer states, steps)
                                 and its data streams' iterator states (data.json)

The per-process part is plain numpy + JSON, written to a temporary directory and renamed
into place (atomic): orbax 0.12's managers restricted to one process (`active_processes`)
commit the step but write item contents only on process 0 (BUILD_NOTES.md). In a
multi-process run <dir> must be storage every process can reach (a shared file system).
Global saves are asynchronous; `wait()` blocks until the last one is durable.

Damage vs mismatch. Each part carries a manifest of its files (size and crc32):
process_<p>/<r>/manifest.json, written with the part before it is renamed into place, and
<r>/lowcomm_manifest.json, written by process 0 from orbax's post-finalization callback,
after every process's files are written and before orbax commits the step. `recover()`
checks the newest rounds against them: a round whose files differ from what was written is
damaged, is moved to <dir>/damaged/<r>-<time>/ (never deleted) with a warning, and the
round before it is tried. A round that verifies is intact, so any failure to restore it
means it does not fit the config: CheckpointMismatch. Rounds written before manifests
existed (neither part has one) are trusted as before.
"""

import json
import logging
import os
import pathlib
import shutil
import time
import zlib

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from lowcomm_jax.run.workdir import WorkdirError, storage_reason

_GLOBAL_MANIFEST = "lowcomm_manifest.json"  # in orbax's step directory
_LOCAL_MANIFEST = "manifest.json"  # in each process's part


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


def _crc32(path: pathlib.Path) -> int:
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(1 << 24):
      crc = zlib.crc32(chunk, crc)
  return crc


# orbax rewrites this one when it commits a step (the commit time), after the manifest.
_UNSEALED = ("_CHECKPOINT_METADATA",)


def _write_manifest(root: pathlib.Path, name: str) -> None:
  """Records the size and crc32 of every file under `root` in `root/name` (atomically)."""
  files = {p.relative_to(root).as_posix(): [p.stat().st_size, _crc32(p)]
           for p in sorted(root.rglob("*"))
           if p.is_file() and p.name != name and p.relative_to(root).as_posix() not in _UNSEALED}
  tmp = root / f"{name}.tmp"
  with open(tmp, "w") as f:
    json.dump({"files": files}, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, root / name)


def _verify(root: pathlib.Path, name: str) -> str | None:
  """None if every file in the manifest `root/name` has its recorded size and crc32; else
  which file is not as written."""
  try:
    files = json.loads((root / name).read_text())["files"]
    expected = [(root / rel, int(size), int(crc)) for rel, (size, crc) in files.items()]
  except FileNotFoundError:
    return f"{root / name} is missing"
  except (OSError, ValueError, KeyError, TypeError, AttributeError):
    return f"{root / name} is unreadable"
  for path, size, crc in expected:
    try:
      actual = path.stat().st_size
    except OSError:
      return f"{path} is missing"
    if actual != size:
      return f"{path} has {actual} bytes, {size} were written"
    if _crc32(path) != crc:
      return f"{path} does not hold the bytes written (crc32 differs)"
  return None


class _ProcessStore:
  """One process's own rounds: <dir>/<r>/{workers.npz, data.json}, renamed into place."""

  def __init__(self, directory: pathlib.Path, max_to_keep: int, read_only: bool = False):
    self.directory = directory
    self.max_to_keep = max_to_keep
    self.read_only = read_only
    if not read_only:
      directory.mkdir(parents=True, exist_ok=True)

  def steps(self) -> list[int]:
    if not self.directory.is_dir():
      return []
    if not self.read_only:  # a reader may look at a live run: its save in flight stays
      for stale in self.directory.glob("*.tmp-*"):  # left by a process killed mid-save
        shutil.rmtree(stale, ignore_errors=True)
    return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit())

  def save(self, step: int, workers, data: dict) -> None:
    tmp = self.directory / f"{step}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
      tmp.mkdir()
      leaves = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(workers))]
      np.savez(tmp / "workers.npz", *leaves)
      (tmp / "data.json").write_text(json.dumps(data))
      _write_manifest(tmp, _LOCAL_MANIFEST)
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)  # frees the space; never renamed into place
      raise
    final = self.directory / str(step)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in self.steps()[:-self.max_to_keep]:
      shutil.rmtree(self.directory / str(old), ignore_errors=True)

  def restore(self, step: int, abstract_workers):
    leaves_abstract, treedef = jax.tree.flatten(abstract_workers)
    with np.load(self.directory / str(step) / "workers.npz") as npz:
      leaves = [npz[f"arr_{i}"] for i in range(len(npz.files))]
    if [(x.shape, x.dtype) for x in leaves] != [(a.shape, a.dtype) for a in leaves_abstract]:
      raise ValueError("worker states have other shapes than this config's")
    workers = jax.tree.unflatten(treedef, [jax.device_put(x, a.sharding)
                                           for x, a in zip(leaves, leaves_abstract)])
    return workers, json.loads((self.directory / str(step) / "data.json").read_text())


class Checkpointer:

  def __init__(self, directory: pathlib.Path, *, max_to_keep: int, read_only: bool = False):
    """`read_only`: only restores (an export of a run that may still be training): nothing
    is created, and no save in flight is mistaken for a stale one and removed."""
    self.directory = pathlib.Path(directory).absolute()
    self._sealing = None  # the round whose orbax save is in flight
    self._closed = False
    self._global = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=not read_only, read_only=read_only,
            cleanup_tmp_directories=not read_only,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._seal)),
        item_names=("state", "meta"))
    self._local = _ProcessStore(self.directory / f"process_{jax.process_index()}", max_to_keep,
                                read_only=read_only)

  def latest_round(self) -> int | None:
    """The newest round whose global part and every process's own part were all written.

    A process killed mid-save leaves its part of the last round missing; all processes
    must then agree on the round before it, or they would resume differently.
    """
    common = set(self._global.all_steps()) & set(self._local.steps())
    mine = max(common) if common else -1
    if jax.process_count() > 1:
      mine = int(np.min(multihost_utils.process_allgather(np.asarray(mine, np.int64))))
    return mine if mine >= 0 else None

  def recover(self) -> int | None:
    """The newest round every process can resume from, like `latest_round`, after moving
    newer damaged rounds aside (see the module docstring). Process 0 checks the global
    part, every process its own part; all take the oldest round any of them verified."""
    me = jax.process_index()
    complete = sorted(set(self._global.all_steps()) & set(self._local.steps()), reverse=True)
    mine = -1
    for step in complete:
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
      for step in sorted(set(self._global.all_steps()) | set(self._local.steps())):
        self._move_aside(step, "incomplete (a save cut short)", with_global=me == 0)
    self._global.reload()  # steps moved aside are gone from orbax's view
    return agreed if agreed >= 0 else None

  @property
  def _damaged(self) -> pathlib.Path:
    return self.directory / "damaged"

  def _damage(self, step: int) -> str | None:
    """What is damaged in round `step` as this process sees it, or None if it verifies."""
    global_dir, local_dir = self.directory / str(step), self._local.directory / str(step)
    if not ((global_dir / _GLOBAL_MANIFEST).exists() or (local_dir / _LOCAL_MANIFEST).exists()):
      return None  # written before manifests existed: trusted, as it always was
    if jax.process_index() == 0:
      problem = _verify(global_dir, _GLOBAL_MANIFEST)
      if problem:
        return problem
    return _verify(local_dir, _LOCAL_MANIFEST)

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
    for step in self._local.steps():
      if step > round_:
        shutil.rmtree(self._local.directory / str(step), ignore_errors=True)

  def save(self, round_: int, state, meta: dict, workers, data: dict) -> None:
    """Saves round `round_`; a failure to write storage raises WorkdirError, and leaves no
    part a resume would trust (a part is only trusted once complete)."""
    try:
      self._global.wait_until_finished()  # orbax would too; the callback seals that one
      self._sealing = round_
      saved = self._global.save(round_, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
      if not saved:
        raise RuntimeError(f"orbax declined to save round {round_} in {self.directory}")
      self._local.save(round_, workers, data)
    except Exception as e:
      self._raise_if_storage(e, round_)
      raise

  def _seal(self) -> None:
    """orbax's post-finalization callback (process 0, orbax's thread): every process's
    files of the save in flight are written and orbax has not committed the step yet, so
    the manifest is committed with it."""
    tmp = sorted(self.directory.glob(f"{self._sealing}.orbax-checkpoint-tmp*"),
                 key=lambda p: p.stat().st_mtime)
    _write_manifest(tmp[-1] if tmp else self.directory / str(self._sealing), _GLOBAL_MANIFEST)

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
