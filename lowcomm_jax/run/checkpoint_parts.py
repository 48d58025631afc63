"""A checkpoint's parts that one process writes alone, and their manifests (no orbax).

A part is a folder <checkpoints>/<name>/<round>/ holding a tree of arrays (workers.npz, in
the tree's leaf order), a JSON document (data.json) and manifest.json, the size and crc32
of each file. It is written to a temporary folder and renamed into place, so it is either
whole or absent. The lockstep runtime's processes each write one (`process_<p>`: their
workers' states and data streams); on Ray each worker actor writes its own and the holder
of θ writes the servers' (runtimes/ray/checkpoints.py), and the driver's orbax commit
(run/checkpoint.py) lists them with their manifests' crc32.
"""

import json
import os
import pathlib
import shutil
import zlib

import jax
import numpy as np

MANIFEST = "manifest.json"  # in each part
_ARRAYS = "workers.npz"  # (the name the lockstep processes' parts have always had)


def crc32(path: pathlib.Path) -> int:
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(1 << 24):
      crc = zlib.crc32(chunk, crc)
  return crc


# orbax rewrites this one when it commits a step (the commit time), after the manifest.
_UNSEALED = ("_CHECKPOINT_METADATA",)


def write_manifest(root: pathlib.Path, name: str) -> None:
  """Records the size and crc32 of every file under `root` in `root/name` (atomically)."""
  files = {p.relative_to(root).as_posix(): [p.stat().st_size, crc32(p)]
           for p in sorted(root.rglob("*"))
           if p.is_file() and p.name != name and p.relative_to(root).as_posix() not in _UNSEALED}
  tmp = root / f"{name}.tmp"
  with open(tmp, "w") as f:
    json.dump({"files": files}, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, root / name)


def verify(root: pathlib.Path, name: str) -> str | None:
  """None if every file in the manifest `root/name` has its recorded size and crc32; else
  which file is not as written."""
  try:
    files = json.loads((root / name).read_text())["files"]
    expected = [(root / rel, int(size), int(crc)) for rel, (size, crc) in files.items()]
  except FileNotFoundError:
    return f"{root / name} is missing"
  except (OSError, ValueError, KeyError, TypeError, AttributeError):
    return f"{root / name} is unreadable"
  for path, size, crc in expected:
    try:
      actual = path.stat().st_size
    except OSError:
      return f"{path} is missing"
    if actual != size:
      return f"{path} has {actual} bytes, {size} were written"
    if crc32(path) != crc:
      return f"{path} does not hold the bytes written (crc32 differs)"
  return None


class PartStore:
  """The rounds of one part (<checkpoints>/<name>/<round>/), each renamed into place."""

  def __init__(self, directory: pathlib.Path, max_to_keep: int, read_only: bool = False):
    self.directory = pathlib.Path(directory)
    self.max_to_keep = max_to_keep
    self.read_only = read_only
    if not read_only:
      self.directory.mkdir(parents=True, exist_ok=True)

  def steps(self) -> list[int]:
    if not self.directory.is_dir():
      return []
    if not self.read_only:  # a reader may look at a live run: its save in flight stays
      for stale in self.directory.glob("*.tmp-*"):  # left by a process killed mid-save
        shutil.rmtree(stale, ignore_errors=True)
    return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit())

  def save(self, step: int, tree, data: dict) -> int:
    """Writes round `step`'s part; returns its manifest's crc32 (what a commit records)."""
    tmp = self.directory / f"{step}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
      tmp.mkdir()
      leaves = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]
      np.savez(tmp / _ARRAYS, *leaves)
      (tmp / "data.json").write_text(json.dumps(data))
      write_manifest(tmp, MANIFEST)
      crc = crc32(tmp / MANIFEST)
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)  # frees the space; never renamed into place
      raise
    final = self.directory / str(step)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in self.steps()[:-self.max_to_keep]:
      shutil.rmtree(self.directory / str(old), ignore_errors=True)
    return crc

  def data(self, step: int) -> dict:
    """Round `step`'s JSON document alone."""
    return json.loads((self.directory / str(step) / "data.json").read_text())

  def restore(self, step: int, abstract_tree):
    """(the tree, the JSON document) of round `step`, in the shapes of `abstract_tree`;
    leaves whose abstract carries a sharding are placed on it, the others stay numpy."""
    leaves_abstract, treedef = jax.tree.flatten(abstract_tree)
    with np.load(self.directory / str(step) / _ARRAYS) as npz:
      leaves = [npz[f"arr_{i}"] for i in range(len(npz.files))]
    if [(x.shape, x.dtype) for x in leaves] != [(a.shape, a.dtype) for a in leaves_abstract]:
      raise ValueError(f"{self.directory / str(step)} holds other shapes than this config's")
    placed = [x if getattr(a, "sharding", None) is None else jax.device_put(x, a.sharding)
              for x, a in zip(leaves, leaves_abstract)]
    tree = jax.tree.unflatten(treedef, placed)
    return tree, self.data(step)
