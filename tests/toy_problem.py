"""A one-fragment toy problem run through programs/steps.py's real programs, for the hand-computed
trajectories of the overlapped DiLoCo variants: θ is one 2-vector, worker w's loss is
½‖θ − t_w‖² (an SGD step at lr η is θ ← θ − η(θ − t_w)), two workers, H steps a round."""

import jax
import jax.numpy as jnp
import numpy as np

from conftest import load_config
from lowcomm_jax import algorithms
from lowcomm_jax.programs import optimizers
from lowcomm_jax.programs import state_average
from lowcomm_jax.programs import steps
from lowcomm_jax.programs import sync_program
from lowcomm_jax.parallel import mesh as mesh_lib
from lowcomm_jax.parallel.flat import ParamLayout

TARGETS = np.array([[1.0, -1.0], [-3.0, 2.0]], np.float32)
THETA0 = np.array([0.5, 0.25], np.float32)
ETA, H, LR, BETA = 0.25, 3, 0.7, 0.9


def sgd_steps(x, target, steps_=H):
  for _ in range(steps_):
    x = x - ETA * (x - target)
  return x


def run(algorithm_name: str, rounds: int, **overrides):
  """(θ after every sync [rounds, 2], the workers' final states)."""
  config = load_config("smoke", algorithm=algorithm_name, num_workers=2, inner_steps=H,
                       rounds=rounds, **{
      "optimizer.name": "sgd", "optimizer.lr": ETA, "optimizer.warmup_steps": 0,
      "optimizer.min_lr_ratio": 1.0, "optimizer.grad_clip": 0.0,
      "outer.lr": LR, "outer.momentum": BETA, **overrides})
  algorithm = algorithms.get(algorithm_name)
  tree = {"w": THETA0}
  layout = ParamLayout.of(tree)
  inner_tx = optimizers.inner_optimizer(config.optimizer, 1000)
  loss_fn = lambda params, target, key, frozen: 0.5 * jnp.sum((params["w"] - target) ** 2)
  aggregator = algorithm.sync(config, hosts=(), d_ff=1).aggregator(layout.fragment(0))
  rule = algorithm.outer_rule(config, inner_tx, layout.fragment(0))
  worker_rule = algorithm.worker_rule(config)
  keeps = algorithm.keeps_worker_params(config)
  local = jax.jit(steps.make_local_segment(
      loss_fn, inner_tx=inner_tx, hidden=1, d_ff=1, layout=layout,
      segment=algorithm.segments(config, H)[0], index=0, count=1, alpha=algorithm.mix(config),
      local_steps=True, keeps_params=keeps, worker_rule=worker_rule))
  sync = jax.jit(sync_program.make_sync(aggregator, rule, nested=False, weigh_tokens=False,
                                 layout=layout, fragment=0, count=1, last=True),
                 static_argnames="metrics")
  with jax.set_mesh(mesh_lib.make_mesh(1, 1, 1)):
    state = steps.init_state(layout.ravel(tree), seed=0, layout=layout,
                             aggregators=[aggregator], rules=[rule], num_workers=2)
    workers = steps.init_workers(state.params, workers=2, hidden=1, d_ff=1, layout=layout,
                                 inner_tx=inner_tx, local_steps=True, keeps_params=keeps,
                                 worker_rule=worker_rule)
    signals = steps.Signals(jnp.ones(2, jnp.int32), jnp.ones(2, jnp.float32),
                            jnp.zeros(2, jnp.float32))
    batches = jnp.broadcast_to(jnp.asarray(TARGETS)[:, None], (2, H, 2))
    state_sync = algorithm.state_sync(config)
    average = (jax.jit(state_average.make_state_sync(state_sync), static_argnames="parts")
               if state_sync is not None else None)
    thetas = []
    for r in range(rounds):
      if average is not None and (parts := state_sync.due(r)):  # DES-LOC's moments
        workers = workers._replace(opt_state=average(workers.opt_state, parts=parts))
      view = state._replace(outer=steps.OuterState((), state.outer.per_fragment)
                            if worker_rule is not None else ())
      delta, workers, _ = local(view, workers, batches, jnp.arange(2, dtype=jnp.int32))
      state, _ = sync(state, delta, signals, metrics=False)
      thetas.append(np.asarray(state.params))
  return np.asarray(thetas), workers
