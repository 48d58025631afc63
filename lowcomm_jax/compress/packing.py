"""Wire formats: bit-packed small codes and the narrowest index type for a range.

Payload arrays hold exactly what would travel, so their byte count is the wire size.
"""

import jax.numpy as jnp
import numpy as np


def index_dtype(size: int) -> np.dtype:
  """Narrowest unsigned integer type that indexes `size` positions (uint16 for 4096)."""
  for dtype in (np.uint8, np.uint16, np.uint32):
    if size - 1 <= np.iinfo(dtype).max:
      return np.dtype(dtype)
  raise ValueError(f"cannot index {size} positions with 32 bits")


def packed_length(count: int, bits: int) -> int:
  return -(-count * bits // 8)


def pack_bits(codes: jnp.ndarray, bits: int) -> jnp.ndarray:
  """Unsigned codes < 2**bits (any shape) -> uint8 [ceil(n * bits / 8)], little-end first."""
  if bits == 8:
    return codes.reshape(-1).astype(jnp.uint8)
  assert bits in (1, 2, 4), bits
  per_byte = 8 // bits
  flat = codes.reshape(-1).astype(jnp.uint8)
  flat = jnp.pad(flat, (0, (-flat.size) % per_byte)).reshape(-1, per_byte)
  shifts = jnp.arange(per_byte, dtype=jnp.uint8) * bits
  return jnp.bitwise_or.reduce(flat << shifts, axis=1).astype(jnp.uint8)


def unpack_bits(packed: jnp.ndarray, bits: int, count: int) -> jnp.ndarray:
  """Inverse of `pack_bits`: uint8 codes [count]."""
  if bits == 8:
    return packed[:count]
  per_byte = 8 // bits
  shifts = jnp.arange(per_byte, dtype=jnp.uint8) * bits
  codes = (packed[:, None] >> shifts) & jnp.uint8((1 << bits) - 1)
  return codes.reshape(-1)[:count]
