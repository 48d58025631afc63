"""Codecs for what crosses the network (see codec.py for the interface).

`make_codec(cfg)` builds the `TreeCodec` named by `compress.codec`:
  none      no codec (the plain mean is used; `make_codec` returns None)
  int8      uniform int8, one fp32 scale per row (or per `quant_block` entries)
  fp8       float8 e4m3, row/block scaled
  int4      uniform 4-bit (levels −7..7), packed two per byte, row/block scaled
  topk      k largest per tensor (`density`) or per chunk×chunk block (`k`), + error feedback
  randomk   `density` of entries at positions from a shared seed (values only), + error feedback
  sparseloco  decayed error buffer (β), chunked top-k, 2-bit values (64 of 4096 per chunk)
  demo      DeMo/DisTrO: momentum (β, scale lr), chunked DCT, top-k per chunk, sign friendly
"""

import ml_collections

from lowcomm_jax.compress.codec import Identity, LeafCodec, TreeCodec
from lowcomm_jax.compress.dct import DCTTopK, dct_matrix
from lowcomm_jax.compress.quantize import Fp8, Uniform
from lowcomm_jax.compress.sparse import RandomK, TopK, randomk_codec, topk_codec

CODECS = ("none", "int8", "fp8", "int4", "topk", "randomk", "sparseloco", "demo")
DEFAULT_BETA = {"sparseloco": 0.95, "demo": 0.999}  # others: 1.0 (classic error feedback)
DEFAULT_K = {"demo": 32}  # others: 64 per 4096-entry chunk (SparseLoCo's)


def resolved(cfg: ml_collections.ConfigDict) -> tuple[float, int]:
  """(beta, k) with the codec's defaults filled in for the -1 / 0 config sentinels."""
  beta = cfg.beta if cfg.beta > 0 else DEFAULT_BETA.get(cfg.codec, 1.0)
  k = cfg.k if cfg.k > 0 else DEFAULT_K.get(cfg.codec, 64)
  return beta, k


def make_codec(cfg: ml_collections.ConfigDict, *, lr: float = 1.0) -> TreeCodec | None:
  """The tree codec for config section `compress` (None for 'none'). `lr` is DeMo's
  momentum scale (the run's learning rate)."""
  name = cfg.codec
  ef = cfg.error_feedback
  beta, k = resolved(cfg)
  if name == "none":
    return None
  if name in ("int8", "int4"):
    bits = 8 if name == "int8" else 4
    return TreeCodec(name, lambda s: Uniform(s, bits, cfg.quant_block, cfg.stochastic_rounding),
                     error_feedback=ef, beta=beta)
  if name == "fp8":
    return TreeCodec(name, lambda s: Fp8(s, cfg.quant_block), error_feedback=ef, beta=beta)
  if name == "topk":
    return TreeCodec(name, lambda s: topk_codec(s, density=cfg.density, chunk=cfg.chunk,
                                                 k=k, value_bits=cfg.value_bits),
                     error_feedback=ef, beta=beta)
  if name == "randomk":
    return TreeCodec(name, lambda s: randomk_codec(s, density=cfg.density),
                     error_feedback=ef, beta=beta)
  if name == "sparseloco":
    return TreeCodec(name, lambda s: topk_codec(s, density=1.0, chunk=cfg.chunk, k=k,
                                                 value_bits=2),
                     error_feedback=True, beta=beta)
  if name == "demo":
    return TreeCodec(name, lambda s: DCTTopK(s, chunk=cfg.chunk, k=k,
                                             sign_only=cfg.value_bits == 1,
                                             mean_over_senders=cfg.mean_over_senders),
                     error_feedback=True, beta=beta, scale=lr)
  raise ValueError(f"unknown compress.codec {name!r}; use one of {CODECS}")


__all__ = ["CODECS", "DCTTopK", "Fp8", "Identity", "LeafCodec", "RandomK", "TopK", "TreeCodec",
           "Uniform", "dct_matrix", "make_codec", "randomk_codec", "topk_codec"]
