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

Weights from a signal s [W]: standardize across workers, p = softmax(z / temperature), mix
with uniform so none falls below floor / W (w = (1 − floor)·p + floor / W), then smooth:
w_t = weight_ema·w_{t−1} + (1 − weight_ema)·w. During the warm-up rounds the weights stay
uniform while the signals already accumulate.

Standardizing alone (z = (s − mean) / std) discards how large the differences are: with two
workers z is always ±1, so two identical workers get 0.8 / 0.2 from noise alone (measured:
1.5% worse eval loss than uniform on clean data). The standardization is therefore
noise-aware: z = (s − mean) / sqrt(std² + (k·σ)²), σ the median over workers of the noise
of each worker's EMA (the variance of its observations relative to the workers' mean,
tracked as an EMA, times α / (2 − α) for α = 1 − ema; the median, so one erratic worker's
own noise cannot hide it) and
k = `noise_sigmas`. Differences well above k·σ still give the plain
z-scores; differences within the noise give weights near uniform. k = 0 is the plain z-score.
grad_norm_stability, a ratio of two EMAs, has no observation noise tracked: plain z-scores.
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
  # [W] EMAs of the squared deviation of each observation from its EMA (the noise)
  loss_var: jax.Array
  cosine_var: jax.Array
  probe_var: jax.Array
  weights: jax.Array  # [W] the weights last used


def init(num_workers: int) -> SignalState:
  zeros = jnp.zeros((num_workers,), jnp.float32)
  return SignalState(rounds=jnp.zeros((), jnp.int32), loss=zeros, norm=zeros, norm_sq=zeros,
                     cosine=zeros, probe=zeros,
                     loss_var=zeros, cosine_var=zeros, probe_var=zeros,
                     weights=jnp.full((num_workers,), 1.0 / num_workers, jnp.float32))


def observe(state: SignalState, *, losses, norms, cosines, probes, ema: float,
            present=None) -> SignalState:
  """The signals after one more round; the first round sets them. `present` [W] (a parameter
  server's round that some workers missed): an absent worker's signals stay as they were,
  a worker seen for the first time (its norm EMA still 0) is set rather than mixed, and
  observations are centred on the present workers' mean."""
  first = state.rounds == 0
  mean = jnp.mean
  if present is not None:
    first = first | (state.norm == 0)
    mean = lambda v: jnp.where(present, v, 0.0).sum() / jnp.maximum(present.sum(), 1)
  mix = lambda old, new: jnp.where(first, new, ema * old + (1.0 - ema) * new)
  # The exponentially weighted variance, var ← ema·(var + (1 − ema)·(x − m_prev)²), of each
  # worker's observation relative to the workers' mean: the trend all workers share
  # (losses falling as training goes) is not noise.
  centered = lambda v: v - mean(v)
  spread = lambda var, m, x: jnp.where(
      first, 0.0, ema * (var + (1.0 - ema) * (centered(x) - centered(m)) ** 2))
  seen = state._replace(rounds=state.rounds + 1, loss=mix(state.loss, losses),
                        norm=mix(state.norm, norms), norm_sq=mix(state.norm_sq, norms ** 2),
                        cosine=mix(state.cosine, cosines), probe=mix(state.probe, probes),
                        loss_var=spread(state.loss_var, state.loss, losses),
                        cosine_var=spread(state.cosine_var, state.cosine, cosines),
                        probe_var=spread(state.probe_var, state.probe, probes))
  if present is None:
    return seen
  keep = lambda new, old: jnp.where(present, new, old) if new.ndim else new
  return jax.tree.map(keep, seen, state)


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


def noise_of(state: SignalState, name: str, ema: float) -> jax.Array:
  """[W] the standard deviation of each worker's EMA of signal `name` from its
  observations' noise (zeros for grad_norm_stability)."""
  alpha = 1.0 - ema
  var = {"loss_ema": state.loss_var, "cosine": state.cosine_var,
         "probe_loss": state.probe_var}.get(name)
  if var is None:
    return jnp.zeros_like(state.loss)
  return jnp.sqrt(var * alpha / (2.0 - alpha))


def weights_from(signal, previous, *, temperature: float, floor: float, weight_ema: float,
                 warm: jax.Array, noise=None, noise_sigmas: float = 0.0,
                 present=None) -> jax.Array:
  """This round's weights [W] (see the module docstring); `warm` False: uniform. `noise`
  [W]: each worker's signal noise σ_w; the scale is sqrt(std² + (noise_sigmas·median σ)²).
  `present` [W] (a parameter server's round that some workers missed): the statistics are
  the present workers', and the absent ones weigh 0."""
  if present is not None:
    return _present_weights(signal, previous, present, temperature=temperature, floor=floor,
                            weight_ema=weight_ema, warm=warm, noise=noise,
                            noise_sigmas=noise_sigmas)
  W = signal.shape[0]
  scale_sq = jnp.var(signal)
  if noise is not None and noise_sigmas > 0:
    scale_sq = scale_sq + (noise_sigmas * jnp.median(noise)) ** 2
  scale = jnp.sqrt(scale_sq)
  z = jnp.where(scale > 0, (signal - jnp.mean(signal)) / jnp.where(scale > 0, scale, 1.0), 0.0)
  p = jax.nn.softmax(z / temperature)
  mixed = (1.0 - floor) * p + floor / W
  smoothed = weight_ema * previous + (1.0 - weight_ema) * mixed
  return jnp.where(warm, smoothed, jnp.full((W,), 1.0 / W, jnp.float32))


def _present_weights(signal, previous, present, *, temperature, floor, weight_ema, warm,
                     noise, noise_sigmas) -> jax.Array:
  """`weights_from` over the present workers only (k of W): their mean, spread and softmax,
  the floor shared among k, the smoothing against their previous weights renormalised."""
  k = jnp.maximum(present.sum(), 1).astype(jnp.float32)
  only = lambda v: jnp.where(present, v, 0.0)
  mean = only(signal).sum() / k
  scale_sq = only((signal - mean) ** 2).sum() / k
  if noise is not None and noise_sigmas > 0:
    scale_sq = scale_sq + (noise_sigmas * jnp.nanmedian(jnp.where(present, noise, jnp.nan))) ** 2
  scale = jnp.sqrt(scale_sq)
  z = jnp.where(scale > 0, (signal - mean) / jnp.where(scale > 0, scale, 1.0), 0.0)
  p = jax.nn.softmax(jnp.where(present, z / temperature, -jnp.inf))
  mixed = only((1.0 - floor) * p + floor / k)
  # A worker absent last round weighed 0 then: it comes back at the uniform share.
  before = only(jnp.where(previous > 0, previous, 1.0 / k))
  before = before / jnp.maximum(before.sum(), 1e-12)
  smoothed = weight_ema * before + (1.0 - weight_ema) * mixed
  return jnp.where(warm, smoothed, only(jnp.ones_like(signal)) / k)


def effective_workers(weights) -> jax.Array:
  """1 / Σ w²: W for uniform weights, 1 when one worker has them all."""
  return 1.0 / jnp.sum(weights ** 2)
