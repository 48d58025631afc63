from conftest import load_config
from lowcomm_jax.config import doc
from lowcomm_jax.assemble.hosts import host


def _lines(text: str) -> dict[str, str]:
  """{'outer.lr': 'outer.lr = 0.7   # ...'} for each field's first line."""
  return {line.split(" = ")[0]: line for line in text.splitlines() if " = " in line
          and not line.startswith(" ")}


def test_every_base_field_has_a_comment():
  docs, _ = doc.field_docs()
  names = [name for name, _ in doc.leaves(load_config('base'))]
  assert len(names) > 50
  assert [n for n in names if not docs.get(n)] == []
  lines = _lines(doc.describe(load_config('base')))
  assert sorted(lines) == sorted(names)
  assert all("  # " in line for line in lines.values())


def test_values_reflect_overrides_and_nested_fields_get_their_comments():
  c = load_config('base')
  c.outer.lr = 0.5
  c.sim.network.inter_gbps = 2.5
  c.model.tp.size = 2
  c.extra_field = 3  # a field some config adds: no comment in base.py
  lines = _lines(doc.describe(c))
  assert lines["outer.lr"].startswith("outer.lr = 0.5 ")
  assert lines["outer.lr"].endswith("# DiLoCo's outer learning rate")
  assert lines["sim.network.inter_gbps"].startswith("sim.network.inter_gbps = 2.5 ")
  assert lines["sim.network.inter_gbps"].endswith("# bandwidth between any two regions")
  assert lines["model.tp.size"].startswith("model.tp.size = 2 ")
  assert "devices on 'model'" in lines["model.tp.size"]
  assert lines["extra_field"] == "extra_field = 3"
  # Continuation lines ('# | ...') join the field's comment; base.py's order is kept.
  assert "| 0.5): every evaluation reports eval_loss/tier_<w>" in lines["eval.widths"]
  assert "REGISTRY" in lines["algorithm"]
  assert list(lines)[:2] == ["algorithm", "num_workers"]


def test_host_table_rows_print_one_per_line():
  c = load_config('base')
  c.hosts = [host(tier=1.0), host(tier=0.25, workers=2, speed=1.5)]
  lines = doc.describe(c).splitlines()
  at = next(i for i, line in enumerate(lines) if line.startswith("hosts = ["))
  assert "  # e.g. [host(tier=1.0)" in lines[at]
  assert lines[at + 1:at + 4] == ["    host(tier=1.0, workers=1),",
                                  "    host(tier=0.25, workers=2, speed=1.5),", "]"]


def test_without_base_py_fields_print_without_comments(tmp_path):
  text = doc.describe(load_config('base'), base=tmp_path / "missing.py")
  assert "outer.lr = 0.7\n" in text
  assert "# DiLoCo's outer learning rate" not in text
  # an algorithm's own section still has its comments: they are read from its module
  assert "pier.warmup = 0.1" in text and "# fraction of the rounds" in text


def test_an_algorithms_section_is_documented_where_it_is_declared():
  """Pier's fields and their comments come from algorithms/pier.py alone."""
  import inspect
  from lowcomm_jax.algorithms import pier
  docs, order = doc.field_docs()
  source = inspect.getsource(pier.Pier.config_defaults)
  for field in ("warmup", "decay_momenta", "final_lr_ratio", "final", "total_rounds"):
    assert docs[f"pier.{field}"] and docs[f"pier.{field}"] in source, field
  assert "pier" not in doc.BASE.read_text().replace("pier.py", "")  # nothing of it there
  assert order["outer.halos"] > order["outer.dn_c"] and docs["outer.halos.sync_every"]
