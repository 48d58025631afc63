"""Importing pretrained checkpoints: tiny models written here in Hugging Face's safetensors
layout (GPT-2 and Llama) and in GGUF (as llama.cpp's converter writes it, Q/K rows
permuted; float32 and Q8_0), read back into lowcomm_jax models."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowcomm_jax.model import GPT, get_preset
from lowcomm_jax.data.tokenizers import get_tokenizer, gguf_tokenizer_json
from lowcomm_jax.model import pretrained
from tests.model.test_llama import _rms, numpy_llama

gguf = pytest.importorskip("gguf")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

VOCAB = 61


def _random_model(cfg, seed=0):
  """A model whose every parameter (norm scales and biases too) is random."""
  model = GPT(cfg, rngs=nnx.Rngs(seed))
  state = nnx.state(model, nnx.Param)
  params = nnx.to_pure_dict(state)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 7), len(leaves))
  params = jax.tree.unflatten(treedef, [0.3 * jax.random.normal(k, x.shape) for k, x in
                                        zip(keys, leaves)])
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  return model, jax.tree.map(np.asarray, params)


def _llama_to_hf(p, cfg):
  """The model's tree in LlamaForCausalLM's names and [out, in] shapes."""
  hd, nq, nkv = cfg.head_dim, cfg.n_head, cfg.kv_heads
  out = {"model.embed_tokens.weight": p["wte"]["embedding"],
         "model.norm.weight": p["ln_f"]["scale"]}
  for i, b in p["blocks"].items():
    qkv = b["attn"]["qkv"]["kernel"]
    pre = f"model.layers.{i}."
    out |= {pre + "self_attn.q_proj.weight": qkv[:, :nq * hd].T,
            pre + "self_attn.k_proj.weight": qkv[:, nq * hd:(nq + nkv) * hd].T,
            pre + "self_attn.v_proj.weight": qkv[:, (nq + nkv) * hd:].T,
            pre + "self_attn.o_proj.weight": b["attn"]["proj"]["kernel"].T,
            pre + "mlp.gate_proj.weight": b["mlp"]["gate_kernel"].T,
            pre + "mlp.up_proj.weight": b["mlp"]["fc_kernel"].T,
            pre + "mlp.down_proj.weight": b["mlp"]["proj_kernel"].T,
            pre + "input_layernorm.weight": b["ln1"]["scale"],
            pre + "post_attention_layernorm.weight": b["ln2"]["scale"]}
  return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def _llama_cpp_permute(w, heads):
  """convert_hf_to_gguf.py's permute of Q/K rows, written from its definition."""
  return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _write_gguf(path, hf, cfg, qtype=None, tokenizer=None):
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_block_count(cfg.n_layer)
  writer.add_context_length(cfg.block_size)
  writer.add_embedding_length(cfg.d_model)
  writer.add_feed_forward_length(cfg.d_ff)
  writer.add_head_count(cfg.n_head)
  writer.add_head_count_kv(cfg.kv_heads)
  writer.add_rope_freq_base(cfg.rope_base)
  writer.add_layer_norm_rms_eps(cfg.norm_eps)
  if tokenizer:
    tokens, merges, types, pre = tokenizer
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
  names = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight"}
  for i in range(cfg.n_layer):
    for g, h in pretrained._GGUF_BLOCK.items():
      names[f"model.layers.{i}.{h}.weight"] = f"blk.{i}.{g}.weight"
  for hf_name, w in hf.items():
    name = names[hf_name]
    if name.endswith("attn_q.weight"):
      w = _llama_cpp_permute(w, cfg.n_head)
    elif name.endswith("attn_k.weight"):
      w = _llama_cpp_permute(w, cfg.kv_heads)
    if qtype is not None and w.ndim == 2:
      # The quantized bytes [rows, bytes per row]; the writer derives the element shape.
      writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    else:
      writer.add_tensor(name, np.ascontiguousarray(w, np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def _logits(cfg, params, tokens):
  model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model, nnx.Param)
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
  return np.asarray(nnx.merge(graphdef, state)(jnp.asarray(tokens)))


def _assert_same_tree(a, b, **tol):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, **tol)


@pytest.fixture(scope="module")
def llama():
  cfg = get_preset("tiny_llama", vocab_size=VOCAB, rope_base=500.0, norm_eps=1e-6)
  model, params = _random_model(cfg)
  tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 12))
  return cfg, params, tokens, np.asarray(model(jnp.asarray(tokens)))


def test_llama_safetensors_round_trip(tmp_path, llama):
  cfg, params, tokens, logits = llama
  safetensors_numpy.save_file(_llama_to_hf(params, cfg), str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text(json.dumps({
      "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "hidden_size": 32, "intermediate_size": 64,
      "max_position_embeddings": 64, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
      "rope_theta": 500.0, "tie_word_embeddings": True}))
  got = pretrained.load(tmp_path)
  assert got.cfg == cfg
  _assert_same_tree(got.params, params)
  assert pretrained.read_config(tmp_path / "model.safetensors") == cfg
  np.testing.assert_allclose(_logits(got.cfg, got.params, tokens), logits, rtol=1e-5,
                             atol=1e-5)


def _gpt2_to_hf(p):
  """The model's tree in GPT2Model's names ([in, out] Conv1D weights, as the model's)."""
  hf = {"wte.weight": p["wte"]["embedding"], "wpe.weight": p["wpe"]["embedding"],
        "ln_f.weight": p["ln_f"]["scale"], "ln_f.bias": p["ln_f"]["bias"]}
  for i, b in p["blocks"].items():
    for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
      hf |= {f"h.{i}.{theirs}.weight": b[ours]["scale"], f"h.{i}.{theirs}.bias": b[ours]["bias"]}
    hf |= {f"h.{i}.attn.c_attn.weight": b["attn"]["qkv"]["kernel"],
           f"h.{i}.attn.c_attn.bias": b["attn"]["qkv"]["bias"],
           f"h.{i}.attn.c_proj.weight": b["attn"]["proj"]["kernel"],
           f"h.{i}.attn.c_proj.bias": b["attn"]["proj"]["bias"],
           f"h.{i}.mlp.c_fc.weight": b["mlp"]["fc_kernel"],
           f"h.{i}.mlp.c_fc.bias": b["mlp"]["fc_bias"],
           f"h.{i}.mlp.c_proj.weight": b["mlp"]["proj_kernel"],
           f"h.{i}.mlp.c_proj.bias": b["mlp"]["proj_bias"]}
  return {k: np.ascontiguousarray(v, np.float32) for k, v in hf.items()}


def test_gpt2_safetensors_round_trip_uses_gpt2s_tanh_gelu(tmp_path):
  cfg = get_preset("tiny", vocab_size=VOCAB, mlp="gelu_tanh")
  model, p = _random_model(cfg)
  # GPT2LMHeadModel's names carry "transformer."
  hf = {f"transformer.{k}": v for k, v in _gpt2_to_hf(p).items()}
  safetensors_numpy.save_file(hf, str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text(json.dumps({
      "model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_inner": 128,
      "n_positions": 64, "vocab_size": VOCAB, "layer_norm_epsilon": 1e-5}))
  got = pretrained.load(tmp_path / "model.safetensors")
  assert got.cfg == cfg
  _assert_same_tree(got.params, p)
  tokens = np.arange(10)[None] % VOCAB
  np.testing.assert_allclose(_logits(got.cfg, got.params, tokens),
                             np.asarray(model(jnp.asarray(tokens))), rtol=1e-5, atol=1e-5)
  exact = _logits(get_preset("tiny", vocab_size=VOCAB), got.params, tokens)
  assert np.abs(exact - np.asarray(model(jnp.asarray(tokens)))).max() > 1e-4  # tanh ≠ erf


def test_gguf_float32_undoes_llama_cpps_qk_permutation(tmp_path, llama):
  cfg, params, tokens, logits = llama
  _write_gguf(tmp_path / "m.gguf", _llama_to_hf(params, cfg), cfg)
  got = pretrained.load(tmp_path / "m.gguf")
  assert got.cfg == cfg
  assert pretrained.read_config(tmp_path / "m.gguf") == cfg
  _assert_same_tree(got.params, params)
  np.testing.assert_allclose(_logits(got.cfg, got.params, tokens), logits, rtol=1e-5,
                             atol=1e-5)


def _adjacent_pair_rope(x_LxNxH, base):
  """llama.cpp's RoPE (GGML_ROPE_TYPE_NORM): rotates adjacent pairs (x0, x1), (x2, x3)…"""
  seq, _, hd = x_LxNxH.shape
  theta = np.arange(seq)[:, None] * (1.0 / base ** (np.arange(0, hd, 2) / hd))[None]
  cos, sin = np.cos(theta)[:, None], np.sin(theta)[:, None]
  even, odd = x_LxNxH[..., 0::2], x_LxNxH[..., 1::2]
  out = np.empty_like(x_LxNxH)
  out[..., 0::2] = even * cos - odd * sin
  out[..., 1::2] = even * sin + odd * cos
  return out


def test_unpermuted_halves_rope_equals_adjacent_pair_rope_on_the_gguf_rows(tmp_path, llama):
  """Both ways of reading a GGUF agree: the model (halves RoPE on unpermuted Q/K) and
  llama.cpp's own arithmetic (adjacent-pair RoPE on the Q/K rows as stored)."""
  cfg, params, tokens, _ = llama
  hf = _llama_to_hf(params, cfg)
  hd, nq, nkv = cfg.head_dim, cfg.n_head, cfg.kv_heads
  x = hf["model.embed_tokens.weight"][tokens[0]].astype(np.float64)
  seq = x.shape[0]
  for i in range(cfg.n_layer):
    w = lambda n: hf[f"model.layers.{i}.{n}.weight"].astype(np.float64)
    h = _rms(x, w("input_layernorm"), cfg.norm_eps)
    q_rows = _llama_cpp_permute(w("self_attn.q_proj"), nq)  # as the GGUF stores them
    k_rows = _llama_cpp_permute(w("self_attn.k_proj"), nkv)
    q = _adjacent_pair_rope((h @ q_rows.T).reshape(seq, nq, hd), cfg.rope_base)
    k = _adjacent_pair_rope((h @ k_rows.T).reshape(seq, nkv, hd), cfg.rope_base)
    v = (h @ w("self_attn.v_proj").T).reshape(seq, nkv, hd)
    heads = []
    for n in range(nq):
      j = n // (nq // nkv)
      # Scores are dot products over the head's dims: the same pairs, in another order.
      s = np.where(np.tril(np.ones((seq, seq), bool)), q[:, n] @ k[:, j].T / np.sqrt(hd),
                   -np.inf)
      e = np.exp(s - s.max(-1, keepdims=True))
      heads.append(e / e.sum(-1, keepdims=True) @ v[:, j])
    x = x + np.concatenate(heads, -1) @ w("self_attn.o_proj").T
    h = _rms(x, w("post_attention_layernorm"), cfg.norm_eps)
    gate = h @ w("mlp.gate_proj").T
    x = x + (gate / (1 + np.exp(-gate)) * (h @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
  llama_cpp = _rms(x, hf["model.norm.weight"], cfg.norm_eps) @ hf["model.embed_tokens.weight"].T
  _write_gguf(tmp_path / "m.gguf", hf, cfg)
  got = pretrained.load(tmp_path / "m.gguf")
  np.testing.assert_allclose(_logits(got.cfg, got.params, tokens[:1])[0], llama_cpp,
                             rtol=2e-4, atol=2e-4)
  np.testing.assert_allclose(llama_cpp, numpy_llama(params, tokens[0], cfg), rtol=1e-6,
                             atol=1e-6)


def test_gguf_q8_0_dequantizes_close_to_the_weights(tmp_path, llama):
  cfg, params, tokens, logits = llama
  _write_gguf(tmp_path / "q8.gguf", _llama_to_hf(params, cfg), cfg,
              qtype=gguf.GGMLQuantizationType.Q8_0)
  got = pretrained.load(tmp_path / "q8.gguf")
  # Q8_0: blocks of 32 with one float16 scale each (step = block max / 127). The error is at
  # most half a step plus 127 steps times the scale's float16 rounding (2^-11): 0.57 steps.
  for x, y in zip(jax.tree.leaves(got.params), jax.tree.leaves(params)):
    assert np.abs(x - y).max() <= 0.57 * np.abs(y).max() / 127 + 1e-6
  assert np.abs(_logits(got.cfg, got.params, tokens) - logits).max() < 0.05


def _bpe_reference(word: str, merges: list[tuple[str, str]]) -> list[str]:
  """Byte-level BPE by the book: repeatedly merge the adjacent pair of lowest rank."""
  rank = {m: r for r, m in enumerate(merges)}
  parts = list(word)
  while True:
    pairs = [(rank.get((a, b), len(rank)), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
    if not pairs or min(pairs)[0] == len(rank):
      return parts
    _, i = min(pairs)
    parts[i:i + 2] = [parts[i] + parts[i + 1]]


def test_gguf_tokenizer_follows_the_vocabularys_merges(tmp_path, llama):
  cfg = get_preset("tiny_llama", vocab_size=300)
  model, params = _random_model(cfg)
  from tokenizers import pre_tokenizers
  byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
  merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or"),
            ("hell", "o")]
  tokens = ["<|endoftext|>"] + sorted(byte_chars) + ["".join(m) for m in merges]
  types = [3] + [1] * (len(tokens) - 1)
  _write_gguf(tmp_path / "t.gguf", _llama_to_hf(params, cfg), cfg,
              tokenizer=(tokens, [" ".join(m) for m in merges], types, "smollm"))
  from tokenizers import Tokenizer
  tok = Tokenizer.from_str(gguf_tokenizer_json(tmp_path / "t.gguf"))
  text = "hello world worlds 2024"
  ids = tok.encode(text).ids
  expected = []
  for word in ["hello", "Ġworld", "Ġworlds", "Ġ", "2", "0", "2", "4"]:  # digits one by one
    expected += [tokens.index(piece) for piece in _bpe_reference(word, merges)]
  assert ids == expected
  assert tok.decode(ids) == text
  assert tok.token_to_id("<|endoftext|>") == 0
  assert tok.encode("<|endoftext|>").ids == [0]
  # The same tokenizer as a run's data.tokenizer: the GGUF's path.
  data_tok = get_tokenizer(str(tmp_path / "t.gguf"))
  assert list(data_tok.encode(text)) == expected and data_tok.eot == 0


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing.gguf", "no such file"),
    (lambda d: (d / "x.bin").write_bytes(b"1") and d / "x.bin", "not a .gguf or .safetensors"),
    (lambda d: (d / "bad.gguf").write_bytes(b"GGUF junk") and d / "bad.gguf",
     "not a readable GGUF"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\0" * 16) and d, "no config.json"),
])
def test_bad_pretrained_files_are_one_line_errors(tmp_path, make, message):
  with pytest.raises(pretrained.PretrainedError, match=message):
    pretrained.load(make(tmp_path))


@pytest.mark.parametrize("fields, message", [
    ({"model_type": "qwen2"}, "model_type='qwen2' is not supported"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling="),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"model_type": "mistral", "sliding_window": 16}, "sliding_window=16"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
])
def test_llama_configs_it_cannot_compute_are_refused_by_name(tmp_path, fields, message):
  hf = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "hidden_size": 32, "intermediate_size": 64,
        "max_position_embeddings": 64, "vocab_size": VOCAB}
  hf.update(fields)
  hf = {k: v for k, v in hf.items() if v is not None}
  (tmp_path / "model.safetensors").write_bytes(b"")
  (tmp_path / "config.json").write_text(json.dumps(hf))
  with pytest.raises(pretrained.PretrainedError, match=message):
    pretrained.read_config(tmp_path)


def test_weights_that_do_not_fit_the_model_name_the_tensor(tmp_path, llama):
  cfg, params, _, _ = llama
  hf = _llama_to_hf(params, cfg)
  hf["model.layers.1.mlp.up_proj.weight"] = hf["model.layers.1.mlp.up_proj.weight"][:32]
  _write_gguf(tmp_path / "cut.gguf", hf, cfg)
  start = pretrained.load(tmp_path / "cut.gguf")
  abstract = jax.eval_shape(lambda: params)
  with pytest.raises(pretrained.PretrainedError, match="blocks/1/mlp/fc_kernel has shape"):
    pretrained.check_shapes(start, abstract)


def test_a_gguf_tokenizer_with_unknown_splitting_rules_is_refused(tmp_path, llama):
  cfg, params, _, _ = llama
  _write_gguf(tmp_path / "t.gguf", _llama_to_hf(params, cfg), cfg,
              tokenizer=(["a", "b", "ab"], ["a b"], [1, 1, 1], "llama-bpe"))
  with pytest.raises(Exception, match="tokenizer.ggml.pre='llama-bpe' is not supported"):
    get_tokenizer(str(tmp_path / "t.gguf"))
