"""The program functions of the runs built in this process (build.build), by what they
depend on: the same run built again gets the same functions back."""

import collections
import hashlib
import weakref

import jax
import ml_collections
import numpy as np

from lowcomm_jax.model import GPTConfig

# The pure functions of the last runs built in this process, by everything they depend on
# (`key`). A process that builds the same run again (a restart or a resume in the
# same process, a simulation beside the runner, a test's second run) gets the same function
# objects back, and with them JAX's traces and compiled programs: tracing the local program
# of even a tiny model takes seconds.
_CACHE: collections.OrderedDict = collections.OrderedDict()
_KEPT = 8


def key(config: ml_collections.ConfigDict, model_cfg: GPTConfig, constants) -> tuple:
  """What a run's programs are functions of: the config, the model it resolved (a checkpoint
  read from model.init_from), the data arrays compiled into them, and the devices."""
  digest = hashlib.sha256()
  for x in jax.tree.leaves(constants):
    digest.update(np.ascontiguousarray(x).tobytes())
  return (config.to_json_best_effort(sort_keys=True), model_cfg, digest.hexdigest(),
          jax.process_index(), jax.process_count(), tuple(d.id for d in jax.devices()))


def same_as_before(run_key: tuple, made: tuple) -> tuple:
  """`made` (programs, state init, initial θ), or the ones built before under `run_key`."""
  if run_key in _CACHE:
    _CACHE.move_to_end(run_key)
    return _CACHE[run_key]
  _CACHE[run_key] = made
  if len(_CACHE) > _KEPT:
    _CACHE.popitem(last=False)
  return made


# Pieces of programs (loss functions, optimizers, local and evaluation programs) by their
# arguments. Runs whose configs differ only where a piece does not look (the codec, the
# outer rule, the number of rounds for the evaluation) get the same piece back, and with it
# JAX's trace and compiled program. Every argument is compared by value (or is itself a
# shared piece), so a piece is never reused where anything it reads differs.
_SHARED: collections.OrderedDict = collections.OrderedDict()
_SHARED_KEPT = 64


def shared(make, *args, **kwargs):
  """make(*args, **kwargs), made once per process for equal arguments (all hashable)."""
  piece_key = (make, args, tuple(sorted(kwargs.items())))
  if piece_key in _SHARED:
    _SHARED.move_to_end(piece_key)
    return _SHARED[piece_key]
  made = _SHARED[piece_key] = make(*args, **kwargs)
  if len(_SHARED) > _SHARED_KEPT:
    _SHARED.popitem(last=False)
  return made


def clear() -> None:
  """Forgets every run's programs and pieces: the next build traces and compiles anew."""
  _CACHE.clear()
  _SHARED.clear()


# What counting a sync's bytes found (ledger.count_bytes traces the sync anew each time), by
# the sync function: a cached program moves the same bytes every time its run is built.
_COUNTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def counted(program, count):
  """count(program), once per program function in this process."""
  if program not in _COUNTED:
    _COUNTED[program] = count(program)
  return _COUNTED[program]
