"""Greedy generation through lowcomm_jax's importer, at any MatFormer width.

By default a real pretrained model: SmolLM2-135M-Instruct (GGUF, Q4_1, fetched by
launch/fetch_smollm2.py) continues a prompt, and its tokenizer (built from the GGUF's
vocabulary and merges by the `tokenizers` library) is checked against byte-level BPE applied
by hand to the same merges. `--model` takes another GGUF or a safetensors model (one that
`python -m lowcomm_jax.export` wrote, say), `--workdir` a run's latest checkpoint, and
`--width` runs the first width × d_ff FFN units of every block only.

  python bench/smollm2_generate.py [--gguf PATH | --model PATH | --workdir RUN] [--width 0.25]
                                   [--prompt "The capital of France is"] [--new_tokens 8]
"""

import argparse
import pathlib
import re
import runpy
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

SAMPLE = ("The quick brown fox jumps over the lazy dog. In 1066, William's army crossed the "
          "Channel; tokenizers split words like 'unbelievably' and numbers like 31415.")


def fetch_smollm2() -> pathlib.Path:
  """SmolLM2's GGUF, cached or downloaded (launch/fetch_smollm2.py: a script, run by path)."""
  return runpy.run_path(str(REPO / "launch" / "fetch_smollm2.py"))["fetch"]()


def bpe_by_hand(word: str, rank: dict) -> list[str]:
  """Merge the adjacent pair of lowest rank until none is in the merge list."""
  parts = list(word)
  while len(parts) > 1:
    best = min(range(len(parts) - 1),
               key=lambda i: rank.get((parts[i], parts[i + 1]), len(rank)))
    if (parts[best], parts[best + 1]) not in rank:
      break
    parts[best:best + 2] = [parts[best] + parts[best + 1]]
  return parts


def check_tokenizer(gguf_path: pathlib.Path, text: str) -> tuple[int, int]:
  """(pre-tokenized pieces whose encoding equals the hand-applied merges, pieces checked);
  exits if the whole sample's encoding is not the pieces' encodings in order."""
  import gguf
  from tokenizers import Tokenizer
  from lowcomm_jax.data.tokenizers import gguf_tokenizer_json
  tok = Tokenizer.from_str(gguf_tokenizer_json(gguf_path))
  fields = gguf.GGUFReader(str(gguf_path)).fields
  vocab = fields["tokenizer.ggml.tokens"].contents()
  rank = {tuple(m.split(" ", 1)): r
          for r, m in enumerate(fields["tokenizer.ggml.merges"].contents())}
  index = {t: i for i, t in enumerate(vocab)}
  # The pre-tokenizer's pieces (digits one by one, then GPT-2's regex), in byte-level chars.
  pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)]
  ok, whole = 0, []
  for piece in pieces:
    expected = [index[p] for p in bpe_by_hand(piece, rank)]
    ok += [t.id for t in tok.model.tokenize(piece)] == expected
    whole += expected
  if tok.encode(text, add_special_tokens=False).ids != whole:
    sys.exit("the tokenizer's encoding of the sample differs from its pieces' merges")
  return ok, len(pieces)


def load_model(args):
  """(GPTConfig, parameter tree, tokenizer name, label) of what to generate from: a run's
  latest checkpoint (--workdir), an exported or pretrained model (--model: safetensors or
  GGUF), or SmolLM2's GGUF by default; cut to --width's FFN units (MatFormer: any width of
  a nested model is a model)."""
  import dataclasses
  from lowcomm_jax.model import pretrained
  from lowcomm_jax.model.matformer import hidden_units, slice_tier, width_problems
  if args.workdir:  # the run's width, as lowcomm_jax.export would write it
    from lowcomm_jax import export
    try:
      w = export.width_model(args.workdir, args.width)
    except export.ExportError as e:
      sys.exit(str(e))
    cfg, params = w.cfg, w.params
    tokenizer, label = w.config.data.tokenizer, f"{args.workdir} (round {w.round})"
  else:
    path = args.model or fetch_smollm2()
    start = pretrained.load(path)
    if problems := width_problems("--width", [args.width], start.cfg.d_ff):
      sys.exit(problems[0])
    m = hidden_units(start.cfg.d_ff, args.width)
    cfg, params, label = start.cfg, start.params, start.source
    if m != cfg.d_ff:
      params, cfg = slice_tier(params, m), dataclasses.replace(cfg, d_ff=m)
    tokenizer = (str(path) if str(path).endswith(".gguf")
                 else _stored_tokenizer(pretrained.file_of(path)))
  return (cfg, params, args.tokenizer or tokenizer,
          f"{label}, width {args.width:g} ({cfg.d_ff} FFN units)")


def _stored_tokenizer(file: pathlib.Path) -> str:
  """A safetensors model's tokenizer: a tokenizer.json beside it (a Hugging Face folder),
  else what lowcomm_jax.export recorded in the metadata, else 'gpt2'."""
  from safetensors import safe_open
  if (beside := file.with_name("tokenizer.json")).is_file():
    return str(beside)
  with safe_open(str(file), framework="numpy") as f:
    return (f.metadata() or {}).get("tokenizer", "gpt2")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  where = p.add_mutually_exclusive_group()
  where.add_argument("--gguf", "--model", dest="model", type=pathlib.Path,
                     help="a GGUF or safetensors model (a folder: its model.safetensors), "
                     "e.g. one lowcomm_jax.export wrote; default: SmolLM2-135M's GGUF")
  where.add_argument("--workdir", type=pathlib.Path, help="a run: its latest checkpoint")
  p.add_argument("--width", type=float, default=1.0, help="MatFormer FFN width to run")
  p.add_argument("--tokenizer", help="override the tokenizer (name or tokenizer.json)")
  p.add_argument("--prompt", default="The capital of France is")
  p.add_argument("--new_tokens", type=int, default=8)
  args = p.parse_args()

  import jax
  import jax.numpy as jnp
  from flax import nnx
  from lowcomm_jax.data.tokenizers import get_tokenizer
  from lowcomm_jax.model import GPT, generate

  t0 = time.perf_counter()
  cfg, params, tokenizer, label = load_model(args)
  model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model, nnx.Param)
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
  load_s = time.perf_counter() - t0
  tok = get_tokenizer(tokenizer)
  prompt = jnp.asarray(tok.encode(args.prompt), jnp.int32)[None]
  logits_fn = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
  t0 = time.perf_counter()
  out = generate(lambda t: logits_fn(state, t), prompt, args.new_tokens)
  continuation = tok.decode(list(out[0, prompt.shape[1]:]))
  gen_s = time.perf_counter() - t0
  print(f"model: {label} ({sum(x.size for x in jax.tree.leaves(params)):,} parameters, "
        f"loaded in {load_s:.1f} s)")
  print(f"prompt: {args.prompt!r} -> {continuation!r} ({args.new_tokens} greedy tokens, "
        f"{gen_s:.1f} s)")
  gguf = args.workdir is None and (args.model is None or str(args.model).endswith(".gguf"))
  if gguf:  # its tokenizer against the merges applied by hand
    ok, checked = check_tokenizer(args.model or fetch_smollm2(), SAMPLE)
    print(f"tokenizer: {ok}/{checked} pre-tokenized pieces of the sample encode exactly as the "
          "GGUF's merges applied by hand")
  says_paris = bool(re.match(r"\s*Paris", continuation))
  if gguf and args.width == 1.0 and args.prompt == p.get_default("prompt") and not says_paris:
    sys.exit("expected the continuation to start with 'Paris'")


if __name__ == "__main__":
  main()
