"""A non-editable install (`pip install .`, as a user without a checkout's source tree on
the path gets) keeps every check and every field's meaning: the defaults ship inside the
package (lowcomm_jax/config/defaults.py), not beside it."""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO


def _installed(tmp_path):
  """`pip install --no-deps --target` of a copy of the project: the package as a wheel
  ships it. Returns the folder it went into."""
  src, site = tmp_path / "src", tmp_path / "site"
  src.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(REPO / name, src / name)
  shutil.copytree(REPO / "lowcomm_jax", src / "lowcomm_jax",
                  ignore=shutil.ignore_patterns("__pycache__"))
  # The build backend from this interpreter where it has one: pip's isolated build fetches
  # setuptools from the index, which a machine without one (the lent GPU host) cannot reach.
  local_backend = importlib.util.find_spec("setuptools") and importlib.util.find_spec("wheel")
  isolation = ["--no-build-isolation"] if local_backend else []
  done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                         "--no-compile", *isolation, "--target", str(site), str(src)],
                        capture_output=True, text=True)
  if done.returncode and not local_backend and "No matching distribution" in done.stderr:
    pytest.skip("pip cannot fetch the build backend (setuptools, wheel): no package index "
                "here and neither is installed")
  assert done.returncode == 0, done.stderr
  return site


def _main(site, cwd, *args):
  # Run outside the checkout (python -m puts the working folder first on the path) with
  # the installed copy ahead of any editable install.
  env = dict(os.environ, PYTHONPATH=str(site))
  return subprocess.run([sys.executable, "-m", "lowcomm_jax.main", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=120)


def test_a_non_editable_install_keeps_the_checks_and_the_fields_meanings(tmp_path):
  site = _installed(tmp_path)
  assert (site / "lowcomm_jax" / "config" / "defaults.py").is_file()
  config = f"--config={REPO / 'configs' / 'smoke.py'}"

  where = subprocess.run([sys.executable, "-c", "import lowcomm_jax; print(lowcomm_jax.__file__)"],
                         cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(site)),
                         capture_output=True, text=True, check=True).stdout
  assert where.startswith(str(site))  # the installed copy is what runs below

  # A check that compares a config with the defaults: sim.* without the simulator.
  refused = _main(site, tmp_path, config, "--config.sim.heterogeneity=very",
                  f"--workdir={tmp_path / 'run'}")
  assert refused.returncode != 0
  assert ("sim.heterogeneity='very': ignored unless runtime is 'simulator'; set"
          in refused.stderr.strip().splitlines()[-1])
  assert not (tmp_path / "run").exists()  # refused before any work

  # --print_config keeps each field's meaning.
  printed = _main(site, tmp_path, config, "--print_config")
  assert printed.returncode == 0, printed.stderr
  lines = printed.stdout.splitlines()
  assert any(line.startswith("outer.lr = 0.7") and "# DiLoCo's outer learning rate" in line
             for line in lines)
  assert sum("#" in line for line in lines) > 0.9 * len(lines)
