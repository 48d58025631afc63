"""Checkpoints whose arrays other processes write (a Ray run's, run/checkpoint.py `commit`):
a round is resumed only once its commit lists its parts, and only as the commit recorded
them; a damaged, missing or replaced part sets the round aside, with its parts, and the
round before it is resumed. (Written here by this process standing in for the actors.)"""

import json
import shutil

import numpy as np
import pytest

from lowcomm_jax.run.checkpoint import Checkpointer
from lowcomm_jax.run.checkpoint_parts import PartStore


def _round(ckpt, round_, value):
  """Round `round_` as a Ray run writes it: two parts (a worker's, a server's), then the
  commit listing them."""
  parts = {}
  for name, tree in (("worker_0", {"state": np.full(3, value, np.float32)}),
                     ("server_global", {"params": np.full(5, value, np.float32)})):
    parts[name] = PartStore(ckpt.directory / name, ckpt.max_to_keep).save(
        round_, tree, {"round": round_})
  ckpt.commit(round_, {"written": round_}, parts)
  ckpt.wait()


@pytest.fixture
def two_rounds(tmp_path):
  ckpt = Checkpointer(tmp_path / "checkpoints", max_to_keep=3)
  _round(ckpt, 1, 1.0)
  _round(ckpt, 2, 2.0)
  ckpt.close()
  return tmp_path / "checkpoints"


def _recover(directory):
  ckpt = Checkpointer(directory, max_to_keep=3)
  try:
    return ckpt.recover(), ckpt.restore_meta(ckpt.recover())
  finally:
    ckpt.close()


def test_a_committed_round_lists_its_parts_and_holds_no_arrays_of_its_own(two_rounds):
  latest, meta = _recover(two_rounds)
  assert latest == 2 and meta["written"] == 2
  assert set(meta["parts"]) == {"worker_0", "server_global"}
  assert not (two_rounds / "2" / "state").exists()  # the driver wrote the meta alone
  tree, doc = PartStore(two_rounds / "server_global", 3, read_only=True).restore(
      2, {"params": np.zeros(5, np.float32)})
  np.testing.assert_array_equal(tree["params"], np.full(5, 2.0, np.float32))
  assert doc == {"round": 2}


def test_parts_written_without_a_commit_are_not_a_round(two_rounds):
  """A driver killed after its actors wrote their parts of round 3, before its commit."""
  PartStore(two_rounds / "worker_0", 3).save(3, {"state": np.zeros(3, np.float32)}, {})
  assert _recover(two_rounds)[0] == 2


@pytest.mark.parametrize("damage", ["flipped byte", "part missing", "part replaced"])
def test_a_round_with_a_bad_part_is_set_aside_whole_and_the_one_before_resumes(
    two_rounds, damage, caplog):
  part = two_rounds / "worker_0" / "2"
  if damage == "flipped byte":
    raw = bytearray((part / "workers.npz").read_bytes())
    raw[-40] ^= 0xFF
    (part / "workers.npz").write_bytes(bytes(raw))
  elif damage == "part missing":
    shutil.rmtree(part)
  else:  # whole and self-consistent, but not the part round 2's commit recorded
    PartStore(two_rounds / "worker_0", 3).save(2, {"state": np.zeros(3, np.float32)}, {})
  latest, meta = _recover(two_rounds)
  assert latest == 1 and meta["written"] == 1
  if damage != "part missing":  # (a round whose part is gone is not whole: not read)
    moved = list((two_rounds / "damaged").glob("2-*"))
    assert len(moved) == 1, moved
    assert {p.name for p in moved[0].iterdir()} >= {"global", "worker_0", "server_global"}
    assert not (two_rounds / "server_global" / "2").exists()
    assert "damaged" in caplog.text
  assert (two_rounds / "worker_0" / "1").is_dir()  # the round before stays


def test_discard_after_drops_every_parts_newer_rounds(two_rounds):
  ckpt = Checkpointer(two_rounds, max_to_keep=3)
  try:
    ckpt.discard_after(1)
    assert ckpt.latest_round() == 1
  finally:
    ckpt.close()
  for name in ("worker_0", "server_global"):
    assert sorted(p.name for p in (two_rounds / name).iterdir()) == ["1"]
  assert json.loads((two_rounds / "worker_0" / "1" / "data.json").read_text()) == {"round": 1}
