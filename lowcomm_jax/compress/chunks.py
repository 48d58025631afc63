"""Chunk geometry shared by the chunked codecs (SparseLoCo, DeMo), fixed at trace time.

A tensor is viewed as 2-D (leading dims flattened, last dim kept) and cut into s1 x s2
chunks; a 1-D tensor into chunks of `one_d` elements. Each dimension's chunk is its largest
divisor <= the target — unless that divisor is small (< target / 2): then the dimension is
zero-padded to a multiple of the target instead. Without the padding a prime-length vector
would be cut into 1-element chunks and top-k would send every entry plus an index each,
more than the dense tensor (the blow-up the issue names).
"""

import dataclasses
import math

import jax.numpy as jnp


def _chunk_and_padded(n: int, target: int) -> tuple[int, int]:
  if n <= target:
    return n, n
  best = max(d for d in range(1, target + 1) if n % d == 0)
  if best >= target // 2:
    return best, n
  return target, -(-n // target) * target


@dataclasses.dataclass(frozen=True)
class Chunks:
  shape: tuple[int, ...]  # the tensor's
  rows: int  # 2-D view (rows = 1 for a 1-D tensor)
  cols: int
  s1: int  # chunk rows
  s2: int  # chunk cols
  pad_rows: int  # padded 2-D view
  pad_cols: int

  @property
  def count(self) -> int:
    return (self.pad_rows // self.s1) * (self.pad_cols // self.s2)

  @property
  def size(self) -> int:
    return self.s1 * self.s2

  def split(self, x: jnp.ndarray) -> jnp.ndarray:
    """Tensor -> [count, s1, s2] chunks."""
    x = x.reshape(self.rows, self.cols)
    x = jnp.pad(x, ((0, self.pad_rows - self.rows), (0, self.pad_cols - self.cols)))
    x = x.reshape(self.pad_rows // self.s1, self.s1, self.pad_cols // self.s2, self.s2)
    return x.transpose(0, 2, 1, 3).reshape(self.count, self.s1, self.s2)

  def join(self, c: jnp.ndarray) -> jnp.ndarray:
    """[count, s1, s2] -> tensor (padding dropped)."""
    gr, gc = self.pad_rows // self.s1, self.pad_cols // self.s2
    x = c.reshape(gr, gc, self.s1, self.s2).transpose(0, 2, 1, 3)
    x = x.reshape(self.pad_rows, self.pad_cols)[:self.rows, :self.cols]
    return x.reshape(self.shape)


def chunks_for(shape: tuple[int, ...], target: int, one_d: int) -> Chunks:
  """Chunking of a tensor: `target` x `target` for matrices, `one_d` elements for vectors."""
  shape = tuple(shape)
  if len(shape) <= 1:
    n = math.prod(shape)
    s, padded = _chunk_and_padded(n, one_d)
    return Chunks(shape, 1, n, 1, s, 1, padded)
  rows, cols = math.prod(shape[:-1]), shape[-1]
  s1, pr = _chunk_and_padded(rows, target)
  s2, pc = _chunk_and_padded(cols, target)
  return Chunks(shape, rows, cols, s1, s2, pr, pc)
