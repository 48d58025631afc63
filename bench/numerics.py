"""Guard for refactors that must not change a number: the eval loss of a fixed set of runs.

    python bench/numerics.py --out before.json            # on the old code
    python bench/numerics.py --out after.json --compare before.json

Each case is the real command line (`python -m lowcomm_jax.main`) in its own process, on 8
virtual CPU devices (the device count decides the mesh), some shortened by overrides. The
final eval losses are compared exactly (bit for bit: JSON floats round-trip), and so are
the bytes each run sent; `--tolerance` allows a relative difference where a summation
order had to change (say why in BUILD_NOTES.md).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from lowcomm_jax.report import read_summary

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIM_SHORT = ["--config.rounds=4", "--config.model.name=tiny", "--config.data.tokenizer=byte",
             "--config.eval_every=2", "--config.checkpoint_every=2", "--config.data.seq_len=32"]
CASES = {
    "main_diloco_hetero": ["configs/diloco_hetero.py"],
    "smoke": ["configs/smoke.py"],
    "ddp_short": ["configs/ddp.py", "--config.rounds=20", "--config.eval_every=10",
                  "--config.checkpoint_every=10"],
    "diloco_sparseloco_short": ["configs/diloco_sparseloco.py", "--config.rounds=3",
                                "--config.eval_every=3", "--config.checkpoint_every=3"],
    "tp_spd_short": ["configs/tp_sweep.py:spd", "--config.rounds=20", "--config.eval_every=10",
                     "--config.checkpoint_every=10"],
    "sim_diloco": ["configs/sim_sweep.py:diloco,moderate", *SIM_SHORT],
    "sim_async": ["configs/sim_sweep.py:async,moderate", *SIM_SHORT],
    "sim_async_dn": ["configs/sim_sweep.py:async_dn_dylu,moderate", *SIM_SHORT],
    "sim_halos": ["configs/sim_geo.py:halos", *SIM_SHORT],
    # Every codec on the smoke run (DeMo under DDP, its only algorithm), a sparsifier
    # without error feedback, DeMo's 1-bit signs and a lossy codec under MatFormer tiers.
    **{f"smoke_{codec}": ["configs/smoke.py", f"--config.compress.codec={codec}"]
       for codec in ("int8", "fp8", "int4", "topk", "randomk", "sparseloco")},
    "smoke_int8_stochastic": ["configs/smoke.py", "--config.compress.codec=int8",
                              "--config.compress.stochastic_rounding=True"],
    "smoke_topk_no_feedback": ["configs/smoke.py", "--config.compress.codec=topk",
                               "--config.compress.error_feedback=False"],
    "smoke_ddp_demo": ["configs/smoke.py", "--config.algorithm=ddp", "--config.inner_steps=1",
                       "--config.compress.codec=demo"],
    "smoke_ddp_demo_signs": ["configs/smoke.py", "--config.algorithm=ddp",
                             "--config.inner_steps=1", "--config.compress.codec=demo",
                             "--config.compress.value_bits=1"],
    # a robust rule with signal weights (aggregate.RobustRule's steps, issue 61), Streaming
    # with τ and a mix (its local program also runs in two parts on Ray)
    "smoke_clip_cosine": ["configs/smoke.py", "--config.aggregate.rule=centered_clip",
                          "--config.aggregate.clip_iters=2", "--config.aggregate.signal=cosine",
                          "--config.aggregate.warmup_rounds=0"],
    "smoke_streaming_tau": ["configs/smoke.py", "--config.algorithm=streaming",
                            "--config.inner_steps=4", "--config.streaming.overlap_steps=1",
                            "--config.streaming.mix=0.5"],
    "hetero_int4_short": ["configs/diloco_hetero.py", "--config.compress.codec=int4",
                          "--config.model.name=tiny", "--config.rounds=4",
                          "--config.data.seq_len=32", "--config.eval_every=4",
                          "--config.checkpoint_every=4"],
}


def run_case(args: list[str], workdir: pathlib.Path) -> tuple[float, int]:
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  cmd = [sys.executable, "-m", "lowcomm_jax.main", f"--config={args[0]}", *args[1:],
         f"--workdir={workdir}"]
  subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL,
                 stderr=subprocess.PIPE)
  summary = read_summary(workdir)
  return summary["eval_loss"], summary["bytes_sent"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="where to write {case: eval_loss}")
  parser.add_argument("--compare", help="a previous --out to compare with")
  parser.add_argument("--tolerance", type=float, default=0.0, help="relative; 0: exact")
  parser.add_argument("--only", nargs="*", help="run these cases only")
  a = parser.parse_args()
  # With --only, the other cases of an existing --out are kept.
  results = (json.loads(pathlib.Path(a.out).read_text())
             if a.only and pathlib.Path(a.out).exists() else {})
  with tempfile.TemporaryDirectory() as tmp:
    for name, args in CASES.items():
      if a.only and name not in a.only:
        continue
      t0 = time.perf_counter()
      results[name], results[f"{name}.bytes_sent"] = run_case(args, pathlib.Path(tmp) / name)
      print(f"{name:26s} eval_loss {results[name]!r:22s} bytes "
            f"{results[f'{name}.bytes_sent']:>12d} {time.perf_counter() - t0:6.1f}s", flush=True)
  pathlib.Path(a.out).write_text(json.dumps(results, indent=2) + "\n")
  if a.compare:
    before = json.loads(pathlib.Path(a.compare).read_text())
    bad = []
    for name, value in results.items():
      old = before.get(name)
      same = old is not None and abs(value - old) <= a.tolerance * abs(old)
      print(f"{name:26s} {'same' if same else 'DIFFERENT'}: {old!r} -> {value!r}")
      bad += [] if same else [name]
    if bad:
      sys.exit(f"changed: {bad}")


if __name__ == "__main__":
  main()
