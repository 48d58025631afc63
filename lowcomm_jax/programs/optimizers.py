"""The optimizers a run uses, built from its config: each worker's inner optimizer and
DeMo's sign descent (how workers' Δ are combined is programs/sync.py's)."""

import jax
import jax.numpy as jnp
import ml_collections
import optax

from lowcomm_jax.errors import Problems
from optax import contrib as optax_contrib


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


def sign_descent(opt: ml_collections.ConfigDict, total_steps: int) -> optax.GradientTransformation:
  """DeMo's outer step: θ ← θ − lr·(sign(ĝ) + wd·θ) on the decoded gradient ĝ (decoupled
  weight decay on matrices), on the run's warmup-cosine schedule."""
  return optax.chain(optax.scale_by_sign(),
                     optax.add_decayed_weights(opt.weight_decay, mask=_is_matrix),
                     optax.scale_by_learning_rate(inner_schedule(opt, total_steps)))


def problems(c: ml_collections.ConfigDict) -> list[str]:
  """The inner optimizer's and the outer rules' shared fields ('field=value: fix')."""
  out = Problems(c)
  check = out.check
  check(c.optimizer.name in INNER, "optimizer.name",
        f"use one of {INNER}")
  check(0.0 <= c.optimizer.momentum < 1.0, "optimizer.momentum", "must be in [0, 1)")
  check(c.optimizer.adam_lr >= 0, "optimizer.adam_lr", "must be >= 0 (0: optimizer.lr)")
  check(c.optimizer.lr > 0, "optimizer.lr", "must be > 0")
  check(c.optimizer.warmup_steps >= 0, "optimizer.warmup_steps", "must be >= 0")
  check(c.optimizer.grad_clip >= 0, "optimizer.grad_clip", "must be >= 0 (0 disables clipping)")
  check(c.optimizer.decay_steps >= 0, "optimizer.decay_steps",
        "must be >= 0 (0: rounds * inner_steps)")
  check(0.0 <= c.optimizer.min_lr_ratio <= 1.0, "optimizer.min_lr_ratio",
        "must be in [0, 1] (the final lr is lr * min_lr_ratio)")
  for field in ("b1", "b2"):
    check(0.0 <= c.optimizer[field] < 1.0, f"optimizer.{field}",
          "AdamW's moment decay must be in [0, 1) (e.g. 0.9, 0.95)")
  check(c.optimizer.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0 (0: none)")
  check(c.outer.lr > 0, "outer.lr", "must be > 0")
  check(0.0 <= c.outer.momentum < 1.0, "outer.momentum", "must be in [0, 1)")
  check(c.outer.dn_buffer >= 0, "outer.dn_buffer", "must be >= 0 (0: the server's workers)")
  check(c.outer.dn_c >= 0, "outer.dn_c", "Delayed Nesterov's c must be >= 0")
  return list(out)


def config_defaults() -> ml_collections.ConfigDict:
  """The `optimizer` section: each worker's inner optimizer (for ddp the per-step one;
  config/defaults.py puts it in every config)."""
  s = ml_collections.ConfigDict()
  # Inner optimizers (this module): adamw | sgd | lamb | lars | adafactor | lion | muon
  # (Newton-Schulz-orthogonalized momentum on hidden matrices, AdamW on embeddings, the LM
  # head, norms and biases).
  s.name = "adamw"  # inner optimizer (above)
  s.lr = 3e-3  # peak learning rate
  s.warmup_steps = 50  # linear warmup (inner steps)
  s.decay_steps = 0  # cosine decay length in inner steps; 0: rounds * inner_steps
  s.min_lr_ratio = 0.1  # final lr = lr * min_lr_ratio
  s.b1 = 0.9  # first-moment decay (AdamW, LAMB, Lion, Muon's AdamW part)
  s.b2 = 0.95  # second-moment decay (the same; Lion's paper uses 0.99)
  s.momentum = 0.95  # momentum of lars and muon (sgd is plain SGD)
  s.adam_lr = 0.0  # muon: peak lr of its AdamW part; 0: optimizer.lr
  s.weight_decay = 0.1  # decoupled, on matrices only (not biases/LayerNorm)
  s.grad_clip = 1.0  # global-norm clipping; 0 disables it
  return s
