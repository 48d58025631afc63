"""compressed_mean over the replica axis: equals the mean of individually decoded payloads,
across 4 forced host devices; the ledger counts the packed payload."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import all_gathered_bytes
from lowcomm_jax import compress
from lowcomm_jax.aggregate import compressed_mean
from lowcomm_jax.parallel import ledger, mesh as mesh_lib, workers

R = 4
RNG = np.random.default_rng(0)
TREE = {"w": jnp.asarray(RNG.standard_normal((130, 96)), jnp.float32),
        "b": jnp.asarray(RNG.standard_normal((67,)), jnp.float32)}


def _decoded(codec, mine, codec_state, key):
  """decode(encode(mine)) with the sender's error buffer and key, as one program (op by op
  each of the codec's ops would compile on its own)."""
  return jax.jit(lambda x, e, k: codec.decode(codec.encode(x, e, k)[0], x, k))(
      mine, codec_state, key)


def _codec(name, **overrides):
  cfg = ml_collections.ConfigDict(dict(
      codec=name, error_feedback=True, beta=0.9, quant_block=0, stochastic_rounding=True,
      density=0.02, chunk=64, k=16, value_bits=32, mean_over_senders=False))
  cfg.update(overrides)
  if name == "fp8":
    cfg.stochastic_rounding = False
  return compress.make_codec(cfg, lr=0.5)


# fp8's codes cross as f16: XLA's CPU backend widens an f8 all-gather. Every other codec's
# all-gathers are exactly its payloads (encoded per device: parallel/workers.py).
_WIDENED_ON_CPU = ("fp8",)


def _per_device(fn):
  """`fn` over the stacked workers the way a run's sync with a codec maps them."""
  return jax.jit(workers.map_workers(fn, (0, 0), (0, 0), per_device=True))


CASES = [("int8", {}), ("fp8", {}), ("int4", {}), ("topk", {}), ("topk", {"chunk": 0}),
         ("randomk", {}), ("sparseloco", {}), ("demo", {}), ("demo", {"mean_over_senders": True}),
         ("demo", {"value_bits": 1})]


@pytest.mark.parametrize("name,overrides", CASES)
def test_compressed_mean_over_four_devices_is_the_mean_of_the_decoded_payloads(name, overrides):
  codec = _codec(name, **overrides)
  tx = compressed_mean(codec, workers.PER_DEVICE, seed=3)
  updates = jax.tree.map(lambda x: jnp.stack([x * (w + 1) - w for w in range(R)]), TREE)
  state = jax.tree.map(lambda x: jnp.broadcast_to(x, (R,) + x.shape), tx.init(TREE))
  # Prime the error buffers with one round so they differ per worker.
  mesh = mesh_lib.make_mesh(R)
  split = NamedSharding(mesh, P("replica"))
  run = _per_device(tx.update)
  updates, state = jax.device_put((updates, state), split)
  with jax.set_mesh(mesh):
    _, state = run(updates, state)
    hlo = run.lower(updates, state).compile().as_text()
    mean, _ = run(updates, state)
  # The packed payloads, and nothing else, cross between the 4 devices: every device gathers
  # all R (f8 codes widened to f16 on this CPU).
  gathered = all_gathered_bytes(hlo)
  if name in _WIDENED_ON_CPU:
    assert R * codec.payload_bytes(TREE) < gathered < 2 * R * codec.payload_bytes(TREE)
  else:
    assert gathered == R * codec.payload_bytes(TREE)
  # Each device keeps only its own worker's error buffer (nothing forced it to).
  if jax.tree.leaves(state.codec_state):
    assert state.codec_state["w"].sharding.is_equivalent_to(split, 3)

  round_key = jax.random.fold_in(jax.random.key(3), 1)
  decoded = []
  for w in range(R):
    mine = jax.tree.map(lambda x: x[w], updates)
    key = jax.random.fold_in(round_key, w)
    decoded.append(_decoded(codec, mine, jax.tree.map(lambda x: x[w], state.codec_state), key))
  if name == "demo" and overrides.get("mean_over_senders"):
    # Averaging each coefficient over its senders is not the mean of the decoded tensors:
    # compare in the DCT domain, where it is the per-coefficient mean over senders.
    leaf = dict(zip(sorted(TREE), codec.codec.leaves(TREE)))["w"]  # inside its buffer
    coefficients = np.stack([leaf.to_coefficients(d["w"]) for d in decoded])
    got = np.asarray(leaf.to_coefficients(mean["w"][0]))
    sent = np.abs(coefficients) > 1e-3  # selected coefficients; the rest are round-off
    counts = np.maximum(sent.sum(0), 1)
    # Rows 128..129 of the 130-row tensor sit in zero-padded chunks (4, 5), whose
    # coefficients do not survive cropping; the four full chunks must match exactly.
    np.testing.assert_allclose(got[:4], (coefficients.sum(0) / counts)[:4], atol=1e-4)
    return
  expected = jax.tree.map(lambda *xs: sum(xs) / R, *decoded)
  for w in range(R):
    jax.tree.map(lambda m, e: np.testing.assert_allclose(m[w], e, rtol=1e-5, atol=1e-5),
                 mean, expected)


def test_sparseloco_sends_only_its_payloads_between_devices():
  """Two workers on each of 2 devices: each device encodes its own two, and the 4 payloads
  are all that is gathered; the mean is the one the 4-device layout computes. (Left to XLA's
  partitioner, `vmap(spmd_axis_name=...)`, the dense |x| was all-gathered to run top-k.)"""
  codec = _codec("sparseloco")
  tx = compressed_mean(codec, workers.PER_DEVICE)
  updates = jax.tree.map(lambda x: jnp.stack([x * (w + 1) for w in range(R)]), TREE)
  state = jax.tree.map(lambda x: jnp.broadcast_to(x, (R,) + x.shape), tx.init(TREE))
  means = []
  for devices in (2, R):
    run = _per_device(tx.update)  # a trace per mesh: the shard_map reads the mesh it is under
    mesh = mesh_lib.make_mesh(devices)
    placed = jax.device_put((updates, state), NamedSharding(mesh, P("replica")))
    with jax.set_mesh(mesh):
      hlo = run.lower(*placed).compile().as_text()
      means.append(run(*placed)[0])
    assert all_gathered_bytes(hlo) == R * codec.payload_bytes(TREE)
  jax.tree.map(np.testing.assert_array_equal, *means)


@pytest.mark.parametrize("name", ["int8", "int4", "sparseloco", "demo", "randomk"])
def test_ledger_counts_exactly_the_packed_payload(name):
  codec = _codec(name)
  tx = compressed_mean(codec)
  updates = jax.tree.map(lambda x: jnp.stack([x] * R), TREE)
  state = jax.tree.map(lambda x: jnp.broadcast_to(x, (R,) + x.shape), tx.init(TREE))
  counted = ledger.count_bytes(jax.vmap(tx.update, axis_name="replica"), updates, state)
  payload = codec.payload_bytes(TREE)
  produced = jax.jit(lambda t: codec.encode(t, codec.init(t), jax.random.key(0))[0])(TREE)
  assert payload == sum(x.nbytes for x in jax.tree.leaves(produced))
  assert counted == ledger.CommBytes(sent=payload, received=(R - 1) * payload)
  assert payload < ledger.tree_bytes(TREE) / 2


def test_roundtrip_without_a_collective():
  codec = _codec("int8")
  out, state = jax.jit(lambda t: codec.roundtrip(t, codec.init(t), jax.random.key(0)))(TREE)
  jax.tree.map(lambda o, x, e: np.testing.assert_allclose(o + e, x, atol=1e-5), out, TREE, state)


@pytest.mark.parametrize("name,overrides", [("topk", {}), ("demo", {}), ("int4", {})])
def test_tier_weights_apply_after_decoding_so_the_wide_worker_is_not_diluted(name, overrides):
  # Worker 0 trains all 96 columns, worker 1 (a narrow tier) only the first 40; its
  # pseudo-gradient is zero beyond them, but a lossy codec may reconstruct something there.
  codec = _codec(name, **overrides)
  tx = compressed_mean(codec)
  w = {"w": TREE["w"]}
  mask = (jnp.arange(96) < 40).astype(jnp.float32)[None, :]
  updates = {"w": jnp.stack([w["w"], w["w"] * mask * 0.5])}
  weights = {"w": jnp.stack([jnp.ones_like(mask), mask])}
  totals = {"w": weights["w"].sum(0)}
  state = jax.tree.map(lambda x: jnp.broadcast_to(x, (2,) + x.shape), tx.init(w))
  mean, _ = jax.jit(jax.vmap(
      lambda u, s: tx.update(u, s, sender_weights=weights, weight_totals=totals),
      axis_name="replica"))(updates, state)
  round_key = jax.random.fold_in(jax.random.key(0), 0)
  decoded = []
  for i in range(2):
    key = jax.random.fold_in(round_key, i)
    mine = {"w": updates["w"][i]}
    decoded.append(_decoded(codec, mine, jax.tree.map(lambda x: x[i], state.codec_state),
                            key)["w"])
  expected = (decoded[0] + mask * decoded[1]) / (1 + mask)
  np.testing.assert_allclose(mean["w"][0], expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(mean["w"][0][:, 40:], decoded[0][:, 40:], rtol=1e-6, atol=1e-6)
