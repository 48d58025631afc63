"""The resolved config, one line per field, with the comment the defaults give it.

  outer.lr = 0.7  # DiLoCo's outer learning rate

Comments come from where each field is declared: config/defaults.py for the run's own
sections, the owner's `config_defaults` for a section declared beside it (codecs,
aggregation, the runtimes', each algorithm's; all inside the package). A field's
comment is the trailing comment on the line that assigns it (`c.<field> = ...`, or `s.<field> =
...` in a section's declaration), plus comment-only lines right below it that start with `# |`
(the continuation convention there). Fields a specific config adds print without a comment.
"""

import ast
import inspect
import io
import pathlib
import textwrap
import tokenize

import ml_collections

BASE = pathlib.Path(__file__).resolve().with_name("defaults.py")
COMMENT_COLUMN = 44  # comments line up here unless the assignment is longer


def field_docs(path: pathlib.Path = BASE) -> tuple[dict[str, str], dict[str, float]]:
  """({dotted field: comment}, {dotted field or group: order in --print_config}) of the
  defaults in `path` and of every section declared beside its owner (after them, in
  `defaults.declared_sections`' order); a source that cannot be read gives none."""
  try:
    docs, order = _docs_in(pathlib.Path(path).read_text())
  except OSError:
    docs, order = {}, {}
  from lowcomm_jax.config import defaults
  start = max(order.values(), default=0) + 1
  for i, (dotted, declare) in enumerate(defaults.declared_sections()):
    try:
      source = textwrap.dedent(inspect.getsource(declare))
    except (OSError, TypeError):
      continue
    mine, mine_order = _docs_in(source, prefix=f"{dotted}.")
    docs.update(mine)
    order[dotted] = start + i
    order.update({k: start + i + v / 1e6 for k, v in mine_order.items()})
  return docs, order


def _docs_in(source: str, prefix: str = "") -> tuple[dict[str, str], dict[str, int]]:
  """(docs, order) of the assignments in `source`, each field named `prefix` + its path."""
  try:
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    tree = ast.parse(source)
  except (SyntaxError, tokenize.TokenError):
    return {}, {}  # comments are a help: never let them stop --print_config
  # line -> (comment text, whether the comment is alone on its line)
  comments = {}
  for tok in tokens:
    if tok.type == tokenize.COMMENT:
      alone = not tok.line[:tok.start[1]].strip()
      comments[tok.start[0]] = (tok.string.lstrip("#").strip(), alone)
  docs, order = {}, {}
  for node in ast.walk(tree):
    if not isinstance(node, ast.Assign):
      continue
    for target in node.targets:
      name = _dotted(target)
      if name is None:
        continue
      name = prefix + name
      order.setdefault(name, node.lineno)
      text, alone = comments.get(node.end_lineno, ("", True))
      parts = [text] if text and not alone else []
      line = node.end_lineno + 1
      while comments.get(line, ("", False))[1] and comments[line][0].startswith("|"):
        parts.append(comments[line][0])
        line += 1
      if parts:
        docs[name] = " ".join(parts)
  return docs, order


def _dotted(target: ast.expr) -> str | None:
  """'outer.lr' for `c.outer.lr`; None for anything that is not an attribute chain on a
  name (the config variable)."""
  names = []
  while isinstance(target, ast.Attribute):
    names.append(target.attr)
    target = target.value
  if not names or not isinstance(target, ast.Name):
    return None
  return ".".join(reversed(names))


def leaves(config: ml_collections.ConfigDict, order: dict[str, int] | None = None,
           prefix: str = ""):
  """(dotted name, value) for every non-ConfigDict field, in the defaults' order where known
  (then alphabetically)."""
  order = order or {}
  keys = sorted(config.keys(), key=lambda k: (order.get(prefix + k, float("inf")), k))
  for key in keys:
    value = config[key]
    if isinstance(value, ml_collections.ConfigDict):
      yield from leaves(value, order, f"{prefix}{key}.")
    else:
      yield prefix + key, value


def format_value(value) -> str:
  if isinstance(value, (list, tuple)) and value and all(
      isinstance(v, (dict, ml_collections.ConfigDict)) for v in value):
    rows = ",\n".join(f"    {host_row(v)}" for v in value)
    return f"[\n{rows},\n]"
  return repr(value)


def host_row(row) -> str:
  """A host-table row as the call that makes it, `host(tier=0.25, workers=2)`: tier and
  workers always, the other fields only when set (0 means 'inherit', host()'s default)."""
  row = dict(row.items())
  first = [k for k in ("tier", "workers") if k in row]
  rest = [k for k in row if k not in first and row[k] not in (0, 0.0, "", None)]
  return "host(" + ", ".join(f"{k}={row[k]!r}" for k in first + rest) + ")"


def describe(config: ml_collections.ConfigDict, base: pathlib.Path = BASE) -> str:
  """`name = value  # comment` for every field of `config` (what --print_config shows)."""
  docs, order = field_docs(base)
  lines = []
  for name, value in leaves(config, order):
    text = f"{name} = {format_value(value)}"
    doc = docs.get(name)
    if doc:
      first, *rest = text.split("\n")  # a host table: the comment goes on its first line
      text = "\n".join([f"{first.ljust(COMMENT_COLUMN - 2)}  # {doc}", *rest])
    lines.append(text)
  return "\n".join(lines)
