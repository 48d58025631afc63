"""Heterogeneous hosts in one process: MatFormer tiers, nested aggregation, DyLU, host tables."""

import json
import pathlib

import jax
import numpy as np
import pytest

from lowcomm_jax.config import check
from lowcomm_jax.runtimes.spmd import driver
from lowcomm_jax.runtimes.spmd import train
from lowcomm_jax.run.checkpoint import Checkpointer, abstract_with_shardings
from conftest import load_config, train_rounds
from lowcomm_jax.assemble.hosts import host
from conftest import checkpointed_state as _checkpointed_state


def _tiers_config(smoke_config, hosts, **overrides):
  return smoke_config(hosts=hosts, num_workers=sum(h.workers for h in hosts), **overrides)


def _smoke(**overrides):
  return load_config("smoke", **overrides)


def _params_after(config, rounds):
  r, state, _, metrics = train_rounds(config, rounds)
  return r, r.model.layout.unravel(state.params), metrics


# One heterogeneous run that several tests read (each of its programs costs seconds to trace
# and compile): three hosts — the full width, a 0.25 tier with two workers at 30% speed, a
# 0.5 tier with half the batch — DyLU from the configured speeds (H per host [4, 2, 4]),
# token-weighted aggregation, a checkpoint after each of its 4 rounds (all kept).
def _mixed_hosts():
  return [host(1.0, speed=1.0), host(0.25, workers=2, speed=0.3),
          host(0.5, batch_size=2, speed=1.0)]


def _mixed_config(hosts=None):
  return _tiers_config(_smoke, _mixed_hosts() if hosts is None else hosts,
                       rounds=4, inner_steps=4, eval_every=2, checkpoint_every=1,
                       keep_checkpoints=4,
                       **{"outer.dylu": True, "aggregate.weighting": "tokens"})


def _params_at(config, workdir, round_):
  """The parameter tree of `config`'s run in `workdir` as checkpointed after `round_`."""
  r = train.build(config)
  ckpt = Checkpointer(pathlib.Path(workdir) / "checkpoints", max_to_keep=config.keep_checkpoints)
  state, _, _, _ = ckpt.restore(
      round_, abstract_with_shardings(r.state_spec.abstract, r.state_spec.shardings),
      r.abstract_workers())
  ckpt.close()
  return r.model.layout.unravel(state.params)


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
  """(config, summary, workdir) of `_mixed_config()` trained uninterrupted (read only)."""
  config = _mixed_config()
  workdir = tmp_path_factory.mktemp("mixed") / "straight"
  return config, train.run(config, workdir), workdir


def test_narrow_workers_never_dilute_the_full_width_workers_outer_units(mixed_run):
  """Round 1 from the same θ: FFN units only the L worker trains move exactly as if L were
  alone, while units every tier trains (and all other parameters) get the narrow workers'
  contributions too."""
  config, summary, workdir = mixed_run
  r, p_alone, _ = _params_after(_mixed_config([host(1.0, speed=1.0)]), 1)
  p_shared = _params_at(config, workdir, 1)  # the mixed run's θ after its round 1
  hidden = r.topology.hosts[0].hidden
  quarter, half = hidden // 4, hidden // 2  # the 0.25 tier's and the 0.5 tier's hidden units
  for name, axis in (("fc_kernel", 1), ("fc_bias", 0), ("proj_kernel", 0)):
    a = p_alone["blocks"][0]["mlp"][name]
    b = p_shared["blocks"][0]["mlp"][name]
    outer = (slice(None),) * axis + (slice(half, None),)  # only L trains these
    inner = (slice(None),) * axis + (slice(0, quarter),)  # every tier trains these
    middle = (slice(None),) * axis + (slice(quarter, half),)  # L and the 0.5 tier
    np.testing.assert_allclose(a[outer], b[outer], rtol=1e-5, atol=1e-7)
    assert not np.allclose(a[inner], b[inner])
    assert not np.allclose(a[middle], b[middle])
  assert not np.allclose(p_alone["wte"]["embedding"], p_shared["wte"]["embedding"])
  # Only the pseudo-gradient crosses the network: the weight totals are computed locally.
  assert summary["bytes_sent_peak_sync"] == r.model.param_bytes  # its one sync per round
  assert summary["bytes_sent"] == config.rounds * r.model.param_bytes


def test_heterogeneous_run_end_to_end(mixed_run):
  config, summary, workdir = mixed_run
  lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert lines[-1]["train_loss_worker_0"] < lines[0]["train_loss_worker_0"]  # tier 0 learns
  assert [w["tier"] for w in summary["workers"]] == [1.0, 0.25, 0.25, 0.5]
  assert [w["host"] for w in summary["workers"]] == [0, 1, 1, 2]
  assert [w["process"] for w in summary["workers"]] == [0, 0, 0, 0]  # all hosts in one process
  assert all(0.0 <= w["idle_fraction"] < 1.0 for w in summary["workers"])
  tiers = summary["tiers"]
  assert tiers["0.25"]["param_bytes"] < tiers["0.5"]["param_bytes"] < tiers["1.0"]["param_bytes"]
  assert tiers["0.25"]["optimizer_bytes"] < tiers["1.0"]["optimizer_bytes"]
  # Tokens count each host's own batch size (and its H): per round 1 worker x 4 x 4 steps,
  # 2 workers x 4 x 2 steps, 1 worker x 2 x 4 steps, of 32 tokens, for 4 rounds.
  assert summary["tokens"] == (16 + 16 + 8) * 32 * 4
  assert {"compute_s_host_0", "idle_s_host_2", "inner_steps_host_1"} <= lines[0].keys()


# The sparse codec's tiers, with DyLU measuring the hosts' speeds (no speed configured), H = 6
# over 4 rounds: the compressed-tiers test trains its round 1, the DyLU test the whole run.
def _compressed_config(hosts):
  return _tiers_config(_smoke, hosts, rounds=4, inner_steps=6,
                       **{"outer.dylu": True, "compress.codec": "sparseloco", "compress.k": 8})


def test_compressed_tiers_keep_the_outer_units_of_the_full_width_worker():
  """With a codec the narrow worker's reconstruction outside its tier never counts: the
  FFN units only L trains move exactly as when L is alone with the same codec."""
  alone = _compressed_config([host(1.0)])
  shared = _compressed_config([host(1.0), host(0.25)])
  r, p_alone, _ = _params_after(alone, 1)
  r_shared, p_shared, metrics = _params_after(shared, 1)
  assert np.isfinite(float(metrics["train_loss"]))
  m = r.topology.hosts[0].hidden // 4
  a = p_alone["blocks"][0]["mlp"]["fc_kernel"][:, m:]
  b = p_shared["blocks"][0]["mlp"]["fc_kernel"][:, m:]
  np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  # Only the packed payloads cross: far fewer bytes than the dense pseudo-gradient.
  assert r_shared.outer_bytes().sent < r_shared.model.param_bytes / 20


def test_dylu_with_configured_speeds_gives_slow_hosts_fewer_steps(mixed_run):
  _, summary, _ = mixed_run
  # speeds [1.0, 0.3, 1.0]: ceil(4 * 0.3) = 2 for host 1 (two workers), 4 for the others
  assert [w["inner_steps"] for w in summary["workers"]] == [4, 2, 2, 4]
  assert summary["tokens"] == (1 * 4 * 4 + 2 * 4 * 2 + 1 * 2 * 4) * 32 * 4  # workers x B x H


def test_dylu_measures_speeds_in_round_two(tmp_path, monkeypatch):
  # Host timings are made up so the outcome is known: in round 1 (compiling) host 1 looks
  # 10x slower per step than host 0, from round 2 on 2.5x slower. DyLU must use round 2's:
  # H = [6, ceil(6 / 2.5)] = [6, 3] (round 1's would give [6, 1]; never measuring, [6, 6]).
  real_round, rounds_run = driver.train_round, []

  def timed_round(r, fns, state, workers, batches, weights, *, timed=False, metrics=True,
                  **kwargs):
    state, workers, metrics_, compute = real_round(r, fns, state, workers, batches, weights,
                                                   timed=timed, metrics=metrics, **kwargs)
    rounds_run.append([b.shape[1] for b in batches])
    step_seconds = [0.1, 1.0] if len(rounds_run) == 1 else [0.1, 0.25]
    if timed:
      compute = [s * b.shape[1] for s, b in zip(step_seconds, batches)]
    return state, workers, metrics_, compute
  monkeypatch.setattr(driver, "train_round", timed_round)
  config = _compressed_config([host(1.0), host(0.25)])  # the compressed-tiers test's programs
  assert config.outer.dylu and config.rounds == 4 and config.inner_steps == 6
  summary = train.run(config, tmp_path)
  assert rounds_run == [[6, 6], [6, 6], [6, 3], [6, 3]]  # what each host really ran
  assert [w["inner_steps"] for w in summary["workers"]] == [6, 3]
  lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [[l[f"inner_steps_host_{i}"] for i in (0, 1)] for l in lines] == rounds_run
  # Tokens follow the H each host actually ran, round by round.
  ran = [l["inner_steps_host_0"] + l["inner_steps_host_1"] for l in lines]
  assert summary["tokens"] == sum(ran) * 4 * 32


def test_heterogeneous_resume_is_bit_identical(tmp_path, mixed_run):
  config, a, straight = mixed_run  # tokens weighting, DyLU's H restored from the checkpoint
  assert train.run(config, tmp_path / "resumed", stop_after_rounds=2) == {"stopped_at_round": 2}
  b = train.run(config, tmp_path / "resumed")
  assert a["eval_loss"] == b["eval_loss"] and a["tokens"] == b["tokens"]
  (state_a, workers_a), data_a = _checkpointed_state(config, straight)
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
  with pytest.raises(check.ConfigError) as e:
    check.validate(smoke_config(hosts=hosts), num_devices=1)
  assert message in str(e.value)


def test_same_batches_need_one_batch_size_and_ddp_one_step(smoke_config):
  with pytest.raises(check.ConfigError, match="one batch size"):
    check.validate(_tiers_config(smoke_config, [host(1.0), host(0.5, batch_size=2)],
                                        **{"data.batch_mode": "same"}), num_devices=1)
  with pytest.raises(check.ConfigError, match="ddp takes one step"):
    check.validate(_tiers_config(smoke_config, [host(1.0, inner_steps=5)],
                                        algorithm="ddp", inner_steps=1), num_devices=1)
