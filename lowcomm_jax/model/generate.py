"""Sampling continuations from any logits function (the NNX model or a tensor-parallel plan).

No KV cache: each new token reruns the causal forward over a fixed [B, T] buffer (T = prompt +
new tokens <= block size), so one compiled program serves every step. Fine for the small
models this library samples from in examples and tests.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp


def generate(logits_fn: Callable[[jax.Array], jax.Array], prompt_BxP: jax.Array,
             new_tokens: int, *, key: jax.Array | None = None,
             temperature: float = 1.0) -> jax.Array:
  """[B, P + new_tokens] tokens: the prompt and its continuation.

  `logits_fn(tokens_BxT) -> [B, T, V]`. `key=None` or `temperature=0` decodes greedily.
  """
  b, p = prompt_BxP.shape
  buffer = jnp.zeros((b, p + new_tokens), prompt_BxP.dtype).at[:, :p].set(prompt_BxP)
  greedy = key is None or temperature == 0.0

  def step(i, tokens):
    logits = logits_fn(tokens)
    last = jax.lax.dynamic_index_in_dim(logits, p + i - 1, axis=1, keepdims=False)
    if greedy:
      nxt = jnp.argmax(last, axis=-1)
    else:
      nxt = jax.random.categorical(jax.random.fold_in(key, i), last / temperature, axis=-1)
    return jax.lax.dynamic_update_index_in_dim(tokens, nxt.astype(tokens.dtype), p + i, axis=1)

  return jax.lax.fori_loop(0, new_tokens, step, buffer)
