"""Checkpoints through orbax (the only module that imports it).

A checkpoint of round r has a global part, written by all processes together, and a part
per process, written by each process alone (its hosts' tiers have their own shapes):

  <dir>/<r>/state, meta            TrainState (θ_global, outer optimizer state, round, base
                                   RNG key) with shardings; JSON run metadata
  <dir>/process_<p>/<r>/workers, data
                                   that process's workers' inner optimizer states; JSON
                                   iterator states of its data streams

In a multi-process run <dir> must be storage every process can reach (a shared file
system). Saves are asynchronous; `wait()` blocks until the last one is durable.
"""

import pathlib

import jax
import orbax.checkpoint as ocp


class CheckpointMismatch(RuntimeError):
  """The checkpoint in a workdir was written by an incompatible config."""


class Checkpointer:

  def __init__(self, directory: pathlib.Path, *, max_to_keep: int):
    self.directory = pathlib.Path(directory).absolute()
    p = jax.process_index()
    self._global = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        item_names=("state", "meta"))
    local_dir = self.directory / f"process_{p}"
    local_dir.mkdir(parents=True, exist_ok=True)  # orbax won't create it for one process
    self._local = ocp.CheckpointManager(
        local_dir,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=False,
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                primary_host=p, active_processes={p}, barrier_sync_key_prefix=f"process_{p}")),
        item_names=("workers", "data"))

  def latest_round(self) -> int | None:
    """The newest round whose global and local parts were both written."""
    common = set(self._global.all_steps()) & set(self._local.all_steps())
    return max(common) if common else None

  def save(self, round_: int, state, meta: dict, workers, data: dict) -> None:
    self._global.save(round_, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
    self._local.save(round_, args=ocp.args.Composite(
        workers=ocp.args.StandardSave(workers), data=ocp.args.JsonSave(data)))

  def restore(self, round_: int, abstract_state, abstract_workers):
    """(state, meta, workers, data) of `round_`; abstract trees carry shapes and shardings."""
    try:
      g = self._global.restore(round_, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
      l = self._local.restore(round_, args=ocp.args.Composite(
          workers=ocp.args.StandardRestore(abstract_workers), data=ocp.args.JsonRestore()))
    except (ValueError, KeyError, TypeError) as e:
      raise CheckpointMismatch(
          f"the checkpoint at {self.directory} (round {round_}) does not fit this config "
          f"({type(e).__name__}: {str(e)[:300]}). Resume with the config and host table that "
          "wrote it, or start fresh with another --workdir") from e
    return g.state, g.meta, l.workers, l.data

  def wait(self) -> None:
    self._global.wait_until_finished()
    self._local.wait_until_finished()

  def close(self) -> None:
    self._global.close()
    self._local.close()


def abstract_with_shardings(abstract_tree, shardings_tree):
  """ShapeDtypeStructs carrying the shardings to restore onto."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract_tree, shardings_tree)
