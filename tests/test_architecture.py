"""The package's layout, read from its imports (ARCHITECTURE.md, "Layers").

Every import of a lowcomm_jax module, at the top of a file or inside a function, is an
arrow. An arrow may point to the same layer's module or down, never up; the three runtimes
import nothing from each other, and neither do the parts (model/, outer/, compress/,
aggregate/, data/, sim/). The commands are the only modules at the top of the package.
"""

import ast
import pathlib

import lowcomm_jax

PACKAGE = pathlib.Path(lowcomm_jax.__file__).parent

# Top to bottom. A module belongs to the entry with the longest matching prefix.
LAYERS = [
    ("commands", ("main", "export", "report")),
    ("config", ("config",)),  # reading and checking a config: asks every layer below
    ("runtimes", ("runtimes",)),
    ("assemble", ("assemble",)),
    ("run", ("run",)),
    ("algorithms", ("algorithms",)),
    ("programs", ("programs",)),
    ("parts", ("model", "outer", "compress", "aggregate", "data", "sim")),
    ("parallel", ("parallel",)),
    ("foundation", ("errors",)),  # below everything: any layer raises
]
# Siblings that must not import each other: each is a prefix inside one layer.
SEALED = {"runtimes": ("runtimes.spmd", "runtimes.simulator", "runtimes.ray"),
          "parts": ("model", "outer", "compress", "aggregate", "data", "sim")}


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in PACKAGE.rglob("*.py"):
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
  """The package modules `name` imports (a name imported from a package counts as the
  submodule when there is one)."""
  package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(["lowcomm_jax", *package[:len(package) - node.level + 1], base]).strip(".")
      targets = [f"{base}.{a.name}" for a in node.names] + [base]
    else:
      continue
    for target in targets:
      if not target.startswith("lowcomm_jax."):
        continue
      target = target[len("lowcomm_jax."):]
      while target and target not in MODULES:
        target = target.rpartition(".")[0]
      if target and target != name:
        found.add(target)
  return found


def _prefixed(name: str, prefixes) -> str | None:
  hits = [p for p in prefixes if name == p or name.startswith(p + ".")]
  return max(hits, key=len) if hits else None


def _layer(name: str) -> int:
  best = max(((len(p), i) for i, (_, prefixes) in enumerate(LAYERS)
              for p in [_prefixed(name, prefixes)] if p), default=None)
  assert best is not None, f"{name}: in no layer; add it to LAYERS (and ARCHITECTURE.md)"
  return best[1]


def _arrows() -> list[tuple[str, str]]:
  return sorted((a, b) for a, path in MODULES.items() if a for b in _imports(a, path))


def test_every_module_has_a_layer():
  for name in MODULES:
    if name and name not in ("config", "runtimes"):  # packages whose modules sit elsewhere
      _layer(name)


def test_no_arrow_points_up():
  up = [f"{a} ({LAYERS[_layer(a)][0]}) -> {b} ({LAYERS[_layer(b)][0]})"
        for a, b in _arrows() if b not in ("config", "runtimes") and _layer(b) < _layer(a)]
  assert not up, "imports that climb a layer:\n" + "\n".join(up)


def test_runtimes_and_parts_import_nothing_from_their_siblings():
  crossing = []
  for a, b in _arrows():
    for siblings in SEALED.values():
      mine, theirs = _prefixed(a, siblings), _prefixed(b, siblings)
      if mine and theirs and mine != theirs:
        crossing.append(f"{a} -> {b}")
  assert not crossing, "imports between sealed siblings:\n" + "\n".join(crossing)


def test_the_top_of_the_package_holds_the_commands_and_the_foundation_alone():
  top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
  assert top == ["errors", "export", "main", "report"]


def test_the_folders_import_each_other_without_a_circle():
  """Folder by folder (config/, runtimes/, parallel/, ..., errors.py): no circle, so each
  folder is one layer (issue 62: config/error.py, imported from five folders below config/,
  made config/ two layers at once)."""
  folder = lambda name: name.split(".")[0]
  graph = {}
  for a, b in _arrows():
    if folder(a) != folder(b):
      graph.setdefault(folder(a), set()).add(folder(b))
  assert ("config", "parallel") in {(a, b) for a, bs in graph.items() for b in bs}  # seen
  done, path = set(), []

  def visit(node):
    if node in path:
      raise AssertionError("a circle of folders: " + " -> ".join(path[path.index(node):] + [node]))
    if node in done:
      return
    path.append(node)
    for nxt in sorted(graph.get(node, ())):
      visit(nxt)
    path.pop()
    done.add(node)

  for node in sorted(graph):
    visit(node)


def test_the_walk_sees_arrows_that_exist():
  # The test above would pass on a walk that finds nothing: pin arrows known to exist,
  # at the top of a file, inside a function, and through `from package import module`.
  arrows = set(_arrows())
  assert ("runtimes.spmd.train", "assemble.build") in arrows
  assert ("runtimes", "runtimes.spmd.train") in arrows  # a function-level import
  assert ("algorithms.ddp", "programs.optimizers") in arrows  # `from lowcomm_jax.programs import …`


def test_no_runtime_or_assembly_names_an_algorithm():
  """The runtimes and the assembly ask an algorithm's declarations (algorithms/base.py),
  never its name: no string in their code (docstrings aside) is an algorithm's name."""
  from lowcomm_jax import algorithms
  names = set(algorithms.REGISTRY)
  found = []
  for module, path in _modules().items():
    if not module.startswith(("runtimes", "assemble", "programs", "run.")):
      continue
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    found += [(module, node.value) for node in ast.walk(tree)
              if isinstance(node, ast.Constant) and node.value in names
              and id(node) not in docstrings]
  assert len(names) >= 9 and found == []
  assert sum(m.startswith("runtimes.ray") for m in _modules()) >= 10  # the walk sees them


def test_nothing_outside_the_algorithms_knows_one():
  """No module outside algorithms/ imports one algorithm's module (only the package's
  registry and base.py's declarations), and none reads an algorithm's own config section
  (`config_section`, HALoS's outer.halos): each algorithm declares its own
  (`config_defaults`), and config/defaults.py puts it in place without naming it."""
  from lowcomm_jax import algorithms
  own = {m for m in MODULES if m.startswith("algorithms.") and m != "algorithms.base"}
  assert "algorithms.halos" in own and len(own) >= 12
  importing = [f"{a} -> {b}" for a, b in _arrows() if b in own and not a.startswith("algorithms")]
  sections = {a.config_section.rpartition(".")[2] for a in algorithms.REGISTRY.values()
              if a.config_section}
  assert {"streaming", "pier", "desloc", "overlap", "halos"} <= sections
  reading = []
  for module, path in MODULES.items():
    if module.startswith("algorithms"):
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      # c.<section>.<field>: an attribute read through the section
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
          and node.value.attr in sections):
        reading.append(f"{module}:{node.lineno} .{node.value.attr}.{node.attr}")
  assert not importing and not reading, "\n".join(importing + reading)


def _comparisons(tree: ast.AST, names: set, field: str) -> list[int]:
  """Lines of `tree` that compare with one of `names`, or compare a `.field`."""

  def named(node) -> bool:
    if isinstance(node, ast.Constant):
      return node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
      return any(named(e) for e in node.elts)
    return isinstance(node, ast.Attribute) and node.attr == field

  return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
          and any(named(side) for side in [node.left, *node.comparators])]


def _runtime_comparisons(tree: ast.AST) -> list[int]:
  """Lines of `tree` that compare with a runtime's name, or compare a `.runtime` field."""
  from lowcomm_jax import runtimes
  return _comparisons(tree, set(runtimes.NAMES), "runtime")


def test_only_the_runtimes_compare_runtime_names():
  """One field picks the runtime, and runtimes.RUNTIMES is where its name is looked up:
  no module outside runtimes/ branches on `c.runtime == 'ray'` or the like."""
  found = [f"{name}:{line}" for name, path in MODULES.items()
           if name and not name.startswith("runtimes")
           for line in _runtime_comparisons(ast.parse(path.read_text()))]
  assert not found, "runtime names compared outside runtimes/: " + ", ".join(found)
  # The walk finds what it is for (so the test above cannot pass by finding nothing).
  for code in ('c.runtime == "ray"', 'x in ("spmd", "simulator")', 'c.sim.x or c.runtime != y'):
    assert _runtime_comparisons(ast.parse(code)), code
  assert not _runtime_comparisons(ast.parse('c.algorithm == "diloco"'))


def _form_comparisons(tree: ast.AST) -> list[int]:
  """Lines of `tree` that compare with a collective form's name (or the simulator's
  'ring'), or compare a `.collective_form` field ('auto' is ray.address's too)."""
  from lowcomm_jax.runtimes.ray import forms
  names = (set(forms.FORMS) | set(forms.config.ON_RAY) | {"ring"}) - {"auto"}
  return _comparisons(tree, names, "collective_form")


def test_only_the_forms_package_compares_a_collective_forms_name():
  """runtimes/ray/forms/ is where a round's collective form is picked (the registry,
  `for_round`, and which forms a config has: forms/config.py): no other module of the Ray
  runtime branches on `c.collective_form == 'server'`, a form's name, or the like."""
  found = [f"{name}:{line}" for name, path in MODULES.items()
           if name.startswith("runtimes.ray") and not name.startswith("runtimes.ray.forms")
           for line in _form_comparisons(ast.parse(path.read_text()))]
  assert not found, "form names compared outside runtimes/ray/forms/: " + ", ".join(found)
  # The walk finds what it is for (so the test above cannot pass by finding nothing).
  for code in ('c.collective_form == "auto"', 'how in ("auto", "hierarchical")',
               'x.name != "pairs"', 'form == "server"'):
    assert _form_comparisons(ast.parse(code)), code
  assert not _form_comparisons(ast.parse('c.algorithm == "diloco"'))
  # ... and before the forms were a package, it found the Ray runtime's branches
  assert _form_comparisons(ast.parse('if c.sim.network.collective == "server" or x: pass'))


def _ray_classes() -> dict[str, list[str]]:
  """Every class of the Ray runtime, by name: the names of its bases."""
  return {node.name: [ast.unparse(b) for b in node.bases]
          for name, path in MODULES.items() if name.startswith("runtimes.ray")
          for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}


def test_a_progress_policy_is_given_its_form_not_mixed_with_it():
  """The policies (quorum rounds, epochs, pushes) take their form (the server's, or the
  workers' replicas) as an argument: no class of the Ray runtime derives from a policy and
  a form at once, and none from two classes (a mixin)."""
  classes = _ray_classes()
  policies = {"QuorumRounds", "Epochs", "Pushes"}
  assert policies <= set(classes) and {"ServerForm", "Replicas", "PairReplicas"} <= set(classes)
  assert all(classes[p] == ["Progress"] for p in policies), {p: classes[p] for p in policies}
  mixed = {name: bases for name, bases in classes.items() if len(bases) > 1}
  assert not mixed, f"classes with more than one base in runtimes/ray: {mixed}"


def _mentions(tree: ast.AST, word: str) -> bool:
  """Whether code in `tree` (names, attributes, imports, strings but docstrings) names
  `word`."""
  docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef))
                and node.body and isinstance(node.body[0], ast.Expr)}
  for node in ast.walk(tree):
    texts = []
    if isinstance(node, ast.Name):
      texts = [node.id]
    elif isinstance(node, ast.Attribute):
      texts = [node.attr]
    elif isinstance(node, ast.alias):
      texts = [node.name, node.asname or ""]
    elif isinstance(node, ast.ImportFrom):
      texts = [node.module or ""]
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
      texts = [] if id(node) in docstrings else [node.value]
    if any(word in t.lower() for t in texts):
      return True
  return False


def test_pier_and_halos_are_their_own_files_and_a_registry_line():
  """Adding an algorithm like Pier is its files under algorithms/ (and outer/ for its outer
  rule) and its line in algorithms.REGISTRY: no other module's code names it (HALoS's
  merge rule is also listed in outer/'s index of rules)."""
  homes = {"pier": {"algorithms.pier", "outer.pier"},
           "halos": {"algorithms.halos", "outer.halos"}}
  elsewhere = {"pier": {"algorithms"}, "halos": {"algorithms", "outer"}}
  for word, own in homes.items():
    naming = {name for name, path in MODULES.items()
              if name not in own and _mentions(ast.parse(path.read_text()), word)}
    assert naming == elsewhere[word], (word, naming)


def test_every_function_is_under_80_lines():
  """A function a reader can hold at once (ARCHITECTURE.md's rule; issue 62 split the six
  that were longer, `get_config` at 302 lines the longest)."""
  long = sorted((node.end_lineno - node.lineno + 1, f"{name}.{node.name}")
                for name, path in MODULES.items() for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.end_lineno - node.lineno + 1 >= 80)
  assert not long, f"functions of 80 lines or more: {long}"


def test_every_module_is_under_400_lines():
  """A module with one job stays short enough to read whole (issue 70's rule)."""
  long = sorted((len(path.read_text().splitlines()), name) for name, path in MODULES.items()
                if len(path.read_text().splitlines()) >= 400)
  assert not long, f"modules of 400 lines or more: {long}"
