"""Adversarial workers for tests and benchmarks of robust aggregation: what the listed
workers send is replaced before any aggregation sees it."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np


def make_attack(workers, kind: str, scale: float, num_workers: int):
  """`attack(Δ[R, N], key) -> Δ'`: the listed workers' updates replaced (tests and
  benchmarks of robust aggregation): 'scale' multiplies them by `scale`, 'sign_flip'
  negates them, 'random' sends a random direction of the same norm. None without workers."""
  if not workers:
    return None
  bad = np.zeros((num_workers,), bool)
  bad[list(workers)] = True

  def attack(deltas_RxN, key):
    if kind == "scale":
      sent = deltas_RxN * scale
    elif kind == "sign_flip":
      sent = -deltas_RxN
    elif kind == "random":
      noise = jax.random.normal(key, deltas_RxN.shape, deltas_RxN.dtype)
      norms = jnp.linalg.norm(deltas_RxN, axis=1) / jnp.maximum(
          jnp.linalg.norm(noise, axis=1), 1e-12)
      sent = noise * norms[:, None]
    else:
      raise ValueError(f"unknown attack.kind {kind!r}")
    return jnp.where(jnp.asarray(bad)[:, None], sent, deltas_RxN)

  return attack


def config_defaults() -> ml_collections.ConfigDict:
  """The `attack` section: adversarial workers (tests and benchmarks of robust aggregation)."""
  s = ml_collections.ConfigDict()
  s.workers = ()  # worker ids that send a manipulated update
  s.kind = "scale"  # 'scale' (x attack.scale) | 'sign_flip' | 'random' (same norm)
  s.scale = 100.0  # the factor of 'scale'
  return s
