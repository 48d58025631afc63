"""A model's parameters in Hugging Face's layout, the inverse of model/pretrained.py's
importers: GPT2LMHeadModel's names for the GPT family, LlamaForCausalLM's for the Llama
family, written as model.safetensors + config.json (`--export_merged`)."""

import json
import os
import pathlib

import jax
import numpy as np

from lowcomm_jax.model.presets import GPTConfig
from lowcomm_jax.model.pretrained import PretrainedError


def hf_tensors(cfg: GPTConfig, params) -> dict[str, np.ndarray]:
  """The parameter tree in Hugging Face's names and shapes (the inverse of the importers):
  GPT2LMHeadModel's for the GPT family with learned positions, LlamaForCausalLM's for the
  Llama family."""
  p = jax.tree.map(np.asarray, params)
  if cfg.family == "llama":
    if (cfg.position, cfg.rotary_fraction, cfg.norm, cfg.mlp, cfg.bias,
        cfg.parallel_residual) != ("rotary", 1.0, "rmsnorm", "swiglu", False, False):
      raise PretrainedError("a Llama export needs rotary positions on whole heads, RMSNorm, "
                            "SwiGLU, no biases and sequential residuals")
    hd, nq, nkv = cfg.head_dim, cfg.n_head, cfg.kv_heads
    out = {"model.embed_tokens.weight": p["wte"]["embedding"],
           "model.norm.weight": p["ln_f"]["scale"]}
    if "lm_head" in p:
      out["lm_head.weight"] = p["lm_head"]["kernel"].T
    for i, b in p["blocks"].items():
      qkv, pre = b["attn"]["qkv"]["kernel"], f"model.layers.{i}."
      out |= {pre + "self_attn.q_proj.weight": qkv[:, :nq * hd].T,
              pre + "self_attn.k_proj.weight": qkv[:, nq * hd:(nq + nkv) * hd].T,
              pre + "self_attn.v_proj.weight": qkv[:, (nq + nkv) * hd:].T,
              pre + "self_attn.o_proj.weight": b["attn"]["proj"]["kernel"].T,
              pre + "mlp.gate_proj.weight": b["mlp"]["gate_kernel"].T,
              pre + "mlp.up_proj.weight": b["mlp"]["fc_kernel"].T,
              pre + "mlp.down_proj.weight": b["mlp"]["proj_kernel"].T,
              pre + "input_layernorm.weight": b["ln1"]["scale"],
              pre + "post_attention_layernorm.weight": b["ln2"]["scale"]}
  else:
    if (cfg.position, cfg.norm, cfg.bias, cfg.parallel_residual) != (
        "learned", "layernorm", True, False) or "lm_head" in p:
      raise PretrainedError("a GPT-2 export needs learned positions, LayerNorm, biases, "
                            "sequential residuals and tied embeddings")
    out = {"wte.weight": p["wte"]["embedding"], "wpe.weight": p["wpe"]["embedding"],
           "ln_f.weight": p["ln_f"]["scale"], "ln_f.bias": p["ln_f"]["bias"]}
    for i, b in p["blocks"].items():
      h = f"h.{i}."
      for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
        out |= {f"{h}{theirs}.weight": b[ours]["scale"], f"{h}{theirs}.bias": b[ours]["bias"]}
      out |= {h + "attn.c_attn.weight": b["attn"]["qkv"]["kernel"],
              h + "attn.c_attn.bias": b["attn"]["qkv"]["bias"],
              h + "attn.c_proj.weight": b["attn"]["proj"]["kernel"],
              h + "attn.c_proj.bias": b["attn"]["proj"]["bias"],
              h + "mlp.c_fc.weight": b["mlp"]["fc_kernel"],
              h + "mlp.c_fc.bias": b["mlp"]["fc_bias"],
              h + "mlp.c_proj.weight": b["mlp"]["proj_kernel"],
              h + "mlp.c_proj.bias": b["mlp"]["proj_bias"]}
  return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def hf_config(cfg: GPTConfig) -> dict:
  """config.json for `hf_tensors`' layout."""
  if cfg.family == "llama":
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.kv_heads, "hidden_size": cfg.d_model,
            "intermediate_size": cfg.d_ff, "max_position_embeddings": cfg.block_size,
            "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_base, "tie_word_embeddings": cfg.tie_embeddings,
            "hidden_act": "silu"}
  return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": cfg.n_layer,
          "n_head": cfg.n_head, "n_embd": cfg.d_model, "n_inner": cfg.d_ff,
          "n_positions": cfg.block_size, "vocab_size": cfg.vocab_size,
          "layer_norm_epsilon": cfg.norm_eps,
          "activation_function": "gelu_new" if cfg.mlp == "gelu_tanh" else "gelu"}


def save_safetensors(folder: str | pathlib.Path, cfg: GPTConfig, params,
                     metadata: dict[str, str] | None = None) -> pathlib.Path:
  """model.safetensors and config.json in `folder`, each written to a temporary name and
  renamed, so an interrupted export leaves no file that looks complete."""
  from safetensors.numpy import save_file
  out = pathlib.Path(folder)
  out.mkdir(parents=True, exist_ok=True)
  for name, write in (("model.safetensors",
                       lambda f: save_file(hf_tensors(cfg, params), str(f), metadata=metadata)),
                      ("config.json",
                       lambda f: f.write_text(json.dumps(hf_config(cfg), indent=2) + "\n"))):
    partial = out / f".{name}.partial"
    write(partial)
    os.replace(partial, out / name)
  return out / "model.safetensors"
