"""Can the data pipeline keep a GPU fed from a large token file, in little memory?

  python bench/data_speed.py [--gb 2] [--workdir DIR]

1. Writes a synthetic token file of `--gb` GB (uint16 ids below GPT-2's 50,257), deleted at
   the end.
2. Tokens/s the pipeline delivers to one worker (WorkerStreams over the memmapped file,
   windows checked against the vocabulary as a run checks them), for the shapes of `small`
   (16 × 256) and `gpt2_124m` (16 × 1024).
3. Tokens/s an inner step consumes: `small` measured on this CPU (bench/mfu.py's bare
   step), `gpt2_124m` estimated from its FLOPs at 50% of an H100's bf16 peak. The pipeline
   must deliver at least 5× the faster of the two.
4. Peak resident memory of a short run (configs/smoke.py, GPT-2 tokens) reading that file,
   against the same run on TinyShakespeare: within 100 MB.
5. `prepare` throughput (MB/s of text) with 1 and 2 processes.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(REPO.parent / "shared" / "data" / "tiktoken"))

import numpy as np  # noqa: E402

from lowcomm_jax.data import WorkerStreams  # noqa: E402
from lowcomm_jax.data import prepare as prepare_lib  # noqa: E402

GPT2_VOCAB = 50257
SHAPES = {"small": (16, 256), "gpt2_124m": (16, 1024)}  # (batch, seq) per worker


def write_token_file(path: pathlib.Path, gb: float) -> int:
  rng = np.random.default_rng(0)
  total = int(gb * 1e9) // 2
  with open(path, "wb") as f:
    for start in range(0, total, 1 << 26):
      rng.integers(0, GPT2_VOCAB, min(1 << 26, total - start), dtype=np.uint16).tofile(f)
  return total


def pipeline_tokens_per_second(path: pathlib.Path, batch: int, seq: int,
                               seconds: float = 5.0) -> float:
  tokens = np.memmap(path, dtype=np.uint16, mode="r")
  streams = WorkerStreams(tokens, worker_ids=[0], seq_len=seq, batch_size=batch, seed=0,
                          batch_mode="different", vocab_size=50304)
  streams.next_round(2)  # warm up
  n, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    n += streams.next_round(10).size  # 10 steps of [batch, seq + 1]
  return n * seq / (seq + 1) / (time.perf_counter() - t0)


def small_step_tokens_per_second() -> float:
  import runpy

  import mfu
  from lowcomm_jax.model import get_preset
  config = runpy.run_path(str(REPO / "configs" / "base.py"))["get_config"]()
  batch, seq = SHAPES["small"]
  cfg = get_preset("small", tokenizer_vocab=GPT2_VOCAB)
  return mfu.bare_steps_per_second(cfg, config, batch, seq, steps=20) * batch * seq


def gpt2_h100_tokens_per_second() -> float:
  import mfu
  from lowcomm_jax.model import get_preset
  from lowcomm_jax.model.flops import train_flops_per_token
  peak = dict(mfu.DATASHEET_BF16)["H100"]
  cfg = get_preset("gpt2_124m", tokenizer_vocab=GPT2_VOCAB)
  return 0.5 * peak / train_flops_per_token(cfg, SHAPES["gpt2_124m"][1])


# Runs the CLI and, as the process exits, records its own peak RSS (VmHWM). The child's
# rusage would not do: on Linux a child's ru_maxrss starts from its parent's at fork.
_MEASURED_MAIN = """
import atexit, runpy, sys
out = sys.argv.pop(1)
def record():
  status = {l.split(':')[0]: int(l.split()[1]) for l in open('/proc/self/status')
            if l.startswith(('VmHWM', 'RssAnon', 'RssFile'))}
  open(out, 'w').write(repr(status))
atexit.register(record)
sys.argv[0] = 'lowcomm_jax.main'
runpy.run_module('lowcomm_jax.main', run_name='__main__')
"""


def peak_rss_mb(data_args: list[str], workdir: pathlib.Path) -> dict:
  """Resident memory of a short smoke run (a process of its own), MB: the peak (VmHWM) and,
  at its end, the process's own memory (RssAnon) and the file pages it maps (RssFile:
  page cache, which the kernel reclaims under pressure)."""
  record = workdir.with_suffix(".rss")
  argv = [sys.executable, "-c", _MEASURED_MAIN, str(record),
          f"--config={REPO / 'configs/smoke.py'}", "--config.data.tokenizer=gpt2",
          "--config.rounds=6", f"--workdir={workdir}", *data_args]
  proc = subprocess.run(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  if proc.returncode:
    raise RuntimeError(f"{argv} failed: {proc.stderr.decode()[-2000:]}")
  import ast
  return {k: v / 1024 for k, v in ast.literal_eval(record.read_text()).items()}


def prepare_mb_per_second(text: pathlib.Path, workers: int, out: pathlib.Path) -> float:
  t0 = time.perf_counter()
  prepare_lib.prepare(prepare_lib.parse_args(
      [f"--input={text}", "--tokenizer=gpt2", f"--out={out}", f"--workers={workers}"]))
  return text.stat().st_size / 1e6 / (time.perf_counter() - t0)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--gb", type=float, default=2.0)
  p.add_argument("--workdir", type=pathlib.Path, default=REPO / "bench/results/data_speed")
  args = p.parse_args()
  args.workdir.mkdir(parents=True, exist_ok=True)
  result = {}
  with tempfile.TemporaryDirectory(prefix="data_speed_", dir=args.workdir) as tmp:
    tmp = pathlib.Path(tmp)
    big = tmp / "synthetic.bin"
    result["file_tokens"] = write_token_file(big, args.gb)
    result["pipeline_tokens_per_s"] = {m: pipeline_tokens_per_second(big, *shape)
                                       for m, shape in SHAPES.items()}
    result["step_tokens_per_s"] = {"small (this CPU)": small_step_tokens_per_second(),
                                   "gpt2_124m (H100, 50% MFU)": gpt2_h100_tokens_per_second()}
    result["peak_rss_mb"] = {
        "tinyshakespeare": peak_rss_mb([], tmp / "run_text"),
        f"{args.gb:g} GB .bin": peak_rss_mb([f"--config.data.path={big}"], tmp / "run_bin")}
    big.unlink()
    shakespeare = (REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt").read_text()
    text = tmp / "text.txt"
    text.write_text(shakespeare * 100)  # ~110 MB: process start-up (~2 s) amortized
    result["prepare_mb_per_s"] = {w: prepare_mb_per_second(text, w, tmp / f"prep{w}")
                                  for w in (1, 2)}
  # The faster consumer is gpt2_124m on an H100; the pipeline feeding its shape must be 5x it.
  pipe = result["pipeline_tokens_per_s"]["gpt2_124m"]
  need = max(result["step_tokens_per_s"].values())
  rss = [r["VmHWM"] for r in result["peak_rss_mb"].values()]
  result["verdict"] = {"pipeline_over_fastest_step": pipe / need, "needs": 5.0,
                       "rss_difference_mb": rss[1] - rss[0], "rss_limit_mb": 100.0}
  lines = ["| | tokens/s per worker |", "|---|---|"]
  lines += [f"| pipeline, {m} shape ({b} × {s}) | {v:,.0f} |"
            for (m, v), (b, s) in zip(result["pipeline_tokens_per_s"].items(), SHAPES.values())]
  lines += [f"| inner step, {m} | {v:,.0f} |" for m, v in result["step_tokens_per_s"].items()]
  lines += ["", f"Pipeline at gpt2_124m's shape / the fastest step (gpt2_124m on an H100): "
            f"{pipe / need:.1f}× (needs ≥ 5×).", "",
            "| run (configs/smoke.py, GPT-2 tokens, 6 rounds) | peak RSS, MB | at the end: "
            "own (anon), MB | at the end: file pages, MB |", "|---|---|---|---|"]
  lines += [f"| {k} | {v['VmHWM']:,.0f} | {v['RssAnon']:,.0f} | {v['RssFile']:,.0f} |"
            for k, v in result["peak_rss_mb"].items()]
  lines += ["", f"Peak difference: {rss[1] - rss[0]:+.0f} MB (limit 100 MB).", "",
            "| prepare processes | MB/s of text |", "|---|---|"]
  lines += [f"| {w} | {v:.2f} |" for w, v in result["prepare_mb_per_s"].items()]
  table = "\n".join(lines)
  print(table)
  (args.workdir / "data_speed.md").write_text(table + "\n")
  (args.workdir / "result.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
  main()
