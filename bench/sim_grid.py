"""Running a grid of simulator cases, several at a time, for the benches that compare many.

A bench names its cases (name -> flattened config fields over a base config) and calls
`run_grid`: every case without a summary.json in `workdir/<name>` runs in its own process
(`python <bench> --only <name> ...`), `jobs` at a time, each process on one CPU thread so
that `jobs` of them fill a machine's cores. A finished case keeps summary.json, config.json
and metrics.jsonl; its checkpoints and event files are removed (they are large and the
benches read nothing else), so a rerun reuses it and a grid can be carried between machines.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import time

from lowcomm_jax import report

# One thread per process: XLA:CPU otherwise sizes its pools for the whole machine.
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def run_case(config, workdir: pathlib.Path) -> dict:
  """Runs one case in this process and trims its workdir to what the benches read."""
  from lowcomm_jax.runtimes.simulator import simulate
  summary = simulate.run(config, workdir)
  trim(workdir)
  return summary


def trim(workdir: pathlib.Path) -> None:
  """Removes a finished case's checkpoints and event files (large; the benches read
  summary.json, config.json and metrics.jsonl)."""
  for heavy in ("checkpoints", "tensorboard"):
    shutil.rmtree(workdir / heavy, ignore_errors=True)


def unfinished(names: list[str], workdir: pathlib.Path) -> list[str]:
  """The cases of `names` without a summary.json in workdir/<name> yet."""
  return [n for n in names if not report.has_summary(workdir / n)]


def run_grid(script: str, names: list[str], workdir: pathlib.Path, jobs: int,
             args: list[str]) -> list[str]:
  """Runs the cases of `names` that have no summary yet; returns the names that failed."""
  todo = unfinished(names, workdir)
  env = dict(os.environ)
  if jobs > 1:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + ONE_THREAD).strip()
  running, failed = {}, []
  (workdir / "logs").mkdir(parents=True, exist_ok=True)
  while todo or running:
    while todo and len(running) < jobs:
      name = todo.pop(0)
      log = open(workdir / "logs" / f"{name}.log", "w")
      running[name] = (subprocess.Popen([sys.executable, script, "--only", name, *args],
                                        env=env, stdout=log, stderr=subprocess.STDOUT), log,
                       time.time())
    for name, (proc, log, t0) in list(running.items()):
      if proc.poll() is not None:
        log.close()
        del running[name]
        status = "done" if proc.returncode == 0 else f"FAILED (rc {proc.returncode})"
        print(f"  {name}: {status} in {time.time() - t0:.0f} s", flush=True)
        if proc.returncode:
          failed.append(name)
    time.sleep(0.5)
  return failed
