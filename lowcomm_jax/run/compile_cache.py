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

_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
_HITS = "/jax/compilation_cache/cache_hits"
_counts = {_REQUESTS: 0, _HITS: 0}
_lock = threading.Lock()


def _count(event: str, **_) -> None:
  if event in _counts:
    with _lock:
      _counts[event] += 1


jax.monitoring.register_event_listener(_count)


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


def counts() -> tuple[int, int]:
  """(programs compiled, programs loaded from the cache) by this process so far, among those
  that went through the cache (none while it is off)."""
  with _lock:
    return _counts[_REQUESTS] - _counts[_HITS], _counts[_HITS]
