"""A run's identity: the resolved config and command line stored in `<workdir>/config.json`.

A workdir belongs to one config. Re-running into it resumes only under the same config:
`rounds` may grow and the cadence fields (what is logged, evaluated and saved, and when)
may change, because none of them changes the trajectory; the distributed fields may too,
since a restart may land on other nodes. Any other change is refused before any work, unless
the user names it in `resume_allow`; allowed changes are recorded in config.json (under
`resumes`), in metrics.jsonl and in summary.json.

A LoRA run's adapters belong to one frozen base, recorded as `base` (`base_of`): the
SHA-256 of `model.init_from`'s file, or the seed that drew a random base. A resume on
another base (a file replaced at the same path, a seed allowed to change) is refused.
"""

import hashlib
import json
import logging
import os
import pathlib
import sys
import time

import ml_collections

FILE = "config.json"
# Changes that cannot alter the trained parameters (the distributed fields a restart on
# other nodes changes; not num_processes, which decides whose checkpoint parts exist).
RESUMABLE = ("rounds", "eval_every", "checkpoint_every", "keep_checkpoints", "log_every",
             "metrics.writer", "overlap_sync", "resume_allow", "compile_cache_dir",
             "distributed.coordinator_address",
             "distributed.coordinator_bind_address", "distributed.process_id",
             "distributed.heartbeat_timeout_s", "distributed.join_timeout_s",
             "collab.wait_timeout_s", "eval.widths", "ray.worker_nodes", "ray.server_node")
# Changes a checkpoint cannot continue under (its shapes, H schedule or plan): never allowed.
FIXED = ("algorithm", "num_workers", "inner_steps", "hosts", "outer.dylu",
         "distributed.num_processes", "data.seq_len", "data.tokenizer", "data.batch_mode",
         "streaming.fragments", "streaming.layout", "lora.rank", "lora.targets")
FIXED_PREFIXES = ("model.", "compress.", "mesh.", "sim.")
# Kernel choices under a fixed prefix that change no shape (a resume on another GPU may
# name another): allowed with resume_allow, like any other field.
KERNEL_CHOICES = ("model.attention", "model.loss_chunk")


class ResumeRefused(ValueError):
  """The workdir holds a run of another config; `str()` lists the changes and the ways out."""


def to_json(value):
  """Config values as plain JSON (ConfigDicts and tuples inside lists included)."""
  if isinstance(value, (ml_collections.ConfigDict, dict)):
    return {k: to_json(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_json(v) for v in value]
  if isinstance(value, (str, int, float, bool)) or value is None:
    return value
  return repr(value)


def flatten(tree: dict, prefix: str = "") -> dict:
  """{'outer': {'lr': 0.7}} -> {'outer.lr': 0.7}; lists stay whole values."""
  flat = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      flat.update(flatten(v, f"{prefix}{k}."))
    else:
      flat[f"{prefix}{k}"] = v
  return flat


def allowed_fields(config: ml_collections.ConfigDict) -> set[str]:
  value = config.get("resume_allow", "")
  names = value.split(",") if isinstance(value, str) else list(value)
  return {n.strip() for n in names if n.strip()}


def upgraded(config: dict) -> dict:
  """A stored config (config.json's "config") in today's fields: `sim.enabled`, which
  picked the simulator before the `runtime` field named all three runtimes, becomes
  `runtime='simulator'`; `sim.network.collective` becomes `collective_form`."""
  sim = config.get("sim") if isinstance(config, dict) else None
  if not isinstance(sim, dict):
    return config
  if "enabled" in sim:
    runtime = "simulator" if sim["enabled"] else config.get("runtime", "spmd")
    sim = {k: v for k, v in sim.items() if k != "enabled"}
    config = {**config, "sim": sim, "runtime": runtime}
  network = sim.get("network")
  if isinstance(network, dict) and "collective" in network:
    logging.warning("%s: its sim.network.collective is read as collective_form (the "
                    "field's name since issue 70)", FILE)
    config = {**config, "collective_form": network["collective"],
              "sim": {**sim, "network": {k: v for k, v in network.items()
                                         if k != "collective"}}}
  return config


def _stored(workdir: pathlib.Path) -> dict | None:
  path = workdir / FILE
  if not path.is_file():
    return None
  try:
    stored = json.loads(path.read_text())
    if not isinstance(stored, dict) or not isinstance(stored.get("config"), dict):
      raise ValueError("no 'config' object")
    return {**stored, "config": upgraded(stored["config"])}
  except (OSError, ValueError) as e:
    raise ResumeRefused(f"{path}: unreadable ({e}); move it aside to resume without the "
                        "config check, or pass another --workdir") from None


def base_of(config: ml_collections.ConfigDict) -> dict | None:
  """The frozen base a LoRA run's adapters are trained on, or None without LoRA."""
  if config.lora.rank <= 0:
    return None
  if not config.model.init_from:
    return {"seeded": config.model.name, "seed": config.seed}
  from lowcomm_jax.model.pretrained import file_of
  file = file_of(config.model.init_from)
  digest = hashlib.sha256()
  with file.open("rb") as f:
    while chunk := f.read(1 << 23):
      digest.update(chunk)
  return {"file": str(file), "sha256": digest.hexdigest()}


def _has_checkpoint(workdir: pathlib.Path) -> bool:
  ckpts = workdir / "checkpoints"
  return ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())


def _fixed(field: str) -> bool:
  return field not in KERNEL_CHOICES and (field in FIXED or field.startswith(FIXED_PREFIXES))


def changes(workdir: pathlib.Path, config: ml_collections.ConfigDict,
            base: dict | None = None) -> dict[str, list]:
  """Compares `config` with the one stored in `workdir`; raises ResumeRefused listing every
  change not allowed, else returns {field: [old, new]} for the changes to record.

  Without a checkpoint nothing resumes (a run that died before its first save): every
  change is allowed and recorded. Fields the stored config lacks (added to lowcomm_jax
  since) are not compared."""
  workdir = pathlib.Path(workdir)
  stored = _stored(workdir)
  if stored is None:
    return {}
  old, new = flatten(stored["config"]), flatten(to_json(config))
  # Compared as JSON text: a NaN read back from config.json equals the NaN in force.
  diff = {k: [old[k], new[k]] for k in new
          if k in old and json.dumps(old[k]) != json.dumps(new[k])}
  if not _has_checkpoint(workdir):
    return {k: v for k, v in diff.items() if k not in RESUMABLE}
  allowed = allowed_fields(config)
  unknown = sorted(allowed - set(new))
  if unknown:
    raise ResumeRefused(f"resume_allow names {', '.join(unknown)}, not config fields; list "
                        "the fields that changed, e.g. --config.resume_allow=outer.lr")
  fixed = sorted(k for k in allowed if _fixed(k) and k in diff)
  if fixed:
    raise ResumeRefused(
        f"resume_allow names {', '.join(fixed)}: a checkpoint cannot continue under another "
        "value (shapes, H schedule or simulation plan); start a new run with another --workdir")
  refused = {k: v for k, v in diff.items() if k not in RESUMABLE and k not in allowed}
  if refused:
    listed = "; ".join(f"{k}: {json.dumps(o)} -> {json.dumps(n)}"
                       for k, (o, n) in sorted(refused.items()))
    changeable = sorted(k for k in refused if not _fixed(k))
    way = (f", or continue this one with the change recorded: "
           f"--config.resume_allow={','.join(changeable)}" if changeable else "")
    raise ResumeRefused(f"{workdir} holds a run of another config ({listed}). Either start "
                        f"a new run with another --workdir{way}")
  if stored.get("base") is not None and stored["base"] != base:
    raise ResumeRefused(
        f"{workdir}'s LoRA adapters belong to another base model ({json.dumps(stored['base'])}; "
        f"this config's is {json.dumps(base)}): resume with the base they were trained on "
        "(model.init_from's file, or the seed of a random base), or start a new run with "
        "another --workdir")
  return {k: v for k, v in diff.items() if k in allowed}


def write(workdir: pathlib.Path, config: ml_collections.ConfigDict, *,
          resumed_at: int | None = None, changed: dict | None = None,
          base: dict | None = None) -> list[dict]:
  """Stores the config in force and the command line; a resume with recorded changes is
  appended to `resumes` (the first config is kept as `first_config`). Returns `resumes`
  (for summary.json)."""
  path = pathlib.Path(workdir) / FILE
  stored = _stored(pathlib.Path(workdir)) or {}
  record = {"config": to_json(config), "command": list(sys.argv), "base": base,
            "first_config": stored.get("first_config", stored.get("config", to_json(config))),
            "resumes": stored.get("resumes", [])}
  if resumed_at is not None and changed:
    record["resumes"].append({"round": resumed_at, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                              "command": list(sys.argv), "changed": changed})
  tmp = path.with_name(f"{FILE}.tmp-{os.getpid()}")
  tmp.write_text(json.dumps(record, indent=2) + "\n")
  os.replace(tmp, path)
  return record["resumes"]
