import pytest

from conftest import REPO, load_config
from lowcomm_jax.config import check, doc

CONFIGS = sorted(p.stem for p in (REPO / "configs").glob("*.py"))


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_is_valid_on_the_fewest_devices_it_needs(name):
  config = load_config(name)
  check.validate(config, num_devices=config.model.tp.size)  # 1 unless it shards


def test_ddp_and_main_job_train_on_equal_tokens():
  diloco, ddp = load_config("diloco_hetero"), load_config("ddp")
  tokens = lambda c: c.num_workers * c.rounds * c.inner_steps * c.data.batch_size * c.data.seq_len
  assert tokens(diloco) == tokens(ddp)
  assert ddp.inner_steps == 1 and diloco.inner_steps > 1


def test_main_job_is_one_full_width_host_and_three_quarter_width_hosts():
  c = load_config("diloco_hetero")
  assert [h.tier for h in c.hosts] == [1.0, 0.25, 0.25, 0.25]
  assert [h.workers for h in c.hosts] == [1, 1, 1, 1]
  assert load_config("LSSS_same").data.batch_mode == "same"
  assert load_config("LSSS_diff").data.batch_mode == "different"
  assert [h.tier for h in load_config("L_only").hosts] == [1.0]


def test_base_config_documents_every_field():
  """Each field is declared once, with its comment: in the schema the package ships
  (configs/base.py hands it on), or in its algorithm's own section."""
  import inspect
  from lowcomm_jax.config import defaults
  sources = {"": doc.BASE.read_text()}
  sources.update({f"{dotted}.": inspect.getsource(declare)
                  for dotted, declare in defaults.declared_sections()})
  assert {"pier.", "outer.halos.", "streaming."} <= set(sources)
  for field, _ in doc.leaves(load_config("base")):
    owner = max((p for p in sources if field.startswith(p)), key=len)
    variable = "s" if owner else "c"
    lines = [l for l in sources[owner].splitlines()
             if l.strip().startswith(f"{variable}.{field[len(owner):]} = ")]
    assert len(lines) == 1 and "#" in lines[0], f"{field}: declared {len(lines)} times"
