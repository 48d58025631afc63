import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowcomm_jax.parallel import collectives, ledger


def test_tree_bytes_counts_shapes_and_dtypes():
  tree = {"a": jnp.zeros((3, 4), jnp.float32), "b": jax.ShapeDtypeStruct((10,), jnp.bfloat16),
          "c": np.zeros(5, np.uint16)}
  assert ledger.tree_bytes(tree) == 48 + 20 + 10


def test_count_bytes_is_per_worker_under_vmap():
  def round_fn(x_R):
    def worker(x):
      m = collectives.mean({"w": x, "h": x[:2].astype(jnp.bfloat16)})
      return collectives.all_gather(m["w"][:1])
    return jax.vmap(worker, axis_name="replica")(x_R)

  counted = ledger.count_bytes(round_fn, jax.ShapeDtypeStruct((4, 8), jnp.float32))
  # mean: 8 fp32 + 2 bf16 sent and received; all_gather: 1 fp32 sent, 3 others received.
  assert counted == ledger.CommBytes(sent=32 + 4 + 4, received=32 + 4 + 3 * 4)


def test_counting_twice_gives_the_same_answer_and_jitted_functions_are_refused():
  f = jax.vmap(lambda x: collectives.mean(x), axis_name="replica")
  x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
  assert ledger.count_bytes(f, x) == ledger.count_bytes(f, x) == ledger.CommBytes(32, 32)
  with pytest.raises(TypeError, match="plain function"):
    ledger.count_bytes(jax.jit(f), x)


def test_a_single_worker_sends_nothing():
  f = jax.vmap(lambda x: collectives.mean(x), axis_name="replica")
  assert ledger.count_bytes(f, jax.ShapeDtypeStruct((1, 8), jnp.float32)) == ledger.CommBytes()


def test_recording_is_off_outside_count_bytes_and_private_to_its_thread():
  f = jax.vmap(lambda x: collectives.mean(x), axis_name="replica")
  x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
  np.testing.assert_allclose(f(jnp.arange(4.0)), jnp.full(4, 1.5))  # no log to write to
  assert getattr(ledger._local, "log", None) is None
  with pytest.raises(ZeroDivisionError):  # a failing trace still ends the recording
    ledger.count_bytes(lambda x: (f(x), 1 / 0), x)
  assert getattr(ledger._local, "log", None) is None
  # Training code tracing collectives in another thread meanwhile (a checkpoint thread,
  # another test) must not be counted as this function's bytes.
  big = jax.vmap(lambda y: collectives.all_gather(y), axis_name="replica")

  def counted_fn(x):
    other = threading.Thread(
        target=lambda: jax.eval_shape(big, jax.ShapeDtypeStruct((4, 1000), jnp.float32)))
    other.start()
    other.join()
    return f(x)
  assert ledger.count_bytes(counted_fn, x) == ledger.CommBytes(32, 32)
