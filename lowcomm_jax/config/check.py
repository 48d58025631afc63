"""Start-up validation: every problem named with its field and its fix, before any compute."""

import copy
import dataclasses
import functools
import importlib.util
import os

import jax
import ml_collections

from lowcomm_jax import algorithms, compress, runtimes
from lowcomm_jax.config import defaults
from lowcomm_jax.assemble import hosts
from lowcomm_jax.programs import optimizers
from lowcomm_jax.programs.sync import scatter_problems
from lowcomm_jax.run import identity
from lowcomm_jax.errors import ConfigError, Problems  # noqa: F401 - ConfigError re-exported
from lowcomm_jax.data.tokenizers import TOKENIZER_VOCAB, is_tokenizer_file
from lowcomm_jax.model.matformer import hidden_units, width_problems
from lowcomm_jax.model import attention, pretrained
from lowcomm_jax.model.presets import PRESETS
from lowcomm_jax.model.tp import SYNC_PLANS, SyncPlan, plan_problems
from lowcomm_jax.parallel import distributed

ALGORITHMS = algorithms.NAMES


def _names_with(declares) -> list[str]:
  """The algorithms whose declarations satisfy `declares(algorithm)`."""
  return [a.name for a in algorithms.REGISTRY.values() if declares(a)]


def validate_here(c: ml_collections.ConfigDict) -> None:
  """`validate` on this process's devices and processes: what a command runs once, at start.
  Runtimes with `one_device` build their runs on one device (`plan.one_device`)."""
  devices, local = jax.device_count(), jax.local_device_count()
  runtime = runtimes.RUNTIMES.get(c.runtime)
  if runtime is not None and runtime.one_device:  # a worker per device (or vmapped on one)
    c = copy.deepcopy(c)
    with c.unlocked():
      c.mesh.replica = 1
  if runtime is not None and runtime.own_devices:  # a worker's devices are its process's
    devices = local = c.mesh.data * c.model.tp.size
  validate(c, num_devices=devices, num_processes=jax.process_count(), local_devices=local)


@dataclasses.dataclass(frozen=True)
class Where:
  """The processes and devices a config is checked for."""
  num_devices: int
  num_processes: int = 1
  local_devices: int | None = None


def validate(c: ml_collections.ConfigDict, *, num_devices: int, num_processes: int = 1,
             local_devices: int | None = None) -> None:
  """Raises ConfigError listing every bad field of `c` for this run's processes and devices:
  each entry of CHECKS in turn (a fixed order, so the first problem named does not change)."""
  problems = Problems(c)
  where = Where(num_devices, num_processes, local_devices)
  for check_fields in CHECKS:
    check_fields(c, problems, where)
  if problems:
    raise ConfigError(problems)


def _check_run(c: ml_collections.ConfigDict, problems: Problems, where: Where) -> None:
  """The run's own fields, and the fields of algorithms other than the chosen one."""
  check = problems.check
  check(c.algorithm in ALGORITHMS, "algorithm", f"use one of {ALGORITHMS}")
  check(c.num_workers >= 1, "num_workers", "need at least one worker")
  check(c.rounds >= 1, "rounds", "need at least one outer round")
  check(c.inner_steps >= 1, "inner_steps", "H must be >= 1")
  if c.algorithm in ALGORITHMS:
    problems.extend(algorithms.get(c.algorithm).problems(c))  # its own fields and limits
  for other in algorithms.REGISTRY.values():  # another algorithm's own fields, changed
    if other.config_section and other.name != c.algorithm:
      changed = _changed_from_base(c[other.config_section], other.config_section, keep=())
      if changed:
        problems.append(f"{', '.join(changed)}: ignored unless algorithm={other.name!r}; set "
                        f"--config.algorithm={other.name} or leave them at their defaults")
  for field in ("eval_every", "checkpoint_every", "log_every"):
    check(c[field] >= 0, field, "must be >= 0 (0: only at the end)")
  check(c.metrics.writer in ("tensorboard", "clu"), "metrics.writer",
        "use 'tensorboard' (no TensorFlow) or 'clu'")
  # clu.metric_writers imports TensorFlow: looked for, not imported (it takes seconds).
  check(c.metrics.writer != "clu" or importlib.util.find_spec("tensorflow") is not None,
        "metrics.writer", "needs TensorFlow (pip install tensorflow-cpu), or use 'tensorboard'")
  check(c.eval_batches >= 1, "eval_batches", "need at least one validation batch")
  check(c.seed >= 0, "seed", "must be >= 0 (random streams derive from it)")
  # (a resume checks the fields against the stored config; a fresh run names them too)
  unknown = sorted(identity.allowed_fields(c) - set(identity.flatten(identity.to_json(c))))
  check(not unknown, "resume_allow", f"names {', '.join(unknown)}, not config fields; list "
        "the fields a resume may change, e.g. --config.resume_allow=outer.lr")
  problems.extend(distributed.problems(c))


def _check_runtime(c: ml_collections.ConfigDict, problems: Problems, where: Where) -> None:
  """The chosen runtime's own check (runtimes.RUNTIMES), and the sections only others read."""
  if "enabled" in c.sim:  # the field that picked the simulator before `runtime` did
    problems.append("sim.enabled: gone; the runtime field picks the simulator: set "
                    "--config.runtime=simulator (and drop sim.enabled)")
  if "collective" in c.sim.network:  # the field that picked the form before collective_form
    problems.append(f"sim.network.collective={c.sim.network.collective!r}: moved; set "
                    f"--config.collective_form={c.sim.network.collective} (and drop "
                    "sim.network.collective)")
  runtime = runtimes.RUNTIMES.get(c.runtime)
  if runtime is None:
    problems.append(f"runtime={c.runtime!r}: use one of {list(runtimes.NAMES)}")
    return
  algorithm = algorithms.get(c.algorithm) if c.algorithm in ALGORITHMS else None
  problems.extend(runtime.problems(c, where.num_processes, algorithm))
  _check_ignored(c, problems, runtime)


def _check_ignored(c: ml_collections.ConfigDict, problems: Problems, runtime) -> None:
  """Other runtimes' own sections, changed: named as ignored by this one, with the
  runtimes that read them. A section this runtime reads inside another's (Ray's
  `sim.network`: the links its nodes sit on) counts as its own."""
  def read_by(r, field: str) -> bool:
    return any(field.startswith(section + ".") for section in r.sections)

  readers = {}  # changed field -> the runtimes that would read it
  for other in runtimes.RUNTIMES.values():
    for section in other.sections:
      for field in _changed_from_base(c[section], section):
        if not read_by(runtime, field.partition("=")[0]):
          readers.setdefault(field, []).append(other.name)
  by_readers = {}
  for field, names in readers.items():
    by_readers.setdefault(tuple(names), []).append(field)
  for names, fields in by_readers.items():
    problems.append(f"{', '.join(fields)}: ignored unless runtime is "
                    f"{' or '.join(map(repr, names))}; set --config.runtime={names[0]} or "
                    "leave them at their defaults")


def _check_mesh(c: ml_collections.ConfigDict, problems: Problems, where: Where) -> None:
  """Workers spread evenly over replica devices, within the devices present."""
  check = problems.check
  m = c.mesh
  check(m.replica == -1 or m.replica >= 1, "mesh.replica", "use -1 (auto) or a positive count")
  check(m.data >= 1, "mesh.data", "must be >= 1")
  if m.replica >= 1 and c.num_workers >= 1:
    check(c.num_workers % m.replica == 0, "num_workers",
          f"must be a multiple of mesh.replica={m.replica} (workers per device are equal); "
          "change num_workers or set --config.mesh.replica=-1")
  tp = c.model.tp.size
  needed = max(m.replica, 1) * max(m.data, 1) * max(tp, 1)
  if needed > where.num_devices:
    problems.append(
        f"mesh.replica*mesh.data*model.tp.size={needed}: only {where.num_devices} devices "
        "are visible; "
        "shrink the mesh (mesh.replica=-1 picks what fits)")


def _check_shapes(c: ml_collections.ConfigDict, problems: Problems, where: Where) -> None:
  """The model's and the data's own fields."""
  check = problems.check
  m = c.mesh
  check(c.model.name in PRESETS, "model.name", f"use one of {sorted(PRESETS)}")
  check(c.model.dtype in ("float32", "bfloat16"), "model.dtype", "use 'float32' or 'bfloat16'")
  check(0.0 <= c.model.dropout < 1.0, "model.dropout", "must be in [0, 1)")
  check(c.model.vocab_size >= 0, "model.vocab_size", "must be >= 0 (0: the preset's)")
  check(c.model.loss_chunk >= 0, "model.loss_chunk",
        "must be >= 0 (positions per piece of the loss; 0: chosen by model.dtype)")
  # Only read with tp.size > 1, but a typo should not wait for the run that shards.
  check(c.model.tp.sync in SYNC_PLANS, "model.tp.sync", f"use one of {SYNC_PLANS}")
  if is_tokenizer_file(c.data.tokenizer):
    check(os.path.isfile(os.path.expanduser(c.data.tokenizer)), "data.tokenizer",
          "no such tokenizer.json; give its path or one of "
          f"{sorted(TOKENIZER_VOCAB)}")
  else:
    check(c.data.tokenizer in TOKENIZER_VOCAB, "data.tokenizer",
          f"use one of {sorted(TOKENIZER_VOCAB)} or a Hugging Face tokenizer.json path")
  check(c.data.dtype in ("", "uint16", "uint32"), "data.dtype",
        "use 'uint16', 'uint32' or '' (meta.json's, else uint16)")
  check(c.data.batch_mode in ("same", "different"), "data.batch_mode",
        "use 'same' (one shared stream) or 'different' (a stream per worker)")
  check(c.data.batch_size >= 1, "data.batch_size", "must be >= 1")
  if m.data >= 1:
    check(c.data.batch_size % m.data == 0, "data.batch_size",
          f"must be divisible by mesh.data={m.data} (each data shard gets an equal slice)")
  check(0.0 < c.data.val_fraction < 1.0, "data.val_fraction", "must be in (0, 1)")


def _check_model(c: ml_collections.ConfigDict, problems: Problems, where: Where) -> None:
  """The model against the mesh, the tokenizer and the widths asked for: a preset's, or a
  pretrained checkpoint's architecture."""
  check = problems.check
  tp = c.model.tp.size
  check(tp >= 1, "model.tp.size", "must be >= 1 (1: no tensor parallelism)")
  preset = PRESETS.get(c.model.name)
  model_label = f"model {c.model.name!r}"
  if c.model.init_from:  # the checkpoint fixes the architecture; model.name is not used
    check(c.model.vocab_size == 0, "model.vocab_size",
          "must be 0 with model.init_from (the checkpoint fixes the vocabulary)")
    model_label = f"checkpoint {c.model.init_from!r}"
    try:
      preset = pretrained.read_config(c.model.init_from)
    except pretrained.PretrainedError as e:
      problems.append(str(e))
      preset = None
  problems.extend(attention.problems(c.model.attention, c.model.dtype,
                                     preset.head_dim if preset is not None else None,
                                     attention.platform()))
  if preset is not None:
    # tp.py's sharded forward is the GPT's: exact GELU, LayerNorm eps 1e-5, rotary base 1e4.
    if tp > 1 and (preset.family != "gpt" or preset.mlp != "gelu"
                   or (preset.norm_eps, preset.rope_base) != (1e-5, 10000.0)):
      problems.append(f"model.tp.size={tp}: tensor parallelism shards the GPT family with "
                      f"exact GELU only, not {model_label}; set --config.model.tp.size=1")
    elif tp > 1:
      plan = SyncPlan(c.model.tp.sync, c.model.tp.layers_per_group,
                      tuple(c.model.tp.attn_sync_layers))
      problems.extend(plan_problems(
          plan, dataclasses.replace(preset, dropout=c.model.dropout, dtype=c.model.dtype), tp))
      for row in c.hosts:
        hidden = hidden_units(preset.d_ff, float(row.tier))
        if hidden % tp:
          problems.append(f"hosts: tier {row.tier} trains {hidden} FFN units, not divisible "
                          f"by model.tp.size={tp}; pick a tier whose width tp divides")
    problems.extend(width_problems("eval.widths", c.eval.widths, preset.d_ff, tp))
    check(1 <= c.data.seq_len <= preset.block_size, "data.seq_len",
          f"must be in [1, {preset.block_size}] (the block size of {model_label})")
    vocab = c.model.vocab_size or preset.vocab_size
    tok_vocab = TOKENIZER_VOCAB.get(c.data.tokenizer)
    if vocab and tok_vocab and vocab < tok_vocab:
      problems.append(f"model.vocab_size={vocab}: smaller than tokenizer {c.data.tokenizer!r}'s "
                      f"{tok_vocab} tokens; set --config.model.vocab_size=0 or larger")


def _check_adversaries(c: ml_collections.ConfigDict, problems: Problems, where: Where) -> None:
  """data.corrupt_workers / data.corruption* and attack.* (tests and benchmarks)."""
  check = problems.check
  from lowcomm_jax.data.pipeline import CORRUPTIONS
  ids = range(c.num_workers)
  check(c.data.partition in ("none", "contiguous"), "data.partition",
        "use 'none' (IID) or 'contiguous' (a shard of the corpus per worker)")
  if c.data.partition != "none":
    check(c.data.batch_mode == "different", "data.partition",
          "needs a stream per worker: data.batch_mode=different")
  bad = list(c.data.corrupt_workers)
  check(all(isinstance(w, int) and w in ids for w in bad), "data.corrupt_workers",
        f"give worker ids in [0, {c.num_workers})")
  if bad:
    check(c.data.corruption in CORRUPTIONS, "data.corruption", f"use one of {list(CORRUPTIONS)}")
    check(0.0 <= c.data.corruption_prob <= 1.0, "data.corruption_prob", "must be in [0, 1]")
    check(c.data.batch_mode == "different", "data.corrupt_workers",
          "needs a stream per worker: data.batch_mode=different")
    if c.data.corruption == "other_text":
      check(bool(c.data.corruption_path), "data.corruption_path",
            "corruption 'other_text' reads another corpus: give a plain-text file")
  attackers = list(c.attack.workers)
  check(all(isinstance(w, int) and w in ids for w in attackers), "attack.workers",
        f"give worker ids in [0, {c.num_workers})")
  check(c.attack.kind in ("scale", "sign_flip", "random"), "attack.kind",
        "use 'scale', 'sign_flip' or 'random'")
  if attackers and c.algorithm in ALGORITHMS:
    check(algorithms.get(c.algorithm).synchronous, "attack.workers",
          "attacks are applied in synchronous syncs; use one of "
          f"{_names_with(lambda a: a.synchronous)}")


def _check_lora(c: ml_collections.ConfigDict, problems: Problems, where: Where) -> None:
  check = problems.check
  lo = c.lora
  check(lo.rank >= 0, "lora.rank", "must be >= 0 (0: no LoRA)")
  if lo.rank == 0:
    return
  check(lo.alpha > 0, "lora.alpha", "must be > 0 (the adapters' scale is alpha / rank)")
  check(bool(lo.targets) and set(lo.targets) <= {"attn", "mlp"}, "lora.targets",
        "use ('attn',), ('mlp',) or ('attn', 'mlp')")
  check(lo.base_dtype in ("float32", "bfloat16"), "lora.base_dtype",
        "use 'float32' or 'bfloat16'")
  # Not built yet with LoRA: say so before any work, rather than train something else.
  for ok, field, why in (
      (c.model.tp.size == 1, "model.tp.size", "tensor parallelism shards full weights"),
      (c.aggregate.signal != "probe_loss", "aggregate.signal",
       "the probe scores proposals without the frozen base")):
    if not ok:
      problems.append(f"lora.rank={lo.rank}: not yet with {field} here ({why}); "
                      f"set --config.lora.rank=0 or change {field}")


def _check_collab(c: ml_collections.ConfigDict, problems: Problems, where: Where) -> None:
  """collab.* (lowcomm_jax/runtimes/spmd/collab.py): a target batch reached together by
  unequal peers."""
  check = problems.check
  co = c.collab
  check(co.target_batch_size >= 0, "collab.target_batch_size",
        "must be >= 0 (0: no collaborative epochs)")
  check(co.wait_timeout_s > 0, "collab.wait_timeout_s", "must be > 0 seconds")
  check(co.link_gbps >= 0, "collab.link_gbps", "must be >= 0 (0: no emulated link)")
  check(co.link_latency_s >= 0, "collab.link_latency_s", "must be >= 0 seconds")
  if co.target_batch_size <= 0:
    return
  off = " (or set --config.collab.target_batch_size=0)"
  if c.algorithm in ALGORITHMS:
    gradients = _names_with(lambda a: not a.local_steps and not a.simulated_only)
    check(not algorithms.get(c.algorithm).local_steps, "algorithm",
          "collaborative epochs average gradients at θ and take one optimizer step per epoch; "
          f"use --config.algorithm={' or '.join(gradients)}" + off)
  check(c.data.batch_mode != "same", "data.batch_mode", "peers reading the same windows "
        "would count the same samples toward the target; use 'different'" + off)
  check(c.aggregate.rule == "mean" and c.aggregate.signal == "none" and c.aggregate.bucket <= 1,
        "aggregate.rule", "an epoch weighs workers by their samples; use the mean with "
        "aggregate.signal='none' and aggregate.bucket=0" + off)


def _check_robust(c: ml_collections.ConfigDict, problems: Problems, where: Where) -> None:
  """aggregate.* (aggregate/robust.py, signal.py): the weighting, the rule, the signal."""
  from lowcomm_jax.aggregate import RULES, SIGNALS
  check = problems.check
  a = c.aggregate
  check(a.weighting in ("uniform", "tokens"), "aggregate.weighting", "use 'uniform' or 'tokens'")
  check(a.rule in RULES, "aggregate.rule", f"use one of {list(RULES)}")
  check(a.signal in SIGNALS, "aggregate.signal", f"use one of {list(SIGNALS)}")
  check(a.clip_iters >= 1, "aggregate.clip_iters", "must be >= 1")
  check(a.clip_tau >= 0, "aggregate.clip_tau", "must be >= 0 (0: the median distance)")
  check(a.bucket >= 0, "aggregate.bucket", "must be >= 0 (0 or 1: no buckets)")
  check(a.temperature > 0, "aggregate.temperature", "must be > 0")
  check(a.noise_sigmas >= 0, "aggregate.noise_sigmas", "must be >= 0 (0: plain z-scores)")
  check(0.0 <= a.floor <= 1.0, "aggregate.floor", "must be in [0, 1]")
  check(0.0 <= a.weight_ema < 1.0, "aggregate.weight_ema", "must be in [0, 1)")
  check(a.warmup_rounds >= 0, "aggregate.warmup_rounds", "must be >= 0")
  check(0.0 <= a.signal_ema < 1.0, "aggregate.signal_ema", "must be in [0, 1)")
  check(a.probe_batch_size >= 1, "aggregate.probe_batch_size", "must be >= 1")
  check(a.probe_step >= 0, "aggregate.probe_step",
        "must be >= 0 (0: 1 with local steps, optimizer.lr for ddp)")
  groups = -(-c.num_workers // a.bucket) if a.bucket > 1 else c.num_workers
  if a.rule == "trimmed_mean":
    check(a.trim >= 0 and 2 * a.trim < groups, "aggregate.trim",
          f"must be >= 0 and leave a value: 2·trim < {groups} (workers, or buckets)")
  if a.rule == "mean" and a.signal == "none" and a.bucket <= 1:
    return  # the plain mean: nothing below applies
  codec = compress.declared(c.compress.codec)
  check(codec is None or not codec.sign_descent, "aggregate.rule",
        f"{c.compress.codec}'s payloads are averaged by its own rule (sign descent of the "
        "mean); use another codec, or aggregate.rule=mean with aggregate.signal=none")
  check(a.weighting == "uniform" and all(float(h.tier) >= 1.0 for h in c.hosts),
        "aggregate.rule", "robust rules and signal weights need full-width workers of equal "
        "weight (no MatFormer tiers, aggregate.weighting=uniform)")
  if c.algorithm in ALGORITHMS:
    check(algorithms.get(c.algorithm).robust_aggregation, "aggregate.rule",
          f"{c.algorithm} combines contributions its own way; use one of "
          f"{_names_with(lambda a: a.robust_aggregation)}")


def _check_codecs(c: ml_collections.ConfigDict, problems: Problems, where: Where) -> None:
  problems.extend(compress.problems(c))
  if c.algorithm in ALGORITHMS:
    problems.extend(scatter_problems(c, algorithms.get(c.algorithm)))


def _check_checkpoints(c: ml_collections.ConfigDict, problems: Problems, where: Where) -> None:
  problems.check(c.keep_checkpoints >= 2, "keep_checkpoints",
                 "keep at least 2: a crash mid-save must leave an older complete checkpoint")


def _check_hosts(c: ml_collections.ConfigDict, problems: Problems, where: Where) -> None:
  problems.extend(hosts.problems(c, where.num_devices, where.num_processes, where.local_devices))


def _check_optimizer(c: ml_collections.ConfigDict, problems: Problems, where: Where) -> None:
  problems.extend(optimizers.problems(c))


# Every group of fields, in the order `validate` asks: the run's own (and the chosen
# algorithm's `problems`, parallel/distributed.py's), the codecs (compress/), the chosen
# runtime's, the devices, the model and data, aggregation, LoRA, collaborative epochs, the
# adversaries, checkpoints, the host table (assemble/hosts.py), the inner optimizer
# (programs/optimizers.py). Each is `check(c, problems, where)`; an owner of new fields adds
# its own here.
CHECKS = (_check_run, _check_codecs, _check_runtime, _check_mesh, _check_shapes, _check_model,
          _check_robust, _check_lora, _check_collab, _check_adversaries, _check_checkpoints,
          _check_hosts, _check_optimizer)


@functools.lru_cache(maxsize=1)
def _base_defaults() -> ml_collections.ConfigDict:
  """The defaults every config starts from (the package's schema). Loaded once; only read."""
  return defaults.get_config()


def _changed_from_base(node: ml_collections.ConfigDict, prefix: str,
                       keep: tuple[str, ...] = ()) -> list[str]:
  """`prefix.*` fields (but those under `keep`) whose value differs from the defaults'."""
  base = _base_defaults()
  for part in prefix.split("."):
    base = base[part]
  mine = identity.flatten(identity.to_json(node), f"{prefix}.")
  theirs = identity.flatten(identity.to_json(base), f"{prefix}.")
  skip = tuple(f"{prefix}.{k}" for k in keep)
  return [f"{k}={v!r}" for k, v in mine.items()
          if not k.startswith(skip) and k in theirs and v != theirs[k]]
