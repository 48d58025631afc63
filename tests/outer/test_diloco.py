import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowcomm_jax.aggregate import replica_mean
from lowcomm_jax.outer import diloco_outer, pseudo_gradient


def _diloco(lr, momentum, nesterov=True):
  """The chain the runner builds for DiLoCo: mean over workers, then the outer rule."""
  return optax.chain(replica_mean("replica"), diloco_outer(lr, momentum, nesterov))


def _outer_round(tx, params, state, local_params_R):
  """One outer step with workers mapped on the named replica axis, as the runner does."""
  def worker(params, state, local):
    updates, state = tx.update(pseudo_gradient(params, local), state, params)
    return optax.apply_updates(params, updates), state
  return jax.vmap(worker, in_axes=(None, None, 0), out_axes=(None, None), axis_name="replica")(
      params, state, local_params_R)


def test_outer_nesterov_matches_hand_computed_two_rounds():
  tx = _diloco(lr=0.7, momentum=0.9)
  theta0 = jnp.array([1.0, 2.0])
  state = tx.init(theta0)
  # Round 1: Δ = θ - θ_w = [0.2, -0.2], [0.4, 0.2] -> mean [0.3, 0.0]
  #   m1 = Δ̄ = [0.3, 0];  θ1 = θ0 - 0.7 (Δ̄ + 0.9 m1) = [1 - 0.7*0.57, 2] = [0.601, 2.0]
  theta1, state = _outer_round(tx, theta0, state, jnp.array([[0.8, 2.2], [0.6, 1.8]]))
  np.testing.assert_allclose(theta1, [0.601, 2.0], rtol=1e-6)
  # Round 2: Δ = [0.1, 0.1], [0.1, -0.3] -> mean [0.1, -0.1]
  #   m2 = Δ̄ + 0.9 m1 = [0.37, -0.1];  θ2 = θ1 - 0.7 (Δ̄ + 0.9 m2) = θ1 - 0.7 [0.433, -0.19]
  local2 = jnp.array([[0.501, 1.9], [0.501, 2.3]])
  theta2, state = _outer_round(tx, theta1, state, local2)
  np.testing.assert_allclose(theta2, [0.601 - 0.3031, 2.0 + 0.133], rtol=1e-5)


def test_outer_without_momentum_is_plain_averaging_at_lr_one():
  tx = _diloco(lr=1.0, momentum=0.0)
  theta = jnp.array([1.0, -1.0, 3.0])
  locals_R = jnp.array([[0.0, 0.0, 0.0], [2.0, 2.0, 2.0], [1.0, -4.0, 4.0]])
  new, _ = _outer_round(tx, theta, tx.init(theta), locals_R)
  np.testing.assert_allclose(new, locals_R.mean(0), rtol=1e-6)  # lr 1 => θ' = mean of θ_w
