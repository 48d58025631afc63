"""Command line: `python -m lowcomm_jax.main --config=configs/X.py [--config.a.b=v] [--workdir=DIR]`.

The default workdir is `runs/<config file name>[_<its argument>]`. Re-running the same command
resumes from the workdir's latest checkpoint; a finished run returns its summary at once.
`--print_config` prints the resolved config, each field with its meaning, and exits.
"""

import json
import logging
import pathlib
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file "
                                          "(path or path:argument).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (default runs/<config name>).")
_EXPORT_MERGED = flags.DEFINE_string(
    "export_merged", None, "LoRA runs: after the run, write base + adapters of the latest "
    "checkpoint as Hugging Face safetensors (model.safetensors, config.json) into this folder.")
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config", False, "Print the resolved config (every field with its value and the "
    "comment from the defaults that explains it) and exit without training.")
flags.mark_flags_as_required(["config"])


def _fail(message: str) -> None:
  print(f"lowcomm_jax: error: {message}", file=sys.stderr)
  sys.exit(2)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, after lowcomm_jax's own check of the config file and override
  names (absl reports those as tracebacks); every problem is one line and exit code 2."""
  from lowcomm_jax.config import command_line
  try:
    command_line.check(argv[1:])
    return flags.FLAGS(argv)
  except command_line.UsageError as e:
    _fail(str(e))
  except flags.Error as e:
    _fail(f"{str(e).splitlines()[0]} (see --help)")
  except Exception as e:  # anything absl or ml_collections raise while applying overrides
    reason = str(e).strip().splitlines()
    _fail(f"{type(e).__name__}: {reason[0] if reason else ''} (see --help)")


def _validate_early(config) -> None:
  """The run's one validation, on this process's devices, before the training modules load:
  a bad value fails in about a second instead of after importing orbax, grain and the model.
  Nothing after it checks the config again (build(), the Ray actors)."""
  from lowcomm_jax.config import check
  check.validate_here(config)


def default_workdir(config_path: str) -> str:
  """runs/<config file name>, and its argument if it has one (configs/sim_geo.py:halos,cpu
  -> runs/sim_geo_halos_cpu): each variant of a config is a run of its own."""
  path, _, arg = config_path.partition(":")
  # only the characters a name needs: an argument cannot lead the workdir out of runs/
  parts = ["".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in part)
           for part in arg.split(",") if part]
  return str(pathlib.Path("runs") / "_".join([pathlib.Path(path).stem] + parts))


class _QuietCheckpointing(logging.Filter):
  """Drops orbax's per-save INFO chatter (dozens of lines a checkpoint); keeps warnings."""

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or "orbax" not in record.pathname


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments {argv[1:]}: every option is a flag, --name=value (see --help)")
  if _PRINT_CONFIG.value:
    from lowcomm_jax.config import doc
    print(doc.describe(_CONFIG.value))
    return
  logging.getLogger().setLevel(logging.INFO)
  logging.getLogger("absl").addFilter(_QuietCheckpointing())
  # jax's backend probe logs "Unable to initialize backend 'tpu'" at INFO wherever there is
  # no TPU; its warnings and errors (a GPU backend failing) still show.
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  config = _CONFIG.value
  if _EXPORT_MERGED.value and config.lora.rank == 0:
    _fail("--export_merged writes a LoRA run's base + adapters; set --config.lora.rank > 0 "
          "(a full run's checkpoint already holds its whole model)")
  cache_dir = _start(config)
  workdir = _WORKDIR.value or default_workdir(config_flags.get_config_filename(flags.FLAGS["config"]))
  summary = _train(config, workdir)
  from lowcomm_jax.run import compile_cache
  compiled, loaded, seconds = compile_cache.counts()
  logging.info("compilation: %d program(s) compiled, %d loaded from the cache%s (%.1f s)",
               compiled, loaded, f" in {cache_dir}" if cache_dir else
               " (off: compile_cache_dir='')", seconds)
  import jax
  if jax.process_index() != 0:
    return  # process 0 reports for the run (and exports)
  print(json.dumps(summary, indent=2))
  if _EXPORT_MERGED.value:
    _export_merged(config, workdir)
  _report(summary, workdir)


def _start(config) -> str:
  """The compilation cache on, the processes joined and the config checked, before anything
  compiles (imported here so `--help` and flag errors stay fast: jax and orbax load
  slowly). Returns the cache's folder ('' : off)."""
  from lowcomm_jax.errors import ConfigError
  from lowcomm_jax.parallel import distributed
  from lowcomm_jax.run import compile_cache
  try:
    cache_dir = compile_cache.enable(config.compile_cache_dir)  # before any compile
  except ValueError as e:
    _fail(str(e))
  try:
    distributed.initialize(config)  # before any other JAX use; no-op single-process
    _validate_early(config)
  except distributed.DistributedError as e:
    _fail(str(e))
  except ConfigError as e:
    _fail(str(e) if len(e.problems) > 1 else f"invalid config: {e.problems[0]}")
  return cache_dir


def _train(config, workdir: str) -> dict:
  """The run on its runtime (config field `runtime`: runtimes.RUNTIMES); a failure the
  user can fix ends it with one line and exit code 2."""
  from lowcomm_jax import runtimes
  from lowcomm_jax.data import DataError
  from lowcomm_jax.errors import ConfigError
  from lowcomm_jax.run.checkpoint import CheckpointMismatch
  from lowcomm_jax.run.files import TrainingDiverged
  from lowcomm_jax.run.identity import ResumeRefused
  from lowcomm_jax.run.workdir import WorkdirError
  try:
    run, its_failures = runtimes.get(config.runtime).load()
  except runtimes.Unavailable as e:
    _fail(str(e))
  failures = (ConfigError, DataError, CheckpointMismatch, ResumeRefused, WorkdirError,
              TrainingDiverged) + its_failures
  try:
    return run(config, workdir)
  except failures as e:
    print(f"lowcomm_jax: error: {e}", file=sys.stderr)
    sys.exit(2)


def _export_merged(config, workdir: str) -> None:
  from lowcomm_jax.export import export_merged, run_of
  from lowcomm_jax.run.checkpoint import CheckpointMismatch
  try:
    written = export_merged(run_of(config), workdir, _EXPORT_MERGED.value)
  except (ValueError, OSError, CheckpointMismatch) as e:
    print(f"lowcomm_jax: error: --export_merged: {e}", file=sys.stderr)
    sys.exit(2)
  print(f"merged model written to {written}", file=sys.stderr)


def _report(summary: dict, workdir: str) -> None:
  """The run's result in a sentence, and where to compare it."""
  if summary.get("simulated"):
    print(f"eval loss {summary['eval_loss']:.4f} after {summary['virtual_seconds']:,.1f} "
          f"virtual seconds and {summary['total_inner_steps']:,} inner steps; mean staleness "
          f"{summary['mean_staleness']:.2f}, mean drift {summary['mean_drift']:.4f}. "
          f"Workdir: {workdir}")
  elif "bytes_sent" in summary:
    sent, ddp = summary["bytes_sent"] / 2**20, summary["bytes_sent_ddp_equivalent"] / 2**20
    from lowcomm_jax import algorithms
    local_steps = algorithms.get(summary["algorithm"]).local_steps  # DDP is the comparison
    versus = ("" if not local_steps or not sent else
              f", DDP would have sent {ddp:,.1f} MiB ({ddp / sent:.0f}x more)" if ddp >= sent
              else f", {sent / ddp:.1f}x what DDP would have sent ({ddp:,.1f} MiB)")
    print(f"eval loss {summary['eval_loss']:.4f} after {summary['tokens']:,} tokens; each worker "
          f"sent {sent:,.1f} MiB{versus}. Workdir: {workdir}")
  print(f"Compare runs: python -m lowcomm_jax.report {workdir} [other workdirs] --plot out.png; "
        "reference numbers: BENCHMARKS.md")


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
