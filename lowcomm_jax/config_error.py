"""The error a config that cannot run raises: below every package, so the checks of any
layer (parallel/distributed.py's, config_check's, memory.py's) raise the same one."""


class ConfigError(ValueError):
  """A config that cannot run. `str()` lists each bad field with how to fix it."""

  def __init__(self, problems: list[str]):
    self.problems = problems
    super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))
