"""LoRA adapters: which kernels they cover, W + (α/r)·A·B by hand, and the merged model
exported as safetensors that the importer reads back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowcomm_jax.model import GPT, get_preset, hf_export, lora, pretrained
from tests.model.test_pretrained import _gpt2_to_hf, _llama_to_hf

pytest.importorskip("safetensors")


def _base(name="tiny_llama"):
  cfg = get_preset(name, vocab_size=61)
  return cfg, nnx.to_pure_dict(nnx.state(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param))


def _paths(tree):
  return {"/".join(str(n) for n in lora._names(p))
          for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_adapters_cover_the_targeted_kernels_and_start_at_the_base():
  cfg, base = _base()
  attn = lora.init_adapters(jax.random.key(0), base, rank=4, targets=("attn",))
  assert _paths(attn) == {f"blocks/{i}/attn/{m}/kernel/{ab}" for i in range(2)
                          for m in ("qkv", "proj") for ab in "ab"}
  both = lora.init_adapters(jax.random.key(0), base, rank=4, targets=("attn", "mlp"))
  assert len(_paths(both)) == 2 * 2 * 5
  qkv = attn["blocks"][0]["attn"]["qkv"]["kernel"]
  assert qkv["a"].shape == (32, 4) and qkv["b"].shape == (4, (4 + 2 * 2) * 8)
  assert not np.any(np.asarray(qkv["b"]))
  merged = lora.merge(base, attn, scale=4.0)
  for x, y in zip(jax.tree.leaves(merged), jax.tree.leaves(base)):
    np.testing.assert_array_equal(x, y)  # B = 0: exactly the base
  assert lora.count(attn) == 2 * (32 * 4 + 4 * 64 + 32 * 4 + 4 * 32)
  with pytest.raises(ValueError, match="LoRA targets"):
    lora.init_adapters(jax.random.key(0), base, rank=4, targets=("embeddings",))


def test_merge_adds_the_scaled_product_to_targeted_kernels_only():
  cfg, base = _base()
  adapters = lora.init_adapters(jax.random.key(0), base, rank=2, targets=("mlp",))
  adapters = jax.tree.map(lambda x: x + 0.1, adapters)  # B nonzero
  alpha, rank = 8.0, 2
  merged = lora.merge(base, adapters, scale=alpha / rank)
  ad = adapters["blocks"][1]["mlp"]["gate_kernel"]
  expected = (np.asarray(base["blocks"][1]["mlp"]["gate_kernel"], np.float64)
              + alpha / rank * np.asarray(ad["a"], np.float64) @ np.asarray(ad["b"], np.float64))
  np.testing.assert_allclose(merged["blocks"][1]["mlp"]["gate_kernel"], expected, rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_array_equal(merged["blocks"][1]["attn"]["qkv"]["kernel"],
                                base["blocks"][1]["attn"]["qkv"]["kernel"])
  # A bfloat16 base is merged in float32 and stays bfloat16.
  low = jax.tree.map(lambda x: x.astype(jnp.bfloat16), base)
  merged_low = lora.merge(low, adapters, scale=alpha / rank)
  assert merged_low["blocks"][1]["mlp"]["gate_kernel"].dtype == jnp.bfloat16


@pytest.mark.parametrize("name", ["tiny_llama", "tiny"])
def test_a_merged_model_exports_as_safetensors_the_importer_reads_back(tmp_path, name):
  cfg, base = _base(name)
  adapters = jax.tree.map(lambda x: x + 0.05,
                          lora.init_adapters(jax.random.key(1), base, rank=2,
                                             targets=("attn", "mlp")))
  merged = lora.merge(base, adapters, scale=2.0)
  # The exporter's layout against the tests' own writers (not only its inverse, the importer).
  written = (_llama_to_hf(jax.tree.map(np.asarray, merged), cfg) if name == "tiny_llama"
             else _gpt2_to_hf(jax.tree.map(np.asarray, merged)))
  exported = hf_export.hf_tensors(cfg, merged)
  assert sorted(exported) == sorted(written)
  for k in written:
    np.testing.assert_array_equal(exported[k], written[k])
  hf_export.save_safetensors(tmp_path, cfg, merged, metadata={"lora_base": "test"})
  assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
  back = pretrained.load(tmp_path)
  assert back.cfg == cfg  # tiny: exact GELU goes out as "gelu" and comes back as such
  for x, y in zip(jax.tree.leaves(back.params), jax.tree.leaves(merged)):
    np.testing.assert_array_equal(x, np.asarray(y))
