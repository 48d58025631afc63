"""Codecs for what crosses the network (codec.py: the interface; spec.py: what a codec
declares). `make_codec(cfg)` builds the one `compress.codec` names; "none" is no codec (the
plain mean). To add one: a module with its leaf codec and a `CodecSpec`, and a line in
REGISTRY."""

import ml_collections

from lowcomm_jax.compress import dct, quantize, sparse
from lowcomm_jax.compress.codec import Codec, Identity, LeafCodec, TreeCodec
from lowcomm_jax.compress.dct import DCTTopK, dct_matrix
from lowcomm_jax.compress.error_feedback import ErrorFeedback, error_feedback
from lowcomm_jax.compress.quantize import Fp8, Uniform
from lowcomm_jax.compress.sparse import RandomK, TopK, randomk_codec, topk_codec
from lowcomm_jax.compress.spec import CodecSpec

REGISTRY: dict[str, CodecSpec] = {s.name: s for s in (
    quantize.INT8, quantize.FP8, quantize.INT4,
    sparse.TOPK, sparse.RANDOMK, sparse.SPARSELOCO,
    dct.DEMO)}
NONE = "none"  # no codec: the plain mean's all-reduce


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


def make_codec(cfg: ml_collections.ConfigDict, *, lr: float = 1.0) -> Codec | None:
  """The codec for config section `compress` (None for 'none'). `lr` scales a momentum
  buffer's input (DeMo: the run's learning rate)."""
  made = spec(cfg.codec)
  return None if made is None else made.build(cfg, lr=lr)


__all__ = ["CODECS", "Codec", "CodecSpec", "DCTTopK", "ErrorFeedback", "Fp8", "Identity",
           "LeafCodec", "REGISTRY", "RandomK", "TopK", "TreeCodec", "Uniform", "dct_matrix",
           "declared", "error_feedback", "make_codec", "names", "randomk_codec", "spec",
           "topk_codec"]
