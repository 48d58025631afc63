"""bench/ uses the package as a user would (issue 50): each script runs as `python bench/x.py`
(bench/ first on sys.path, the package installed), reads finished runs through
lowcomm_jax.report, and reaches no private name of the package. Read from the scripts'
syntax trees: nothing here imports a bench or runs one."""

import ast

import pytest

from conftest import REPO

SCRIPTS = sorted((REPO / "bench").glob("*.py"))
RUN_FILES = ("summary.json", "metrics.jsonl")
# Scripts that may name a run's files, and why: not a second reader of a finished run.
NAMES_RUN_FILES = {
    "frontier.py": "writes a diverged run's summary.json (the grid's infinite-loss point)",
    "ray_goodput.py": "tails metrics.jsonl while the run writes it (report reads finished runs)",
}
# Private names still reached, and why they are not made public here.
REACHES_PRIVATE: dict[str, str] = {}


def _tree(script) -> ast.Module:
  return ast.parse(script.read_text(), str(script))


def _parents(tree: ast.Module) -> dict:
  return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _is_sys_path(node) -> bool:
  return (isinstance(node, ast.Attribute) and node.attr == "path"
          and isinstance(node.value, ast.Name) and node.value.id == "sys")


def test_there_are_bench_scripts():
  assert len(SCRIPTS) > 20


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_no_bench_script_edits_sys_path(script):
  """`python bench/x.py` puts bench/ first on sys.path (its siblings: `import stats`), and
  the package is installed: no script adds the repository, tests/ or launch/."""
  edits = [node.lineno for node in ast.walk(_tree(script))
           if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
               and _is_sys_path(node.func.value))
           or (isinstance(node, (ast.Assign, ast.AugAssign))
               and any(_is_sys_path(t) or (isinstance(t, ast.Subscript) and _is_sys_path(t.value))
                       for t in getattr(node, "targets", [getattr(node, "target", None)])))]
  assert not edits, f"{script.name} edits sys.path on lines {edits}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_bench_scripts_read_runs_through_the_report(script):
  """A path `<workdir> / "summary.json"` (or metrics.jsonl) in a script is a reader of its
  own: report.read_summary, read_metrics and has_summary are the one reader."""
  if script.name in NAMES_RUN_FILES:
    pytest.skip(NAMES_RUN_FILES[script.name])
  tree = _tree(script)
  parents = _parents(tree)
  paths = [node.lineno for node in ast.walk(tree)
           if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
           and isinstance(node.right, ast.Constant) and node.right.value in RUN_FILES
           and not (isinstance(parents.get(node), ast.Attribute)
                    and parents[node].attr == "write_text")]
  assert not paths, f"{script.name} reads a run's files by path on lines {paths}"


def _private_names(tree: ast.Module) -> list[str]:
  """`from lowcomm_jax... import _x`, and `m._x` where m is a name imported from the
  package (a module or an object of it), anywhere in the script."""
  bound, found = set(), []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lowcomm_jax"):
      for alias in node.names:
        bound.add(alias.asname or alias.name)
        if alias.name.startswith("_"):
          found.append(f"{node.module}.{alias.name}")
    elif isinstance(node, ast.Import):
      bound.update(a.asname or a.name.split(".")[0] for a in node.names
                   if a.name.startswith("lowcomm_jax"))
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
        and not node.attr.startswith("__")):
      root = node.value
      while isinstance(root, ast.Attribute):
        root = root.value
      if isinstance(root, ast.Name) and root.id in bound:
        found.append(f"{ast.unparse(node)} (line {node.lineno})")
  return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_bench_scripts_reach_no_private_name(script):
  """What a bench needs of the package is public (runtimes/spmd/driver.all_hosts)."""
  found = _private_names(_tree(script))
  if script.name in REACHES_PRIVATE:
    assert found, f"{script.name} reaches no private name now: drop it from REACHES_PRIVATE"
    pytest.skip(REACHES_PRIVATE[script.name])
  assert not found, f"{script.name} reaches private names: {found}"


def test_the_private_name_check_finds_what_it_looks_for():
  tree = ast.parse("from lowcomm_jax.runtimes.spmd import driver\n"
                   "from lowcomm_jax.x import _y\nimport lowcomm_jax.report\n"
                   "driver._all_hosts(1)\nlowcomm_jax.report._cell(2)\nstate._replace()\n")
  assert sorted(_private_names(tree)) == ["driver._all_hosts (line 4)",
                                          "lowcomm_jax.report._cell (line 5)",
                                          "lowcomm_jax.x._y"]
