import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowcomm_jax.parallel.flat import ParamLayout, tree_view


def _tree(key=0):
  k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
  return {"w": jax.random.normal(k1, (3, 4)), "b": jax.random.normal(k2, (4,)),
          "blocks": [{"k": jax.random.normal(k3, (2, 2, 2))}]}


def test_ravel_unravel_round_trip_in_leaf_order_and_per_worker_under_vmap():
  tree = _tree()
  layout = ParamLayout.of(tree)
  assert layout.size == 12 + 4 + 8
  flat = layout.ravel(tree)
  # Leaf order (jax.tree order: "b", "blocks", "w"), each leaf row-major.
  np.testing.assert_array_equal(flat, np.concatenate(
      [np.ravel(tree["b"]), np.ravel(tree["blocks"][0]["k"]), np.ravel(tree["w"])]))
  jax.tree.map(np.testing.assert_array_equal, layout.unravel(flat), tree)
  # As the runner uses it: one worker per vmapped row.
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), tree, _tree(1))  # [2, ...] per leaf
  flat_2 = jax.vmap(layout.ravel)(stacked)
  assert flat_2.shape == (2, layout.size)
  np.testing.assert_array_equal(flat_2[1], layout.ravel(_tree(1)))
  jax.tree.map(np.testing.assert_array_equal, jax.vmap(layout.unravel)(flat_2), stacked)


def test_layout_of_mixed_dtypes_is_refused():
  with pytest.raises(ValueError, match="one dtype"):
    ParamLayout.of({"a": jnp.zeros(2), "b": jnp.zeros(2, jnp.bfloat16)})


def test_ravel_refuses_a_tree_of_other_shapes():
  layout = ParamLayout.of(_tree())
  cut = jax.tree.map(lambda x: x[..., :1], _tree())  # e.g. a tier tree that was not padded
  with pytest.raises(ValueError, match="where the layout has"):
    layout.ravel(cut)


def test_tree_view_passes_extra_args_through_as_trees():
  """The nested and compressed means take tier weights as trees: they must arrive intact."""
  tree = _tree()
  layout = ParamLayout.of(tree)

  def update(updates, state, params=None, *, coordinate_weights):
    return jax.tree.map(lambda w, u: w * u, coordinate_weights, updates), state

  weights = jax.tree.map(lambda x: jnp.full(x.shape[-1:], 2.0), tree)  # broadcast over rows
  flat_tx = tree_view(optax.GradientTransformationExtraArgs(lambda p: (), update), layout)
  out, _ = flat_tx.update(layout.ravel(tree), flat_tx.init(layout.ravel(tree)),
                          coordinate_weights=weights)
  np.testing.assert_allclose(out, 2.0 * layout.ravel(tree), rtol=1e-6)


def test_tree_view_gives_the_tree_transforms_update_and_state():
  """AdamW with weight decay on matrices only: the mask needs the tree, the view keeps it."""
  tree, grads = _tree(0), _tree(1)
  layout = ParamLayout.of(tree)
  tx = optax.adamw(0.1, weight_decay=0.5, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
  flat_tx = tree_view(tx, layout)
  state, flat_state = tx.init(tree), flat_tx.init(layout.ravel(tree))
  for _ in range(2):
    updates, state = tx.update(grads, state, tree)
    flat_updates, flat_state = flat_tx.update(layout.ravel(grads), flat_state, layout.ravel(tree))
    np.testing.assert_allclose(flat_updates, layout.ravel(updates), rtol=1e-6)
  jax.tree.map(np.testing.assert_array_equal, flat_state, state)
