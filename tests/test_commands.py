"""Every command the docs show is accepted as written, without running it.

Collected: the ```bash blocks and inline commands (`python ...`, `pip ...`,
`tensorboard ...`, `sbatch ...`) of README.md and of every page in docs/, and the commands
and `--config.x=y` hints in the docstrings of configs/*.py. Each is split into simple
commands (`&&`, leading VAR=value):

  python -m lowcomm_jax.main   flags parsed the way main.py parses them (its own absl flags,
                               ml_collections overrides), then check.validate on the
                               devices the command's XLA_FLAGS (or launcher) gives it, in
                               as many processes as its JAX_NUM_PROCESSES (or launcher) says
  scripts and other modules    their argparse parser takes the arguments (the script runs up
                               to its parse, then stops); launch/local.py's main arguments
                               are checked as above on its processes
  pip / venv / tensorboard / ray start ... the tool's own parser, extras in pyproject.toml,
                               files exist
"""

import argparse
import ast
import copy
import importlib.util
import os
import pathlib
import re
import runpy
import shlex
import sys
import tomllib
from unittest import mock

import pytest
from absl import flags
from ml_collections import config_flags

from conftest import REPO

PROGRAMS = ("python", "python3", "pip", "tensorboard", "sbatch", "ray")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


# --- collecting -------------------------------------------------------------------------

def _logical_lines(text: str) -> list[str]:
  """Lines with backslash continuations joined."""
  return [" ".join(line.split()) for line in re.sub(r"\\\n", " ", text).splitlines()]


def _is_command(line: str) -> bool:
  words = line.split()
  while words and _ASSIGNMENT.match(words[0]):
    words = words[1:]
  return bool(words) and words[0] in PROGRAMS


def _optional_included(command: str) -> str:
  """`[--plot out.png]` (an optional part in usage notation) -> `--plot out.png`."""
  return re.sub(r"\[(\s*-[^\]]*)\]", r"\1", command)


DOC_PAGES = ["README.md", *(f"docs/{p.name}" for p in sorted((REPO / "docs").glob("*.md")))]


def markdown_commands(where: str) -> list[tuple[str, str]]:
  """The commands a markdown file shows, each labelled with the file (`where`, from REPO)."""
  text = (REPO / where).read_text()
  out = []
  for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
    for line in _logical_lines(block):
      line = line.split(" # ")[0].strip()  # trailing comments
      if line and not line.startswith("#"):
        out.append((where, line))
  prose = re.sub(r"```.*?```", "", text, flags=re.S)
  for span in re.findall(r"`([^`]+)`", prose):
    span = " ".join(span.split())
    if _is_command(span):
      out.append((where, _optional_included(span)))
  return out


def doc_commands() -> list[tuple[str, str]]:
  return [command for page in DOC_PAGES for command in markdown_commands(page)]


def _docstring(path: pathlib.Path) -> str:
  return ast.get_docstring(ast.parse(path.read_text())) or ""


def config_commands() -> list[tuple[str, str]]:
  out = []
  for path in sorted((REPO / "configs").glob("*.py")):
    doc, where = _docstring(path), f"configs/{path.name}"
    for line in _logical_lines(doc):
      if _is_command(line.strip()):
        out.append((where, line.strip()))
    # Inline override hints (`--config.a=b ...`) apply to this file's own config.
    for span in re.findall(r"`(--config\.[^`]+)`", doc):
      out.append((where, f"python -m lowcomm_jax.main --config=configs/{path.name} "
                         + " ".join(span.split())))
  return out


COMMANDS = doc_commands() + config_commands()


# --- checking ---------------------------------------------------------------------------

class _Parsed(Exception):
  """Raised by the patched argparse once the outermost parser has parsed its arguments."""

  def __init__(self, namespace, rest):
    super().__init__("parsed")
    self.namespace, self.rest = namespace, rest


def _stop_after_parsing(monkeypatch):
  """argparse parses as usual (errors exit 2), then the program stops before doing anything."""
  parse_args, parse_known_args = argparse.ArgumentParser.parse_args, \
      argparse.ArgumentParser.parse_known_args
  depth = [0]  # subparsers parse inside the outer parser

  def wrap(original, known):
    def parse(self, args=None, namespace=None):
      depth[0] += 1
      try:
        result = original(self, args, namespace)
      finally:
        depth[0] -= 1
      if depth[0] == 0:
        raise _Parsed(*(result if known else (result, [])))
      return result
    return parse

  monkeypatch.setattr(argparse.ArgumentParser, "parse_args", wrap(parse_args, False))
  monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", wrap(parse_known_args, True))


def _run_until_parsed(monkeypatch, argv: list[str], *, script=None, module=None) -> _Parsed:
  source = (script or pathlib.Path(importlib.util.find_spec(module).origin)).read_text()
  # A program that parses without argparse would run for real here.
  assert "argparse" in source, f"{argv[0]} does not use argparse; teach this test its parser"
  _stop_after_parsing(monkeypatch)
  monkeypatch.setattr(sys, "argv", argv)
  monkeypatch.setattr(os, "environ", dict(os.environ))  # scripts may setdefault env vars
  monkeypatch.setattr(sys, "path", [str(script.parent) if script else "", *sys.path])
  try:
    if script:
      runpy.run_path(str(script), run_name="__main__")
    else:
      monkeypatch.delitem(sys.modules, module, raising=False)  # a fresh __main__ copy
      runpy.run_module(module, run_name="__main__", alter_sys=False)
  except _Parsed as parsed:
    return parsed
  except SystemExit as e:
    pytest.fail(f"{' '.join(argv)}: its parser rejected the arguments (exit {e.code})")
  pytest.fail(f"{' '.join(argv)} finished without parsing arguments")


def _device_count(env: dict) -> int:
  """Devices the command runs on: forced host devices, the GPUs it names, else one."""
  if env.get("CUDA_VISIBLE_DEVICES"):  # a GPU command: CUDA_VISIBLE_DEVICES=0,1,2,3 python ...
    return len(env["CUDA_VISIBLE_DEVICES"].split(","))
  match = re.search(r"--xla_force_host_platform_device_count=(\d+)", env.get("XLA_FLAGS", ""))
  return int(match.group(1)) if match else 1  # a CPU exposes one device by default


def _processes(args: list[str], env: dict) -> int:
  """Processes a real host's command joins: --config.distributed.num_processes, else
  JAX_NUM_PROCESSES, else one."""
  for arg in args:
    if arg.startswith("--config.distributed.num_processes="):
      return int(arg.partition("=")[2]) or 1
  return int(env.get("JAX_NUM_PROCESSES", "1"))


def check_main(args: list[str], *, devices_per_process: int, processes: int = 1):
  """main.py's flag parsing on a fresh FlagValues, then the validation it does first."""
  import lowcomm_jax.main as main
  from lowcomm_jax import runtimes
  from lowcomm_jax.config import command_line
  from lowcomm_jax.config import check
  command_line.check(args)  # main's own pre-check of the config file and override names
  argv = ["main", *args]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True,
                                  sys_argv=argv)
  for flag in flags.FLAGS.get_flags_for_module(main):  # --workdir, --print_config, ...
    if flag.name != "config":
      values[flag.name] = copy.deepcopy(flag)
  rest = values(argv)
  assert rest == ["main"], f"main takes flags only; unexpected {rest[1:]}"
  config = copy.deepcopy(values.config)
  if runtimes.get(config.runtime).one_device:  # as main does: a worker per device
    with config.unlocked():
      config.mesh.replica = 1
  check.validate(config, num_devices=devices_per_process * processes,
                        num_processes=processes, local_devices=devices_per_process)


def _pyproject_extras() -> set[str]:
  project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
  return set(project.get("optional-dependencies", {}))


def check_simple(words: list[str], env: dict, created: set[str], monkeypatch):
  program, args = words[0], words[1:]
  if program == "cd":
    assert (REPO / args[0]).is_dir(), f"cd: no directory {args[0]}"
  elif program == "export":
    env.update(a.partition("=")[::2] for a in args)
  elif program in (".", "source"):
    assert args[0] in created or (REPO / args[0]).is_file(), f"no file {args[0]}"
  elif program == "pip":
    assert args[0] == "install", words
    from pip._internal.commands import create_command
    options, _ = create_command("install").parse_args(args[1:])
    for editable in options.editables:
      path, _, extras = editable.partition("[")
      assert (REPO / path / "pyproject.toml").is_file(), editable
      missing = {e.strip() for e in extras.rstrip("]").split(",") if e.strip()} - \
          _pyproject_extras()
      assert not missing, f"pip install {editable}: pyproject.toml has no extra {missing}"
  elif program == "tensorboard":
    from tensorboard import program as tb
    # Its parser also validates the process's absl flags (main's --config is required).
    with mock.patch.object(flags.FlagValues, "validate_all_flags", lambda self: None):
      tb.TensorBoard().configure(argv=["tensorboard", *args])
  elif program == "ray":  # `ray start ...` (docs/ray.md, a cluster): Ray's click parser
    import click
    from ray.scripts.scripts import cli
    assert args and args[0] in cli.commands, f"ray has no command {args[:1]}"
    try:
      cli.commands[args[0]].make_context(f"ray {args[0]}", list(args[1:]))
    except click.exceptions.Exit as e:  # --help
      assert e.exit_code == 0, words
  elif program == "sbatch":
    for path in args:
      assert (REPO / path.split(":")[0]).is_file(), f"sbatch: no file {path}"
  elif program in ("python", "python3"):
    if args[0] == "-c":
      compile(args[1], "<command>", "exec")
    elif args[0] == "-m":
      module, args = args[1], args[2:]
      if module == "lowcomm_jax.main" and {"--help", "--helpfull", "--helpshort"} & set(args):
        import lowcomm_jax.main  # noqa: F401  (absl's app.run adds the help flags)
      elif module == "lowcomm_jax.main":  # one process of several (real hosts)
        check_main(args, devices_per_process=_device_count(env), processes=_processes(args, env))
      elif module == "venv":
        assert len(args) == 1, args
        created.add(f"{args[0]}/bin/activate")
      elif module == "pytest":
        from _pytest.config import get_config
        get_config()._parser.parse(args)
      else:
        _run_until_parsed(monkeypatch, [module, *args], module=module)
    else:
      script = REPO / args[0]
      assert script.is_file(), f"no script {args[0]}"
      parsed = _run_until_parsed(monkeypatch, [str(script), *args[1:]], script=script)
      if script.name == "local.py" and parsed.namespace.module == "lowcomm_jax.main":
        rest = parsed.rest[1:] if parsed.rest[:1] == ["--"] else parsed.rest
        check_main(rest, devices_per_process=parsed.namespace.devices_per_process or 1,
                   processes=parsed.namespace.num_processes)
  else:
    pytest.fail(f"no check for the program {program!r}; add one")


def test_the_docs_show_the_commands_this_test_expects():
  # The collector itself must keep finding them (a format change would silently skip).
  found = {command for _, command in COMMANDS}
  pages = {where for where, _ in COMMANDS}
  assert len(DOC_PAGES) >= 10 and "docs/runtimes-and-hosts.md" in DOC_PAGES
  # Every page that shows a ```bash block or an inline command yields commands.
  for page in DOC_PAGES:
    text = (REPO / page).read_text()
    if "```bash" in text:
      assert page in pages, f"{page} shows commands but none were collected"
  readme = {command for where, command in COMMANDS if where == "README.md"}
  # README: the two commands, and a command per runtime of its "Which runtime" table.
  assert any(c.startswith("python3 -m venv .venv") and c.endswith("diloco_hetero.py")
             for c in readme)
  assert any(c.endswith('pip install -e ".[test]" && python -m pytest -q') for c in readme)
  assert "python -m lowcomm_jax.main --config=configs/sim_geo.py:halos,cpu" in readme
  assert any("--config.runtime=ray" in c for c in readme)
  assert len([c for c in found if "lowcomm_jax.main" in c]) >= 40
  assert len([c for c in pages if c.startswith("docs/")]) >= 10
  # The main job on 2 and 4 processes (launch/local.py) and on real hosts.
  hosts = {command for where, command in COMMANDS if where == "docs/runtimes-and-hosts.md"}
  assert ("python launch/local.py --num_processes 2 -- --config=configs/diloco_hetero.py:1.0,0.25"
          in hosts)
  assert "python launch/local.py --num_processes 4 -- --config=configs/diloco_hetero.py" in hosts
  for n in (2, 4):
    assert any(c.startswith(f"JAX_COORDINATOR_ADDRESS=10.0.0.1:1234 JAX_NUM_PROCESSES={n} ")
               for c in hosts), n
  assert any("--config.hosts[1]." in c for c in hosts)
  assert any("tensorboard" in c for c in found) and any("lowcomm_jax.report" in c for c in found)
  assert any(c.startswith("sbatch ") for c in found) and any(c.startswith("ray start") for c in found)
  assert any("async_hetero.py --config.model.name=tiny" in c for c in found)


@pytest.mark.parametrize("where,command", COMMANDS, ids=[f"{w}: {c}" for w, c in COMMANDS])
def test_command_runs_as_written(where, command, monkeypatch):
  monkeypatch.chdir(REPO)
  created, exported = set(), {}
  for simple in re.split(r"\s*&&\s*", command):
    words = shlex.split(simple)
    env = dict(exported)
    while words and _ASSIGNMENT.match(words[0]):
      name, _, value = words.pop(0).partition("=")
      env[name] = value
    check_simple(words, env if words[0] != "export" else exported, created, monkeypatch)


def _usage_error():
  from lowcomm_jax.config.command_line import UsageError
  return UsageError


def _config_error():
  from lowcomm_jax.config.check import ConfigError
  return ConfigError


# Each bad command is rejected for its own reason: the expected error's type and message.
REJECTED = [
    # The old CPU hint of configs/async_hetero.py: seq_len 128 > the tiny model's block 64.
    ("python -m lowcomm_jax.main --config=configs/async_hetero.py --config.model.name=tiny "
     "--config.data.tokenizer=byte", _config_error, r"data\.seq_len=128: must be in \[1, 64\]"),
    ("python -m lowcomm_jax.main --config=configs/smoke.py --config.no_such_field=1",
     _usage_error, "no config field 'no_such_field'"),
    ("python -m lowcomm_jax.main --config=configs/smoke.py --no_such_flag=1",
     lambda: flags.UnrecognizedFlagError, "Unknown command line flag 'no_such_flag'"),
    ("python -m lowcomm_jax.main --config=configs/smoke.py extra_argument",
     lambda: AssertionError, r"main takes flags only; unexpected \['extra_argument'\]"),
    ("XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m lowcomm_jax.main "
     "--config=configs/tp_sweep.py:grouped_k3",  # 4 tensor-parallel shards on 2 devices
     _config_error, "tp.size=4: only 2 devices are visible"),
    ("python bench/tp_plans.py no_such_mode", lambda: pytest.fail.Exception,
     "tp_plans.py no_such_mode: its parser rejected the arguments"),
    ("python -m lowcomm_jax.report", lambda: pytest.fail.Exception,  # needs workdirs
     "lowcomm_jax.report: its parser rejected the arguments"),
    ("python launch/local.py --num_processes 4 -- --config=configs/smoke.py --config.rounds=0",
     _config_error, r"rounds=0: need at least one outer round(.|\n)*not divisible by the 4 processes"),
    # A host table needs one row per process: the main job's 4 rows on 2 processes.
    ("python launch/local.py --num_processes 2 -- --config=configs/diloco_hetero.py",
     _config_error, "the host table has 4 rows but 2 processes joined"),
    ("JAX_COORDINATOR_ADDRESS=10.0.0.1:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 "
     "python -m lowcomm_jax.main --config=configs/diloco_hetero.py",
     _config_error, "the host table has 4 rows but 2 processes joined"),
    ('pip install -e ".[no_such_extra]"', lambda: AssertionError,
     "pyproject.toml has no extra {'no_such_extra'}"),
    ("tensorboard --no_such_flag", lambda: SystemExit, "^2$"),  # its argparse: exit 2
    ("sbatch launch/no_such_script.sbatch", lambda: AssertionError,
     "sbatch: no file launch/no_such_script.sbatch"),
    ("no_such_program --help", lambda: pytest.fail.Exception,
     "no check for the program 'no_such_program'"),
]


@pytest.mark.parametrize("command,error,message", REJECTED, ids=[c for c, _, _ in REJECTED])
def test_the_checks_reject_bad_commands(command, error, message, monkeypatch):
  with pytest.raises(error(), match=message):
    test_command_runs_as_written("test", command, monkeypatch)
