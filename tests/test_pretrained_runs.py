"""Runs that start from a pretrained checkpoint (model.init_from)."""

import json

import jax
import numpy as np
import pytest

from conftest import load_config
from lowcomm_jax.runtimes.spmd import train
from lowcomm_jax.config.check import ConfigError, validate_here
from lowcomm_jax.model import get_preset

gguf = pytest.importorskip("gguf")
from tests.model.test_pretrained import _llama_to_hf, _random_model, _write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  cfg = get_preset("tiny_llama", vocab_size=256)
  _, params = _random_model(cfg)
  path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
  _write_gguf(path, _llama_to_hf(params, cfg), cfg)
  return path, params


def test_a_run_starts_from_the_checkpoints_weights_and_trains(tiny_gguf, tmp_path):
  path, params = tiny_gguf
  config = load_config("smoke", **{"model.init_from": str(path), "algorithm": "diloco"})
  r = train.build(config)
  with r.partitioner():
    state, _ = train.init_run(r, train.jitted_steps(r))
  assert r.model.cfg.mlp == "swiglu" and r.model.cfg.kv_heads == 2
  np.testing.assert_array_equal(np.asarray(state.params),
                                np.asarray(r.model.layout.ravel(params)))
  with jax.set_mesh(r.topology.mesh):
    start_loss = float(jax.jit(r.programs.eval)(state.params, r.data.eval_windows)[0])
  summary = train.run(config, tmp_path / "run")
  assert summary["model"] == f"gguf:{path}"
  assert summary["params"] == sum(x.size for x in jax.tree.leaves(params))
  assert summary["eval_loss"] < start_loss - 0.1, (summary["eval_loss"], start_loss)
  recorded = json.loads((tmp_path / "run" / "config.json").read_text())["config"]
  assert recorded["model"]["init_from"] == str(path)


@pytest.mark.parametrize("overrides, message", [
    ({"model.init_from": "/nonexistent/model.gguf"}, "model.init_from='/nonexistent/model.gguf'"),
    ({"model.init_from": "GGUF", "model.vocab_size": 512}, "model.vocab_size=512"),
    ({"model.name": "tiny_llama", "model.tp.size": 2}, "model.tp.size=2: tensor parallelism"),
])
def test_bad_pretrained_configs_name_the_field(tiny_gguf, overrides, message):
  if overrides.get("model.init_from") == "GGUF":
    overrides = {**overrides, "model.init_from": str(tiny_gguf[0])}
  with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
    validate_here(load_config("smoke", **overrides))


def test_lora_adapters_resume_only_on_the_base_they_were_trained_on(tiny_gguf, tmp_path):
  from lowcomm_jax.run.identity import ResumeRefused
  path, params = tiny_gguf
  base = tmp_path / "base.gguf"
  base.write_bytes(path.read_bytes())
  config = load_config("smoke", **{"model.init_from": str(base), "algorithm": "diloco",
                                   "lora.rank": 2, "rounds": 2, "checkpoint_every": 1})
  train.run(config, tmp_path / "run", stop_after_rounds=1)
  recorded = json.loads((tmp_path / "run" / "config.json").read_text())["base"]
  import hashlib
  assert recorded == {"file": str(base), "sha256": hashlib.sha256(base.read_bytes()).hexdigest()}
  # Another file at the same path: the adapters would land on other weights.
  cfg = get_preset("tiny_llama", vocab_size=256)
  _, other = _random_model(cfg, seed=1)
  _write_gguf(base, _llama_to_hf(other, cfg), cfg)
  with pytest.raises(ResumeRefused, match="belong to another base model"):
    train.run(config, tmp_path / "run")
  base.write_bytes(path.read_bytes())  # the original back: the run resumes and finishes
  assert train.run(config, tmp_path / "run")["base"] == recorded

  # A random base is drawn from the seed: resume_allow=seed would swap it under the adapters.
  seeded = load_config("smoke", **{"algorithm": "diloco", "lora.rank": 2, "rounds": 2,
                                   "checkpoint_every": 1})
  train.run(seeded, tmp_path / "seeded", stop_after_rounds=1)
  seeded.seed, seeded.resume_allow = 7, "seed"
  with pytest.raises(ResumeRefused, match="belong to another base model"):
    train.run(seeded, tmp_path / "seeded")
