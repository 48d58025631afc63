"""A codec as the rest of the code sees it: its name, how `compress.*` builds it, and what it
supports. config/check.py and the algorithms ask these declarations; nothing compares names."""

import dataclasses
from collections.abc import Callable

import ml_collections

from lowcomm_jax.compress.codec import Codec, LeafCodec, TreeCodec
from lowcomm_jax.compress.error_feedback import error_feedback
from lowcomm_jax.compress.sharded import DEFAULT_BLOCK, Sharded

MakeLeaf = Callable[[tuple], LeafCodec]


def _no_problems(z: ml_collections.ConfigDict) -> list[str]:
  return []


@dataclasses.dataclass(frozen=True)
class CodecSpec:
  name: str
  summary: str  # one line: what travels
  # (the `compress` section, k resolved) -> the codec of one tensor of a given shape
  leaf: Callable[[ml_collections.ConfigDict, int], MakeLeaf]
  default_beta: float = 1.0  # the error buffer's decay when compress.beta = -1
  default_k: int = 64  # entries per chunk when compress.k = 0 (codecs that read k)
  always_error_feedback: bool = False  # ignores compress.error_feedback=False (refused)
  scale_by_lr: bool = False  # the buffer is a momentum βΔ + lr·g (DeMo)
  chunked: bool = False  # always cuts tensors into compress.chunk² blocks (chunk >= 2)
  reads_k: bool = False  # sends compress.k entries per chunk, capped at half a chunk
  value_bits: tuple[int, ...] = ()  # the compress.value_bits it accepts (empty: not read)
  stochastic_rounding: bool = False  # supports compress.stochastic_rounding
  # Its payloads can be reduce-scattered (compress.reduce='scatter': compress/sharded.py):
  # a quantizer, whose shard of the mean an owner can re-encode. Sparse codecs keep their
  # papers' all-gather: a mean of k-sparse rows is not k-sparse.
  scatters: bool = False
  # A per-step optimizer rather than a wire format: its decoded mean is stepped by its
  # sign (DeMo/DisTrO). Only DDP's rounds are steps; no robust rule combines it.
  sign_descent: bool = False
  problems: Callable[[ml_collections.ConfigDict], list[str]] = _no_problems  # its own

  def resolved(self, z: ml_collections.ConfigDict) -> tuple[float, int]:
    """(beta, k) with this codec's defaults for the -1 / 0 config sentinels."""
    beta = z.beta if z.beta > 0 else self.default_beta
    k = z.k if z.k > 0 else self.default_k
    return beta, k

  def build(self, z: ml_collections.ConfigDict, *, lr: float = 1.0,
            shards: int | None = None) -> Codec:
    """The codec for the `compress` section `z`; `lr` scales a momentum buffer's input;
    `shards`: the workers a scatter (compress.reduce) cuts the update among."""
    beta, k = self.resolved(z)
    if z.get("reduce", "gather") == "scatter":  # (a section built by hand may lack it)
      if not self.scatters or not shards:
        raise ValueError(f"compress.reduce='scatter' needs a quantizing codec and the worker "
                         f"count (codec {self.name!r}, shards {shards})")
      block = z.quant_block or DEFAULT_BLOCK  # (rows do not survive the flat cut)
      codec = Sharded(self.name, self.leaf(ml_collections.ConfigDict(
          {**z.to_dict(), "quant_block": block}), k), shards, block)
    else:
      codec = TreeCodec(self.name, self.leaf(z, k))
    if self.always_error_feedback or z.error_feedback:
      codec = error_feedback(codec, beta=beta, scale=lr if self.scale_by_lr else 1.0)
    return codec
