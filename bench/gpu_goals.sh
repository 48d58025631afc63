#!/usr/bin/env bash
# The GPU speed goals in one command, on a GPU host with the repo checked out (venv active):
# gpt2_124m bf16 on one GPU, every bench/mfu.py variant (as configured, each attention
# kernel, plain loss, no optimizer, forward only, scanned, runner), batch 16 and 64 x 1024.
# The runner row reads TinyShakespeare and GPT-2's tiktoken files from $LOWCOMM_DATA_DIR
# (default ../shared/data); without them it says why and the bare rows stand.
#   bash bench/gpu_goals.sh [OUT_DIR]   # default bench/results: mfu_b16.json/.log, mfu_b64.*
#   GOALS_BATCHES=16 bash bench/gpu_goals.sh OUT   # batch 16 only (the batch-64 table did
#                                                   # not finish in either H200 session)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-bench/results}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0

# Start-up of the main job: a first run compiles into a fresh cache, a second (another
# workdir) should load every program and start training within 5 s (summary.json).
cache=$(mktemp -d)
for run in cold warm; do
  python -m lowcomm_jax.main --config=configs/diloco_hetero.py --workdir="$cache/run_$run" \
    --config.compile_cache_dir="$cache/xla" > "$OUT_DIR/startup_$run.log" 2>&1 || status=1
  python - "$cache/run_$run/summary.json" "$run" <<'PY' || status=1
import json, sys
s = json.load(open(sys.argv[1]))
print(f"main job, {sys.argv[2]}: startup {s['startup_seconds']:.1f} s, "
      f"{s['programs_compiled']} programs compiled, {s['programs_from_cache']} from the cache, "
      f"wall {s['wall_seconds']:.1f} s, eval loss {s['eval_loss']:.4f}")
PY
done | tee "$OUT_DIR/startup.txt"

for batch in ${GOALS_BATCHES:-16 64}; do  # a failure at one batch still leaves the other measured
  python bench/mfu.py --model gpt2_124m --dtype bfloat16 --batch "$batch" \
    --json "$OUT_DIR/mfu_b$batch.json" 2>&1 | tee "$OUT_DIR/mfu_b$batch.log" || status=1
done
exit $status
