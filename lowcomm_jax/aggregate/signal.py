"""Per-worker weights from online measures of each worker's usefulness.

Signals, tracked per worker as exponential moving averages (`ema`) of what each round shows,
oriented so that higher means more trusted:

  loss_ema             −EMA(training loss)
  grad_norm_stability  EMA(‖u‖) / std(‖u‖): the inverse coefficient of variation of the
                       worker's update norms (scale-free: steady workers are trusted)
  cosine               EMA(cos(u_w, previous aggregate))
  probe_loss           −EMA(probe loss): the loss, on a probe batch every receiver holds, of
                       the model the worker's update proposes (DiLoCo family: θ − Δ_w, the
                       worker's own model; DDP: θ − lr·g_w). The receivers compute it from
                       what was sent, so a worker cannot misreport its own quality.

Weights from a signal s [W]: standardize across workers (z = (s − mean) / std, 0 where all
agree), p = softmax(z / temperature), mix with uniform so none falls below floor / W
(w = (1 − floor)·p + floor / W), then smooth: w_t = weight_ema·w_{t−1} + (1 − weight_ema)·w.
During the warm-up rounds the weights stay uniform while the signals already accumulate.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

SIGNALS = ("none", "loss_ema", "grad_norm_stability", "cosine", "probe_loss")


class SignalState(NamedTuple):
  rounds: jax.Array  # rounds seen
  loss: jax.Array  # [W] EMA of the training loss
  norm: jax.Array  # [W] EMA of ‖u_w‖
  norm_sq: jax.Array  # [W] EMA of ‖u_w‖²
  cosine: jax.Array  # [W] EMA of cos(u_w, previous aggregate)
  probe: jax.Array  # [W] EMA of the probe loss of each worker's proposal (0 when not probed)
  weights: jax.Array  # [W] the weights last used


def init(num_workers: int) -> SignalState:
  zeros = jnp.zeros((num_workers,), jnp.float32)
  return SignalState(jnp.zeros((), jnp.int32), zeros, zeros, zeros, zeros, zeros,
                     jnp.full((num_workers,), 1.0 / num_workers, jnp.float32))


def observe(state: SignalState, *, losses, norms, cosines, probes, ema: float) -> SignalState:
  """The signals after one more round; the first round sets them."""
  first = state.rounds == 0
  mix = lambda old, new: jnp.where(first, new, ema * old + (1.0 - ema) * new)
  return state._replace(rounds=state.rounds + 1, loss=mix(state.loss, losses),
                        norm=mix(state.norm, norms), norm_sq=mix(state.norm_sq, norms ** 2),
                        cosine=mix(state.cosine, cosines), probe=mix(state.probe, probes))


def signal_of(state: SignalState, name: str) -> jax.Array:
  """The signal `name` per worker, higher = more trusted."""
  if name == "loss_ema":
    return -state.loss
  if name == "grad_norm_stability":
    std = jnp.sqrt(jnp.maximum(state.norm_sq - state.norm ** 2, 0.0))
    return state.norm / jnp.maximum(std, 1e-6 * jnp.maximum(state.norm, 1e-12))
  if name == "cosine":
    return state.cosine
  if name == "probe_loss":
    return -state.probe
  raise ValueError(f"unknown signal {name!r}; choose one of {SIGNALS}")


def weights_from(signal, previous, *, temperature: float, floor: float, weight_ema: float,
                 warm: jax.Array) -> jax.Array:
  """This round's weights [W] (see the module docstring); `warm` False: uniform."""
  W = signal.shape[0]
  std = jnp.std(signal)
  z = jnp.where(std > 0, (signal - jnp.mean(signal)) / jnp.where(std > 0, std, 1.0), 0.0)
  p = jax.nn.softmax(z / temperature)
  mixed = (1.0 - floor) * p + floor / W
  smoothed = weight_ema * previous + (1.0 - weight_ema) * mixed
  return jnp.where(warm, smoothed, jnp.full((W,), 1.0 / W, jnp.float32))


def effective_workers(weights) -> jax.Array:
  """1 / Σ w²: W for uniform weights, 1 when one worker has them all."""
  return 1.0 / jnp.sum(weights ** 2)
