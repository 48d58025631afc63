"""JAX's persistent compilation cache for a run (`compile_cache_dir`), and what it saved.

A program compiled once is stored by a key of its HLO, compile options, devices and jax
version, so a second run of the same config (or a host whose programs have another's shapes,
started later on the same folder) loads it instead of compiling. Every program is kept,
however fast it compiled: the many small ones (init, eval, the outer step) add up to seconds
on a GPU start-up.
"""

import os
import threading

import jax
import jax.monitoring

_HITS = "/jax/compilation_cache/cache_hits"
_LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # one per program made
# What making a program costs: tracing, lowering, and XLA's compile (a program the cache
# had costs its load instead, which JAX times as no compile).
_COSTS = ("/jax/core/compile/jaxpr_trace_duration", _LOWERED,
          "/jax/core/compile/backend_compile_duration",
          "/jax/compilation_cache/cache_retrieval_time_sec")
_made = {"programs": 0, "hits": 0, "seconds": 0.0}
_lock = threading.Lock()


def _count_hit(event: str, **_) -> None:
  if event == _HITS:
    with _lock:
      _made["hits"] += 1


def _count_made(event: str, duration: float, **_) -> None:
  if event in _COSTS:
    with _lock:
      _made["seconds"] += duration
      _made["programs"] += event == _LOWERED


jax.monitoring.register_event_listener(_count_hit)
jax.monitoring.register_event_duration_secs_listener(_count_made)


def enable(path: str) -> str | None:
  """Turns the cache on in `path` (created; '~' expanded), or off for ''. Must run before
  the process compiles anything: JAX decides once whether a process uses the cache. Returns
  the folder in use, or None."""
  if not path:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  folder = os.path.abspath(os.path.expanduser(path))
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    raise ValueError(f"compile_cache_dir={path!r}: cannot create it ({e.strerror}); give a "
                     "writable folder, or '' to compile every run afresh") from None
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", folder)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return folder


def counts() -> tuple[int, int, float]:
  """(programs compiled, programs loaded from the cache, seconds spent making programs:
  tracing, lowering, compiling or loading) by this process so far."""
  with _lock:
    return _made["programs"] - _made["hits"], _made["hits"], _made["seconds"]
