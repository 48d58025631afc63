"""Checkpoints through orbax (the only module that imports it).

A checkpoint of round r has a global part, written by all processes together through
orbax, and a part per process, written by each process alone (its hosts' tiers have their
own shapes):

  <dir>/<r>/state, meta          orbax: TrainState (θ_global, outer optimizer state, round,
                                 base RNG key) with shardings; JSON run metadata
  <dir>/process_<p>/<r>/         that process's workers' inner optimizer states (workers.npz)
                                 and its data streams' iterator states (data.json)

The per-process part is plain numpy + JSON, written to a temporary directory and renamed
into place (atomic): orbax 0.12's managers restricted to one process (`active_processes`)
commit the step but write item contents only on process 0 (BUILD_NOTES.md). In a
multi-process run <dir> must be storage every process can reach (a shared file system).
Global saves are asynchronous; `wait()` blocks until the last one is durable.
"""

import json
import os
import pathlib
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils


class CheckpointMismatch(RuntimeError):
  """The checkpoint in a workdir was written by an incompatible config."""


class _ProcessStore:
  """One process's own rounds: <dir>/<r>/{workers.npz, data.json}, renamed into place."""

  def __init__(self, directory: pathlib.Path, max_to_keep: int):
    self.directory = directory
    self.max_to_keep = max_to_keep
    directory.mkdir(parents=True, exist_ok=True)

  def steps(self) -> list[int]:
    for stale in self.directory.glob("*.tmp-*"):  # left by a process killed mid-save
      shutil.rmtree(stale, ignore_errors=True)
    return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit())

  def save(self, step: int, workers, data: dict) -> None:
    tmp = self.directory / f"{step}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    leaves = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(workers))]
    np.savez(tmp / "workers.npz", *leaves)
    (tmp / "data.json").write_text(json.dumps(data))
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
      raise ValueError("worker optimizer states have other shapes than this config's")
    workers = jax.tree.unflatten(treedef, [jax.device_put(x, a.sharding)
                                           for x, a in zip(leaves, leaves_abstract)])
    return workers, json.loads((self.directory / str(step) / "data.json").read_text())


class Checkpointer:

  def __init__(self, directory: pathlib.Path, *, max_to_keep: int):
    self.directory = pathlib.Path(directory).absolute()
    self._global = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             cleanup_tmp_directories=True),
        item_names=("state", "meta"))
    self._local = _ProcessStore(self.directory / f"process_{jax.process_index()}", max_to_keep)

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
    saved = self._global.save(round_, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
    if not saved:
      raise RuntimeError(f"orbax declined to save round {round_} in {self.directory}")
    self._local.save(round_, workers, data)

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
          "lowcomm_jax stored θ as one flat vector, 2026-11-22, do not restore.)") from e
    return g.state, g.meta, workers, data

  def wait(self) -> None:
    self._global.wait_until_finished()

  def close(self) -> None:
    self._global.close()


def abstract_with_shardings(abstract_tree, shardings_tree):
  """ShapeDtypeStructs carrying the shardings to restore onto."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract_tree, shardings_tree)
