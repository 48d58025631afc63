"""Pretrained causal LMs as lowcomm_jax models: the architecture (a GPTConfig) and the
parameters (NumPy float32, in the model's parameter tree), read from

  - Hugging Face safetensors (a `model.safetensors` file or its folder, with the
    `config.json` beside it): GPT-2 (`GPT2LMHeadModel`) and Llama-family
    (`LlamaForCausalLM`: Llama, SmolLM2, TinyLlama, …) layouts;
  - GGUF (llama.cpp's format, `general.architecture = llama`) through the `gguf` package,
    quantized tensors dequantized to float32.

Layout notes, so the mapping can be checked by eye:
  - Hugging Face's `nn.Linear` weights are [out, in]; the model's kernels are [in, out].
    GPT-2's `Conv1D` weights are already [in, out].
  - The model's attention has one fused q|k|v kernel [d, (n_head + 2·kv_heads)·head_dim].
  - GGUF lists dimensions fastest first; the reader gives the NumPy shape, which is
    Hugging Face's [out, in].
  - llama.cpp's converter permutes the rows of Q and K within each head so that its RoPE,
    which rotates adjacent pairs (x0, x1), (x2, x3)…, matches Hugging Face's, which rotates
    the halves (x_i, x_{i+hd/2}). `_unpermute` undoes that, so the model's halves RoPE
    applies (tests/model/test_pretrained.py checks both agree).
"""

import dataclasses
import json
import pathlib
from typing import Any

import jax
import numpy as np

from lowcomm_jax.model.presets import PRESETS, GPTConfig


class PretrainedError(ValueError):
  """A pretrained file that cannot be imported (the message names the file and the fix)."""


@dataclasses.dataclass(frozen=True)
class Pretrained:
  cfg: GPTConfig
  params: dict  # the model's parameter tree, NumPy float32
  source: str  # what was read, for checkpoints and summaries ("gguf:<file>" etc.)


def file_of(path) -> pathlib.Path:
  """The weights file `model.init_from` names (a folder's model.safetensors), checked."""
  p = pathlib.Path(path).expanduser()
  if p.is_dir():
    p = p / "model.safetensors"
  if not p.is_file():
    raise PretrainedError(f"model.init_from={str(path)!r}: no such file; give a .gguf, a "
                          ".safetensors file or a folder holding model.safetensors")
  if p.suffix not in (".gguf", ".safetensors"):
    raise PretrainedError(f"model.init_from={str(path)!r}: not a .gguf or .safetensors file")
  return p


def source_of(path: str | pathlib.Path) -> str:
  """What a run records as its model: the format and the file ("gguf:<path>")."""
  p = file_of(path)
  return f"{p.suffix[1:]}:{p}"


def architecture_of(model_config) -> GPTConfig | None:
  """The architecture a run's `model` config section names: the checkpoint's when
  `init_from` is set (None if it cannot be read), else the preset's (None if unknown)."""
  if model_config.init_from:
    try:
      return read_config(model_config.init_from)
    except PretrainedError:
      return None
  return PRESETS.get(model_config.name)


def load(path: str | pathlib.Path) -> Pretrained:
  """The architecture and weights of the checkpoint at `path` (.gguf, .safetensors, or a
  folder holding model.safetensors and config.json)."""
  p = file_of(path)
  return _from_gguf(p) if p.suffix == ".gguf" else _from_safetensors(p)


def weights_or_init(init_from: str, model_tree):
  """The model's own weights: `init_from`'s (checked against the shapes `model_tree`, the
  seeded init, would give), or, without a file, the seeded init itself."""
  if not init_from:
    return jax.jit(model_tree)()
  start = load(init_from)
  check_shapes(start, jax.eval_shape(model_tree))
  return start.params


def check_shapes(start: Pretrained, abstract_params) -> None:
  """Refuses, naming the first tensor that differs, weights that do not fit the model."""
  got = dict(jax.tree_util.tree_flatten_with_path(start.params)[0])
  for path, want in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    have = got.pop(path, None)
    if have is None or have.shape != want.shape:
      raise PretrainedError(f"{start.source}: parameter {name} has shape "
                            f"{None if have is None else have.shape}, the model needs "
                            f"{want.shape}; the file does not match its own metadata")
  if got:
    raise PretrainedError(f"{start.source}: {len(got)} tensors the model has no place for")


def read_config(path: str | pathlib.Path) -> GPTConfig:
  """Only the architecture, from metadata (no tensor is read or dequantized)."""
  p = file_of(path)
  if p.suffix == ".gguf":
    _, reader = _gguf_reader(p)
    return _gguf_config(p, reader, {t.name: t for t in reader.tensors})
  return _config_from_hf(_hf_config(p))


# --- Hugging Face safetensors -----------------------------------------------------------------

def _hf_config(file: pathlib.Path) -> dict:
  cfg_file = file.with_name("config.json")
  if not cfg_file.is_file():
    raise PretrainedError(f"{file}: no config.json beside it; copy the model's config.json "
                          "from its Hugging Face repository into the same folder")
  try:
    hf = json.loads(cfg_file.read_text())
  except (OSError, ValueError) as e:
    raise PretrainedError(f"{cfg_file} is not readable JSON ({e})") from e
  hf["_file"] = str(cfg_file)
  return hf


# GPT-2's released weights use gelu_new (tanh); "gelu" is the exact one (nanoGPT's)
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _llama_problems(hf: dict) -> list[str]:
  """What a Llama-family config.json may hold that this model does not compute."""
  out = []
  scaling = hf.get("rope_scaling") or {}
  if scaling.get("rope_type", scaling.get("type", "default")) != "default":
    out.append(f"rope_scaling={scaling} (only plain RoPE)")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      out.append(f"{key}=true (the Llama family here has no biases)")
  if hf.get("hidden_act", "silu") != "silu":
    out.append(f"hidden_act={hf['hidden_act']!r} (SwiGLU uses silu)")
  heads = hf["num_attention_heads"]
  if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
    out.append(f"head_dim={hf['head_dim']} (must be hidden_size / num_attention_heads)")
  window = hf.get("sliding_window")
  if window is not None and hf.get("use_sliding_window", True) and \
      window < hf.get("max_position_embeddings", 0):
    out.append(f"sliding_window={window} (full causal attention only)")
  return out


def _config_from_hf(hf: dict) -> GPTConfig:
  kind, file = hf.get("model_type"), hf.get("_file", "config.json")
  try:
    if kind == "gpt2":
      act = hf.get("activation_function", "gelu_new")
      if act not in _GPT2_ACTIVATIONS:
        raise PretrainedError(f"{file}: activation_function={act!r} is not supported; "
                              f"{sorted(_GPT2_ACTIVATIONS)} are")
      return GPTConfig(
          n_layer=hf["n_layer"], n_head=hf["n_head"], d_model=hf["n_embd"],
          d_ff=hf.get("n_inner") or 4 * hf["n_embd"], block_size=hf["n_positions"],
          vocab_size=hf["vocab_size"], norm_eps=hf.get("layer_norm_epsilon", 1e-5),
          mlp=_GPT2_ACTIVATIONS[act])
    if kind in ("llama", "mistral"):
      problems = _llama_problems(hf)
      if problems:
        raise PretrainedError(f"{file}: {'; '.join(problems)}: not supported")
      return GPTConfig(
          n_layer=hf["num_hidden_layers"], n_head=hf["num_attention_heads"],
          n_kv_head=hf.get("num_key_value_heads") or hf["num_attention_heads"],
          d_model=hf["hidden_size"], d_ff=hf["intermediate_size"],
          block_size=hf.get("max_position_embeddings", 2048), vocab_size=hf["vocab_size"],
          bias=False, position="rotary", norm="rmsnorm", mlp="swiglu",
          norm_eps=hf.get("rms_norm_eps", 1e-6),
          rope_base=float(hf.get("rope_theta", 10000.0)),
          tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
  except KeyError as e:
    raise PretrainedError(f"{file}: no {e.args[0]!r} field; is it a {kind} model's "
                          "config.json?") from e
  raise PretrainedError(f"{file}: model_type={kind!r} is not supported; 'gpt2' and the "
                        "Llama family ('llama', 'mistral' without a sliding window) are")


def _from_safetensors(file: pathlib.Path) -> Pretrained:
  try:
    from safetensors.numpy import load_file
  except ImportError as e:
    raise PretrainedError("reading safetensors needs the safetensors package: pip install "
                          "'lowcomm_jax[pretrained]'") from e
  cfg = _config_from_hf(_hf_config(file))
  try:
    raw = load_file(str(file))
  except Exception as e:  # the library raises SafetensorError for damaged files
    raise PretrainedError(f"{file} is not a readable safetensors file ({e})") from e
  # GPT2LMHeadModel prefixes "transformer.", the bare GPT2Model does not.
  tensors = {k.removeprefix("transformer."): v.astype(np.float32) for k, v in raw.items()}
  get = _getter(tensors, file)
  if cfg.family == "gpt":
    params = _gpt2_params(cfg, get)
  else:
    params = _llama_params(cfg, lambda i, n: get(f"model.layers.{i}.{n}.weight"),
                           get("model.embed_tokens.weight"), get("model.norm.weight"),
                           None if cfg.tie_embeddings else get("lm_head.weight"))
  return Pretrained(cfg, params, source_of(file))


def _getter(tensors: dict, file: pathlib.Path):
  def get(name):
    if name not in tensors:
      raise PretrainedError(f"{file}: tensor {name!r} is missing (has {len(tensors)} "
                            "tensors); is it the model its config.json describes?")
    return tensors[name]
  return get


def _gpt2_params(cfg: GPTConfig, get) -> dict:
  def ln(name):
    return {"scale": get(f"{name}.weight"), "bias": get(f"{name}.bias")}

  blocks = {}
  for i in range(cfg.n_layer):
    h = f"h.{i}"
    blocks[i] = {
        "ln1": ln(f"{h}.ln_1"), "ln2": ln(f"{h}.ln_2"),
        "attn": {"qkv": {"kernel": get(f"{h}.attn.c_attn.weight"),
                         "bias": get(f"{h}.attn.c_attn.bias")},
                 "proj": {"kernel": get(f"{h}.attn.c_proj.weight"),
                          "bias": get(f"{h}.attn.c_proj.bias")}},
        "mlp": {"fc_kernel": get(f"{h}.mlp.c_fc.weight"), "fc_bias": get(f"{h}.mlp.c_fc.bias"),
                "proj_kernel": get(f"{h}.mlp.c_proj.weight"),
                "proj_bias": get(f"{h}.mlp.c_proj.bias")}}
  return {"wte": {"embedding": get("wte.weight")}, "wpe": {"embedding": get("wpe.weight")},
          "blocks": blocks, "ln_f": ln("ln_f")}


def _llama_params(cfg: GPTConfig, layer, embedding, final_norm, lm_head) -> dict:
  """`layer(i, name)` gives block i's tensor `name` in Hugging Face's naming and shapes."""
  blocks = {}
  for i in range(cfg.n_layer):
    q, k, v = (layer(i, f"self_attn.{n}_proj") for n in "qkv")
    blocks[i] = {
        "ln1": {"scale": layer(i, "input_layernorm")},
        "ln2": {"scale": layer(i, "post_attention_layernorm")},
        "attn": {"qkv": {"kernel": np.concatenate([q, k, v], axis=0).T},
                 "proj": {"kernel": layer(i, "self_attn.o_proj").T}},
        "mlp": {"gate_kernel": layer(i, "mlp.gate_proj").T,
                "fc_kernel": layer(i, "mlp.up_proj").T,
                "proj_kernel": layer(i, "mlp.down_proj").T}}
  params = {"wte": {"embedding": embedding}, "blocks": blocks, "ln_f": {"scale": final_norm}}
  if lm_head is not None:
    params["lm_head"] = {"kernel": lm_head.T}
  return params


# --- GGUF -----------------------------------------------------------------------------------

# llama.cpp tensor names -> Hugging Face's, per block
_GGUF_BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
               "ffn_norm": "post_attention_layernorm"}


_HF_BLOCK = {h: g for g, h in _GGUF_BLOCK.items()}


def _unpermute(w_OxI: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's Q/K row permutation (convert_hf_to_gguf's `permute`), which within
  each head interleaves the two halves: GGUF rows [a0, b0, a1, b1, …] back to Hugging
  Face's [a0, a1, …, b0, b1, …]."""
  rows = w_OxI.shape[0]
  return (w_OxI.reshape(heads, rows // heads // 2, 2, *w_OxI.shape[1:])
          .swapaxes(1, 2).reshape(w_OxI.shape))


def _gguf_reader(file: pathlib.Path):
  try:
    import gguf
  except ImportError as e:
    raise PretrainedError("reading GGUF needs the gguf package: pip install "
                          "'lowcomm_jax[pretrained]'") from e
  try:
    return gguf, gguf.GGUFReader(str(file))
  except Exception as e:  # the reader raises ValueError/struct errors for damaged files
    raise PretrainedError(f"{file} is not a readable GGUF file ({e})") from e


def gguf_metadata(reader) -> dict[str, Any]:
  """Scalar and string metadata (arrays left out: the vocabulary is read on its own)."""
  out = {}
  for name, field in reader.fields.items():
    if len(field.types) == 1:
      value = field.contents()
      out[name] = value
  return out


def _gguf_config(file: pathlib.Path, reader, tensors: dict) -> GPTConfig:
  meta = gguf_metadata(reader)
  arch = meta.get("general.architecture")
  if arch != "llama":
    raise PretrainedError(f"{file}: general.architecture={arch!r}; only 'llama' GGUF files "
                          "are supported")
  if "token_embd.weight" not in tensors:
    raise PretrainedError(f"{file}: tensor 'token_embd.weight' is missing; the file is "
                          "incomplete")
  def m(key, default=None):
    value = meta.get(f"llama.{key}", default)
    if value is None:
      raise PretrainedError(f"{file}: metadata llama.{key} is missing; the file is incomplete")
    return value

  # GGUF stores float32: 1e-6 reads back as 9.99999997e-07; take float32's shortest decimal.
  f32 = lambda x: float(str(np.float32(x)))
  n_head = int(m("attention.head_count"))
  head_dim = int(m("embedding_length")) // n_head
  if meta.get("llama.rope.scaling.type", "none") != "none" or "rope_freqs.weight" in tensors:
    raise PretrainedError(f"{file}: scaled RoPE (llama.rope.scaling.*, rope_freqs) is not "
                          "supported; only plain RoPE")
  if int(meta.get("llama.rope.dimension_count", head_dim)) != head_dim:
    raise PretrainedError(f"{file}: llama.rope.dimension_count="
                          f"{meta['llama.rope.dimension_count']} rotates part of each head; "
                          f"only the whole head ({head_dim}) is supported")
  return GPTConfig(
      n_layer=int(m("block_count")), n_head=n_head,
      n_kv_head=int(m("attention.head_count_kv", n_head)),
      d_model=int(m("embedding_length")), d_ff=int(m("feed_forward_length")),
      block_size=int(m("context_length", 2048)),
      # GGUF lists dimensions fastest first: [d_model, vocab]
      vocab_size=int(tensors["token_embd.weight"].shape[-1]), bias=False,
      position="rotary", norm="rmsnorm", mlp="swiglu",
      norm_eps=f32(m("attention.layer_norm_rms_epsilon", 1e-5)),
      rope_base=f32(m("rope.freq_base", 10000.0)),
      tie_embeddings="output.weight" not in tensors)


def _from_gguf(file: pathlib.Path) -> Pretrained:
  gguf, reader = _gguf_reader(file)
  tensors = {t.name: t for t in reader.tensors}
  cfg = _gguf_config(file, reader, tensors)

  def get(name):
    if name not in tensors:
      raise PretrainedError(f"{file}: tensor {name!r} is missing; the file is incomplete")
    t = tensors[name]
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)

  def layer(i, hf_name):
    gguf_name = _HF_BLOCK[hf_name]
    w = get(f"blk.{i}.{gguf_name}.weight")
    if gguf_name == "attn_q":
      return _unpermute(w, cfg.n_head)
    if gguf_name == "attn_k":
      return _unpermute(w, cfg.kv_heads)
    return w

  params = _llama_params(cfg, layer, get("token_embd.weight"), get("output_norm.weight"),
                         None if cfg.tie_embeddings else get("output.weight"))
  return Pretrained(cfg, params, source_of(file))
