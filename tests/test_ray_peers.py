"""The peer form of the Ray runtime's quorum rounds (runtimes/ray/replica.py,
replicas.py): replicas of θ on every worker, a round's collective among its members.

In-process here (no Ray): each member's real part of its collective form
(runtimes/ray/forms) runs in a thread of its own on its own Replica, the members reaching
each other through their mailboxes (tests/peer_members.py counts what crosses), and their
result is held against the parameter server's program over the same rows (itself held
against the lockstep runner in tests/test_server_sync.py). The runs on Ray, failures
included, are in tests/test_ray_runtime.py."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_config
from peer_members import form_round, run_members
from lowcomm_jax.assemble.build import build
from lowcomm_jax.assemble.hosts import host
from lowcomm_jax.assemble.plan import one_device
from lowcomm_jax.compress import CODECS
from lowcomm_jax.config import check
from lowcomm_jax.programs import state_average, steps, sync_program
from lowcomm_jax.runtimes.ray import forms
from lowcomm_jax.runtimes.ray import replica as replica_lib
from lowcomm_jax.runtimes.ray.actors import initial_params, round_inputs
from lowcomm_jax.runtimes.ray.sender import Sender


def _run(**overrides):
  c = load_config("smoke", **{"algorithm": "diloco", "num_workers": 3, "inner_steps": 2,
                              "mesh.replica": 1, **overrides})
  return build(one_device(c), check_memory=False)


def _rows(r, members, seed=0):
  """Each member's Δ (distinct, one loud) and meta, as a job keeps them (version 0)."""
  rng = np.random.default_rng(seed)
  n = r.model.layout.size
  out = {}
  for w in members:
    delta = rng.normal(0, 1e-3 * (1 + 9 * (w == members[-1])), n).astype(np.float32)
    out[w] = (delta, {"tokens": 8.0 * (w + 1), "loss": 2.0 + w, "version": 0})
  return out


def _peer_round(r, rows, form=None):
  """Round 0 among `rows`' workers, as the members run it on Ray (`form`, else the one the
  driver picks: a dense mean's shards reduced and all-gathered, the outer step on every
  member); (each member's committed replica, its outcome, the transport that counted the
  bytes)."""
  members = sorted(rows)
  replicas = {w: replica_lib.Replica(r, initial_params(r), w) for w in members}
  for w, (delta, meta) in rows.items():
    replicas[w].keep(0, delta, meta)
  outcome, transport = form_round(replicas, 0, rows, form=form)
  for w in members:
    assert replicas[w].commit(0) == 1
    assert replicas[w].commit(0) == 1  # a second commit of the round applies nothing
  return replicas, outcome, transport


def _hashes(replicas, version, rows) -> dict:
  """Round `version` among `rows`' workers (their contributions kept on their replicas), as
  the members run it on Ray: each member's staged hash."""
  outcome, _ = form_round(replicas, version, rows)
  return {w: out["hash"] for w, out in outcome.items()}


def _server(r):
  """The parameter server's program for round rows, and its state at θ₀."""
  server = jax.jit(sync_program.make_server_sync(
      r.sync, r.outer_rules[0], layout=r.model.layout, fragment=0, count=1, last=True),
      static_argnames="full")
  params = jnp.asarray(initial_params(r))
  from lowcomm_jax.runtimes.ray.actors import initial_rule_state
  return server, steps.TrainState(jnp.asarray(0, jnp.int32), steps.run_key(r.config.seed),
                                  params, steps.OuterState((), initial_rule_state(r, "global",
                                                                                  params)))


def _server_round(r, rows):
  server, state = _server(r)
  received, keys, signals = round_inputs(r, {w: rows[w] for w in rows},
                                         steps.run_key(r.config.seed))
  return server(state, received, keys, signals, full=len(rows) == r.config.num_workers)


@pytest.mark.parametrize("overrides,members", [
    ({}, (0, 1, 2)),
    ({"aggregate.weighting": "tokens"}, (0, 1, 2)),
    ({"aggregate.weighting": "tokens"}, (0, 2)),  # a round closed without worker 1
    ({"hosts": [host(1.0), host(0.5), host(0.5)]}, (0, 1, 2)),  # tiers: the nested mean
    ({"hosts": [host(1.0), host(0.5), host(0.5)]}, (1, 2)),  # nobody of full width came
], ids=["mean", "tokens", "tokens-partial", "tiers", "tiers-partial"])
@pytest.mark.parametrize("form", [forms.DIRECT, forms.RING], ids=["direct", "ring"])
def test_reduced_shards_move_every_replica_as_the_server_moves_theta(overrides, members, form):
  """The members' reduce-scatter and all-gather (at once, or around the ring), then the
  outer step on each: every replica ends with the server's θ and outer state for the same
  rows (the shards' means are the rows' weighted mean, coordinate by coordinate), and the
  replicas are identical."""
  r = _run(**overrides)
  rows = _rows(r, list(members))
  replicas, outcome, transport = _peer_round(r, rows, form)
  assert len({out["hash"] for out in outcome.values()}) == 1
  # each link carried a reduce-scatter and an all-gather, 2·(M−1)/M of Δ each way (chunks
  # differ by one coordinate at most), as each member reported it: not (M−1)·Δ
  n, m = r.model.layout.size, len(members)
  for w, (sent, received) in transport.links(members).items():
    assert [sent, received] == [outcome[w]["sent"], outcome[w]["received"]]
    for nbytes in (sent, received):
      assert abs(nbytes - 4 * 2 * (m - 1) / m * n) <= 4 * 2 * m, (nbytes, n, m)
  theirs = _server_round(r, rows)
  for w, ours in replicas.items():
    assert ours.version == 1 and not ours.kept
    np.testing.assert_allclose(ours.params, theirs.params, rtol=0, atol=1e-6)
    for a, b in zip(jax.tree.leaves(ours.opt_state), jax.tree.leaves(theirs.outer.per_fragment)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  first = replicas[members[0]]
  assert np.abs(np.asarray(first.params) - initial_params(r)).max() > 1e-5  # θ moved


def _outside_tier(r, worker: int) -> np.ndarray:
  """The coordinates (of the flat θ) that `worker`'s tier does not train: FFN units past
  its width."""
  from lowcomm_jax.model.matformer import tier_mask
  layout = r.model.layout
  hidden = r.topology.hosts[next(h.index for h in r.topology.hosts
                                 if worker in h.worker_ids)].hidden
  full = jax.tree.map(lambda m, a: jnp.broadcast_to(m, a.shape),
                      tier_mask(layout.abstract, hidden), layout.abstract)
  return np.asarray(layout.ravel(full)) == 0


def test_a_partial_quorum_of_unequal_tiers_keeps_the_servers_momentum_over_rounds():
  """A full-width worker and two half-width ones, outer Nesterov momentum 0.9: round 0 with
  all three, then two rounds of the two narrow workers alone. Every round each member's
  replica is the server's θ and outer state for the same rows. On the units only the
  full-width worker trains, the partial rounds do what sync_program defines ("units no
  present worker trained keep their values"): θ stays where round 0 moved it, and the
  outer rule took a zero Δ there, so its momentum decays by β (m ← β·m). The old check
  (one coordinate equal to θ₀ after a single round at zero momentum) could not tell."""
  r = _run(hosts=[host(1.0), host(0.5), host(0.5)])
  assert r.config.outer.momentum == 0.9 and r.config.outer.nesterov
  outside = _outside_tier(r, 1)
  assert outside.any() and not _outside_tier(r, 0).any()
  replicas = {w: replica_lib.Replica(r, initial_params(r), w) for w in (0, 1, 2)}
  server, state = _server(r)
  momentum = lambda tree: np.asarray(jax.tree.leaves(tree)[0])
  for version, members in enumerate([(0, 1, 2), (1, 2), (1, 2)]):
    rows = {}
    for w, (delta, meta) in _rows(r, list(members), seed=version).items():
      delta = np.where(_outside_tier(r, w), 0.0, delta).astype(np.float32)  # (as it trains)
      rows[w] = (delta, {**meta, "version": version})
      replicas[w].keep(version, *rows[w])
    form_round({w: replicas[w] for w in members}, version, rows)
    for w in members:
      assert replicas[w].commit(version) == version + 1
    before = state
    received, keys, signals = round_inputs(r, rows, steps.run_key(r.config.seed))
    state = server(state, received, keys, signals, full=len(rows) == 3)
    for w in members:
      np.testing.assert_allclose(replicas[w].params, state.params, rtol=0, atol=1e-6)
      for a, b in zip(jax.tree.leaves(replicas[w].opt_state),
                      jax.tree.leaves(state.outer.per_fragment)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    if version:  # no member trains `outside`: θ stays, its momentum decays
      old, new = momentum(before.outer.per_fragment), momentum(state.outer.per_fragment)
      np.testing.assert_allclose(new[outside], 0.9 * old[outside], rtol=1e-6, atol=0)
      assert np.abs(old[outside]).min() > 0
      np.testing.assert_array_equal(np.asarray(state.params)[outside],
                                    np.asarray(before.params)[outside])
    else:  # the full round moved every unit
      assert (np.asarray(state.params) != np.asarray(before.params)).all()


@pytest.mark.parametrize("n,m", [(10, 3), (7, 7), (5, 1), (142848, 8)])
def test_shards_cover_the_fragment_once_in_near_equal_parts(n, m):
  bounds = replica_lib.shard_bounds(n, m)
  assert bounds[0][0] == 0 and bounds[-1][1] == n
  assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
  sizes = [b - a for a, b in bounds]
  assert max(sizes) - min(sizes) <= 1


def test_gathered_rows_are_the_servers_program_on_every_member():
  """A codec with a robust rule: every member runs the server's own program over every
  member's payload (all-gathered), so each replica is the server's θ."""
  r = _run(**{"compress.codec": "int8", "aggregate.rule": "median"})
  assert not sync_program.peer_reduces(r.sync)
  from lowcomm_jax import aggregate
  from lowcomm_jax.programs import servers
  codec, layout = r.sync.codec, r.model.layout
  encode = jax.jit(jax.vmap(servers.make_encode(codec, layout)))
  rows = {}
  for w, (delta, meta) in _rows(r, [0, 1, 2]).items():
    keys = aggregate.sender_keys(r.config.seed, 0, jnp.asarray([w]))
    errors = jax.tree.map(lambda x: x[None], codec.init(layout.abstract))
    payload, _ = encode(jnp.asarray(delta)[None], errors, keys)
    rows[w] = (jax.device_get(jax.tree.map(lambda x: x[0], payload)),
               {**meta, "codec_key": np.asarray(jax.random.key_data(keys[0]))})
  replicas = {w: replica_lib.Replica(r, initial_params(r), w) for w in rows}
  for w, row in rows.items():
    replicas[w].keep(0, *row)
  outcome, transport = form_round(replicas, 0, rows)
  assert len({out["hash"] for out in outcome.values()}) == 1
  size = lambda tree: sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))
  for w, (sent, received) in transport.links(list(rows)).items():  # its payload to each
    assert sent == outcome[w]["sent"] == 2 * size(rows[w][0])
    assert received == outcome[w]["received"] == sum(size(rows[i][0]) for i in rows if i != w)
  theirs = _server_round(r, rows)
  for w in rows:
    assert replicas[w].commit(0) == 1
    np.testing.assert_allclose(replicas[w].params, theirs.params, rtol=0, atol=1e-6)


def _robust_peer_round(r, replicas, version, rows):
  """Round `version` of a robust rule shard by shard among `rows`' workers, as the members
  run it on Ray (forms/direct.py); the hashes of what each member staged."""
  rows = {w: (delta, {**meta, "version": version}) for w, (delta, meta) in rows.items()}
  for w, (delta, meta) in rows.items():
    replicas[w].keep(version, delta, meta)
  return _hashes(replicas, version, rows)


@pytest.mark.parametrize("overrides", [
    {"aggregate.rule": "median"},
    {"aggregate.rule": "trimmed_mean", "num_workers": 4},
    {"aggregate.rule": "centered_clip", "aggregate.clip_iters": 3},
    {"aggregate.rule": "centered_clip", "aggregate.clip_tau": 1e-3},
    {"aggregate.signal": "loss_ema", "aggregate.warmup_rounds": 0},  # weighted mean
    {"aggregate.rule": "centered_clip", "aggregate.signal": "cosine",
     "aggregate.warmup_rounds": 0, "aggregate.weighting": "tokens"},
    # (not grad_norm_stability: its std, √(EMA‖u‖² − EMA‖u‖²), cancels in float32, so the
    # shards' order of summation (1e-7) moves its weights by percents: BUILD_NOTES)
    {"aggregate.rule": "median", "aggregate.signal": "loss_ema",
     "aggregate.warmup_rounds": 0},
], ids=["median", "trimmed", "clip-3", "clip-tau", "loss-weights", "clip-cosine",
        "median-loss"])
def test_a_robust_rule_shard_by_shard_is_the_servers_over_whole_rows(overrides):
  """Each member combines its shard of every row, from the rows' statistics over the whole
  update (added across shards): over three rounds (the second missing a worker: the
  present rows alone), every replica holds the server's θ and outer state (the previous
  aggregate, the signals, the weights), and the replicas are identical."""
  r = _run(**overrides)
  assert sync_program.robust_shards(r.sync) and not sync_program.peer_reduces(r.sync)
  slots = r.config.num_workers
  replicas = {w: replica_lib.Replica(r, initial_params(r), w) for w in range(slots)}
  server, state = _server(r)
  for version, members in enumerate([list(range(slots)), list(range(1, slots)),
                                     list(range(slots))]):
    rows = _rows(r, members, seed=version)
    for w in set(range(slots)) - set(members):  # (the absent one takes the round, not in it)
      replicas[w].adopt(replicas[members[0]].share()) if version else None
    hashes = _robust_peer_round(r, replicas, version, rows)
    assert len(set(hashes.values())) == 1
    for w in members:
      replicas[w].commit(version)
    received, keys, signals = round_inputs(r, rows, steps.run_key(r.config.seed))
    state = server(state, received, keys, signals, full=len(members) == slots)
    for w in members:
      ours = replicas[w]
      assert ours.version == version + 1 and not ours.combining
      np.testing.assert_allclose(ours.params, state.params, rtol=0, atol=1e-6)
      for a, b in zip(jax.tree.leaves(ours.opt_state),
                      jax.tree.leaves(state.outer.per_fragment)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    absent = set(range(slots)) - set(members)
    for w in absent:
      replicas[w].adopt(replicas[members[0]].share())
  weights = state.outer.per_fragment[0].combine.signals.weights
  if overrides.get("aggregate.signal"):
    assert np.ptp(np.asarray(weights)) > 1e-4  # the signals weighed the workers apart
  assert np.abs(np.asarray(state.params) - initial_params(r)).max() > 1e-5  # θ moved


def test_a_replica_adopts_a_peers_state_and_keeps_what_it_contributed():
  r = _run()
  ahead, behind = (replica_lib.Replica(r, initial_params(r), w) for w in range(2))
  behind.keep(0, np.ones(r.model.layout.size, np.float32), {"tokens": 8.0})
  ahead._set(3, ahead.params + 1.0, ahead.opt_state)
  assert behind.adopt(ahead.share()) == 3
  np.testing.assert_array_equal(behind.params, ahead.params)
  assert 0 in behind.kept  # a late contribution still goes into the open round
  with pytest.raises(RuntimeError, match="version 3"):  # a round of another version
    behind.apply_reduced(2, [0], [8.0], [2.0], [np.zeros(r.model.layout.size, np.float32)])


def test_a_delayed_sync_takes_theta_before_its_collective_and_ends_where_the_plain_one_does():
  """One-step delay in the peer form: `advance` takes θ' of round v before the round's
  collective (the next job starts from it; a share waits for the round), then the
  collective's outer step fills in the outer state. Two rounds that way end bit for bit
  where the same two rounds closed one after the other end: θ and the outer state."""
  r = _run(algorithm="one_step_delay", num_workers=2)
  members = [0, 1]
  theta0 = initial_params(r)
  plain, early = (replica_lib.Replica(r, theta0, 0) for _ in range(2))
  for v in range(2):
    rows = _rows(r, members, seed=v)
    tokens = [rows[w][1]["tokens"] for w in members]
    losses = [rows[w][1]["loss"] for w in members]
    mean = [np.asarray(sync_program.make_shard_mean(
        r.sync, layout=r.model.layout, fragment=0)(
            jnp.asarray(np.stack([rows[w][0] for w in members])),
            jnp.asarray(np.asarray(r.topology.hidden_per_worker)[members]),
            jnp.asarray(tokens, jnp.float32), np.int32(0)))]
    before = early.params
    moved = early.advance(v, members, tokens, losses)
    assert early.version == v + 1 and (early.params == before).all() == (v == 0)
    with pytest.raises(RuntimeError, match="in flight"):
      early.share()
    digests = [x.apply_reduced(v, members, tokens, losses, mean) for x in (plain, early)]
    assert digests[0] == digests[1] == moved  # θ' did not wait for the mean
    assert plain.commit(v) == early.commit(v) == v + 1
  assert early.pending is None
  np.testing.assert_array_equal(early.params, plain.params)
  assert (plain.params != theta0).any()  # round 1 applied round 0's mean
  for a, b in zip(jax.tree.leaves(early.share()), jax.tree.leaves(plain.share())):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("members", [(0, 1, 2, 3), (0, 1, 3)])  # (worker 2 lost: its peer
def test_a_pair_swap_moves_each_member_by_its_peer_alone(members):  # keeps its own model)
  """NoLoCo in the peer form: each member sends θ_i = φ_i − Δ_i to its round's peer alone
  and steps its own (φ_i, δ_i), checked against NoLoCo's rule written out in NumPy."""
  r = _run(algorithm="noloco", num_workers=4)
  theta0 = initial_params(r)
  rows = _rows(r, members)
  peer = r.sync.partners(0)
  assert sorted(peer) == [0, 1, 2, 3] and all(peer[peer[w]] == w != peer[w] for w in range(4))
  replicas = {w: replica_lib.Replica(r, theta0, w) for w in members}
  for w in members:
    replicas[w].keep(0, *rows[w])
    rows_w, _ = replicas[w].view_outer()  # (its own rows only, as a server's pull)
    assert jax.tree.leaves(rows_w)[0].shape == (1, theta0.shape[0])
  outcome, transport = form_round(replicas, 0, rows)
  hashes = {w: out["hash"] for w, out in outcome.items()}
  n = 4 * theta0.shape[0]  # θ_i to its peer alone, and the peer's back; nothing else moves
  assert transport.moved == {(w, peer[w]): n for w in members if peer[w] in members}
  # each pair's own: from the same φ = θ₀ in round 0, a pair's two members land together
  assert len(set(hashes.values())) == len({min(w, peer[w]) if peer[w] in members else w
                                           for w in members}) > 1
  c = r.config
  for w in members:
    assert replicas[w].commit(0) == 1
    mine = theta0.astype(np.float64) - rows[w][0]
    theirs = theta0 - rows[peer[w]][0] if peer[w] in members else mine
    step = c.outer.momentum * 0.0 - c.outer.lr * (theta0 - (mine + theirs) / 2)
    np.testing.assert_allclose(replicas[w].phi(), theta0 + step, rtol=0, atol=1e-6)
    own = jax.tree.leaves(replicas[w].share()["opt_state"].per_worker)
    np.testing.assert_allclose(own[1][0], step, rtol=0, atol=1e-6)  # δ_i: the step taken
  assert (replicas[members[0]].phi() != theta0).any()


@pytest.mark.parametrize("members", [1, 3, 4])
def test_a_state_average_among_the_workers_is_the_servers_bit_for_bit(members):
  """DES-LOC's moments in the peer form: each worker's parts as one vector in M shards,
  member j's mean of shard j, all-gathered (forms.mean_of, its members in threads) and put
  back in each part's shape and dtype, equal bit for bit on every member to the Ray task's
  mean of whole rows (server.average_parts)."""
  from lowcomm_jax.runtimes.ray.server import average_parts
  rng = np.random.default_rng(members)
  rows = [{"mu": rng.standard_normal((1, 5, 3)).astype(np.float32),
           "nu": {"w": rng.random((1, 7)).astype(np.float32)}} for _ in range(members)]
  vectors = [replica_lib.flat(row) for row in rows]
  assert vectors[0].shape == (22,)
  steps = {w: (lambda ex, w=w: dict(zip(("mean", "moved"), forms.mean_of(ex, vectors[w]))))
           for w in range(members)}
  outcome, transport = run_members(list(range(members)), 0, steps)
  theirs = average_parts(*rows)
  for w in range(members):
    ours = replica_lib.unflat(outcome[w]["mean"], rows[0])
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
      assert a.shape == b.shape and a.dtype == b.dtype == np.float32
      np.testing.assert_array_equal(a, b)
    moved = outcome[w]["moved"]
    assert [moved["sent"], moved["received"]] == transport.links(range(members))[w]


# --- config ----------------------------------------------------------------------------


def _problems(**overrides):
  try:
    check.validate(load_config("smoke", **{"runtime": "ray", **overrides}), num_devices=8)
  except check.ConfigError as e:
    return str(e)
  return ""


def test_the_form_follows_the_collective_and_the_algorithm():
  from lowcomm_jax import algorithms
  peers = lambda **o: forms.among_workers(load_config("smoke", **{"runtime": "ray", **o}),
                                          algorithms.get(o.get("algorithm", "diloco")))
  assert peers(algorithm="diloco")
  assert peers(algorithm="streaming")
  assert not peers(algorithm="diloco", **{"collective_form": "server"})
  assert not peers(algorithm="async_dn")  # the server is the algorithm
  assert peers(algorithm="noloco", num_workers=4)  # each pair swaps directly
  assert peers(algorithm="ddp", **{"collab.target_batch_size": 64})  # (epochs too)


@pytest.mark.parametrize("overrides,field", [
    ({"ray.collective_timeout_s": 1.0}, "ray.collective_timeout_s"),
    ({"collective_form": "hierarchical"}, "collective_form"),  # one region
    # two regions, but payloads all-gathered whole (a codec) or a pair swap (NoLoCo)
    ({"collective_form": "hierarchical", "sim.network.regions": 2,
      "compress.codec": "int8"}, "collective_form"),
    ({"algorithm": "noloco", "num_workers": 4, "collective_form": "hierarchical",
      "sim.network.regions": 2}, "collective_form"),
    ({"algorithm": "async_dn", "collective_form": "direct"}, "collective_form"),
    ({"collective_form": "ring", "compress.codec": "int8"}, "collective_form"),  # (whole
    # payloads: no partial sums to pass on)
    ({"collective_form": "tree"}, "collective_form"),
    ({"ray.chaos": ("kill_server@2",)}, "ray.chaos"),  # the peer form has no server
    ({"ray.chaos": ("crash_in_sync=0@2",), "collective_form": "server"}, "ray.chaos"),
    ({"ray.standby_server": True}, "ray.standby_server"),
])
def test_bad_collective_input_is_one_line_naming_its_field(overrides, field):
  text = _problems(algorithm=overrides.pop("algorithm", "diloco"), **overrides)
  assert text.count(field + "=") == 1, text


def test_a_hierarchical_dense_mean_over_regions_is_accepted():
  assert _problems(algorithm="diloco", **{"collective_form": "hierarchical",
                                          "sim.network.regions": 2}) == ""


@pytest.mark.parametrize("intra_gbps,inter_gbps", [(100.0, 1.0), (0.1, 100.0)])
def test_auto_reduces_by_region_where_the_simulators_model_does(intra_gbps, inter_gbps):
  """'auto' on Ray picks the form the simulator's model of the same network and members
  finds fastest (sim/collectives: ring, hierarchical, direct; a tie to the first): by
  region over slow links between regions (1 Gb/s against 100 Gb/s inside), around a ring
  where the NICs are the slow ones (0.1 Gb/s: a leader's link would carry its region's sums
  too; the ring ties the direct exchange's bytes). Values through Ray's object store
  (ray.transport='objects') take the direct exchange instead of a ring: 2·(W−1) fetches in
  a row, each asked for first. No latency, so bandwidth decides."""
  from peer_members import rounds_of
  from lowcomm_jax.sim import collectives
  r = _run(num_workers=4, **{"sim.network.regions": 2, "sim.network.inter_gbps": inter_gbps,
                            "sim.network.intra_gbps": intra_gbps,
                            "sim.network.intra_latency_s": 0.0,
                            "sim.network.inter_latency_s": 0.0})
  fake = rounds_of(r)
  plan = fake.d.plan
  groups = forms.regions_of(fake, [0, 1, 2, 3])
  times = {how: collectives.seconds(plan.network, "allreduce", [0, 1, 2, 3],
                                    4 * r.model.layout.size, how)[0]
           for how in ("direct", "hierarchical")}
  faster = times["hierarchical"] < times["direct"]
  assert (groups is not None) == faster == (inter_gbps < intra_gbps), times
  assert groups in (None, [[0, 1], [2, 3]])
  assert forms.regions_of(fake, [0, 1]) is None  # (one region among these members)
  assert forms.for_round(fake, [0, 1, 2, 3]) is (forms.HIERARCHICAL if faster else forms.RING)
  fake.d.c.ray.transport = "objects"
  assert forms.for_round(fake, [0, 1, 2, 3]) is (forms.HIERARCHICAL if faster else forms.DIRECT)


@pytest.mark.parametrize("overrides,regions", [
    ({}, [0, 0, 1]),  # a region of two and one of one
    ({"aggregate.weighting": "tokens"}, [0, 1, 1, 0]),  # the regions interleaved in ids
])
def test_a_hierarchical_reduce_is_the_flat_rounds_mean_on_every_member(overrides, regions):
  """The reduce by region as its members run it (forms/hierarchical.py): region sums of each
  shard, cut into the leaders' pieces, each piece divided by every member's weight, the mean
  cut again and all-gathered in each region. Every member stages the same θ', which is the
  direct exchange's up to the order of the sum; each link carries `hierarchical_bytes`."""
  members = list(range(len(regions)))
  r = _run(num_workers=len(members), **overrides)
  rows = _rows(r, members)
  flat, _, _ = _peer_round(r, rows)
  replicas = {w: replica_lib.Replica(r, initial_params(r), w) for w in members}
  for w in members:
    replicas[w].keep(0, *rows[w])
  groups = [[w for w in members if regions[w] == g] for g in sorted(set(regions))]
  outcome, transport = form_round(replicas, 0, rows, form=forms.HIERARCHICAL,
                                  extra={"groups": groups})
  assert len({out["hash"] for out in outcome.values()}) == 1
  for w in members:
    assert replicas[w].commit(0) == 1
  theta = replicas[0].params
  np.testing.assert_allclose(theta, flat[0].params, rtol=0, atol=1e-7)
  assert (theta != initial_params(r)).any()
  # The bytes each link really carried (counted value by value as the members sent them)
  n = r.model.layout.size
  expect = replica_lib.hierarchical_bytes(n, groups)
  assert {w: [e["sent"], e["received"]] for w, e in expect.items()} == transport.links(members)
  assert all(outcome[w]["sent"] == expect[w]["sent"] for w in members)
  # Only the leaders cross regions, each with one all-reduce's share of the leaders' ring
  # (2·(G−1)/G of the payload), where in the direct exchange every member does.
  across = collections.Counter()
  for (a, b), nbytes in transport.moved.items():
    if regions[a] != regions[b]:
      across[a] += nbytes
  pieces_n = np.diff(replica_lib.shard_bounds(n, len(groups))).ravel()
  assert across == {g[0]: 4 * int(n - pieces_n[h] + pieces_n[h] * (len(groups) - 1))
                    for h, g in enumerate(groups)}


def test_a_state_average_is_the_runners_program_on_every_runtime():
  """The lockstep runner's (and the simulator's) state average, `make_state_sync` with
  DES-LOC's MomentSync, and the Ray server's task (`average_parts`) on the parts the workers
  send give the same moments bit for bit: one program averages them everywhere."""
  from lowcomm_jax.algorithms.desloc import MomentSync
  from lowcomm_jax.runtimes.ray.server import average_parts
  import optax
  rng = np.random.default_rng(0)
  sync = MomentSync(1, 1)
  states = [optax.ScaleByAdamState(
      count=jnp.int32(3), mu={"w": rng.standard_normal((5, 3)).astype(np.float32)},
      nu={"w": rng.random((5, 3)).astype(np.float32)}) for _ in range(3)]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
  parts = ("first_moment", "second_moment")
  runner = jax.jit(state_average.make_state_sync(sync), static_argnames="parts")(stacked, parts=parts)
  rows = [jax.tree.map(lambda x: np.asarray(x)[None], sync.take(s, parts)) for s in states]
  server = average_parts(*rows)
  for w in range(3):
    mine = jax.tree.map(lambda x: np.asarray(x)[w][None], sync.take(runner, parts))
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(server)):
      np.testing.assert_array_equal(a, b)


# --- a round's whole path on Ray, held against the lockstep sync -----------------------

_TIERS = [host(1.0), host(0.5), host(0.5)]


def _ray_round(r, senders, replicas, version, deltas, tokens, losses):
  """Round `version` as the Ray runtime's peer form runs it, from each worker's Δ: what
  the worker sends (sender.py: its codec's payload, key and error buffer), kept on its
  replica, then the members' collective in the form the driver picks for the run (a dense
  mean reduced shard by shard, a robust rule shard by shard, or the rows all-gathered into
  the round's own program: round_inputs, decode, attack, rule), committed on every
  member."""
  members = sorted(replicas)
  rows = {}
  for w in members:
    meta = {"tokens": tokens[w], "loss": losses[w], "version": version}
    view = steps.TrainState(jnp.asarray(version, jnp.int32), replicas[w]._rng,
                            jnp.asarray(replicas[w].params), ())
    sent = senders[w].send(view, jnp.asarray(deltas[w])[None], meta)
    replicas[w].keep(version, sent, meta)
    rows[w] = (sent, meta)
  hashes = set(_hashes(replicas, version, rows).values())
  assert len(hashes) == 1  # every member staged the same θ
  for w in members:
    assert replicas[w].commit(version) == version + 1


@pytest.mark.parametrize("overrides", [
    *({"compress.codec": codec} for codec in CODECS if codec != "none"),
    {"aggregate.rule": "trimmed_mean", "aggregate.trim": 1},
    {"aggregate.rule": "centered_clip", "aggregate.clip_iters": 2},
    {"aggregate.signal": "loss_ema", "aggregate.warmup_rounds": 1},
    {"aggregate.weighting": "tokens"},
    {"attack.workers": (1,), "attack.kind": "sign_flip"},  # under the plain mean
    {"attack.workers": (1,), "attack.kind": "random"},
    {"attack.workers": (2,), "attack.kind": "scale", "aggregate.rule": "median"},
    {"hosts": _TIERS, "compress.codec": "int4"},
    {"hosts": _TIERS, "aggregate.rule": "median", "aggregate.signal": "loss_ema",
     "aggregate.warmup_rounds": 1},
], ids=lambda o: ",".join(f"{k.split('.')[-1]}={v if k != 'hosts' else 'tiers'}"
                          for k, v in o.items()))
def test_a_rays_round_path_is_the_lockstep_sync(overrides):
  """Three rounds of three workers' Δ (distinct, one loud every other round) through the
  Ray runtime's own path (each worker's sender, its replica, the members' collective) and
  through the lockstep runner's sync of the same config: the same θ (within 1e-5) and
  outer state. An attacked run's θ differs from the clean run's: the attack was applied."""
  from lowcomm_jax.assemble.jitted import jitted_steps
  r = _run(**overrides)
  slots = r.config.num_workers
  senders = {w: Sender(r, jnp.asarray([w], jnp.int32)) for w in range(slots)}
  replicas = {w: replica_lib.Replica(r, initial_params(r), w) for w in range(slots)}
  lockstep = jitted_steps(r, donate=False).syncs[0]
  with jax.set_mesh(r.topology.mesh):
    theirs = jax.jit(r.state_spec.init)(r.state_spec.initial_params())
  clean = None
  if r.config.attack.workers:
    plain = _run(**{k: v for k, v in overrides.items() if not k.startswith("attack.")})
    clean_sync = jitted_steps(plain, donate=False).syncs[0]
    clean = theirs
  tokens = [5.0, 10.0, 15.0]  # unequal: 'tokens' weighting must weigh them
  rng = np.random.default_rng(0)
  for version in range(3):
    deltas = rng.normal(0, 1e-3, (slots, r.model.layout.size)).astype(np.float32)
    deltas[2] *= 1 + 10 * (version % 2)
    losses = [2.0, 2.1, 2.5 + version]
    _ray_round(r, senders, replicas, version, deltas, tokens, losses)
    signals = steps.Signals(jnp.asarray(r.topology.hidden_per_worker),
                            jnp.asarray(tokens, jnp.float32), jnp.asarray(losses, jnp.float32))
    with jax.set_mesh(r.topology.mesh):
      theirs, _ = lockstep(theirs, jnp.asarray(deltas), signals, metrics=False)
      if clean is not None:
        clean, _ = clean_sync(clean, jnp.asarray(deltas), signals, metrics=False)
  for ours in replicas.values():
    assert ours.version == 3
    diff = np.abs(np.asarray(ours.params) - np.asarray(theirs.params)).max()
    assert diff <= 1e-5, diff
    for a, b in zip(jax.tree.leaves(ours.opt_state), jax.tree.leaves(theirs.outer.per_fragment)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(theirs.params) - initial_params(r)).max() > 1e-5  # θ moved
  if clean is not None:
    assert np.abs(np.asarray(theirs.params) - np.asarray(clean.params)).max() > 1e-4


def _encoded_rows(r, members, seed=0):
  """`_rows`, each Δ encoded by the run's codec with its sender key (a scatter's rows)."""
  from lowcomm_jax import aggregate
  from lowcomm_jax.programs import servers
  codec, layout = r.sync.codec, r.model.layout
  encode = jax.jit(servers.make_encode(codec, layout))
  keys = aggregate.sender_keys(r.config.seed, 0, jnp.asarray(members))
  out = {}
  for k, (w, (delta, meta)) in enumerate(_rows(r, members, seed).items()):
    sent, _ = encode(jnp.asarray(delta), codec.init(layout.abstract), keys[k])
    out[w] = (jax.device_get(sent),
              {**meta, "codec_key": np.asarray(jax.random.key_data(keys[k]))})
  return out


@pytest.mark.parametrize("overrides", [
    {}, {"aggregate.rule": "trimmed_mean"},
    {"algorithm": "streaming", "inner_steps": 4, "streaming.fragments": 2},
    {"compress.codec": "int8", "compress.reduce": "scatter"}, {"algorithm": "one_step_delay"},
], ids=["mean", "trimmed-mean", "streaming-fragment", "int8-scatter", "one-step-delay"])
def test_a_replica_one_round_behind_takes_the_rounds_inputs_and_reaches_its_members_state(
    overrides):
  """Round 0 among workers 0–2; worker 3 contributed late and is still at version 0. A
  member serves it round 0's inputs (catch_up.serve), not its replica, and worker 3 runs the
  round's last step itself: θ and the outer state bit-equal to the members', its own late
  contribution still kept, for fewer bytes than the whole replica (θ plus the outer state).
  A member asked for another round hands its whole replica; inputs that do not reach the
  members' θ are refused."""
  from lowcomm_jax.runtimes.ray import catch_up
  r = _run(num_workers=4, **overrides)
  members = [0, 1, 2]
  rows = (_encoded_rows if "compress.codec" in overrides else _rows)(r, members)
  n = r.model.layout.fragment(r.algorithm.segments(r.config, r.config.inner_steps)[0].sync).size
  if r.algorithm.name == "streaming":  # (round 0 syncs fragment 0 alone: its coordinates)
    assert n < r.model.layout.size
    rows = {w: (delta[:n], meta) for w, (delta, meta) in rows.items()}
  replicas = {w: replica_lib.Replica(r, initial_params(r), w) for w in range(4)}
  for w in members:
    replicas[w].keep(0, *rows[w])
  late, meta = _rows(r, [3], seed=1)[3]
  replicas[3].keep(0, late[:n], meta)
  if r.algorithm.delayed_sync:  # θ' first, as the runtime's overlapped rounds take it
    tokens, losses = [rows[w][1]["tokens"] for w in members], [2.0 + w for w in members]
    for w in members:
      replicas[w].advance(0, members, tokens, losses)
  form_round(replicas, 0, rows)
  for w in members:
    assert replicas[w].commit(0) == 1
  served = catch_up.serve(replicas[1], 0)
  assert set(served) == {"round"}
  whole = replicas[1].share()
  assert catch_up.nbytes(served) < 0.6 * catch_up.nbytes(whole)
  assert replicas[3].adopt(served) == 1
  for a, b in zip(jax.tree.leaves(replicas[3].share()), jax.tree.leaves(whole)):
    np.testing.assert_array_equal(a, b)
  assert 0 in replicas[3].kept  # its late contribution goes into the open round
  assert "round" not in catch_up.serve(replicas[1], 1)  # not the round it holds: whole
  stray = replica_lib.Replica(r, initial_params(r), 3)
  record = dict(served["round"], hash="0" * 32)
  with pytest.raises(RuntimeError, match="did not reach its members"):
    stray.adopt({"round": record})
