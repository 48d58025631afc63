"""Codecs for what crosses the network (codec.py: the interface; spec.py: what a codec
declares). `make_codec(cfg)` builds the one `compress.codec` names; "none" is no codec (the
plain mean). To add one: a module with its leaf codec and a `CodecSpec`, and a line in
REGISTRY."""

import ml_collections

from lowcomm_jax.compress import dct, quantize, sparse
from lowcomm_jax.compress.codec import Codec, Identity, LeafCodec, TreeCodec
from lowcomm_jax.compress.dct import DCTTopK, dct_matrix
from lowcomm_jax.compress.error_feedback import ErrorFeedback, error_feedback
from lowcomm_jax.compress.quantize import Fp8, Statistical, Uniform
from lowcomm_jax.compress.sparse import (RandomK, TopK, kept_per_chunk, randomk_codec,
                                         topk_codec)
from lowcomm_jax.compress.spec import CodecSpec
from lowcomm_jax.errors import Problems

REGISTRY: dict[str, CodecSpec] = {s.name: s for s in (
    quantize.INT8, quantize.FP8, quantize.INT4, quantize.MULOCO,
    sparse.TOPK, sparse.RANDOMK, sparse.SPARSELOCO,
    dct.DEMO)}
NONE = "none"  # no codec: the plain mean's all-reduce
# How the workers' payloads meet (compress.reduce): all-gathered whole, every worker
# decoding every payload, or reduce-scattered (compress/sharded.py: each shard's owner
# decodes, averages and re-encodes it once, then the reduced shards are all-gathered).
REDUCE = ("gather", "scatter")


def names() -> tuple[str, ...]:
  """Every choice of compress.codec."""
  return (NONE, *REGISTRY)


CODECS = names()  # the codecs this package ships


def spec(name: str) -> CodecSpec | None:
  """The codec called `name`, None for "none"; a ValueError naming the choices otherwise."""
  if name == NONE:
    return None
  if name not in REGISTRY:
    raise ValueError(f"unknown compress.codec {name!r}; use one of {names()}")
  return REGISTRY[name]


def declared(name: str) -> CodecSpec | None:
  """The spec of codec `name`, or None for "none" and for a name nothing registered (the
  config check names that one): what checks ask before a config is known to be valid."""
  return REGISTRY.get(name)


def make_codec(cfg: ml_collections.ConfigDict, *, lr: float = 1.0,
               shards: int | None = None) -> Codec | None:
  """The codec for config section `compress` (None for 'none'). `lr` scales a momentum
  buffer's input (DeMo: the run's learning rate); `shards`, the workers a reduce-scatter
  (compress.reduce='scatter') cuts each update among."""
  made = spec(cfg.codec)
  return None if made is None else made.build(cfg, lr=lr, shards=shards)


def problems(c: ml_collections.ConfigDict) -> list[str]:
  """compress.*'s problems: the fields every codec shares, then what the chosen codec
  declares (its spec's capabilities and its own checks)."""
  out = Problems(c)
  check = out.check
  z = c.compress
  check(z.codec in names(), "compress.codec", f"use one of {names()}")
  check(z.beta == -1.0 or 0.0 < z.beta <= 1.0, "compress.beta",
        "the error-buffer decay must be in (0, 1], or -1 for the codec's default")
  check(z.quant_block >= 0, "compress.quant_block", "use 0 (per row) or a positive block size")
  check(0.0 < z.density <= 1.0, "compress.density", "must be in (0, 1]")
  check(z.chunk >= 0, "compress.chunk", "use 0 (per tensor, topk only) or a positive side")
  check(z.k >= 0, "compress.k", "entries per chunk: >= 1, or 0 for the codec's default")
  check(z.reduce in REDUCE, "compress.reduce", f"use one of {REDUCE}")
  tiered = c.aggregate.weighting == "tokens" or any(float(h.tier) < 1.0 for h in c.hosts)
  if z.mean_over_senders:
    check(not tiered, "compress.mean_over_senders",
          "averaging over senders replaces the tier/token weights; set it False with "
          "MatFormer tiers < 1 or aggregate.weighting=tokens")
  codec = declared(z.codec)
  if codec is None:
    return out
  if codec.chunked:
    check(z.chunk >= 2, "compress.chunk", f"{z.codec} is chunked; use e.g. 64")
  if codec.always_error_feedback:
    check(z.error_feedback, "compress.error_feedback",
          f"{z.codec} always keeps its error buffer; leave it True (or pick another codec)")
  if z.reduce == "scatter":
    scatters = [s.name for s in REGISTRY.values() if s.scatters]
    check(codec.scatters, "compress.reduce",
          f"{z.codec} keeps its paper's all-gather (a mean of sparse rows is not sparse); "
          f"'scatter' is for {', '.join(scatters)}: use 'gather'")
  if codec.reads_k and z.chunk > 0 and z.k > 0:
    # Codecs cap k at half a chunk silently (beyond that the indices cost more than the
    # dense chunk): a larger k would not send what it says.
    most = kept_per_chunk(z.chunk * z.chunk, z.chunk * z.chunk)  # the codecs' own cap
    check(z.k <= most, "compress.k",
          f"a {z.chunk}x{z.chunk} chunk sends at most half its entries ({most}); lower k "
          "or raise compress.chunk")
  if codec.value_bits:
    check(z.value_bits in codec.value_bits, "compress.value_bits",
          f"{z.codec} sends values of {' or '.join(map(str, codec.value_bits))} bits")
  if z.stochastic_rounding:
    rounding = [s.name for s in REGISTRY.values() if s.stochastic_rounding]
    check(codec.stochastic_rounding, "compress.stochastic_rounding",
          f"{z.codec} has no stochastic rounding (only {', '.join(rounding)}); set it False")
  out.extend(codec.problems(z))  # its own fields and limits
  return out


__all__ = ["CODECS", "Codec", "CodecSpec", "DCTTopK", "ErrorFeedback", "Fp8", "Identity",
           "LeafCodec", "REGISTRY", "RandomK", "Statistical", "TopK", "TreeCodec", "Uniform",
           "dct_matrix",
           "declared", "error_feedback", "make_codec", "names", "problems", "randomk_codec",
           "spec", "topk_codec"]


def config_defaults() -> ml_collections.ConfigDict:
  """The `compress` section: what crosses the network, and how (config/defaults.py puts it in
  every config). diloco compresses each round's pseudo-gradients; ddp every step's
  gradients ('demo' there is DisTrO-style training: DeMo momentum + DCT top-k, sign
  descent)."""
  s = ml_collections.ConfigDict()
  s.codec = "none"  # none | int8 | fp8 | int4 | muloco | topk | randomk | sparseloco | demo
  s.error_feedback = True  # keep what was not sent and re-send it (sparseloco/demo always do)
  s.beta = -1.0  # error-buffer decay e = beta*e + x; -1: the codec's (1.0; SparseLoCo 0.95; DeMo momentum 0.999)
  s.quant_block = 0  # int8/fp8/int4/muloco: one scale (muloco: bin table) per row (0) or per this many entries
  s.stochastic_rounding = False  # int8/int4: round to a random neighbour (unbiased)
  s.density = 0.01  # topk (chunk=0) / randomk: fraction of each tensor's entries sent
  s.chunk = 64  # topk/sparseloco/demo: chunk side (chunk x chunk blocks); topk 0 = per tensor
  s.k = 0  # topk/sparseloco/demo: entries sent per chunk; 0: the codec's (64 of 4096; DeMo 32)
  s.value_bits = 32  # topk: 32 or 2; demo: 32 or 1 (sign only); sparseloco is always 2
  s.reduce = "gather"  # gather | scatter (int8/int4/fp8/muloco: a quantized reduce-scatter, docs/compression.md)
  s.mean_over_senders = False  # demo: average each coefficient over the workers that sent it
  return s
