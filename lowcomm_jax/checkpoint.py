"""Checkpoints through orbax (the only module that imports it).

A checkpoint (one per saved round) holds two items:
  state: the TrainState pytree — θ_global, outer optimizer state, every worker's inner
         optimizer state, round counter and base RNG key — saved/restored with shardings;
  meta:  JSON — the data streams' iterator states and the cumulative wall time.
Saves are asynchronous; `wait()` blocks until the last one is durable.
"""

import pathlib

import jax
import orbax.checkpoint as ocp


class CheckpointMismatch(RuntimeError):
  """The checkpoint in a workdir was written by an incompatible config."""


class Checkpointer:

  def __init__(self, directory: pathlib.Path, *, max_to_keep: int):
    self.directory = pathlib.Path(directory).absolute()
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        item_names=("state", "meta"))

  def latest_round(self) -> int | None:
    return self._manager.latest_step()

  def save(self, round_: int, state, meta: dict) -> None:
    self._manager.save(round_, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

  def restore(self, round_: int, abstract_state):
    """(state, meta) of `round_`; `abstract_state` carries shapes, dtypes and shardings."""
    try:
      restored = self._manager.restore(round_, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    except (ValueError, KeyError, TypeError) as e:
      raise CheckpointMismatch(
          f"the checkpoint at {self.directory} (round {round_}) does not fit this config "
          f"({type(e).__name__}: {str(e)[:300]}). Resume with the config that wrote it, or "
          "start fresh with another --workdir") from e
    return restored.state, restored.meta

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


def abstract_with_shardings(abstract_tree, shardings_tree):
  """ShapeDtypeStructs carrying the shardings to restore onto."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract_tree, shardings_tree)
