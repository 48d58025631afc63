"""LoRA runs: only the adapters train, cross the network and fill the checkpoints; the
frozen base stays bit-exactly what it was; a run starts at the base model exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import checkpointed_state, load_config, train_rounds
from lowcomm_jax.runtimes.spmd import train
from lowcomm_jax.config.check import ConfigError, validate_here
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
    state, workers = train.init_run(r, fns)
    start_loss = float(fns.eval(state.params, r.data.eval_windows)[0])
    # The base is an argument of the compiled local program, not a constant inside it.
    batches = r.data.streams[0].next_round(r.topology.hosts[0].inner_steps)
    compiled = fns.local[0][0].lower(r.local_input(state), workers[0], batches,
                                     np.arange(2, dtype=np.int32)).compile()
    frozen_bytes = sum(x.nbytes for x in jax.tree.leaves(frozen_before))
    assert compiled.memory_analysis().argument_size_in_bytes > frozen_bytes
    # B = 0: the first model is the base itself.
    plain = train.build(load_config("smoke", algorithm="diloco"))
    plain_loss = float(jax.jit(plain.programs.eval)(plain.state_spec.initial_params(),
                                                    plain.data.eval_windows)[0])
  assert start_loss == pytest.approx(plain_loss, rel=1e-6)
  summary = train.run(config, tmp_path / "run")
  assert summary["trainable_params"] == r.model.param_count == 2048
  assert summary["param_count"] == summary["params"] == 2048 + r.model.frozen_count
  assert summary["eval_loss"] < start_loss
  # A round moves the adapters' Δ: at most 2x its fp32 bytes per worker (a ring all-reduce),
  # where the full model's would be 50x more.
  assert 0 < summary["bytes_sent"] <= 2 * 4 * 2048 * config.rounds
  (state, _), _ = checkpointed_state(config, tmp_path / "run")
  assert state.params.shape == (2048,)
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
  # The exported model, loaded as a plain (non-LoRA) run's start, has the trained run's
  # loss on the same evaluation windows: the export merged at the scale training used.
  exported = train.build(load_config("smoke", algorithm="diloco",
                                     **{"model.init_from": str(tmp_path / "merged")}))
  with exported.partitioner():
    loss = float(train.jitted_steps(exported).eval(exported.state_spec.initial_params(),
                                                   exported.data.eval_windows)[0])
  assert loss == pytest.approx(summary["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("overrides", [{"lora.base_dtype": "bfloat16"},
                                       {"algorithm": "ddp", "inner_steps": 1}])
def test_adapters_train_on_a_bfloat16_base_and_under_ddp(overrides):
  r = train.build(_config(**{"optimizer.warmup_steps": 0, **overrides}))  # step 0 moves B
  dtype = jnp.bfloat16 if overrides.get("lora.base_dtype") else jnp.float32
  assert {x.dtype for x in jax.tree.leaves(r.frozen)} == {jnp.dtype(dtype)}
  with r.partitioner():
    fns = train.jitted_steps(r)
    state, workers = train.init_run(r, fns)
    batches = [s.next_round(h.inner_steps) for s, h in zip(r.data.streams, r.topology.hosts)]
    state, _, metrics, _ = train.train_round(r, fns, state, workers, batches,
                                             [h.inner_steps for h in r.topology.hosts])
  assert np.isfinite(float(metrics["train_loss"]))
  # B started at 0 and moved: the adapters learned something.
  b = [x for p, x in jax.tree_util.tree_flatten_with_path(r.model.layout.unravel(state.params))[0]
       if str(p[-1]) == "['b']"]
  assert b and all(float(jnp.abs(x).max()) > 0 for x in b)


@pytest.mark.parametrize("overrides, message", [
    ({"lora.targets": ("embeddings",)}, "lora.targets"),
    ({"lora.base_dtype": "float16"}, "lora.base_dtype"),
    ({"model.tp.size": 2}, "not yet with model.tp.size"),
    ({"aggregate.signal": "probe_loss"}, "not yet with aggregate.signal"),
])
def test_bad_lora_configs_name_the_field(overrides, message):
  with pytest.raises(ConfigError, match=message):
    validate_here(_config(**overrides))


def test_lora_adapters_train_on_matformer_tiers():
  from lowcomm_jax.assemble.hosts import host
  config = _config(**{"lora.targets": ("mlp",), "optimizer.warmup_steps": 0, "model.name":
                      "tiny_llama"})
  config.hosts = [host(0.5), host(0.5)]  # both narrow: half of every FFN's hidden units
  r = train.build(config)
  d_ff, m = r.model.cfg.d_ff, r.topology.hosts[0].hidden
  assert m == d_ff // 2
  with r.partitioner():
    _, state, _, metrics = train_rounds(config, 2)
  assert np.isfinite(float(metrics["train_loss"]))
  mlp = r.model.layout.unravel(state.params)["blocks"][0]["mlp"]
  # The hidden units the tier trains moved; the others no worker trained stay at B = 0 / A_0.
  for name in ("fc_kernel", "gate_kernel"):
    b = np.asarray(mlp[name]["b"])
    assert np.abs(b[:, :m]).max() > 0 and not np.any(b[:, m:])
  start = r.model.layout.unravel(r.state_spec.initial_params())["blocks"][0]["mlp"]
  a = np.asarray(mlp["proj_kernel"]["a"])
  np.testing.assert_array_equal(a[m:], np.asarray(start["proj_kernel"]["a"])[m:])
  assert not np.array_equal(a[:m], np.asarray(start["proj_kernel"]["a"])[:m])
