"""Checks main's command line before absl parses it, so a typo costs one line, not a traceback.

absl and ml_collections report a missing config file, a failing `get_config(arg)`, an
unknown override field or an index past a list as tracebacks (some with no hint). Here the
config file is loaded once on its own and each `--config.<path>=<value>` is walked
through it; the first problem becomes a `UsageError` naming the flag and the fix.
"""

import difflib
import importlib.util
import pathlib
import re

import ml_collections

_OVERRIDE = re.compile(r"^--?config\.([^=\s]+)(?:=|$)")
_PATH_PART = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)|\[(-?\d+)\]")
# Names users bring from other trainers, and this project's name for them.
_ALIASES = {"learning_rate": "lr", "num_worker": "num_workers", "workers": "num_workers",
            "steps": "inner_steps", "local_steps": "inner_steps", "H": "inner_steps",
            "outer_lr": "lr", "batch": "batch_size", "seq_length": "seq_len",
            "block_size": "seq_len"}
# Fields that moved, and the override that now says the same.
_MOVED = {"sim.enabled": "--config.runtime=simulator (the runtime field picks the simulator)",
          "sim.network.collective": "--config.collective_form (the same values; it picks "
                                    "a round's collective in the simulator and on Ray)"}


class UsageError(ValueError):
  """A command-line problem; `str()` is one line naming the flag and the fix."""


def config_argument(argv: list[str]) -> str | None:
  """The value of --config (`path` or `path:arg`), or None when it is absent."""
  for i, arg in enumerate(argv):
    if arg in ("--config", "-config") and i + 1 < len(argv):
      return argv[i + 1]
    for prefix in ("--config=", "-config="):
      if arg.startswith(prefix):
        return arg[len(prefix):]
  return None


def load_config(spec: str) -> ml_collections.ConfigDict:
  """Runs `get_config` of the file in `spec` (`path` or `path:arg`) as config_flags does."""
  path, *arg = spec.split(":", 1)
  file = pathlib.Path(path)
  if not file.is_file():
    near = sorted(p.name for p in file.parent.glob("*.py")) if file.parent.is_dir() else []
    hint = f" (files in {file.parent}/: {', '.join(near)})" if near else ""
    raise UsageError(f"--config={spec}: no such file {path}; give a path to a config file "
                     f"such as configs/smoke.py{hint}")
  module_spec = importlib.util.spec_from_file_location("_lowcomm_checked_config", file)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
    return module.get_config(*arg)
  except Exception as e:  # the config file's own check of its argument, or a bug in it
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise UsageError(f"--config={spec}: {reason}") from None


def _suggest(name: str, options: list[str]) -> str:
  if name in _ALIASES and _ALIASES[name] in options:
    return f"did you mean {_ALIASES[name]}?"
  close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
  if close:
    return f"did you mean {close[0]}?"
  return "fields here: " + ", ".join(sorted(options))


def check_override(config: ml_collections.ConfigDict, dotted: str) -> None:
  """Raises UsageError unless `dotted` (e.g. `hosts[1].tier`) names a field of `config`."""
  if dotted in _MOVED:
    raise UsageError(f"--config.{dotted}: gone; use {_MOVED[dotted]}")
  node, walked = config, ""
  for name, index in _PATH_PART.findall(dotted):
    if name:
      fields = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
      if name not in fields:
        where = f"{walked} has no field" if walked else "no config field"
        raise UsageError(f"--config.{dotted}: {where} {name!r}; {_suggest(name, fields)}")
      node, walked = node[name], f"{walked}.{name}" if walked else name
    else:
      if not isinstance(node, (list, tuple)):
        raise UsageError(f"--config.{dotted}: {walked} is not a list; drop the [{index}]")
      if not -len(node) <= int(index) < len(node):
        rows = f"has {len(node)} rows (0..{len(node) - 1})" if node else "is empty"
        raise UsageError(f"--config.{dotted}: {walked} {rows}; add rows in the config file "
                         "(a command line can only change existing ones)")
      node, walked = node[int(index)], f"{walked}[{index}]"


def check(argv: list[str]) -> ml_collections.ConfigDict | None:
  """Checks the config file, its argument and every override field named in `argv`.

  Returns the loaded config (before overrides), or None when --config is absent (absl then
  says it is required)."""
  spec = config_argument(argv)
  if spec is None:
    return None
  config = load_config(spec)
  for arg in argv:
    match = _OVERRIDE.match(arg)
    if match:
      check_override(config, match.group(1))
  return config
