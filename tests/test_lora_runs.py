"""LoRA runs: only the adapters train, cross the network and fill the checkpoints; the
frozen base stays bit-exactly what it was; a run starts at the base model exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import checkpointed_state, load_config
from lowcomm_jax import train
from lowcomm_jax.config_check import ConfigError
from lowcomm_jax.export import export_merged
from lowcomm_jax.model import lora, pretrained


def _config(**overrides):
  return load_config("smoke", **{"lora.rank": 2, "lora.alpha": 4.0, "algorithm": "diloco",
                                 **overrides})


def test_only_adapters_train_cross_the_network_and_fill_checkpoints(tmp_path):
  config = _config(**{"lora.targets": ("attn", "mlp")})
  r = train.build(config)
  # tiny: d 32, q|k|v 96, FFN 128, 2 blocks; rank 2 on qkv, proj, fc and the MLP's proj.
  assert r.model.param_count == lora.count(r.model.layout.abstract) == 2 * (
      2 * (32 + 96) + 2 * (32 + 32) + 2 * (32 + 128) + 2 * (128 + 32))
  frozen_before = jax.tree.map(np.asarray, r.frozen)
  with r.partitioner():
    fns = train.jitted_steps(r)
    state, _ = train.init_run(r, fns)
    start_loss = float(fns.eval(state.params, r.data.eval_windows))
    # B = 0: the first model is the base itself.
    plain = train.build(load_config("smoke", algorithm="diloco"))
    plain_state, _ = train.init_run(plain, train.jitted_steps(plain))
    plain_loss = float(jax.jit(plain.programs.eval)(plain_state.params, plain.data.eval_windows))
  assert start_loss == pytest.approx(plain_loss, rel=1e-6)
  summary = train.run(config, tmp_path / "run")
  assert summary["trainable_params"] == r.model.param_count == 2048
  assert summary["param_count"] == 2048 + r.model.frozen_count
  assert summary["eval_loss"] < start_loss
  # A round moves the adapters' Δ: at most 2x its fp32 bytes per worker (a ring all-reduce),
  # where the full model's would be 50x more.
  assert 0 < summary["bytes_sent"] <= 2 * 4 * 2048 * config.rounds
  (state, _), _ = checkpointed_state(config, tmp_path / "run")
  assert state.params.shape == (2048,)
  for a, b in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(r.frozen)):
    np.testing.assert_array_equal(a, np.asarray(b))
  # --export_merged: base + (α/r)·A·B of the last checkpoint, as safetensors.
  export_merged(r, tmp_path / "run", tmp_path / "merged")
  back = pretrained.load(tmp_path / "merged")
  adapters = r.model.layout.unravel(state.params)
  expected = lora.merge(frozen_before, adapters, scale=4.0 / 2)
  assert back.cfg == r.model.cfg
  for x, y in zip(jax.tree.leaves(back.params), jax.tree.leaves(expected)):
    np.testing.assert_allclose(x, np.asarray(y), rtol=1e-6, atol=1e-7)
  qkv = back.params["blocks"][0]["attn"]["qkv"]["kernel"]
  assert not np.array_equal(qkv, frozen_before["blocks"][0]["attn"]["qkv"]["kernel"])


def test_a_bfloat16_base_trains_its_adapters():
  r = train.build(_config(**{"lora.base_dtype": "bfloat16"}))
  assert {x.dtype for x in jax.tree.leaves(r.frozen)} == {jnp.dtype(jnp.bfloat16)}
  with r.partitioner():
    fns = train.jitted_steps(r)
    state, workers = train.init_run(r, fns)
    batches = [s.next_round(h.inner_steps) for s, h in zip(r.data.streams, r.topology.hosts)]
    state, _, metrics, _ = train.train_round(r, fns, state, workers, batches,
                                             [h.inner_steps for h in r.topology.hosts])
  assert np.isfinite(float(metrics["train_loss"]))
  assert float(jnp.abs(state.params).sum()) > 0


@pytest.mark.parametrize("overrides, message", [
    ({"lora.targets": ("embeddings",)}, "lora.targets"),
    ({"lora.base_dtype": "float16"}, "lora.base_dtype"),
    ({"model.tp.size": 2}, "not yet with model.tp.size"),
    ({"aggregate.signal": "probe_loss"}, "not yet with aggregate.signal"),
])
def test_bad_lora_configs_name_the_field(overrides, message):
  with pytest.raises(ConfigError, match=message):
    train.build(_config(**overrides))
