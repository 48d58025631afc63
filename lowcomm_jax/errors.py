"""The error a config that cannot run raises, and the form of each problem: below every
package, so the checks of any layer (parallel/distributed.py's, compress/'s, sim/'s,
config/check.py's, assemble/memory.py's) speak alike."""


class ConfigError(ValueError):
  """A config that cannot run. `str()` lists each bad field with how to fix it."""

  def __init__(self, problems: list[str]):
    self.problems = problems
    super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


def field_problem(c, field: str, fix: str) -> str:
  """'field=value: fix', the form every config problem takes."""
  value = c
  for part in field.split("."):
    value = value[part]
  return f"{field}={value!r}: {fix}"


class Problems(list):
  """The problems found in config `c`: `check(ok, field, fix)` adds one where `ok` fails."""

  def __init__(self, c):
    super().__init__()
    self.c = c

  def check(self, ok: bool, field: str, fix: str) -> None:
    if not ok:
      self.append(field_problem(self.c, field, fix))
