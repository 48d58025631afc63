"""A parameter server's sync (sync_program.make_server_sync, the Ray runtime's quorum rounds)
against the lockstep runner's sync of the same config, rule by rule: the same Δ in, the same θ
and outer state out. And a round some workers missed: the present rows combined as if the
absent workers were not there."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_config
from lowcomm_jax import aggregate
from lowcomm_jax.aggregate import robust
from lowcomm_jax.assemble.build import build
from lowcomm_jax.assemble.jitted import jitted_steps
from lowcomm_jax.assemble.plan import one_device
from lowcomm_jax.programs import servers, steps, sync_program

WORKERS, ROUNDS = 3, 4  # loss_ema's weights start after 2 warm-up rounds


def _server_sync(r):
  return jax.jit(sync_program.make_server_sync(r.sync, r.outer_rules[0], layout=r.model.layout,
                                               fragment=0, count=1, last=True),
                 static_argnames="full")


def _rounds(r):
  """Each round's Δ [W, N] and train losses [W]: distinct per worker, one a far outlier."""
  rng = np.random.default_rng(0)
  n = r.model.layout.size
  for t in range(ROUNDS):
    deltas = rng.normal(0, 1e-3, (WORKERS, n)).astype(np.float32)
    deltas[2] *= 1 + 10 * (t % 2)  # worker 2 is loud every other round
    yield jnp.asarray(deltas), jnp.asarray([2.0, 2.1, 2.5 + t], jnp.float32)


@pytest.mark.parametrize("overrides", [
    {},
    {"aggregate.rule": "median"},
    {"aggregate.rule": "trimmed_mean", "aggregate.trim": 1},
    {"aggregate.rule": "centered_clip", "aggregate.clip_iters": 2},
    {"aggregate.signal": "loss_ema", "aggregate.warmup_rounds": 1},
    {"attack.workers": (1,), "attack.kind": "sign_flip"},
    {"aggregate.weighting": "tokens"},
    {"compress.codec": "int8"},
    {"compress.codec": "topk", "aggregate.rule": "median"},
], ids=lambda o: ",".join(f"{k.split('.')[-1]}={v}" for k, v in o.items()) or "mean")
def test_a_full_server_round_is_the_lockstep_sync(overrides):
  c = load_config("smoke", algorithm="diloco", num_workers=WORKERS, inner_steps=2,
                  **{"mesh.replica": 1, **overrides})
  r = build(one_device(c), check_memory=False)
  lockstep = jitted_steps(r, donate=False).syncs[0]
  server = _server_sync(r)
  with jax.set_mesh(r.topology.mesh):
    state = jax.jit(r.state_spec.init)(r.state_spec.initial_params())
  theirs = state
  ours = steps.TrainState(state.round, state.rng, state.params,
                          steps.OuterState((), state.outer.per_fragment))
  codec, layout = r.sync.codec, r.model.layout
  encode = jax.jit(jax.vmap(servers.make_encode(codec, layout))) if codec else None
  errors = (jax.tree.map(lambda x: jnp.broadcast_to(x, (WORKERS,) + x.shape),
                         codec.init(layout.abstract)) if codec else None)
  ids = jnp.arange(WORKERS)
  tokens = [5.0, 10.0, 15.0]  # unequal: 'tokens' weighting must weigh them
  for deltas, losses in _rounds(r):
    signals = steps.Signals(jnp.asarray(r.topology.hidden_per_worker),
                            jnp.asarray(tokens, jnp.float32), losses)
    with jax.set_mesh(r.topology.mesh):
      theirs, _ = lockstep(theirs, deltas, signals, metrics=False)
    keys = aggregate.sender_keys(c.seed, ours.round, ids)
    sent = deltas
    if codec:  # each worker encodes its own Δ, its error buffer kept with it
      sent, errors = encode(deltas, errors, keys)
    ours = server(ours, sent, keys, signals, full=True)
  assert int(ours.round) == int(theirs.round) == ROUNDS
  np.testing.assert_allclose(ours.params, theirs.params, rtol=0, atol=1e-6)
  assert float(jnp.max(jnp.abs(ours.params - state.params))) > 1e-4  # θ moved
  for a, b in zip(jax.tree.leaves(ours.outer.per_fragment),
                  jax.tree.leaves(theirs.outer.per_fragment)):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                               rtol=1e-5, atol=1e-6)


def test_a_missing_workers_row_counts_for_nothing():
  """Worker 1 missed the round: its row is zeros with no tokens. Each rule combines workers 0
  and 2 as it would two workers' rows."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(4, 7)).astype(np.float32))
  present = jnp.asarray([True, False, True, True])
  kept = x[jnp.asarray([0, 2, 3])]
  gone = x.at[1].set(1e6)  # whatever an absent row holds must not count
  np.testing.assert_allclose(robust.present_median(gone, present), robust.median(kept),
                             atol=1e-6)
  np.testing.assert_allclose(robust.present_trimmed_mean(gone, present, 1),
                             robust.trimmed_mean(kept, 1), atol=1e-6)
  # Trimming more than the present rows leave: their median, not NaN.
  np.testing.assert_allclose(robust.present_trimmed_mean(gone, present, 2),
                             robust.median(kept), atol=1e-6)
  w = jnp.asarray([1 / 3, 0.0, 1 / 3, 1 / 3])
  center = jnp.zeros((7,))
  ours, tau = robust.centered_clip(gone, center, w, iters=2, present_W=present)
  theirs, tau_kept = robust.centered_clip(kept, center, jnp.full((3,), 1 / 3), iters=2)
  np.testing.assert_allclose(ours, theirs, atol=1e-5)
  assert float(tau) == pytest.approx(float(tau_kept))


@pytest.mark.parametrize("rule", ["mean", "median"])
def test_a_server_round_without_a_worker_is_the_round_of_the_others(rule):
  """A round closed without worker 2 (row zeros, tokens 0) moves θ as a run of workers 0
  and 1 alone does: the outer rule sees their combination."""
  def run(num_workers, drop):
    c = load_config("smoke", algorithm="diloco", num_workers=num_workers, inner_steps=2,
                    **{"mesh.replica": 1, "aggregate.rule": rule})
    r = build(one_device(c), check_memory=False)
    with jax.set_mesh(r.topology.mesh):
      state = jax.jit(r.state_spec.init)(r.state_spec.initial_params())
    state = steps.TrainState(state.round, state.rng, state.params,
                             steps.OuterState((), state.outer.per_fragment))
    n = r.model.layout.size
    deltas = np.random.default_rng(2).normal(0, 1e-3, (3, n)).astype(np.float32)
    tokens = np.asarray([8.0, 8.0, 8.0], np.float32)
    if drop:
      deltas[2], tokens[2] = 0.0, 0.0
    else:
      deltas, tokens = deltas[:num_workers], tokens[:num_workers]
    signals = steps.Signals(jnp.asarray(r.topology.hidden_per_worker), jnp.asarray(tokens),
                            jnp.zeros((len(tokens),), jnp.float32))
    out = _server_sync(r)(state, jnp.asarray(deltas), jax.random.split(jax.random.key(0),
                                                                       len(tokens)),
                          signals, full=not drop)
    return np.asarray(out.params), np.asarray(state.params)

  missed, before = run(3, drop=True)
  pair, _ = run(2, drop=False)
  np.testing.assert_allclose(missed, pair, atol=1e-6)
  assert np.abs(missed - before).max() > 1e-4


def test_units_no_present_worker_trained_keep_their_values():
  """Host table: a full-width worker and a half-width one. The full one missed the round:
  the FFN units only it trains are left as they were (momentum and all), the rest move."""
  from lowcomm_jax.assemble.hosts import host
  from lowcomm_jax.model.matformer import tier_mask
  c = load_config("smoke", algorithm="diloco", num_workers=2, inner_steps=2,
                  **{"mesh.replica": 1, "hosts": [host(1.0), host(0.5)]})
  r = build(one_device(c), check_memory=False)
  with jax.set_mesh(r.topology.mesh):
    state = jax.jit(r.state_spec.init)(r.state_spec.initial_params())
  state = steps.TrainState(state.round, state.rng, state.params,
                           steps.OuterState((), state.outer.per_fragment))
  layout = r.model.layout
  deltas = np.random.default_rng(3).normal(0, 1e-3, (2, layout.size)).astype(np.float32)
  deltas[0] = 0.0  # worker 0 (full width) sent nothing
  signals = steps.Signals(jnp.asarray(r.topology.hidden_per_worker),
                          jnp.asarray([0.0, 8.0], jnp.float32), jnp.zeros((2,), jnp.float32))
  out = _server_sync(r)(state, jnp.asarray(deltas), jax.random.split(jax.random.key(0), 2),
                        signals, full=False)
  half = layout.ravel(jax.tree.map(lambda m, x: jnp.broadcast_to(m, x.shape),
                                   tier_mask(layout.abstract, r.topology.hidden_per_worker[1]),
                                   layout.abstract)) > 0
  moved = np.abs(np.asarray(out.params) - np.asarray(state.params)) > 0
  assert not moved[~np.asarray(half)].any()  # the units only worker 0 trains
  assert moved[np.asarray(half)].mean() > 0.9  # everything worker 1 trains


def test_noloco_on_a_server_a_worker_whose_peer_missed_keeps_its_own_model():
  """The Ray server's NoLoCo round (the runner's sync over every worker's row of φ, δ):
  worker 3 sent nothing, so its peer's pair mean is its own trained model, worker 3's row
  stays as it was, and the other pair swaps as in the runner."""
  from lowcomm_jax.algorithms.noloco import pairings, peers
  from lowcomm_jax.runtimes.ray.server import ServerProcess
  c = load_config("smoke", algorithm="noloco", num_workers=4, inner_steps=2, runtime="ray",
                  **{"mesh.replica": 1})
  server = ServerProcess(c)
  before = jax.tree.map(np.asarray, server.arrays["opt_state"].per_worker[0])
  peer = peers(pairings(4, c.seed), c.seed, 0)
  deltas = np.random.default_rng(4).normal(0, 1e-2, before.phi.shape).astype(np.float32)
  for w in (0, 1, 2):
    server.contribute({"worker": w, "version": 0, "tokens": 8, "loss": 2.0}, deltas[w])
  server.close_round()
  after = jax.tree.map(np.asarray, server.arrays["opt_state"].per_worker[0])
  np.testing.assert_array_equal(after.phi[3], before.phi[3])
  np.testing.assert_array_equal(after.momentum[3], before.momentum[3])
  lr = c.outer.lr  # δ starts at 0: δ_i = −lr·(φ_i − pair mean of the trained models)
  trained = before.phi - deltas
  for i in range(3):
    pair_mean = trained[i] if peer[i] == 3 else (trained[i] + trained[peer[i]]) / 2
    np.testing.assert_allclose(after.phi[i], before.phi[i] - lr * (before.phi[i] - pair_mean),
                               rtol=0, atol=1e-6)
  # θ: the consensus of the workers that came (worker 3's stale row would hold it back)
  np.testing.assert_allclose(server.arrays["params"], after.phi[:3].mean(0), rtol=0, atol=1e-6)


@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
def test_a_partial_server_round_combines_only_the_rows_that_came(rule):
  """Ray's server closes a quorum round that worker 3 missed (`close_round`): the robust
  rule combines the three rows that arrived, as NumPy computes it from those rows alone
  (the absent worker's zero row, counted in, would move both rules), and the outer rule
  (SGD at lr 1) steps by the result."""
  from lowcomm_jax.runtimes.ray.server import ServerProcess
  c = load_config("smoke", algorithm="diloco", num_workers=4, inner_steps=2, runtime="ray",
                  **{"mesh.replica": 1, "aggregate.rule": rule, "aggregate.trim": 1,
                     "outer.lr": 1.0, "outer.momentum": 0.0, "outer.nesterov": False,
                     "collective_form": "server"})
  server = ServerProcess(c)
  theta = np.asarray(server.arrays["params"])
  rows = (np.random.default_rng(5).normal(0, 1e-2, (3, theta.size)) + 0.05).astype(np.float32)
  for w in range(3):
    server.contribute({"worker": w, "version": 0, "tokens": 8, "loss": 2.0}, rows[w])
  server.close_round()
  combined = np.median(rows, 0) if rule == "median" else np.sort(rows, 0)[1:-1].mean(0)
  np.testing.assert_allclose(np.asarray(server.arrays["params"]), theta - combined,
                             rtol=0, atol=1e-6)
