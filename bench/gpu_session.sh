#!/usr/bin/env bash
# A lent GPU session's checks in one call (BENCHMARKS.md, "The one command for a GPU session"):
# the GPU tests, the speed goals (bench/gpu_goals.sh) and README's test command, each under its
# own time limit so that one slow step still leaves the others' logs.
#   bash bench/gpu_session.sh OUT_DIR [gpu,goals,suite] [suite seconds]
# On the H200 (2026-12-04) the GPU tests took 36-40 s, the goals over 260 s and the suite (14
# processes) about 460 s, more than one 600 s call holds: run `gpu,suite 480` in one call and
# `GOALS_BATCHES=16 bash bench/gpu_session.sh OUT goals` in a second at once, while the
# machine is warm (BENCHMARKS.md, "GPU checks").
# Runs from the repo root on the GPU host, with what the image lacks carried in the checkout:
#   .whl/*.whl          wheels (grain, array-record, portpicker, ml-collections, clu, pyzmq,
#                       gguf, jsonschema and its needs), installed with --no-deps into /tmp/site;
#   .whl/tar/*.tar.xz   Ray's wheel unpacked without its Java jars and libraries (rllib, serve,
#                       data, tune, train), xz-packed: the whole wheel (79 MB) is over the 64 MiB
#                       a call carries;
#   .data/              a copy of ../shared/data (the corpus and GPT-2's BPE files).
# Logs go to /tmp/gpu_session and are packed into OUT_DIR/logs.tgz (at most 8 files come back).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:?OUT_DIR}"
STEPS="${2:-gpu,goals,suite}"
SUITE_S="${3:-400}"
LOGS=/tmp/gpu_session
mkdir -p "$OUT_DIR" "$LOGS" /tmp/site
export PYTHONUNBUFFERED=1
trap 'tar czf "$OUT_DIR/logs.tgz" -C "$LOGS" . 2>/dev/null' EXIT

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
for t in .whl/tar/*.tar.xz; do [ -f "$t" ] && tar xJf "$t" -C /tmp/site; done
# A venv over the image's packages, so the tests find a `ray` command beside sys.executable.
# The image's python3 is itself a venv: a .pth file hands the new one its packages.
python3 -m venv /tmp/venv || exit 1
python3 -c "import site; print(f'import site; site.addsitedir({site.getsitepackages()[0]!r})')" \
  > "$(/tmp/venv/bin/python3 -c 'import site; print(site.getsitepackages()[0])')/image.pth"
printf '#!/tmp/venv/bin/python3\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n' \
  > /tmp/venv/bin/ray && chmod +x /tmp/venv/bin/ray
export PATH="/tmp/venv/bin:$PATH" PYTHONPATH="/tmp/site:$PWD"
export LOWCOMM_DATA_DIR="$PWD/.data" TIKTOKEN_CACHE_DIR="$PWD/.data/tiktoken"
export LOWCOMM_CACHE_DIR="$(mktemp -d)"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python -c "import jax, flax, optax, ray; print('jax', jax.__version__, 'flax', flax.__version__,
'optax', optax.__version__, 'ray', ray.__version__, jax.devices())"
  nproc; } 2>&1 | tee "$LOGS/machine.txt"

status=0
if [[ ",$STEPS," == *,gpu,* ]]; then
  timeout 150 python -m pytest -q -n 0 -rA tests/test_gpu.py 2>&1 | tee "$LOGS/test_gpu.log" \
    | tail -40 || status=1
fi
if [[ ",$STEPS," == *,goals,* ]]; then  # alone: nothing else runs while it times
  timeout 400 bash bench/gpu_goals.sh "$LOGS/goals" > "$LOGS/goals.log" 2>&1 || status=1
  grep -h -E "main job|MFU|as configured|runner|scanned|plain loss|no optimizer|forward|xla|cudnn|peak" \
    "$LOGS/goals.log" | head -60
fi
if [[ ",$STEPS," == *,suite,* ]]; then  # README's test command, on 14 of the 16 cores
  # -v names each test as it ends, so a run cut by its limit still says which failed.
  timeout "$SUITE_S" python -m pytest -v -n 14 > "$LOGS/suite.log" 2>&1 || status=1
  grep -E "FAILED|ERROR" "$LOGS/suite.log" | head -30; tail -15 "$LOGS/suite.log"
fi
exit $status
