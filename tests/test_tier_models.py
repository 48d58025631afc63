"""MatFormer tiers as models of their own: every width evaluated during training, any width
exported as a standalone Hugging Face model that the importer loads back (issue 32)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import checkpointed_state, load_config
from lowcomm_jax import export
from lowcomm_jax.config import check
from lowcomm_jax.runtimes.spmd import train
from lowcomm_jax.config.check import ConfigError
from lowcomm_jax.assemble.hosts import host
from lowcomm_jax.model import GPT, next_token_loss, pretrained
from lowcomm_jax.model.matformer import hidden_units, slice_tier


def _tiers_config(**overrides):
  hosts = [host(1.0), host(0.25)]
  return load_config("smoke", **{"hosts": hosts, "num_workers": len(hosts), "rounds": 2,
                                 "inner_steps": 2, "eval_every": 1, "checkpoint_every": 2,
                                 **overrides})


@pytest.fixture(scope="module")
def tier_run(tmp_path_factory):
  """(config, summary, workdir) of a full-width host and a 0.25 host, with the Mix'n'Match
  width 0.5 evaluated too."""
  config = _tiers_config(**{"eval.widths": (0.5,)})
  workdir = tmp_path_factory.mktemp("tiers") / "run"
  return config, train.run(config, workdir), workdir


def _hand_eval(r, params, width: float) -> float:
  """The eval loss at `width` from a model built at that width around the sliced weights."""
  m = hidden_units(r.model.cfg.d_ff, width)
  cfg = dataclasses.replace(r.model.cfg, d_ff=m)
  graphdef = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))[0]
  model = nnx.merge(graphdef, slice_tier(params, m))
  return float(np.mean([next_token_loss(model, jnp.asarray(w)) for w in r.data.eval_windows]))


def test_every_width_is_evaluated_and_reported(tier_run):
  config, summary, workdir = tier_run
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  evaluated = [row for row in rows if "eval_loss" in row]
  assert len(evaluated) == config.rounds
  for row in evaluated:  # the trained tiers and the Mix'n'Match width, full width first
    assert [k for k in row if k.startswith("eval_loss/")] == [
        "eval_loss/tier_1", "eval_loss/tier_0.5", "eval_loss/tier_0.25"]
    assert row["eval_loss/tier_1"] == row["eval_loss"]
  assert summary["eval_loss_by_width"] == {
      "1": summary["eval_loss"], "0.5": evaluated[-1]["eval_loss/tier_0.5"],
      "0.25": evaluated[-1]["eval_loss/tier_0.25"]}
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  events = EventAccumulator(str(workdir / "tensorboard")).Reload()
  logged = [e.value for e in events.Scalars("eval_loss/tier_0.25")]
  np.testing.assert_allclose(logged, [row["eval_loss/tier_0.25"] for row in evaluated],
                             rtol=1e-6)


def test_the_eval_at_a_width_equals_a_hand_sliced_forward_pass(tier_run):
  config, summary, workdir = tier_run
  r = train.build(config)
  (state, _), _ = checkpointed_state(config, workdir)
  params = r.model.layout.unravel(state.params)
  for width, loss in summary["eval_loss_by_width"].items():
    assert loss == pytest.approx(_hand_eval(r, params, float(width)), rel=1e-6), width


def test_one_host_evaluates_width_one_as_the_plain_eval(tmp_path):
  """A run with one full-width host and a width to evaluate: its width-1.0 row is the
  evaluation a run without widths makes of the same model."""
  config = load_config("smoke", rounds=2, eval_every=1, **{"eval.widths": (0.5,)})
  summary = train.run(config, tmp_path / "run")
  assert set(summary["eval_loss_by_width"]) == {"1", "0.5"}
  assert summary["eval_loss_by_width"]["1"] == summary["eval_loss"]
  plain = train.build(load_config("smoke", rounds=2, eval_every=1))
  (state, _), _ = checkpointed_state(config, tmp_path / "run")
  with jax.set_mesh(plain.topology.mesh):
    losses = jax.jit(plain.programs.eval)(state.params, plain.data.eval_windows)
  assert losses.shape == (1,)  # a run without narrower widths evaluates the full one alone
  assert float(losses[0]) == pytest.approx(summary["eval_loss"], rel=1e-6)


@pytest.mark.parametrize("width", [0.5, 0.25, 1.0])
def test_an_exported_width_round_trips_through_the_importer(tier_run, tmp_path, width):
  """The exported model, loaded back by the importer, gives the logits of the full model
  run at that width (GPT.__call__'s ffn_fraction slices the same units)."""
  config, summary, workdir = tier_run
  written = export.export_width(workdir, width, tmp_path / "out")
  back = pretrained.load(written)
  r = train.build(config)
  m = hidden_units(r.model.cfg.d_ff, width)
  assert back.cfg.d_ff == m
  assert json.loads((tmp_path / "out" / "config.json").read_text())["n_inner"] == m
  (state, _), _ = checkpointed_state(config, workdir)
  full = nnx.merge(r.model.graphdef, r.model.layout.unravel(state.params))
  exported = nnx.merge(nnx.split(nnx.eval_shape(lambda: GPT(back.cfg, rngs=nnx.Rngs(0))))[0],
                       jax.tree.map(jnp.asarray, back.params))
  tokens = jnp.asarray(r.data.eval_windows[0][:, :-1])
  np.testing.assert_allclose(np.asarray(exported(tokens)),
                             np.asarray(full(tokens, ffn_fraction=width)), rtol=1e-5, atol=1e-5)
  # The run's own evaluation at that width is the exported model's loss.
  loss = np.mean([next_token_loss(exported, jnp.asarray(w)) for w in r.data.eval_windows])
  assert float(loss) == pytest.approx(summary["eval_loss_by_width"][f"{width:g}"], rel=1e-5)


def test_an_exported_width_loads_in_transformers(tier_run, tmp_path):
  """Where `transformers` is installed: its GPT2LMHeadModel reads the export and gives the
  same logits."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  config, _, workdir = tier_run
  export.export_width(workdir, 0.25, tmp_path / "out")
  back = pretrained.load(tmp_path / "out" / "model.safetensors")
  theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
  tokens = np.asarray(train.build(config).data.eval_windows[0][:, :-1])
  ours = nnx.merge(nnx.split(nnx.eval_shape(lambda: GPT(back.cfg, rngs=nnx.Rngs(0))))[0],
                   jax.tree.map(jnp.asarray, back.params))(jnp.asarray(tokens))
  with torch.no_grad():
    logits = theirs(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(logits, np.asarray(ours), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("widths, expected", [
    ((0.3,), "eval.widths: 0.3 of 128 FFN units is 38.4, not a whole number"),
    ((1.5,), "eval.widths: 1.5 is not an FFN fraction"),
    ((0.0,), "eval.widths: 0.0 is not an FFN fraction"),
])
def test_a_width_off_the_ffn_grain_is_refused_naming_the_field(widths, expected):
  with pytest.raises(ConfigError) as e:
    check.validate(load_config("smoke", **{"eval.widths": widths}), num_devices=8)
  assert any(p.startswith(expected) for p in e.value.problems), e.value.problems
  assert all("\n" not in p for p in e.value.problems)


def test_export_refuses_a_width_off_the_grain_and_a_folder_without_a_run(tier_run, tmp_path):
  _, _, workdir = tier_run
  with pytest.raises(export.ExportError, match=r"^--width: 0.3 of 128 FFN units"):
    export.export_width(workdir, 0.3, tmp_path / "out")
  with pytest.raises(export.ExportError, match="no readable run config"):
    export.export_width(tmp_path / "nothing", 0.5, tmp_path / "out")
  assert not (tmp_path / "out").exists()  # nothing written before the checks


def test_generation_reads_any_width_of_a_run_or_its_export(tier_run, tmp_path):
  """bench/smollm2_generate.py's loader: a run's checkpoint at a width, and the export of
  that width, are the same model (and the export names the run's tokenizer)."""
  import argparse
  from conftest import bench_module
  generate_bench = bench_module("smollm2_generate")
  config, _, workdir = tier_run
  export.export_width(workdir, 0.25, tmp_path / "out")
  ask = dict(model=None, workdir=None, width=0.25, tokenizer=None)
  load = lambda **kw: generate_bench.load_model(argparse.Namespace(**{**ask, **kw}))  # noqa: E731
  cfg, params, tokenizer, _ = load(workdir=workdir)
  cfg2, params2, tokenizer2, _ = load(model=tmp_path / "out", width=1.0)
  assert cfg.d_ff == cfg2.d_ff == hidden_units(128, 0.25)
  assert tokenizer == tokenizer2 == config.data.tokenizer
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_llama_width_exports_in_llamas_layout(tmp_path):
  """The Llama family (RMSNorm, SwiGLU, grouped KV heads, rotary): the export of a width
  has `intermediate_size` = m and the logits of the full model run at that width."""
  config = _tiers_config(rounds=1, checkpoint_every=1, **{"model.name": "tiny_llama"})
  train.run(config, tmp_path / "run")
  written = export.export_width(tmp_path / "run", 0.25, tmp_path / "out")
  hf = json.loads((tmp_path / "out" / "config.json").read_text())
  r = train.build(config)
  m = hidden_units(r.model.cfg.d_ff, 0.25)
  assert (hf["model_type"], hf["intermediate_size"]) == ("llama", m)
  back = pretrained.load(written)
  (state, _), _ = checkpointed_state(config, tmp_path / "run")
  full = nnx.merge(r.model.graphdef, r.model.layout.unravel(state.params))
  exported = nnx.merge(nnx.split(nnx.eval_shape(lambda: GPT(back.cfg, rngs=nnx.Rngs(0))))[0],
                       jax.tree.map(jnp.asarray, back.params))
  tokens = jnp.asarray(r.data.eval_windows[0][:, :-1])
  np.testing.assert_allclose(np.asarray(exported(tokens)),
                             np.asarray(full(tokens, ffn_fraction=0.25)), rtol=1e-5, atol=1e-5)


def test_widths_to_evaluate_may_change_when_a_run_resumes(tmp_path):
  """eval.widths changes no trained parameter: a resume may add widths (and reports them)."""
  train.run(load_config("smoke", rounds=2), tmp_path / "run")
  summary = train.run(load_config("smoke", rounds=3, **{"eval.widths": (0.5,)}),
                      tmp_path / "run")
  assert set(summary["eval_loss_by_width"]) == {"1", "0.5"}


def test_export_reads_a_run_written_before_eval_widths_existed(tier_run, tmp_path):
  """Fields a run's config.json lacks (added since) take their defaults."""
  import shutil
  _, _, workdir = tier_run
  old = tmp_path / "old_run"
  shutil.copytree(workdir, old)
  stored = json.loads((old / "config.json").read_text())
  del stored["config"]["eval"]
  (old / "config.json").write_text(json.dumps(stored))
  assert export.config_of(old).eval.widths == ()
  back = pretrained.load(export.export_width(old, 0.25, tmp_path / "out"))
  assert back.cfg.d_ff == hidden_units(128, 0.25)


@pytest.mark.parametrize("stored", [{"runtime": "simulator"},
                                    {"sim": {"enabled": True}}])  # written before `runtime`
def test_export_refuses_a_simulator_run(tmp_path, stored):
  # (a Ray run's checkpoint is read: tests/test_ray_runtime.py exports one)
  (tmp_path / "config.json").write_text(json.dumps({"config": stored}))
  with pytest.raises(export.ExportError, match="a simulator run"):
    export.config_of(tmp_path)


def test_a_hosts_tier_exports_even_off_the_ffn_grain():
  """A host's tier trains round(tier × d_ff) units: that width is a model of the run."""
  config = load_config("smoke", hosts=[host(1.0), host(0.3)], num_workers=2)
  export.check_width(config, 0.3)  # 38.4 of 128 units: the host trains 38
  with pytest.raises(export.ExportError, match="not a whole number"):
    export.check_width(config, 0.35)


def test_a_lora_runs_narrow_width_exports_with_its_adapters_merged(tmp_path):
  """LoRA: the export of a 0.25 width is the base with the adapters merged, then sliced; its
  loss is the run's own evaluation at that width (which runs the adapters unmerged)."""
  config = _tiers_config(rounds=1, checkpoint_every=1,
                         **{"lora.rank": 4, "optimizer.lr": 1e-2, "eval.widths": ()})
  summary = train.run(config, tmp_path / "run")
  back = pretrained.load(export.export_width(tmp_path / "run", 0.25, tmp_path / "out"))
  r = train.build(config)
  m = hidden_units(r.model.cfg.d_ff, 0.25)
  exported = nnx.merge(nnx.split(nnx.eval_shape(lambda: GPT(back.cfg, rngs=nnx.Rngs(0))))[0],
                       jax.tree.map(jnp.asarray, back.params))
  loss = np.mean([next_token_loss(exported, jnp.asarray(w)) for w in r.data.eval_windows])
  assert float(loss) == pytest.approx(summary["eval_loss_by_width"]["0.25"], rel=1e-5)
  # The adapters moved the weights: the export is not the sliced base.
  base = slice_tier(jax.tree.map(lambda x: np.asarray(x, np.float32), r.frozen), m)
  changed = [not np.array_equal(np.asarray(a), b)
             for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(base), strict=True)]
  assert any(changed) and not all(changed)  # adapted kernels moved; embeddings, norms did not
