"""summary.json's common part: the keys every runtime writes, the same on each, with their
types and meanings (docs/outputs-and-reports.md lists them). A runtime adds keys of its own
beside them (docs/simulator.md, docs/ray.md); `run.loop` adds the runtime's name and the
start-up's figures to every one. tests/test_summary.py holds each runtime to this."""

# key -> (the types its value may have, what it means)
COMMON: dict[str, tuple[tuple[type, ...], str]] = {
    "runtime": ((str,), "the runtime that ran it (config.runtime: spmd, simulator, ray)"),
    "algorithm": ((str,), "config.algorithm"),
    "num_workers": ((int,), "the workers the run started with (config.num_workers)"),
    "rounds": ((int,), "config.rounds"),
    "inner_steps": ((int,), "config.inner_steps (H)"),
    "model": ((str,), "the model's name"),
    "params": ((int,), "the model's parameters, a LoRA run's frozen base included"),
    "trainable_params": ((int,), "the parameters trained (a LoRA run's adapters)"),
    "codec": ((str,), "compress.codec"),
    "eval_loss": ((float,), "the last evaluation's loss, at full width"),
    "tokens": ((int,), "training tokens the run applied to θ, every worker's"),
    "bytes_sent": ((int,), "what a worker sent over the run by the byte ledger (the codec's "
                   "payloads; the mean over workers where they differ)"),
    "bytes_sent_ddp_equivalent": ((int,), "what a worker would have sent all-reducing dense "
                                  "fp32 gradients every inner step"),
    "wall_seconds": ((int, float), "the run's wall time (a resumed run's, its earlier lives' "
                     "included)"),
    "startup_seconds": ((int, float), "this invocation's start until its first round was "
                        "dispatched"),
    "programs_compiled": ((int,), "programs this invocation compiled"),
    "programs_from_cache": ((int,), "programs it loaded from compile_cache_dir"),
}


def problems(summary: dict) -> list[str]:
  """One line per common key `summary` lacks or holds with another type."""
  out = []
  for key, (types, meaning) in COMMON.items():
    if key not in summary:
      out.append(f"summary.json lacks {key!r} ({meaning})")
    elif isinstance(summary[key], bool) or not isinstance(summary[key], types):
      out.append(f"summary.json's {key!r} is {summary[key]!r}, not "
                 f"{' or '.join(t.__name__ for t in types)} ({meaning})")
  return out
