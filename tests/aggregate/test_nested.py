import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowcomm_jax.aggregate import nested_mean
from lowcomm_jax.model.matformer import pad_tier, slice_tier, tier_mask


def _aggregate(deltas_R, weights_R):
  tx = nested_mean()
  totals = jax.tree.map(lambda w: w.sum(0), weights_R)
  update = lambda d, w: tx.update(d, tx.init(d), coordinate_weights=w, weight_totals=totals)[0]
  return jax.vmap(update, axis_name="replica", out_axes=None)(deltas_R, weights_R)


def test_two_tiers_hand_computed():
  # One FFN with F = 4 hidden units and one shared vector. Worker 0: full width (m = 4);
  # workers 1, 2: tier m = 1, so their padded Δ is zero on hidden units 1..3.
  full = {"mlp": {"fc_kernel": jnp.zeros((2, 4)), "fc_bias": jnp.zeros(4)}, "ln": jnp.zeros(2)}
  deltas = {"mlp": {"fc_kernel": jnp.array([[[1., 2., 3., 4.], [5., 6., 7., 8.]],
                                            [[4., 0., 0., 0.], [2., 0., 0., 0.]],
                                            [[7., 0., 0., 0.], [8., 0., 0., 0.]]]),
                    "fc_bias": jnp.array([[3., 3., 3., 3.], [6., 0., 0., 0.], [0., 0., 0., 0.]])},
            "ln": jnp.array([[3., 0.], [6., 3.], [0., 3.]])}
  masks = jax.vmap(lambda m: tier_mask(full, m))(jnp.array([4, 1, 1]))
  out = _aggregate(deltas, masks)
  # Unit 0 is trained by all three: mean of (1, 4, 7) = 4 and (5, 2, 8) = 5; units 1..3
  # only by worker 0: its values, undiluted. Shared params: plain mean over three.
  np.testing.assert_allclose(out["mlp"]["fc_kernel"], [[4., 2., 3., 4.], [5., 6., 7., 8.]])
  np.testing.assert_allclose(out["mlp"]["fc_bias"], [3., 3., 3., 3.])
  np.testing.assert_allclose(out["ln"], [3., 2.])
  # Token weighting: worker 0 counts 2x. Unit 0 of fc_bias: (2*3 + 6 + 0) / 4 = 3.
  weighted = jax.tree.map(lambda m: m * jnp.array([2., 1., 1.]).reshape((3,) + (1,) * (m.ndim - 1)),
                          masks)
  np.testing.assert_allclose(_aggregate(deltas, weighted)["mlp"]["fc_bias"], [3., 3., 3., 3.])
  np.testing.assert_allclose(_aggregate(deltas, weighted)["ln"], [3., 1.5])


def test_uniform_weights_are_the_plain_mean():
  deltas = jnp.arange(12.0).reshape(4, 3)
  out = _aggregate({"w": deltas}, {"w": jnp.ones((4,))})
  np.testing.assert_allclose(out["w"], deltas.mean(0))


def test_slice_and_pad_round_trip():
  params = {"blocks": {"0": {"mlp": {"fc_kernel": jnp.ones((3, 8)), "fc_bias": jnp.ones(8),
                                     "proj_kernel": jnp.ones((8, 3)), "proj_bias": jnp.ones(3)}}},
            "wte": jnp.ones((5, 3))}
  tier = slice_tier(params, 2)
  mlp = tier["blocks"]["0"]["mlp"]
  assert mlp["fc_kernel"].shape == (3, 2) and mlp["fc_bias"].shape == (2,)
  assert mlp["proj_kernel"].shape == (2, 3) and mlp["proj_bias"].shape == (3,)
  padded = pad_tier(tier, params)
  assert jax.tree.map(jnp.shape, padded) == jax.tree.map(jnp.shape, params)
  np.testing.assert_array_equal(padded["blocks"]["0"]["mlp"]["fc_kernel"][:, 2:], 0.0)
  np.testing.assert_array_equal(padded["blocks"]["0"]["mlp"]["fc_kernel"][:, :2], 1.0)
  assert optax.tree.norm(padded) ** 2 == optax.tree.norm(tier) ** 2
