"""One run per workdir: a lock file, and one-line errors for workdirs that cannot be written.

A run holds `<workdir>/LOCK` (JSON: pid, host, start time) from its start to its end, also
when it fails. The file is created with O_CREAT|O_EXCL, which is atomic on local file
systems and on NFSv3+. A second run into the same workdir stops at once naming the holder.
A lock left by a run that was killed is taken over with a warning: on this host when its
pid is gone; from another host (a requeued job on new nodes) when it has not been refreshed
for STALE_AFTER_S — the holder touches it every BEAT_S. A lock from another host that has
missed two beats is waited for until then; a fresh one stops the run at once. In a
multi-process run every process takes its own lock (`LOCK` for process 0,
`LOCK.process_<p>` for the others), so each process of a second run stops by itself instead
of waiting in a collective for a process 0 that has exited.
"""

import contextlib
import errno
import functools
import json
import logging
import os
import pathlib
import socket
import threading
import time

import jax


class WorkdirError(RuntimeError):
  """The workdir cannot be used: locked by another run, not a directory, or not writable."""


# How storage failures read in errors raised by tensorstore (orbax's writer), which come as
# ValueError with the OS message inside.
_STORAGE_REASONS = ("No space left on device", "Disk quota exceeded", "Read-only file system",
                    "Permission denied", "Input/output error")

BEAT_S = 15.0  # the holder refreshes its lock's mtime this often
STALE_AFTER_S = 120.0  # a lock from another host this much older is abandoned (clock skew margin)


# The same failures as OSError numbers; any other OSError (a file vanishing in a race, say)
# is a bug to show with its traceback, not advice to free space.
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


def storage_reason(e: BaseException) -> str | None:
  """The OS-level reason if `e` is a failure to write storage, else None."""
  if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS:
    return e.strerror or str(e)
  text = str(e)
  return next((r for r in _STORAGE_REASONS if r in text), None)


def _lock_path(workdir: pathlib.Path) -> pathlib.Path:
  p = jax.process_index()
  return workdir / ("LOCK" if p == 0 else f"LOCK.process_{p}")


def _read(path: pathlib.Path) -> dict | None:
  try:
    holder = json.loads(path.read_text())
    return holder if isinstance(holder, dict) else None
  except (OSError, ValueError):
    return None


def _age(path: pathlib.Path) -> float:
  """Seconds since the holder last refreshed the lock (inf if it is gone)."""
  try:
    return time.time() - path.stat().st_mtime
  except FileNotFoundError:
    return float("inf")


def _dead(holder: dict | None, path: pathlib.Path) -> bool:
  """Whether the lock's holder is known to be gone: a dead pid on this host, or a lock not
  refreshed for STALE_AFTER_S (another host's, or one left unwritten by a process that died
  between creating and writing it). A lock from another host that missed two beats is
  waited for until it is stale or refreshed."""
  if holder is None or holder.get("host") != socket.gethostname():
    if 2 * BEAT_S < _age(path) <= STALE_AFTER_S:
      logging.warning("the lock %s has not been refreshed for %.0f s; waiting up to %.0f s for "
                      "its holder to show it is alive", path, _age(path), STALE_AFTER_S)
      while 2 * BEAT_S < _age(path) <= STALE_AFTER_S:
        time.sleep(min(1.0, BEAT_S))
    return _age(path) > STALE_AFTER_S
  # Our own pid (a container restarted with the same small pids; a run never re-enters),
  # or a live pid that stopped refreshing (the pid was reused): not a live holder.
  if holder.get("pid") == os.getpid() or _age(path) > STALE_AFTER_S:
    return True
  try:
    os.kill(int(holder["pid"]), 0)
  except ProcessLookupError:
    return True
  except (PermissionError, KeyError, ValueError, TypeError):
    return False
  return False


def _refuse(path: pathlib.Path, holder: dict | None) -> WorkdirError:
  who = (f"pid {holder.get('pid')} on host {holder.get('host')}" if holder
         else "a process that has not written its name yet")
  return WorkdirError(
      f"{path.parent} is in use by another run ({who}, lock {path} refreshed "
      f"{_age(path):.0f} s ago): wait for it to end or pass another --workdir; if that run "
      f"is dead, delete {path}")


def _unwritable(workdir: pathlib.Path, e: OSError) -> WorkdirError:
  return WorkdirError(f"cannot write to workdir {workdir} ({e.strerror or e}): pass a "
                      "writable --workdir, or fix its permissions or free space")


def acquire(workdir: pathlib.Path) -> pathlib.Path:
  """Creates the workdir if needed and takes its lock; returns the lock's path."""
  workdir = pathlib.Path(workdir)
  if workdir.exists() and not workdir.is_dir():
    raise WorkdirError(f"--workdir {workdir} is a file, not a directory: pass a directory "
                       "(it is created if missing)")
  try:
    workdir.mkdir(parents=True, exist_ok=True)
  except (FileExistsError, NotADirectoryError):
    raise WorkdirError(f"cannot create workdir {workdir}: a part of its path is a file; pass "
                       "another --workdir") from None
  except OSError as e:
    raise _unwritable(workdir, e) from None
  path = _lock_path(workdir)
  me = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
  for _ in range(5):
    try:
      fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
      holder = _read(path)
      if not _dead(holder, path):
        raise _refuse(path, holder) from None
      _take_over(path, holder)
      continue
    except OSError as e:
      raise _unwritable(workdir, e) from None
    try:
      os.write(fd, me.encode())
      os.fsync(fd)
    except OSError as e:
      os.close(fd)
      path.unlink(missing_ok=True)
      raise _unwritable(workdir, e) from None
    os.close(fd)
    return path
  raise _refuse(path, _read(path))  # others keep taking it over: someone else is racing us


def _take_over(path: pathlib.Path, holder: dict | None) -> None:
  """Moves a dead holder's lock aside. Two runs may find the same stale lock: each renames
  LOCK away, and one that finds it renamed a lock other than the stale one it judged (a
  racer's fresh lock) puts it back, so only one of them goes on to create LOCK."""
  age = _age(path)
  aside = path.with_name(f"{path.name}.stale-{os.getpid()}")
  try:
    os.rename(path, aside)
  except FileNotFoundError:
    return
  if _read(aside) != holder:
    with contextlib.suppress(OSError):
      os.link(aside, path)  # fails if a third run took LOCK meanwhile; it then holds it
    aside.unlink(missing_ok=True)
    return
  aside.unlink(missing_ok=True)
  who = f"pid {holder.get('pid')} on {holder.get('host')}" if holder else "never written"
  logging.warning("took over the lock %s of a run that is gone (%s, refreshed %.0f s ago)",
                  path, who, age)


def _heartbeat(path: pathlib.Path, stop: threading.Event) -> None:
  while not stop.wait(BEAT_S):
    with contextlib.suppress(OSError):
      os.utime(path)


def release(path: pathlib.Path) -> None:
  """Removes the lock if this process still holds it."""
  holder = _read(path)
  if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
    with contextlib.suppress(OSError):
      path.unlink()


@contextlib.contextmanager
def locked(workdir: str | pathlib.Path):
  """Holds the workdir's lock; a workdir this run created and left empty (a config or data
  error before any work) is removed again, so a failed start leaves nothing behind."""
  workdir = pathlib.Path(workdir)
  created = not workdir.exists()
  path = acquire(workdir)
  stop = threading.Event()
  beat = threading.Thread(target=_heartbeat, args=(path, stop), daemon=True,
                          name="workdir-lock-heartbeat")
  beat.start()
  try:
    yield path
  finally:
    stop.set()
    beat.join()
    release(path)
    if created:
      with contextlib.suppress(OSError):  # not empty (the run wrote), or another process's
        workdir.rmdir()


def holds_lock(run_fn):
  """Decorates `run(config, workdir, ...)` to hold the workdir's lock while it runs."""
  @functools.wraps(run_fn)
  def wrapper(config, workdir, *args, **kwargs):
    with locked(workdir):
      return run_fn(config, workdir, *args, **kwargs)
  return wrapper
