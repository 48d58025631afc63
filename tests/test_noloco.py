"""NoLoCo (algorithms/noloco.py): the gossip step equals the authors' update (both means over
the pair, γ = β), crosses devices as one collective-permute of θ_w and nothing else, and a
run keeps one model per worker that trains, is counted by the ledger and resumes exactly."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import assert_run_resumes_exactly
from lowcomm_jax.config import check
from lowcomm_jax.algorithms import noloco
from lowcomm_jax.parallel import ledger, mesh as mesh_lib, workers

R, N, SEED, LR, MOMENTUM = 4, 300, 5, 0.7, 0.9


def _reference_round(phi, momentum, delta, pairs):
  """The authors' outer step (sparse_optimizer_c.py), in NumPy: each worker's group means of
  its old weights φ_j and of its drift −Δ_j."""
  peer = dict(pairs)
  out_phi, out_m = phi.copy(), momentum.copy()
  for i in range(R):
    group = [i, peer[i]]
    mean_phi = phi[group].mean(0)
    mean_delta = delta[group].mean(0)
    step = MOMENTUM * momentum[i] - LR * mean_delta - LR * (phi[i] - mean_phi)
    out_m[i], out_phi[i] = step, phi[i] + step
  return out_phi, out_m


def test_gossip_is_the_authors_step_and_only_permutes_theta_between_devices():
  tx = noloco.gossip(R, LR, MOMENTUM, SEED)
  rng = np.random.default_rng(0)
  phi = rng.standard_normal((R, N)).astype(np.float32)
  momentum = np.zeros((R, N), np.float32)
  theta = jnp.zeros((N,), jnp.float32)
  mesh = mesh_lib.make_mesh(R)
  split = NamedSharding(mesh, P("replica"))
  step = jax.jit(workers.map_workers(
      lambda d, s, t, k: tx.update(d, s, t, round_index=k), (0, 0, None, None), (None, 0),
      per_device=True))
  pools = noloco.pairings(R, SEED)
  drawn = set()
  for round_ in range(4):
    delta = (0.1 * rng.standard_normal((R, N))).astype(np.float32)
    state = jax.device_put((jnp.asarray(delta), noloco.NoLoCoState(jnp.asarray(phi),
                                                                    jnp.asarray(momentum))), split)
    with jax.set_mesh(mesh):
      update, new = step(*state, theta, round_)
      if round_ == 0:
        hlo = step.lower(*state, theta, round_).compile().as_text()
    draw = int(jax.random.randint(jax.random.fold_in(jax.random.key(SEED), round_), (), 0,
                                  len(pools)))
    drawn.add(draw)
    phi, momentum = _reference_round(phi, momentum, delta, pools[draw])
    np.testing.assert_allclose(np.asarray(new.phi), phi, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(new.momentum), momentum, rtol=1e-5, atol=1e-5)
    assert not np.asarray(update).any()  # θ is the consensus's, not the step's
    phi, momentum = np.asarray(new.phi), np.asarray(new.momentum)
  assert len(drawn) > 1  # peers change between rounds
  # Between devices: collective-permutes of one worker's θ_w (one per pairing in the pool,
  # one of them runs), no all-reduce or all-gather.
  ops = re.findall(r"= (\S+) (all-reduce|all-gather|collective-permute)(?:-start)?\(", hlo)
  assert {op for _, op in ops} == {"collective-permute"}
  assert {re.sub(r"\{.*\}", "", shape) for shape, _ in ops} == {f"f32[1,{N}]"}
  with jax.set_mesh(mesh):
    counted = ledger.count_bytes(workers.map_workers(
        lambda d, s: tx.update(d, s, theta, round_index=0), (0, 0), (None, 0),
        per_device=True), *state)
  assert counted == ledger.CommBytes(sent=4 * N, received=4 * N)


def test_a_noloco_run_keeps_a_model_per_worker_learns_and_resumes_exactly(tmp_path,
                                                                          smoke_config):
  config = smoke_config(algorithm="noloco", num_workers=4, rounds=3, checkpoint_every=1,
                        eval_every=3, log_every=1)
  straight, a = assert_run_resumes_exactly(config, tmp_path, stop_after_rounds=2)
  # One model per worker, apart (no global average) yet close (the pull toward the peer);
  # θ, what is evaluated and checkpointed, is their mean.
  phi = np.asarray(a.outer.per_worker[0].phi)
  spread = np.abs(phi - phi.mean(0)).max(axis=1)
  assert (spread > 0).all() and spread.max() < 0.5 * np.abs(phi).max()
  np.testing.assert_allclose(np.asarray(a.params), phi.mean(0), rtol=1e-6, atol=1e-6)
  # The ledger: one permute of θ_w a round, as many bytes as the model (DiLoCo's all-reduce).
  params = np.asarray(a.params).size
  assert straight["bytes_sent"] == straight["bytes_received"] == 3 * 4 * params
  losses = [r["train_loss"] for r in map(json.loads, (tmp_path / "straight" / "metrics.jsonl")
                                         .read_text().splitlines()) if "train_loss" in r]
  assert len(losses) == 3 and losses[-1] < losses[0] - 0.2


def test_noloco_refuses_what_it_cannot_pair(smoke_config):
  with pytest.raises(check.ConfigError, match=r"num_workers=3: NoLoCo pairs"):
    check.validate(smoke_config(algorithm="noloco", num_workers=3), num_devices=8)
  with pytest.raises(check.ConfigError, match=r"compress.codec='int8'"):
    check.validate(smoke_config(algorithm="noloco", num_workers=4,
                                       **{"compress.codec": "int8"}), num_devices=8)
  sync = noloco.ALGORITHM.sync(smoke_config(algorithm="noloco", num_workers=4), [], 0)
  assert sync.place(4) == sync.place(1) == []
  assert "2 workers on each of 2 devices" in sync.place(2)[0]


def test_the_simulator_equals_the_runner(tmp_path):
  from conftest import assert_simulator_equals_runner, sim_and_runner_config
  assert_simulator_equals_runner(sim_and_runner_config("noloco", **{"sim.heterogeneity": "very"}),
                                 tmp_path)
