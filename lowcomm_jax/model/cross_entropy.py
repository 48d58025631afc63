"""Next-token cross-entropy in pieces of the sequence, so the float32 logits of the whole
batch ([B·L, V]: 3.3 GB for GPT-2 at batch 16 × 1024) never exist at once.

Each piece's logits stay in the compute dtype; the float32 cast, log-softmax and label pick
live only inside the piece. The backward pass keeps each piece's compute-dtype logits (what
the plain loss keeps too) and recomputes the float32 part from them, so no matmul is run
twice.
"""

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

_SAVED = "piece_logits"
AUTO_CHUNK = 256  # positions: GPT-2 at batch 16 keeps 0.8 GB of float32 logits, not 3.3 GB


def chunk_of(loss_chunk: int, dtype: str) -> int:
  """`model.loss_chunk` settled: itself when set; else AUTO_CHUNK where the logits are
  16-bit (the plain loss would make a float32 copy of them all), 0 (whole) in float32."""
  if loss_chunk > 0:
    return loss_chunk
  return 0 if dtype == "float32" else AUTO_CHUNK


def chunked_token_losses(x_BxLxD: jax.Array, labels_BxL: jax.Array,
                         head: Callable[[jax.Array], jax.Array], chunk: int) -> jax.Array:
  """Per-position losses [B, L] of `head(x)`'s logits against `labels`, `chunk` positions at
  a time (a last, shorter piece takes the rest). Each position's loss is the one the whole
  [B, L, V] computation gives."""
  b, l, d = x_BxLxD.shape
  pieces, rest = divmod(l, chunk)

  def piece(x_BxCxD, labels_BxC):
    logits = checkpoint_name(head(x_BxCxD), _SAVED)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                           labels_BxC)
  piece = jax.checkpoint(piece, policy=jax.checkpoint_policies.save_only_these_names(_SAVED))

  whole = pieces * chunk
  x_NxBxCxD = x_BxLxD[:, :whole].reshape(b, pieces, chunk, d).swapaxes(0, 1)
  labels_NxBxC = labels_BxL[:, :whole].reshape(b, pieces, chunk).swapaxes(0, 1)
  _, losses_NxBxC = jax.lax.scan(lambda _, xy: (None, piece(*xy)), None,
                                 (x_NxBxCxD, labels_NxBxC))
  losses_BxL = losses_NxBxC.swapaxes(0, 1).reshape(b, whole)
  if rest:
    losses_BxL = jnp.concatenate([losses_BxL, piece(x_BxLxD[:, whole:], labels_BxL[:, whole:])],
                                 axis=1)
  return losses_BxL
