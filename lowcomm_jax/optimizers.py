"""The optax transforms a run uses, built from its config: inner (per worker) and outer."""

import jax
import ml_collections
import optax

from lowcomm_jax import aggregate, compress, outer
from lowcomm_jax.parallel.flat import ParamLayout, tree_view


def inner_schedule(opt: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  """Linear warmup to `lr`, cosine decay to `lr * min_lr_ratio` over the run's inner steps."""
  decay_steps = opt.decay_steps or total_steps
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=opt.lr, warmup_steps=opt.warmup_steps,
      decay_steps=max(decay_steps, opt.warmup_steps + 1), end_value=opt.lr * opt.min_lr_ratio)


def _is_matrix(params):
  return jax.tree.map(lambda x: x.ndim >= 2, params)


def inner_optimizer(opt: ml_collections.ConfigDict, total_steps: int) -> optax.GradientTransformation:
  """Each worker's optimizer: (clip) + AdamW or SGD on the warmup-cosine schedule."""
  schedule = inner_schedule(opt, total_steps)
  if opt.name == "adamw":
    tx = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay,
                     mask=_is_matrix)
  elif opt.name == "sgd":
    tx = optax.sgd(schedule)
  else:
    raise ValueError(f"unknown optimizer.name {opt.name!r}")
  if opt.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(opt.grad_clip), tx)
  return tx


def needs_nested_mean(config: ml_collections.ConfigDict, hosts, d_ff: int) -> bool:
  """Plain mean unless some worker trains a narrower FFN or workers are weighted by tokens."""
  return config.aggregate.weighting == "tokens" or any(h.hidden != d_ff for h in hosts)


def outer_optimizer(config: ml_collections.ConfigDict, inner_tx: optax.GradientTransformation,
                    layout: ParamLayout, *, nested: bool = False
                    ) -> optax.GradientTransformation:
  """What turns the workers' pseudo-gradients (or gradients, for DDP) into a global update.

  The aggregator comes first: it is the chain's only communication. With a codec
  (`compress.codec`) it is the compressed mean (encode, all-gather payloads, decode); else
  `nested` picks the tier-aware weighted mean (aggregate/nested.py) over the plain one (the
  compressed mean takes the same tier weights). DDP steps the averaged gradient with the
  per-step optimizer — or, with `demo`, with sign descent (DeMo/DisTrO); DiLoCo applies its
  outer Nesterov rule.

  It runs on flat Δ and θ (parallel/flat.py). The plain mean and DiLoCo's rule are
  elementwise and run on the flat buffer as is; codecs (per tensor), the nested mean (tier
  masks per FFN leaf) and DDP's optimizers (weight decay on matrices only) see the tree.
  """
  codec = compress.make_codec(config.compress, lr=config.optimizer.lr)
  if config.algorithm == "ddp" and config.compress.codec == "demo":
    rule = tree_view(sign_descent(config.optimizer, config.rounds), layout)
  elif config.algorithm == "ddp":
    rule = tree_view(inner_tx, layout)
  elif config.algorithm in ("diloco", "async", "async_dn", "halos"):
    # The synchronous outer step. (Asynchronous servers' rules: sim_backend.server_rules.)
    rule = outer.diloco_outer(config.outer.lr, config.outer.momentum, config.outer.nesterov)
  else:
    raise ValueError(f"unknown algorithm {config.algorithm!r}")
  if codec is not None:
    aggregator = tree_view(aggregate.compressed_mean(codec, "replica", seed=config.seed), layout)
  elif nested:
    aggregator = tree_view(aggregate.nested_mean("replica"), layout)
  else:
    aggregator = aggregate.replica_mean("replica")
  return optax.chain(aggregator, rule)


def sign_descent(opt: ml_collections.ConfigDict, total_steps: int) -> optax.GradientTransformation:
  """DeMo's outer step: θ ← θ − lr·(sign(ĝ) + wd·θ) on the decoded gradient ĝ (decoupled
  weight decay on matrices), on the run's warmup-cosine schedule."""
  return optax.chain(optax.scale_by_sign(),
                     optax.add_decayed_weights(opt.weight_decay, mask=_is_matrix),
                     optax.scale_by_learning_rate(inner_schedule(opt, total_steps)))
