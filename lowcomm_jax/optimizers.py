"""The optax transforms a run uses, built from its config: inner (per worker) and outer."""

import jax
import jax.numpy as jnp
import ml_collections
import optax
from optax import contrib as optax_contrib

from lowcomm_jax import aggregate, compress
from lowcomm_jax.parallel.flat import ParamLayout, tree_view


def inner_schedule(opt: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  """Linear warmup to `lr`, cosine decay to `lr * min_lr_ratio` over the run's inner steps."""
  decay_steps = opt.decay_steps or total_steps
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=opt.lr, warmup_steps=opt.warmup_steps,
      decay_steps=max(decay_steps, opt.warmup_steps + 1), end_value=opt.lr * opt.min_lr_ratio)


def at_schedule_step(opt_state, step):
  """`opt_state` with its learning-rate schedule's position (every
  `optax.ScaleByScheduleState.count`) set to `step`, the rest (Adam's moments and bias-
  correction count) untouched. Stacked states take a step per leading entry: step[G]."""
  is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)

  def place(s):
    if not is_schedule(s):
      return s
    return s._replace(count=jnp.broadcast_to(jnp.asarray(step, s.count.dtype), s.count.shape))
  return jax.tree.map(place, opt_state, is_leaf=is_schedule)


def _is_matrix(params):
  return jax.tree.map(lambda x: x.ndim >= 2, params)


INNER = ("adamw", "sgd", "lamb", "lars", "adafactor", "lion", "muon")
_EMBEDDINGS = ("wte", "wpe", "lm_head")  # Muon leaves these to AdamW, as its authors do


def muon_dimension_numbers(params):
  """Muon's leaves: the 2-D hidden matrices (attention and MLP kernels). Embeddings, the LM
  head, norms and biases get None: its AdamW part trains them."""
  def pick(path, x):
    names = {getattr(k, "key", None) for k in path}
    if x.ndim == 2 and not names & set(_EMBEDDINGS):
      return optax_contrib.MuonDimensionNumbers()
    return None
  return jax.tree_util.tree_map_with_path(pick, params)


def inner_optimizer(opt: ml_collections.ConfigDict, total_steps: int) -> optax.GradientTransformation:
  """Each worker's optimizer on the warmup-cosine schedule, after global-norm clipping.
  Weight decay (where the method has it) is on matrices only."""
  schedule = inner_schedule(opt, total_steps)
  if opt.name == "adamw":
    tx = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay,
                     mask=_is_matrix)
  elif opt.name == "sgd":
    tx = optax.sgd(schedule)
  elif opt.name == "lamb":  # layer-wise trust ratio on AdamW's update (You et al. 2020)
    tx = optax.lamb(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay,
                    mask=_is_matrix)
  elif opt.name == "lars":  # trust ratio on momentum SGD; norms and biases without it
    tx = optax.lars(schedule, weight_decay=opt.weight_decay, weight_decay_mask=_is_matrix,
                    trust_ratio_mask=_is_matrix, momentum=opt.momentum)
  elif opt.name == "adafactor":  # factored second moments: O(rows + cols) state per matrix
    # optax adds Adafactor's decay after the lr step: scale it by the lr, as AdamW's is.
    decay = (lambda t: opt.weight_decay * schedule(t)) if opt.weight_decay else None
    tx = optax.adafactor(schedule, weight_decay_rate=decay, weight_decay_mask=_is_matrix)
  elif opt.name == "lion":  # sign of an interpolated momentum (Chen et al. 2023)
    tx = optax.lion(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay,
                    mask=_is_matrix)
  elif opt.name == "muon":
    adam_schedule = (inner_schedule(ml_collections.ConfigDict({**opt.to_dict(),
                                                               "lr": opt.adam_lr}), total_steps)
                     if opt.adam_lr > 0 else schedule)
    tx = optax_contrib.muon(
        schedule, beta=opt.momentum, weight_decay=opt.weight_decay,
        weight_decay_mask=_is_matrix, adam_b1=opt.b1, adam_b2=opt.b2,
        # No decay in the AdamW part (embeddings, LM head, norms, biases): it takes no mask,
        # and norms and biases must not decay. Embeddings lose the decay AdamW gives them.
        adam_weight_decay=0.0, adam_learning_rate=adam_schedule,
        muon_weight_dimension_numbers=muon_dimension_numbers)
  else:
    raise ValueError(f"unknown optimizer.name {opt.name!r}; choose one of {INNER}")
  if opt.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(opt.grad_clip), tx)
  return tx


def needs_nested_mean(config: ml_collections.ConfigDict, hosts, d_ff: int) -> bool:
  """Plain mean unless some worker trains a narrower FFN or workers are weighted by tokens."""
  return config.aggregate.weighting == "tokens" or any(h.hidden != d_ff for h in hosts)


def robust_combination(config: ml_collections.ConfigDict) -> bool:
  """Whether the sync combines all-gathered updates by a robust rule or signal weights
  (aggregate/robust.py) instead of the plain mean's all-reduce."""
  a = config.aggregate
  return a.rule != "mean" or a.signal != "none" or a.bucket > 1


def robust_rule(config: ml_collections.ConfigDict, rule: optax.GradientTransformation,
                probe=None) -> optax.GradientTransformationExtraArgs:
  """The outer `rule` after the robust combination of the all-gathered updates. The
  combination's state (previous aggregate, signal EMAs, weights) is the same on every
  worker, so it lives with the outer rule's, once per fragment, and is checkpointed there.
  Works on the flat Δ: norms and coordinates are the tree's."""
  a = config.aggregate
  return aggregate.combine_then(aggregate.robust_combine(
      rule=a.rule, signal=a.signal, num_workers=config.num_workers, trim=a.trim,
      clip_iters=a.clip_iters, clip_tau=a.clip_tau, bucket=a.bucket,
      temperature=a.temperature, floor=a.floor, weight_ema=a.weight_ema,
      warmup_rounds=a.warmup_rounds, signal_ema=a.signal_ema, seed=config.seed,
      noise_sigmas=a.noise_sigmas, probe=probe), rule)


def probe_step(config: ml_collections.ConfigDict, local_steps: bool) -> float:
  """How far along each worker's update the `probe_loss` signal evaluates its proposal:
  `aggregate.probe_step`, or by default the whole Δ for algorithms with local steps (θ − Δ_w
  is the worker's own model) and one SGD step at the inner lr for DDP (Δ is a gradient)."""
  if config.aggregate.probe_step > 0:
    return float(config.aggregate.probe_step)
  return 1.0 if local_steps else float(config.optimizer.lr)


def aggregator(config: ml_collections.ConfigDict, layout: ParamLayout, *, nested: bool = False
               ) -> optax.GradientTransformationExtraArgs:
  """How the workers' Δ of one fragment (flat, `layout` is the fragment's) become one update:
  the sync's only communication.

  A robust rule or signal weights (`aggregate.rule`, `aggregate.signal`) all-gather the
  updates (with a codec: the payloads, decoded per sender), which `robust_rule` combines.
  With a codec (`compress.codec`) it is the compressed mean (encode, all-gather payloads,
  decode); else `nested` picks the tier-aware weighted mean (aggregate/nested.py) over the
  plain one (the compressed mean takes the same tier weights). The plain mean runs on the
  flat buffer as is; codecs (per tensor) and the nested mean (tier masks per FFN leaf) see
  the tree. What follows it, the outer rule, is the algorithm's (algorithms/).
  """
  codec = compress.make_codec(config.compress, lr=config.optimizer.lr)
  if robust_combination(config):  # combined in the outer rule: `robust_rule`
    if codec is not None:
      return tree_view(aggregate.compressed_gather(codec, "replica", seed=config.seed), layout,
                       stacked=True)
    return aggregate.gather_all("replica")
  if codec is not None:
    return tree_view(aggregate.compressed_mean(codec, "replica", seed=config.seed), layout)
  if nested:
    return tree_view(aggregate.nested_mean("replica"), layout)
  return optax.with_extra_args_support(aggregate.replica_mean("replica"))


def sign_descent(opt: ml_collections.ConfigDict, total_steps: int) -> optax.GradientTransformation:
  """DeMo's outer step: θ ← θ − lr·(sign(ĝ) + wd·θ) on the decoded gradient ĝ (decoupled
  weight decay on matrices), on the run's warmup-cosine schedule."""
  return optax.chain(optax.scale_by_sign(),
                     optax.add_decayed_weights(opt.weight_decay, mask=_is_matrix),
                     optax.scale_by_learning_rate(inner_schedule(opt, total_steps)))
