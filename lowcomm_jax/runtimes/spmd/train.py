"""The runner: synchronous rounds on real devices, one process per host.

What runs is assembled by assemble/build.py and one round is `rounds.train_round`; a driver feeds
the run loop (run/loop.py): `driver.RoundDriver` round by round, or, for collaborative epochs,
`collab.CollabDriver`. This module picks one and checks what every process must share before it
starts.
"""

import pathlib
import time

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from lowcomm_jax.errors import ConfigError
from lowcomm_jax.run import loop
from lowcomm_jax.assemble.build import build
from lowcomm_jax.runtimes.spmd.collab import CollabDriver
from lowcomm_jax.runtimes.spmd.driver import RoundDriver
from lowcomm_jax.assemble.jitted import init_run, jitted_steps  # noqa: F401 - tests use them
from lowcomm_jax.runtimes.spmd.rounds import train_round  # noqa: F401 - tests use it
from lowcomm_jax.run.files import RunFiles, TrainingDiverged  # noqa: F401 - raised by the loop
from lowcomm_jax.run.workdir import holds_lock


@holds_lock  # one run per workdir (run/workdir.py)
def run(config: ml_collections.ConfigDict, workdir: str | pathlib.Path, *,
        stop_after_rounds: int | None = None) -> dict:
  """Trains (or resumes) the run in `workdir` and returns its summary.

  `stop_after_rounds` ends this invocation early, as a preemption would, leaving the last
  checkpoint for the next call to resume from (used by the resume tests).
  """
  t_start = time.time()
  files = RunFiles(config, workdir)  # refuses a changed config before any work
  if files.base is not None and "sha256" in files.base and jax.process_count() > 1:
    _check_same_base(files.base)
  r = build(config)
  # Epochs of a target batch (collab.py), or synchronous rounds (what the config check lets
  # through to this runtime).
  drivers = {"epochs": CollabDriver, "rounds": RoundDriver}
  driver = drivers[r.algorithm.progress(config)](r, stop_after_rounds)
  with r.partitioner():  # tensor-parallel programs compile under GSPMD (model/tp.py)
    return loop.run(driver, files, t_start=t_start)


def run_of(config: ml_collections.ConfigDict):
  """The run as the one that saved its checkpoints built it (export: runtimes.RUNTIMES)."""
  return build(config, check_memory=False)


def global_params(ckpt, r, step: int):
  """θ (flat) of checkpoint `step`, restored onto the run's shardings."""
  from lowcomm_jax.run.checkpoint import abstract_with_shardings
  abstract = abstract_with_shardings(r.state_spec.abstract, r.state_spec.shardings)
  return ckpt.restore_state(step, abstract).params


def _check_same_base(base: dict) -> None:
  """Every process of a LoRA run loads its own copy of the frozen base (nothing sends it):
  they must be the same file, compared by SHA-256 (32 bytes gathered)."""
  digest = np.frombuffer(bytes.fromhex(base["sha256"]), np.uint8)
  gathered = np.asarray(multihost_utils.process_allgather(digest))
  if not (gathered == gathered[0]).all():
    differ = [p for p in range(len(gathered)) if not (gathered[p] == gathered[0]).all()]
    raise ConfigError([
        f"model.init_from={base.get('file')!r}: process(es) {differ} hold another file than "
        "process 0 (their SHA-256 differ); give every peer the same base model"])


