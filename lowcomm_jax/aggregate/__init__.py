"""How workers' decoded contributions combine: optax transforms over the replica axis."""

import ml_collections

from lowcomm_jax.aggregate.attack import make_attack
from lowcomm_jax.aggregate.compressed import (CompressedMeanState, compressed_gather,
                                              compressed_mean, compressed_scatter_mean,
                                              sender_keys)
from lowcomm_jax.aggregate.mean import replica_mean
from lowcomm_jax.aggregate.nested import nested_mean
from lowcomm_jax.aggregate.robust import (RULES, CombinedState, RobustRule, RobustState,
                                          combine_then, gather_all, robust_combine)
from lowcomm_jax.aggregate.signal import SIGNALS


def config_defaults() -> ml_collections.ConfigDict:
  """The `aggregate` section: how the workers' contributions are weighted and combined
  (config/defaults.py puts it in every config; --print_config prints each field's
  comment)."""
  s = ml_collections.ConfigDict()
  s.weighting = "uniform"  # 'uniform' | 'tokens' (weight workers by tokens processed)
  s.rule = "mean"  # 'mean' | 'median' | 'trimmed_mean' | 'centered_clip' (robust)
  s.signal = "none"  # per-worker weights from: 'none' | 'loss_ema'
  # | 'grad_norm_stability' | 'cosine' | 'probe_loss' (lowcomm_jax/aggregate/signal.py)
  s.trim = 1  # trimmed_mean: values dropped per side per coordinate (workers)
  s.clip_iters = 1  # centered_clip: clipping iterations from the previous aggregate
  s.clip_tau = 0.0  # centered_clip: clipping radius; 0: the median distance
  s.bucket = 0  # > 1: average shuffled buckets of this many workers before the rule
  s.temperature = 1.0  # softmax temperature over the standardized signal
  s.noise_sigmas = 3.0  # a difference must exceed this many noise std to count; 0: plain z-score
  s.floor = 0.2  # no worker's weight below floor / num_workers
  s.weight_ema = 0.5  # smoothing of the weights from round to round
  s.warmup_rounds = 2  # uniform weights while the signals accumulate
  s.signal_ema = 0.9  # EMA decay of each worker's signals
  s.probe_batch_size = 16  # probe_loss: windows in the shared probe batch (train split)
  s.probe_step = 0.0  # probe_loss: proposal θ − step·Δ_w; 0: 1 (local steps), optimizer.lr (ddp)
  return s
