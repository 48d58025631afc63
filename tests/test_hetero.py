"""Heterogeneous hosts in one process: MatFormer tiers, nested aggregation, DyLU, host tables."""

import json

import jax
import numpy as np
import pytest

from lowcomm_jax import config_check, train
from conftest import train_rounds
from lowcomm_jax.hosts import host
from conftest import checkpointed_state as _checkpointed_state


def _tiers_config(smoke_config, hosts, **overrides):
  return smoke_config(hosts=hosts, num_workers=sum(h.workers for h in hosts), **overrides)


def _params_after(config, rounds):
  r, state, _, metrics = train_rounds(config, rounds)
  return r, r.model.layout.unravel(state.params), metrics


def test_narrow_workers_never_dilute_the_full_width_workers_outer_units(smoke_config):
  """Round 1 from the same θ: FFN units only the L worker trains move exactly as if L were
  alone, while units every tier trains (and all other parameters) get the narrow workers'
  contributions too."""
  alone = _tiers_config(smoke_config, [host(1.0)])
  shared = _tiers_config(smoke_config, [host(1.0), host(0.25, workers=2)])
  r, p_alone, _ = _params_after(alone, 1)
  _, p_shared, _ = _params_after(shared, 1)
  m = r.topology.hosts[0].hidden // 4  # the 25% tier's hidden units
  for name, axis in (("fc_kernel", 1), ("fc_bias", 0), ("proj_kernel", 0)):
    a = p_alone["blocks"][0]["mlp"][name]
    b = p_shared["blocks"][0]["mlp"][name]
    outer = (slice(None),) * axis + (slice(m, None),)
    inner = (slice(None),) * axis + (slice(0, m),)
    np.testing.assert_allclose(a[outer], b[outer], rtol=1e-5, atol=1e-7)
    assert not np.allclose(a[inner], b[inner])
  assert not np.allclose(p_alone["wte"]["embedding"], p_shared["wte"]["embedding"])
  # Only the pseudo-gradient crosses the network: the weight totals are computed locally.
  shared_run = train.build(shared)
  assert shared_run.outer_bytes().sent == shared_run.model.param_bytes


def test_heterogeneous_run_end_to_end(tmp_path, smoke_config):
  config = _tiers_config(smoke_config, [host(1.0), host(0.25), host(0.5, batch_size=2)],
                         rounds=6, eval_every=3, inner_steps=3)
  summary = train.run(config, tmp_path)
  lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert lines[-1]["train_loss_worker_0"] < lines[0]["train_loss_worker_0"]  # tier 0 learns
  assert [w["tier"] for w in summary["workers"]] == [1.0, 0.25, 0.5]
  assert [w["host"] for w in summary["workers"]] == [0, 1, 2]
  assert [w["process"] for w in summary["workers"]] == [0, 0, 0]  # all hosts in one process
  assert all(0.0 <= w["idle_fraction"] < 1.0 for w in summary["workers"])
  tiers = summary["tiers"]
  assert tiers["0.25"]["param_bytes"] < tiers["0.5"]["param_bytes"] < tiers["1.0"]["param_bytes"]
  assert tiers["0.25"]["optimizer_bytes"] < tiers["1.0"]["optimizer_bytes"]
  # Tokens count each host's own batch size: (4 + 4 + 2) x 3 steps x 32 tokens x 6 rounds.
  assert summary["tokens"] == 10 * 3 * 32 * 6
  assert {"compute_s_host_0", "idle_s_host_2", "inner_steps_host_1"} <= lines[0].keys()


def test_compressed_tiers_keep_the_outer_units_of_the_full_width_worker(smoke_config):
  """With a codec the narrow worker's reconstruction outside its tier never counts: the
  FFN units only L trains move exactly as when L is alone with the same codec."""
  codec = {"compress.codec": "sparseloco", "compress.k": 8}
  alone = _tiers_config(smoke_config, [host(1.0)], **codec)
  shared = _tiers_config(smoke_config, [host(1.0), host(0.25)], **codec)
  r, p_alone, _ = _params_after(alone, 1)
  r_shared, p_shared, metrics = _params_after(shared, 1)
  assert np.isfinite(float(metrics["train_loss"]))
  m = r.topology.hosts[0].hidden // 4
  a = p_alone["blocks"][0]["mlp"]["fc_kernel"][:, m:]
  b = p_shared["blocks"][0]["mlp"]["fc_kernel"][:, m:]
  np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  # Only the packed payloads cross: far fewer bytes than the dense pseudo-gradient.
  assert r_shared.outer_bytes().sent < r_shared.model.param_bytes / 20


def test_dylu_with_configured_speeds_gives_slow_hosts_fewer_steps(tmp_path, smoke_config):
  config = _tiers_config(smoke_config, [host(1.0, speed=1.0), host(0.25, speed=0.3)],
                         rounds=2, inner_steps=4, **{"outer.dylu": True})
  summary = train.run(config, tmp_path)
  assert [w["inner_steps"] for w in summary["workers"]] == [4, 2]  # ceil(4 * 0.3) = 2
  assert summary["tokens"] == (4 + 2) * 4 * 32 * 2


def test_dylu_measures_speeds_in_round_two(tmp_path, smoke_config, monkeypatch):
  # Host timings are made up so the outcome is known: in round 1 (compiling) host 1 looks
  # 10x slower per step than host 0, from round 2 on 2.5x slower. DyLU must use round 2's:
  # H = [6, ceil(6 / 2.5)] = [6, 3] (round 1's would give [6, 1]; never measuring, [6, 6]).
  real_round, rounds_run = train.train_round, []

  def timed_round(r, fns, state, workers, batches, weights, *, timed=False, metrics=True):
    state, workers, metrics_, compute = real_round(r, fns, state, workers, batches, weights,
                                                   timed=timed, metrics=metrics)
    rounds_run.append([b.shape[1] for b in batches])
    step_seconds = [0.1, 1.0] if len(rounds_run) == 1 else [0.1, 0.25]
    if timed:
      compute = [s * b.shape[1] for s, b in zip(step_seconds, batches)]
    return state, workers, metrics_, compute
  monkeypatch.setattr(train, "train_round", timed_round)
  config = _tiers_config(smoke_config, [host(1.0), host(0.25)], rounds=4, inner_steps=6,
                         **{"outer.dylu": True})
  summary = train.run(config, tmp_path)
  assert rounds_run == [[6, 6], [6, 6], [6, 3], [6, 3]]  # what each host really ran
  assert [w["inner_steps"] for w in summary["workers"]] == [6, 3]
  lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [[l[f"inner_steps_host_{i}"] for i in (0, 1)] for l in lines] == rounds_run
  # Tokens follow the H each host actually ran, round by round.
  ran = [l["inner_steps_host_0"] + l["inner_steps_host_1"] for l in lines]
  assert summary["tokens"] == sum(ran) * 4 * 32


def test_heterogeneous_resume_is_bit_identical(tmp_path, smoke_config):
  config = _tiers_config(smoke_config, [host(1.0), host(0.5)], rounds=4, checkpoint_every=2,
                         **{"aggregate.weighting": "tokens"})
  a = train.run(config, tmp_path / "straight")
  train.run(config, tmp_path / "resumed", stop_after_rounds=2)
  b = train.run(config, tmp_path / "resumed")
  assert a["eval_loss"] == b["eval_loss"] and a["tokens"] == b["tokens"]
  (state_a, workers_a), data_a = _checkpointed_state(config, tmp_path / "straight")
  (state_b, workers_b), data_b = _checkpointed_state(config, tmp_path / "resumed")
  jax.tree.map(np.testing.assert_array_equal, (state_a, workers_a), (state_b, workers_b))
  assert data_a == data_b


BAD_HOST_TABLES = [
    ([host(0.0)], "hosts[0].tier=0.0: the FFN fraction must be in (0, 1]"),
    ([host(1.5)], "hosts[0].tier=1.5"),
    ([host(1.0), host(0.5, workers=0)], "hosts[1].workers=0"),
    ([host(1.0, workers=2), host(0.5)], "num_workers=2: the host table has 3 workers"),
]


@pytest.mark.parametrize("hosts,message", BAD_HOST_TABLES)
def test_bad_host_tables_fail_at_start_up(smoke_config, hosts, message):
  with pytest.raises(config_check.ConfigError) as e:
    config_check.validate(smoke_config(hosts=hosts), num_devices=1)
  assert message in str(e.value)


def test_same_batches_need_one_batch_size_and_ddp_one_step(smoke_config):
  with pytest.raises(config_check.ConfigError, match="one batch size"):
    config_check.validate(_tiers_config(smoke_config, [host(1.0), host(0.5, batch_size=2)],
                                        **{"data.batch_mode": "same"}), num_devices=1)
  with pytest.raises(config_check.ConfigError, match="ddp takes one step"):
    config_check.validate(_tiers_config(smoke_config, [host(1.0, inner_steps=5)],
                                        algorithm="ddp", inner_steps=1), num_devices=1)
