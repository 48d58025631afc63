"""A real pretrained model through lowcomm_jax's importer: SmolLM2-135M-Instruct (GGUF,
Q4_1, fetched by launch/fetch_smollm2.py) continues a prompt greedily, and its tokenizer
(built from the GGUF's vocabulary and merges by the `tokenizers` library) is checked against
byte-level BPE applied by hand to the same merges.

  python bench/smollm2_generate.py [--gguf PATH] [--prompt "The capital of France is"]
"""

import argparse
import pathlib
import re
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "launch"))

SAMPLE = ("The quick brown fox jumps over the lazy dog. In 1066, William's army crossed the "
          "Channel; tokenizers split words like 'unbelievably' and numbers like 31415.")


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


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--gguf", type=pathlib.Path)
  p.add_argument("--prompt", default="The capital of France is")
  p.add_argument("--new_tokens", type=int, default=8)
  args = p.parse_args()
  import fetch_smollm2
  path = args.gguf or fetch_smollm2.fetch()

  import jax
  import jax.numpy as jnp
  from flax import nnx
  from lowcomm_jax.data.tokenizers import get_tokenizer
  from lowcomm_jax.model import GPT, generate
  from lowcomm_jax.model import pretrained

  t0 = time.perf_counter()
  start = pretrained.load(path)
  model = nnx.eval_shape(lambda: GPT(start.cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model, nnx.Param)
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, start.params))
  load_s = time.perf_counter() - t0
  tok = get_tokenizer(str(path))
  prompt = jnp.asarray(tok.encode(args.prompt), jnp.int32)[None]
  logits_fn = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
  t0 = time.perf_counter()
  out = generate(lambda t: logits_fn(state, t), prompt, args.new_tokens)
  continuation = tok.decode(list(out[0, prompt.shape[1]:]))
  gen_s = time.perf_counter() - t0
  ok, checked = check_tokenizer(path, SAMPLE)
  print(f"model: {start.source} ({sum(x.size for x in jax.tree.leaves(start.params)):,} "
        f"parameters, loaded and dequantized in {load_s:.1f} s)")
  print(f"prompt: {args.prompt!r} -> {continuation!r} ({args.new_tokens} greedy tokens, "
        f"{gen_s:.1f} s)")
  print(f"tokenizer: {ok}/{checked} pre-tokenized pieces of the sample encode exactly as the "
        "GGUF's merges applied by hand")
  says_paris = bool(re.match(r"\s*Paris", continuation))
  if args.prompt == p.get_default("prompt") and not says_paris:
    sys.exit("expected the continuation to start with 'Paris'")


if __name__ == "__main__":
  main()
