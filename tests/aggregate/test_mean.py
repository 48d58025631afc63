import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowcomm_jax.aggregate import replica_mean


def test_replica_mean_is_the_mean_over_workers_and_stateless():
  tx = replica_mean()
  g = jnp.arange(12.0).reshape(4, 3)
  out, state = jax.vmap(lambda u: tx.update(u, tx.init(u)), axis_name="replica",
                        out_axes=(None, None))(g)
  np.testing.assert_allclose(out, g.mean(0))
  assert state == optax.EmptyState()


def test_mean_then_step_optimizer_is_ddp():
  tx = optax.chain(replica_mean(), optax.sgd(0.1))
  params = jnp.zeros(2)
  grads = jnp.array([[1.0, 2.0], [3.0, 6.0]])

  def worker(g):
    updates, _ = tx.update(g, tx.init(params), params)
    return updates

  np.testing.assert_allclose(jax.vmap(worker, axis_name="replica", out_axes=None)(grads),
                             [-0.2, -0.4], rtol=1e-6)
