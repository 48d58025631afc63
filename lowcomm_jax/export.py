"""A run's model as one Hugging Face checkpoint (model.safetensors + config.json), from the
run's latest checkpoint.

  python -m lowcomm_jax.export --workdir=RUN [--width=0.25] --out=DIR

`--width` picks a MatFormer width (default 1.0, the whole model): the first m = width × d_ff
FFN units of every block, the model a tier of that width trains and `eval_loss/tier_<w>`
evaluates, written as a standalone model (GPT-2's layout with `n_inner` = m, Llama's with
`intermediate_size` = m). A LoRA run's export is its base with the adapters merged
(W + (α/r)·A·B), then cut to the width. A width must be a whole number of FFN units or one
of the run's host tiers. `--export_merged` on the main command line writes the same for a
LoRA run at full width when the run ends.

The run is rebuilt from RUN/config.json in this one process, so its data must be where it
was, and it must fit one process: the host table's hosts all run here (a run whose hosts
each had several replica devices, or tensor parallelism over more devices than this machine
has, is refused by the config check). The checkpoint is opened read-only, so a run that is
still training can be exported. A Ray run's checkpoint gives its global server's θ;
simulator runs keep their parameters elsewhere and are refused.
"""

import argparse
import dataclasses
import json
import pathlib
import sys

import jax
import ml_collections

from lowcomm_jax import runtimes
from lowcomm_jax.config import check, defaults
from lowcomm_jax.run import identity
from lowcomm_jax.run.checkpoint import Checkpointer
from lowcomm_jax.model import hf_export, lora
from lowcomm_jax.model.presets import GPTConfig
from lowcomm_jax.model.matformer import hidden_units, slice_tier, width_problems


class ExportError(ValueError):
  """The run cannot be exported as asked (one line: what and how to fix it)."""


def _typed(value, like=None):
  """A config.json value as the config had it: dicts as ConfigDicts, lists of dicts (host
  rows) as lists, other lists as tuples unless the field (`like`) is a list."""
  if isinstance(value, dict):
    return ml_collections.ConfigDict({k: _typed(v) for k, v in value.items()})
  if isinstance(value, list):
    items = [_typed(v) for v in value]
    return items if isinstance(like, list) or (items and isinstance(value[0], dict)) else (
        tuple(items))
  return value


def _overlay(config: ml_collections.ConfigDict, stored: dict) -> None:
  """`stored`'s values over `config`'s (fields the stored config lacks keep their
  defaults: a run written before they were added)."""
  for key, value in stored.items():
    here = config.get(key)
    if isinstance(here, ml_collections.ConfigDict) and isinstance(value, dict):
      _overlay(here, value)
    else:
      with config.unlocked():
        config[key] = _typed(value, like=here)


def config_of(workdir: str | pathlib.Path) -> ml_collections.ConfigDict:
  """The run's config from `workdir`/config.json over the package's defaults, for one
  process (see the module docstring). Simulator runs are refused."""
  path = pathlib.Path(workdir) / identity.FILE
  try:
    stored = identity.upgraded(json.loads(path.read_text())["config"])
  except (OSError, ValueError, KeyError) as e:
    raise ExportError(f"{path}: no readable run config ({type(e).__name__}); point --workdir "
                      "at a run's folder") from e
  config = defaults.get_config()
  _overlay(config, stored)
  runtime = runtimes.RUNTIMES.get(config.runtime)
  if runtime is None or runtime.finished is None:
    why = runtime.no_checkpoint if runtime else f"runtime {config.runtime!r} is not known here"
    raise ExportError(f"{workdir}: {why}")
  config.distributed.num_processes, config.distributed.process_id = 1, -1
  config.distributed.coordinator_address = ""
  return config


def run_of(config: ml_collections.ConfigDict):
  """The run built as the one that wrote its checkpoints (its runtime says how: a Ray run
  as its servers build it, one device and a row per worker id)."""
  return runtimes.get(config.runtime).finished().run_of(config)


def latest_params(r, workdir: str | pathlib.Path) -> tuple[int, dict]:
  """(round, the model's parameter tree) of the workdir's latest checkpoint: the global θ,
  or for LoRA the base with the adapters merged in. `r`: the run, built."""
  c = r.config
  ckpt = Checkpointer(pathlib.Path(workdir) / "checkpoints", max_to_keep=c.keep_checkpoints,
                      read_only=True)
  try:
    step = ckpt.latest_round()
    if step is None:
      raise ExportError(f"{workdir}: no checkpoint to export; run it first")
    flat = runtimes.get(c.runtime).finished().global_params(ckpt, r, step)
  finally:
    ckpt.close()
  params = r.model.layout.unravel(flat)
  if c.lora.rank > 0:
    base = jax.tree.map(lambda x: x.astype("float32"), r.frozen)
    params = lora.merge(base, params, scale=c.lora.alpha / c.lora.rank)
  return step, params


def export_merged(r, workdir: str | pathlib.Path, out: str | pathlib.Path) -> pathlib.Path:
  """`--export_merged`: `out`/model.safetensors + config.json, the frozen base with every
  adapted kernel replaced by W + (α/r)·A·B of the workdir's latest checkpoint. The
  safetensors metadata names the base and the checkpoint's round. `r`: the run, built."""
  c = r.config
  if c.lora.rank == 0:
    raise ValueError("--export_merged needs a LoRA run (lora.rank > 0)")
  step, merged = latest_params(r, workdir)
  meta = {"lora_base": c.model.init_from or f"seeded init (seed {c.seed})",
          # a bfloat16-stored base is exported as it was trained on: bfloat16-rounded
          "lora_base_dtype": c.lora.base_dtype,
          "lora": json.dumps({"rank": c.lora.rank, "alpha": c.lora.alpha,
                              "targets": list(c.lora.targets)}),
          "round": str(step)}
  return hf_export.save_safetensors(out, r.model.cfg, merged, metadata=meta)


def check_width(config, width: float) -> None:
  """Raises ExportError unless `width` is a model of the run's FFN: a whole number of its
  units (matformer.width_problems) or one of its hosts' tiers (which train rounded units)."""
  from lowcomm_jax.model import pretrained
  from lowcomm_jax.model.presets import PRESETS
  tiers = {float(h.tier) for h in config.hosts}
  if float(width) in tiers:
    return
  d_ff = (pretrained.read_config(config.model.init_from).d_ff if config.model.init_from
          else PRESETS[config.model.name].d_ff)
  if problems := width_problems("--width", [width], d_ff):
    raise ExportError(problems[0])


@dataclasses.dataclass(frozen=True)
class WidthModel:
  """One width of a run's latest checkpoint, as a model of its own."""
  cfg: GPTConfig  # the run's model with d_ff = the width's units
  params: dict  # its parameter tree: the first d_ff units of every FFN
  config: ml_collections.ConfigDict  # the run's config (config_of)
  round: int  # the checkpoint's
  full_ffn_units: int


def width_model(workdir: str | pathlib.Path, width: float) -> WidthModel:
  """The width-`width` model of the workdir's latest checkpoint (module docstring): what
  `export_width` writes and bench/smollm2_generate.py --workdir runs."""
  config = config_of(workdir)
  check_width(config, width)
  if not list((pathlib.Path(workdir) / "checkpoints").glob("[0-9]*")):
    raise ExportError(f"{workdir}: no checkpoint to export; run it first")
  check.validate_here(config)  # this command's one validation (main's is the run's)
  r = run_of(config)
  step, params = latest_params(r, workdir)
  d_ff = r.model.cfg.d_ff
  m = hidden_units(d_ff, width)
  return WidthModel(dataclasses.replace(r.model.cfg, d_ff=m),
                    slice_tier(params, m) if m != d_ff else params, config, step, d_ff)


def export_width(workdir: str | pathlib.Path, width: float,
                 out: str | pathlib.Path) -> pathlib.Path:
  """`out`/model.safetensors + config.json: the width-`width` model of the workdir's latest
  checkpoint. Returns the safetensors file."""
  w = width_model(workdir, width)
  config = w.config
  meta = {"run": str(pathlib.Path(workdir).resolve()), "round": str(w.round),
          "width": f"{width:g}", "ffn_units": str(w.cfg.d_ff),
          "full_ffn_units": str(w.full_ffn_units),
          "tokenizer": config.data.tokenizer}  # what bench/smollm2_generate.py encodes with
  if config.lora.rank > 0:
    meta["lora_base"] = config.model.init_from or f"seeded init (seed {config.seed})"
  return hf_export.save_safetensors(out, w.cfg, w.params, metadata=meta)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m lowcomm_jax.export",
                              description=__doc__.splitlines()[0])
  p.add_argument("--workdir", required=True, type=pathlib.Path, help="the run's folder")
  p.add_argument("--width", type=float, default=1.0,
                 help="MatFormer FFN width to export (fraction of d_ff; default 1.0)")
  p.add_argument("--out", required=True, type=pathlib.Path,
                 help="folder for model.safetensors and config.json")
  args = p.parse_args(argv)
  from lowcomm_jax.errors import ConfigError
  from lowcomm_jax.run.checkpoint import CheckpointMismatch
  try:
    written = export_width(args.workdir, args.width, args.out)
  except (ExportError, ConfigError, CheckpointMismatch, OSError) as e:
    print(f"lowcomm_jax.export: error: {e}", file=sys.stderr)
    sys.exit(2)
  print(f"width {args.width:g} of {args.workdir} written to {written}")


if __name__ == "__main__":
  main()
