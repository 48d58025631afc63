"""The quantized reduce-scatter (compress.reduce='scatter'; compress/sharded.py,
aggregate.compressed_scatter_mean, the Ray members' steps in runtimes/ray/scatter_shards.py):
its definition step by step, its bytes by the ledger and on each link, the lockstep sync
against the Ray members' rounds, and what the config refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_config
from peer_members import form_round
from lowcomm_jax import aggregate, compress
from lowcomm_jax.assemble.build import build
from lowcomm_jax.assemble.hosts import host
from lowcomm_jax.assemble.jitted import jitted_steps
from lowcomm_jax.assemble.plan import make_plan, one_device
from lowcomm_jax.config import check
from lowcomm_jax.errors import ConfigError
from lowcomm_jax.parallel import ledger
from lowcomm_jax.programs import scatter_program, servers, steps
from lowcomm_jax.runtimes.ray import replica as replica_lib
from lowcomm_jax.runtimes.ray.actors import initial_params
from lowcomm_jax.sim.sync_schedules import collective_seconds


def _codec(codec="int8", shards=4, **fields):
  z = compress.config_defaults()
  z.update(codec=codec, reduce="scatter", **fields)
  return compress.make_codec(z, shards=shards)


def _updates(workers, seed=0):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.normal(0, 1e-2, (workers, 37, 29)), jnp.float32),
          "b": jnp.asarray(rng.normal(0, 1e-2, (workers, 301)), jnp.float32)}


def _lockstep_mean(codec, updates, round_index=5, seed=3):
  tx = aggregate.compressed_scatter_mean(codec, seed=seed)
  state = jax.vmap(tx.init)(updates)

  def sync(u, s):
    return jax.vmap(lambda u, s: tx.update(u, s, round_index=jnp.int32(round_index)),
                    axis_name="replica")(u, s)

  return sync, state


@pytest.mark.parametrize("name", ["int8", "int4", "fp8", "muloco"])
def test_each_owner_decodes_its_shard_of_every_payload_averages_and_encodes_it_once(name):
  """The mean every worker ends with is, shard by shard: every sender's payload of the
  shard decoded with its key, averaged, encoded once more with the owner's key, decoded;
  each sender's error buffer keeps its own first quantization's error only."""
  workers, seed, round_index = 4, 3, 5
  codec = _codec(name, shards=workers)
  sharded = codec.sharded
  updates = _updates(workers)
  sync, state = _lockstep_mean(codec, updates, round_index, seed)
  mean, new_state = sync(updates, state)
  like = jax.tree.map(lambda x: x[0], updates)
  keys = aggregate.sender_keys(seed, round_index, jnp.arange(workers))
  payloads, sent = [], []
  for w in range(workers):
    buffered = jax.tree.map(lambda x: x[w], updates)  # (the buffer starts at zero)
    p, s = sharded.send(buffered, keys[w])
    payloads.append(p)
    sent.append(s)
  leaf = sharded.leaf(like)
  reduced = []
  for k in range(workers):
    decoded = [leaf.decode(jax.tree.map(lambda x: x[k], payloads[w]),
                           jax.random.fold_in(keys[w], k)) for w in range(workers)]
    again = leaf.encode(sum(decoded) / workers, sharded.reduced_key(seed, round_index, k))[0]
    reduced.append(leaf.decode(again, sharded.reduced_key(seed, round_index, k)))
  expected = sharded.join(jnp.stack(reduced), like)
  for w in range(workers):
    for a, b in zip(jax.tree.leaves(mean), jax.tree.leaves(expected)):
      np.testing.assert_allclose(a[w], b, rtol=0, atol=1e-7)
    errors = new_state.codec_state
    for e, u, s in zip(jax.tree.leaves(errors), jax.tree.leaves(updates),
                       jax.tree.leaves(sent[w])):
      np.testing.assert_allclose(e[w], u[w] - s, rtol=0, atol=1e-7)
  true = jax.tree.map(lambda x: x.mean(0), updates)
  worst = max(float(jnp.abs(a[0] - b).max()) for a, b in zip(jax.tree.leaves(mean),
                                                                jax.tree.leaves(true)))
  top = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(updates))
  assert 0 < worst < {"int8": 2 / 127, "fp8": 0.2, "int4": 2 / 7, "muloco": 2.0}[name] * top


def test_the_ledger_counts_two_payloads_less_one_share_per_worker_where_gather_counts_w_less_one():
  workers = 8
  scatter = _codec("int8", shards=workers)
  updates = _updates(workers)
  like = jax.tree.map(lambda x: x[0], updates)
  payload = scatter.payload_bytes(like)
  sync, state = _lockstep_mean(scatter, updates)
  scattered = ledger.count_bytes(sync, updates, state)
  assert scattered.received == 2 * (workers - 1) * payload // workers
  z = compress.config_defaults()
  z.update(codec="int8", quant_block=256)
  gather = compress.make_codec(z)
  tx = aggregate.compressed_mean(gather)
  gathered = ledger.count_bytes(
      lambda u, s: jax.vmap(lambda u, s: tx.update(u, s), axis_name="replica")(u, s),
      updates, jax.vmap(tx.init)(updates))
  assert gathered.received == (workers - 1) * gather.payload_bytes(like)
  assert scattered.received < 0.3 * gathered.received


def _run(workers, **overrides):
  c = load_config("smoke", **{"algorithm": "diloco", "num_workers": workers, "inner_steps": 2,
                              "mesh.replica": 1, "compress.codec": "int8",
                              "compress.reduce": "scatter", **overrides})
  return build(one_device(c), check_memory=False)


@pytest.mark.parametrize("workers,overrides", [
    (3, {}),
    (4, {}),
    (4, {"aggregate.weighting": "tokens", "compress.codec": "int4"}),
    (3, {"hosts": [host(1.0), host(0.5), host(0.5)], "compress.stochastic_rounding": True}),
], ids=["w3", "w4", "w4-tokens-int4", "w3-tiers-stochastic"])
def test_ray_members_reduce_scatter_as_the_lockstep_sync(workers, overrides):
  """Three rounds of the lockstep sync against the same rounds among the Ray runtime's
  members (each encodes its own Δ with its error buffer; the shards' owners reduce and
  re-encode): θ and the outer state agree to float rounding, and every link carried
  2·(W−1)/W payloads."""
  r = _run(workers, **overrides)
  assert scatter_program.scatters(r.sync) and not make_plan(r.config, r).gathers
  lockstep = jitted_steps(r, donate=False).syncs[0]
  with jax.set_mesh(r.topology.mesh):
    theirs = jax.jit(r.state_spec.init)(r.state_spec.initial_params())
  codec, layout = r.sync.codec, r.model.layout
  encode = jax.jit(jax.vmap(servers.make_encode(codec, layout)))
  errors = jax.tree.map(lambda x: jnp.broadcast_to(x, (workers,) + x.shape),
                        codec.init(layout.abstract))
  replicas = {w: replica_lib.Replica(r, initial_params(r), w) for w in range(workers)}
  np.testing.assert_array_equal(replicas[0].params, theirs.params)
  rng = np.random.default_rng(0)
  tokens = [5.0 * (w + 1) for w in range(workers)]
  payload_bytes = codec.payload_bytes(layout.abstract)
  for version in range(3):
    deltas = rng.normal(0, 1e-3, (workers, layout.size)).astype(np.float32)
    deltas[-1] *= 10  # one loud worker
    signals = steps.Signals(jnp.asarray(r.topology.hidden_per_worker),
                            jnp.asarray(tokens, jnp.float32), jnp.full(workers, 2.0))
    with jax.set_mesh(r.topology.mesh):
      theirs, _ = lockstep(theirs, jnp.asarray(deltas), signals, metrics=False)
    keys = aggregate.sender_keys(r.config.seed, version, jnp.arange(workers))
    sent, errors = encode(jnp.asarray(deltas), errors, keys)
    rows = {}
    for w in range(workers):
      rows[w] = (jax.device_get(jax.tree.map(lambda x: x[w], sent)),
                 {"tokens": tokens[w], "loss": 2.0, "version": version,
                  "codec_key": np.asarray(jax.random.key_data(keys[w]))})
      replicas[w].keep(version, *rows[w])
    outcome, transport = form_round(replicas, version, rows)
    assert len({out["hash"] for out in outcome.values()}) == 1
    for w, (out_bytes, in_bytes) in transport.links(list(rows)).items():
      assert [out_bytes, in_bytes] == [outcome[w]["sent"], outcome[w]["received"]]
      assert in_bytes == 2 * (workers - 1) * payload_bytes // workers
    for w in range(workers):
      assert replicas[w].commit(version) == version + 1
  for w in range(workers):
    np.testing.assert_allclose(replicas[w].params, theirs.params, rtol=0, atol=1e-6)
    for a, b in zip(jax.tree.leaves(replicas[w].opt_state),
                    jax.tree.leaves(theirs.outer.per_fragment)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  assert np.abs(np.asarray(theirs.params) - initial_params(r)).max() > 1e-4  # θ moved


def test_a_round_without_a_member_gives_its_shards_to_the_others():
  """Three of four members: member j reduces the shards k with k mod 3 = j (shard 3 too),
  over the present payloads; the replicas agree and θ is the present workers' mean to the
  second quantization's error."""
  workers = 4
  r = _run(workers)
  codec, layout = r.sync.codec, r.model.layout
  encode = jax.jit(jax.vmap(servers.make_encode(codec, layout)))
  errors = jax.tree.map(lambda x: jnp.broadcast_to(x, (workers,) + x.shape),
                        codec.init(layout.abstract))
  deltas = np.random.default_rng(1).normal(0, 1e-3, (workers, layout.size)).astype(np.float32)
  keys = aggregate.sender_keys(r.config.seed, 0, jnp.arange(workers))
  sent, _ = encode(jnp.asarray(deltas), errors, keys)
  members = [0, 2, 3]
  replicas = {w: replica_lib.Replica(r, initial_params(r), w) for w in members}
  rows = {w: (jax.device_get(jax.tree.map(lambda x: x[w], sent)),
              {"tokens": 8.0, "loss": 2.0, "version": 0,
               "codec_key": np.asarray(jax.random.key_data(keys[w]))}) for w in members}
  for w in members:
    replicas[w].keep(0, *rows[w])
  outcome, _ = form_round(replicas, 0, rows)
  assert len({out["hash"] for out in outcome.values()}) == 1
  assert outcome[0]["sent"] > outcome[2]["sent"]  # member 0 owns shards 0 and 3
  for w in members:
    replicas[w].commit(0)
  moved = initial_params(r) - np.asarray(replicas[0].params)
  decoded = np.stack([np.asarray(layout.ravel(codec.decode(
      rows[w][0], layout.abstract, keys[w]))) for w in members])
  mean = decoded.mean(0)  # the present workers' (the absent one's would pull it elsewhere)
  # θ moved along it (Nesterov's first outer step is a multiple of the mean)
  cosine = moved @ mean / np.linalg.norm(moved) / np.linalg.norm(mean)
  assert cosine > 0.999, cosine
  everyone = np.asarray(layout.ravel(codec.decode(jax.tree.map(lambda x: x[1], sent),
                                                  layout.abstract, keys[1])))
  with_1 = (decoded.sum(0) + everyone) / workers
  assert moved @ with_1 / np.linalg.norm(moved) / np.linalg.norm(with_1) < cosine


@pytest.mark.parametrize("overrides,field", [
    ({"compress.codec": "topk"}, "compress.reduce"),
    ({"compress.codec": "int8", "aggregate.rule": "median"}, "compress.reduce"),
    ({"compress.codec": "int8", "algorithm": "async"}, "compress.reduce"),
    ({"compress.codec": "int8", "runtime": "ray", "collective_form": "server"},
     "compress.reduce"),
    ({"compress.codec": "int8", "compress.reduce": "both"}, "compress.reduce"),
], ids=["sparse", "robust", "async", "ray-server", "unknown"])
def test_the_config_refuses_a_scatter_it_cannot_run(overrides, field):
  c = load_config("smoke", **{"compress.reduce": "scatter", **overrides})
  with pytest.raises(ConfigError, match=field):
    check.validate(c, num_devices=1)


def test_the_simulator_times_a_scatter_as_a_reduce_of_payloads_not_their_gather():
  gather = make_plan(*_plan_inputs("gather"))
  scatter = make_plan(*_plan_inputs("scatter"))
  assert gather.gathers and not scatter.gathers and scatter.collective == "direct"
  scale = 1e5  # a payload of megabytes, not the smoke model's kilobytes (its latency)
  ratio = collective_seconds(scatter, scatter.delta_bytes * scale)[0] / collective_seconds(
      gather, gather.delta_bytes * scale)[0]
  assert ratio < 1 / 3  # W = 8: 2·7/8 payloads a link against 7


def _plan_inputs(reduce):
  c = load_config("smoke", **{"algorithm": "diloco", "num_workers": 8, "mesh.replica": 1,
                              "compress.codec": "int8", "compress.reduce": reduce,
                              "compress.quant_block": 256})
  return c, build(one_device(c), check_memory=False)
