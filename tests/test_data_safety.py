"""Data safety: damaged checkpoints are moved aside, one run per workdir, storage errors.

One trained workdir (checkpoints of rounds 1 and 2) is copied for each case. Root runs these
tests here and root ignores permission bits, so a read-only workdir is simulated by making
the lock's os.open fail with EROFS, and a full disk by making a checkpoint writer raise
ENOSPC; a real full tmpfs gave the same errors when this was written (BUILD_NOTES.md).
"""

import errno
import json
import logging
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import REPO, load_config, xla_flags
from lowcomm_jax.run import checkpoint, checkpoint_parts
from lowcomm_jax.runtimes.spmd import train
from lowcomm_jax.run.checkpoint import Checkpointer, CheckpointMismatch, abstract_with_shardings


def _config(**overrides):
  return load_config("smoke", rounds=3, checkpoint_every=1, **overrides)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(workdir with checkpoints of rounds 1 and 2, the Run that restores them)."""
  workdir = tmp_path_factory.mktemp("trained")
  assert train.run(_config(), workdir, stop_after_rounds=2) == {"stopped_at_round": 2}
  return workdir, train.build(_config())


def _copy(trained, tmp_path) -> pathlib.Path:
  shutil.copytree(trained[0], tmp_path / "run")
  return tmp_path / "run"


def _restore(run, workdir, round_):
  ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=2)
  try:
    state, _, workers, data = ckpt.restore(
        round_, abstract_with_shardings(run.state_spec.abstract, run.state_spec.shardings),
        run.abstract_workers())
  finally:
    ckpt.close()
  return (state, workers), data


def _largest(directory: pathlib.Path) -> pathlib.Path:
  return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _truncate(path):
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
  return path


def _scribble(path):  # same size, other bytes in the middle
  data = bytearray(path.read_bytes())
  mid = len(data) // 2
  data[mid:mid + 64] = bytes(b ^ 0xA5 for b in data[mid:mid + 64])
  path.write_bytes(bytes(data))
  return path


def _remove(path):
  shutil.rmtree(path) if path.is_dir() else path.unlink()
  return path


def _empty(path):
  path.write_bytes(b"")
  return path


def _not_json(path):
  path.write_text('{"streams": [')
  return path


def _orbax_array(ck):
  return _largest(ck / "2" / "state" / "ocdbt.process_0" / "d")


# What is done to round 2 (returns the path it damaged); the two removals leave nothing.
DAMAGE = {
    "orbax array file truncated": lambda ck: _truncate(_orbax_array(ck)),
    "garbage bytes in an orbax array file": lambda ck: _scribble(_orbax_array(ck)),
    "orbax tree metadata emptied": lambda ck: _empty(ck / "2" / "state" / "_METADATA"),
    "state directory missing": lambda ck: _remove(ck / "2" / "state"),
    "workers.npz missing": lambda ck: _remove(ck / "process_0" / "2" / "workers.npz"),
    "garbage bytes in workers.npz": lambda ck: _scribble(ck / "process_0" / "2" / "workers.npz"),
    "data.json not JSON": lambda ck: _not_json(ck / "process_0" / "2" / "data.json"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_newest_checkpoint_is_moved_aside_and_the_previous_one_resumes(
    trained, tmp_path, caplog, case):
  workdir = _copy(trained, tmp_path)
  ck = workdir / "checkpoints"
  damaged = DAMAGE[case](ck)
  with caplog.at_level(logging.WARNING):
    assert train.run(_config(), workdir, stop_after_rounds=1) == {"stopped_at_round": 2}
  warnings = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
  assert len(warnings) == 1 and "checkpoint round 2" in warnings[0]
  assert str(damaged) in warnings[0]
  # Kept, not deleted: round 2's global and process parts, as they were found.
  [aside] = (ck / "damaged").iterdir()
  assert aside.name.startswith("2-")
  assert (aside / "global" / "meta").is_dir() and (aside / "process_0" / "data.json").exists()
  rel = damaged.relative_to(ck)
  moved = (aside / "global" / rel.relative_to("2") if rel.parts[0] == "2"
           else aside / "process_0" / rel.relative_to("process_0/2"))
  assert moved.exists() == (case not in ("state directory missing", "workers.npz missing"))
  # Round 2 was redone from round 1, exactly as the first time.
  redone, data = _restore(trained[1], workdir, 2)
  original, data_original = _restore(trained[1], trained[0], 2)
  jax.tree.map(np.testing.assert_array_equal, original, redone)
  assert data == data_original


def test_intact_checkpoint_of_another_config_is_a_mismatch_not_damage(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  other = train.build(_config(num_workers=4))  # worker states of another shape
  ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=2)
  try:
    assert ckpt.recover() == 2
    spec = other.state_spec
    with pytest.raises(CheckpointMismatch, match="does not fit this config"):
      ckpt.restore(2, abstract_with_shardings(spec.abstract, spec.shardings),
                   other.abstract_workers())
  finally:
    ckpt.close()
  assert not (workdir / "checkpoints" / "damaged").exists()
  assert (workdir / "checkpoints" / "2").is_dir()


def test_checkpoints_without_manifests_are_trusted_as_before(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  for manifest in [*workdir.glob("checkpoints/*/lowcomm_manifest.json"),
                   *workdir.glob("checkpoints/process_0/*/manifest.json")]:
    manifest.unlink()
  ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=2)
  try:
    assert ckpt.recover() == 2
  finally:
    ckpt.close()
  assert not (workdir / "checkpoints" / "damaged").exists()


def _lock_holder(workdir):
  """Another live process holding the workdir's lock until killed."""
  code = ("import sys, time; from lowcomm_jax.run import workdir\n"
          "with workdir.locked(sys.argv[1]):\n  print('held', flush=True); time.sleep(300)\n")
  proc = subprocess.Popen([sys.executable, "-c", code, str(workdir)], cwd=REPO,
                          stdout=subprocess.PIPE, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.stdout.readline().strip() == "held"
  return proc


def test_second_run_into_a_locked_workdir_stops_at_once_naming_the_holder(tmp_path):
  from lowcomm_jax.run.workdir import WorkdirError
  workdir = tmp_path / "run"
  holder = _lock_holder(workdir)
  try:
    with pytest.raises(WorkdirError) as e:
      train.run(_config(), workdir)
  finally:
    holder.kill()
    holder.wait()
  message = str(e.value)
  assert f"pid {holder.pid} on host {socket.gethostname()}" in message
  assert str(workdir / "LOCK") in message and "--workdir" in message and "\n" not in message
  assert not (workdir / "checkpoints").exists()  # stopped before any work


def test_lock_of_a_dead_run_is_taken_over_and_a_live_one_from_another_host_is_not(
    tmp_path, caplog):
  from lowcomm_jax.run import workdir as workdir_lib
  lock = tmp_path / "LOCK"
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
  with caplog.at_level(logging.WARNING), workdir_lib.locked(tmp_path):
    assert json.loads(lock.read_text())["pid"] == os.getpid()
  assert any(f"pid {dead.pid}" in r.getMessage() and "took over" in r.getMessage()
             for r in caplog.records)
  assert not lock.exists()  # released
  # Another host's lock: alive while its holder refreshes it, abandoned after STALE_AFTER_S.
  lock.write_text(json.dumps({"pid": os.getpid(), "host": "elsewhere"}))
  with pytest.raises(workdir_lib.WorkdirError, match=f"pid {os.getpid()} on host elsewhere"):
    workdir_lib.acquire(tmp_path)
  long_ago = lock.stat().st_mtime - workdir_lib.STALE_AFTER_S - 1
  os.utime(lock, (long_ago, long_ago))
  with workdir_lib.locked(tmp_path):
    assert json.loads(lock.read_text())["pid"] == os.getpid()
  assert "on elsewhere, refreshed" in caplog.records[-1].getMessage()


def test_a_held_lock_is_refreshed_so_other_hosts_see_the_run_alive(tmp_path, monkeypatch):
  from lowcomm_jax.run import workdir as workdir_lib
  monkeypatch.setattr(workdir_lib, "BEAT_S", 0.05)
  with workdir_lib.locked(tmp_path) as lock:
    os.utime(lock, (0, 0))
    deadline = time.time() + 10
    while lock.stat().st_mtime == 0 and time.time() < deadline:
      time.sleep(0.05)
    assert time.time() - lock.stat().st_mtime < 5


@pytest.mark.parametrize("part", ["process part", "orbax part"])
def test_disk_full_during_a_save_is_one_line_and_the_previous_checkpoint_resumes(
    trained, tmp_path, monkeypatch, part):
  from lowcomm_jax.run.workdir import WorkdirError
  workdir = _copy(trained, tmp_path)
  full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  if part == "process part":  # the per-process arrays, written on the training thread
    def savez(*args, **kwargs):
      raise full
    monkeypatch.setattr(checkpoint_parts.np, "savez", savez)
  else:  # the last file of orbax's save, written in orbax's thread
    write = checkpoint_parts.write_manifest
    def write_manifest(root, name):
      if name == checkpoint._GLOBAL_MANIFEST:
        raise full
      write(root, name)
    monkeypatch.setattr(checkpoint_parts, "write_manifest", write_manifest)
  with pytest.raises(WorkdirError) as e:
    train.run(_config(), workdir)  # resumes at round 2, fails saving round 3
  monkeypatch.undo()
  message = str(e.value)
  assert "\n" not in message and "checkpoint round 3" in message
  assert str(workdir / "checkpoints") in message and "No space left on device" in message
  assert not (workdir / "LOCK").exists()  # released on the error
  ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=2)
  try:  # what was written of round 3 is not trusted
    assert ckpt.latest_round() == ckpt.recover() == 2
  finally:
    ckpt.close()
  resumed, _ = _restore(trained[1], workdir, 2)
  original, _ = _restore(trained[1], trained[0], 2)
  jax.tree.map(np.testing.assert_array_equal, original, resumed)


def test_workdir_that_is_a_file_or_read_only_is_one_line(tmp_path, monkeypatch):
  from lowcomm_jax.run import workdir as workdir_lib
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  with pytest.raises(workdir_lib.WorkdirError, match=f"--workdir {a_file} is a file"):
    train.run(_config(), a_file)
  with pytest.raises(workdir_lib.WorkdirError, match="part of its path is a file"):
    train.run(_config(), a_file / "run")
  real_open = os.open
  def read_only(path, *args, **kwargs):
    if pathlib.Path(path).name == "LOCK":
      raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
    return real_open(path, *args, **kwargs)
  monkeypatch.setattr(workdir_lib.os, "open", read_only)
  with pytest.raises(workdir_lib.WorkdirError,
                     match=f"cannot write to workdir {tmp_path / 'ro'} .Read-only file system"):
    train.run(_config(), tmp_path / "ro")


def test_cli_reports_a_workdir_that_is_a_file_in_one_line(tmp_path):
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  env = dict(os.environ, XLA_FLAGS=xla_flags(1))
  proc = subprocess.run([sys.executable, "-m", "lowcomm_jax.main", "--config=configs/smoke.py",
                         f"--workdir={a_file}"], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert f"--workdir {a_file} is a file" in proc.stderr and "Traceback" not in proc.stderr
