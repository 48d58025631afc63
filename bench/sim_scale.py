"""The simulator at scale (issue 52): start-up, wall time, peak memory and programs compiled,
for configs/sim_geo.py's three methods and against the number of workers.

  python bench/sim_scale.py [--parts geo,workers,readme] [--workers 4 16 64] [--set=--config.F=V ...]
      [--models pythia_14m,small] [--timeout 1200] [--out bench/results/sim_scale.jsonl]
  python bench/sim_scale.py --report [--out ...]

Every case is its own `python -m lowcomm_jax.main` process with a fresh compilation cache,
so start-up is the compile it needs (summary.json's compile_seconds: tracing, lowering and
compiling; JAX's own compile log where a version has no such field); its peak RSS is the
kernel's (os.wait4). Rows are appended to --out as each case ends.

geo:     configs/sim_geo.py with each method (diloco, async_dn_dylu, halos), as written
         (pythia_14m on GPT-2 BPE).
readme:  docs/simulator.md's example commands, at the size `cpu` (the byte-level
         `small` model): async_hetero.py:cpu, sim_sweep.py:diloco,very,cpu and sim_geo.py with
         each method. The goal: each under 3 minutes on a 2-core CPU.
workers: W = 4, 16, 64 workers of each model (pythia_14m with the GPT-2 tokenizer, and
         `small` on bytes; batch 8 × 128), async_dn + DyLU ('moderate' speeds) and DiLoCo,
         at a fixed 2 rounds of H = 5 per worker: wall seconds per applied inner step (after
         start-up) and peak RSS.

Each row also gives the model FLOP/s of its training (model/flops.py's count of the applied
tokens over the wall seconds after start-up) against this CPU's float32 matmul rate,
measured by this process before the cases run (bench/mfu.py's `matmul_rate`, 2048², alone).
"""

import argparse
import json
import os
import pathlib
import re
import runpy
import subprocess
import sys
import tempfile
import time

from lowcomm_jax.report import has_summary, read_summary

REPO = pathlib.Path(__file__).resolve().parents[1]
GEO_METHODS = ("diloco", "async_dn_dylu", "halos")
ALGORITHMS = {"async_dn_dylu": ["--config.algorithm=async_dn", "--config.outer.dylu=True",
                                "--config.sim.heterogeneity=moderate"],
              "diloco": ["--config.algorithm=diloco"]}
MODELS = {"pythia_14m": ["--config.model.name=pythia_14m", "--config.data.tokenizer=gpt2"],
          "small": ["--config.model.name=small", "--config.data.tokenizer=byte"]}


def run_case(name: str, args: list[str], timeout: float) -> dict:
  """One main.py process: its summary's figures, its wall seconds and peak RSS (the
  kernel's, from wait4)."""
  with tempfile.TemporaryDirectory() as workdir:
    # A fresh compilation cache: every program is compiled (and counted by any version's
    # summary, which counts the programs that went through the cache).
    cmd = [sys.executable, "-m", "lowcomm_jax.main", *args, f"--workdir={workdir}",
           f"--config.compile_cache_dir={workdir}/fresh_cache"]
    err_path = pathlib.Path(workdir) / "stderr.txt"
    start = time.perf_counter()
    with err_path.open("w") as err:
      proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                              env=dict(os.environ, JAX_LOG_COMPILES="1"))
      timed_out = False
      while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
          break
        if not timed_out and time.perf_counter() - start > timeout:
          proc.kill()
          timed_out = True
        time.sleep(0.2)
      proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    row = {"case": name, "args": args,
           "returncode": "timeout" if timed_out else proc.returncode,
           "seconds": time.perf_counter() - start, "peak_rss_gib": usage.ru_maxrss / 2**20}
    # JAX's own log of each trace, lowering and compile (what a version without the
    # summary's compile_seconds is measured by).
    row["log_compile_seconds"] = sum(float(x) for x in re.findall(
        r"Finished (?:XLA compilation of|tracing|jaxpr to MLIR module conversion) .*? in "
        r"([0-9.e+-]+) sec", err_path.read_text()))
    if proc.returncode == 0 and has_summary(workdir):
      s = read_summary(workdir)
      row.update({k: s.get(k) for k in ("eval_loss", "wall_seconds", "startup_seconds",
                                        "programs_compiled", "programs_from_cache",
                                        "jobs_per_call", "total_inner_steps",
                                        "virtual_seconds", "num_workers", "tokens",
                                        "compile_seconds")})

    else:
      row["error"] = err_path.read_text()[-2000:]
    return row


def _flag(args: list[str], name: str, default):
  """The case's `--config.<name>=` value, else `default` (sim_geo's own, where it has it)."""
  return type(default)(next((a.split("=", 1)[1] for a in args
                             if a.startswith(f"--config.{name}=")), default))


def _train_flops_per_token(args: list[str]) -> float:
  """model/flops.py's training FLOPs per token of the case's model (its flags, or the
  sim_geo config's pythia_14m at seq 128)."""
  from lowcomm_jax.model import flops, presets
  config = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), "")
  size = config.partition(":")[2].split(",")[-1] if ":" in config else ""
  sizes = runpy.run_path(str(REPO / "configs" / "base.py"))["SIZES"]
  fields = sizes.get(size, sizes["pythia"])  # the study configs' size (configs/base.py)
  name = _flag(args, "model.name", fields["model.name"])
  seq = _flag(args, "data.seq_len", 128)
  tokenizer = _flag(args, "data.tokenizer", fields["data.tokenizer"])
  cfg = presets.get_preset(name, tokenizer_vocab=50257 if tokenizer == "gpt2" else 256)
  return flops.train_flops_per_token(cfg, seq)


def cases(parts: list[str], workers: list[int], models: list[str], extra: list[str]):
  if "geo" in parts:
    for method in GEO_METHODS:
      yield f"geo_{method}", [f"--config=configs/sim_geo.py:{method}", *extra]
  if "readme" in parts:
    for config in ("async_hetero.py:cpu", "sim_sweep.py:diloco,very,cpu",
                   *(f"sim_geo.py:{m},cpu" for m in GEO_METHODS)):
      yield f"readme_{config.replace('.py:', '_').replace(',', '_')}", [
          f"--config=configs/{config}", *extra]
  if "workers" in parts:
    for model in models:
      for algorithm, flags in ALGORITHMS.items():
        for w in workers:
          yield (f"workers_{model}_{algorithm}_{w}",
                 ["--config=configs/base.py", "--config.runtime=simulator",
                  f"--config.num_workers={w}", "--config.rounds=2", "--config.inner_steps=5",
                  "--config.data.batch_size=8", "--config.data.seq_len=128",
                  "--config.eval_every=2", "--config.checkpoint_every=2",
                  "--config.eval_batches=2", *MODELS[model], *flags, *extra])


def report(path: pathlib.Path) -> None:
  rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  peak = next((r["matmul_flops_per_s"] for r in rows if "matmul_flops_per_s" in r), None)
  if peak:
    print(f"float32 matmul 2048², this CPU: {peak / 1e9:.0f} GFLOP/s")
  print("| case | wall s | compiling s | wall per applied step s (less compiling) | peak RSS GiB | "
        "programs compiled | jobs per call | model GFLOP/s (of matmul) | eval loss |")
  print("|---|---|---|---|---|---|---|---|---|")
  share = lambda r: f" ({r['model_flops_per_s'] / peak:.0%})" if peak else ""
  for r in rows:
    if "case" not in r:
      continue
    if r["returncode"] == 0:  # training seconds: the wall less the compiling
      tokens = (r["total_inner_steps"] * _flag(r["args"], "data.batch_size", 8)
                * _flag(r["args"], "data.seq_len", 128))
      compiling = r.get("compile_seconds") or r.get("log_compile_seconds") or 0.0
      r["compile_seconds"] = compiling
      train_s = r["wall_seconds"] - compiling
      r["wall_per_step_s"] = train_s / r["total_inner_steps"]
      r["model_flops_per_s"] = tokens * _train_flops_per_token(r["args"]) / train_s
    if r["returncode"] != 0:
      print(f"| {r['case']} | {r['seconds']:.0f} ({r['returncode']}) | | | "
            f"{r.get('peak_rss_gib') or 0:.2f} | | | | |")
      continue
    print(f"| {r['case']} | {r['wall_seconds']:.1f} | {r['compile_seconds']:.1f} | "
          f"{r['wall_per_step_s']:.4f} | {r['peak_rss_gib']:.2f} | {r['programs_compiled']} | "
          f"{r['jobs_per_call']} | {r['model_flops_per_s'] / 1e9:.0f}{share(r)} | "
          f"{r['eval_loss']:.4f} |")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--parts", default="geo,workers")
  p.add_argument("--workers", type=int, nargs="+", default=[4, 16, 64])
  p.add_argument("--models", default="pythia_14m,small")
  p.add_argument("--timeout", type=float, default=1200.0)
  p.add_argument("--out", default=str(REPO / "bench" / "results" / "sim_scale.jsonl"))
  p.add_argument("--report", action="store_true")
  p.add_argument("--set", action="append", default=[],
                 help="a flag more for every case, e.g. --set=--config.rounds=1 (repeatable)")
  a = p.parse_args()
  out = pathlib.Path(a.out)
  if a.report:
    report(out)
    return
  out.parent.mkdir(parents=True, exist_ok=True)
  import jax.numpy as jnp
  from mfu import matmul_rate  # (bench/ is first on sys.path)
  with out.open("a") as f:  # this CPU's matmul rate, alone, before the cases
    f.write(json.dumps({"matmul_flops_per_s": matmul_rate(jnp.float32, 2048, calls=2)}) + "\n")
  for name, args in cases(a.parts.split(","), a.workers, a.models.split(","), a.set):
    row = run_case(name, args, a.timeout)
    with out.open("a") as f:
      f.write(json.dumps(row) + "\n")
    print(json.dumps({k: v for k, v in row.items() if k not in ("args", "error")}),
          flush=True)


if __name__ == "__main__":
  main()
