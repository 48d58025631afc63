"""Collaborative epochs (lowcomm_jax/runtimes/spmd/collab.py): unequal peers fill a target batch, the
sample-weighted mean gradient takes one optimizer step."""

import functools
import json
import pathlib
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import checkpointed_state, load_config
from lowcomm_jax.runtimes.spmd import collab
from lowcomm_jax.run import loop
from lowcomm_jax.runtimes.spmd import train
from lowcomm_jax.config.check import ConfigError, validate
from lowcomm_jax.assemble.hosts import host
from lowcomm_jax.model import next_token_loss
from lowcomm_jax.run.files import RunFiles

REPO = pathlib.Path(__file__).resolve().parents[1]


def _config(**overrides):
  # Host 0: micro-batches of 4 every time unit; host 1: of 2, every 2 units. Target 12:
  # t=1: 4, t=2: 8 and 10, t=3: 14 >= 12. Host 1's micro-batch started at t=2 < 3 counts:
  # host 0 gave 3 micro-batches (12 samples), host 1 two (4 samples).
  # Plain SGD without clipping: the step is linear in the averaged gradient.
  c = load_config("smoke", algorithm="ddp", inner_steps=1, rounds=1, num_workers=2,
                  checkpoint_every=1, eval_every=0, **{
                      "optimizer.warmup_steps": 0, "optimizer.name": "sgd",
                      "optimizer.lr": 0.5, "optimizer.grad_clip": 0.0,
                      "collab.target_batch_size": 12})
  c.hosts = [host(1.0, batch_size=4, speed=1.0), host(1.0, batch_size=2, speed=0.5)]
  for k, v in overrides.items():
    c[k] = v
  return c


def _run(config, workdir, progress_cls=None):
  r = train.build(config)
  progress = None
  if progress_cls is not None:
    progress = progress_cls(config.collab.target_batch_size,
                            [len(h.worker_ids) * h.batch_size for h in r.topology.hosts],
                            [h.speed for h in r.topology.hosts])
  driver = collab.CollabDriver(r, None, progress=progress)
  summary = loop.run(driver, RunFiles(config, workdir), t_start=time.time())
  return r, summary


@functools.cache
def _flat_grad(graphdef, layout):
  """(flat θ, batch) -> the flat gradient of the batch's loss at θ: unravel, grad, ravel in
  one program (op by op, every leaf's slice and reshape would compile on its own), made once
  per model in this process (its tests share it)."""
  def loss(p, batch):
    return next_token_loss(nnx.merge(graphdef, p), batch)
  return jax.jit(lambda theta, batch: layout.ravel(jax.grad(loss)(layout.unravel(theta), batch)))


def _hand_step(config, micro_batches_per_host):
  """(θ_0, the epoch's update) by hand: each host's micro-batches drawn from fresh streams,
  every gradient at θ_0, averaged weighted by samples (and, for contrast, the plain mean of
  the hosts' mean gradients), times -lr."""
  r = train.build(config)
  theta = r.state_spec.initial_params()
  grad = _flat_grad(r.model.graphdef, r.model.layout)
  sums, counts = [], []  # per worker
  for stream, count in zip(r.data.streams, micro_batches_per_host):
    total = np.zeros((len(stream.worker_ids),) + theta.shape, np.float64)
    n = np.zeros(len(stream.worker_ids))
    for _ in range(count):
      for w, batch in enumerate(stream.next_round(1)[:, 0]):
        total[w] += batch.shape[0] * np.asarray(grad(theta, batch))
        n[w] += batch.shape[0]
    sums.extend(total)
    counts.extend(n)
  weighted = np.sum(sums, axis=0) / sum(counts)
  plain = np.mean([s / n for s, n in zip(sums, counts) if n], axis=0)
  lr = config.optimizer.lr
  return np.asarray(theta), -lr * weighted, -lr * plain


def _metrics(workdir):
  return [json.loads(l) for l in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


# Host 0 with two workers of batch 2 (4 samples a micro-batch, like host 0 above).
TWO_WORKERS = [host(1.0, workers=2, batch_size=2, speed=1.0), host(1.0, batch_size=2, speed=0.5)]


@pytest.mark.parametrize("hosts", [None, TWO_WORKERS], ids=["one_worker_each", "two_workers"])
def test_unequal_peers_average_weighted_by_samples(tmp_path, hosts):
  config = _config()
  if hosts:
    config.hosts, config.num_workers = hosts, 3
  summary = train.run(config, tmp_path)
  row = _metrics(tmp_path)[-1]
  assert (row["samples_host_0"], row["samples_host_1"], row["samples"]) == (12, 4, 16)
  assert summary["tokens"] == 16 * config.data.seq_len
  assert summary["collab"] == {"target_batch_size": 12, "epochs": 1, "samples": 16}
  (state, _), _ = checkpointed_state(config, tmp_path)
  theta, update, plain = _hand_step(config, [3, 2])
  np.testing.assert_allclose(np.asarray(state.params) - theta, update, rtol=1e-4, atol=1e-7)
  # Not the plain mean of the two hosts' mean gradients: the sample weights matter here.
  assert np.abs(update - plain).max() > 100 * np.abs(np.asarray(state.params) - theta
                                                     - update).max()
  rows = [json.loads(l) for l in (tmp_path / collab.PROGRESS_FILE).read_text().splitlines()]
  assert rows[-1]["samples"] == [12, 4] and rows[-1]["target"] == 12


def _assert_one_epoch(config, workdir, micro_batches, samples):
  """The run's one epoch took `samples` from the two hosts, and its step is the hand step of
  `micro_batches` per host."""
  row = _metrics(workdir)[-1]
  assert (row["samples_host_0"], row["samples_host_1"]) == samples
  (state, _), _ = checkpointed_state(config, workdir)
  theta, update, _ = _hand_step(config, micro_batches)
  np.testing.assert_allclose(np.asarray(state.params) - theta, update, rtol=1e-4, atol=1e-7)


def test_a_static_split_gives_each_peer_its_speeds_share(tmp_path):
  # The baseline without counting: target 12 split 2:1 by speed, in micro-batches of 4 and
  # 2 samples: host 0 takes ceil(8 / 4) = 2, host 1 ceil(4 / 2) = 2, whatever the clock.
  assert collab.quotas(12, [4, 2], [1.0, 0.5]) == [2, 2]
  assert collab.quotas(12, [4, 2], [1.0, 0.01]) == [3, 1]  # at least one each
  config = _config()
  config.collab.static_split = True
  train.run(config, tmp_path)
  _assert_one_epoch(config, tmp_path, micro_batches=[2, 2], samples=(8, 4))


def test_the_emulated_link_is_a_ring_all_reduce_of_the_epochs_bytes():
  # 2 peers, 1 MB sent each, 0.1 Gb/s and 50 ms: 2 steps' latency + 8e6 bits / 1e8 bit/s.
  assert collab.link_seconds(2, 1e6, 0.1, 0.05) == pytest.approx(0.1 + 0.08)
  assert collab.link_seconds(3, 1e6, 0.1, 0.05) == pytest.approx(0.2 + 0.08)
  assert collab.link_seconds(1, 1e6, 0.1, 0.05) == 0.0  # nobody to talk to
  assert collab.link_seconds(2, 1e6, 0.0, 0.05) == 0.0  # no emulation


class _LateHostOne(collab.VirtualProgress):
  """Host 1 is still busy (compiling, loading) while host 0 fills the batch."""

  def next_host(self):
    return 0 if self.total < self.target else None


def test_an_epoch_is_full_once_its_counted_samples_reach_the_target():
  """The one rule both runtimes close an epoch by (programs/epochs.EpochTally): a peer's
  samples taken out (it died with them) make the epoch short again."""
  from lowcomm_jax.programs.epochs import EpochTally
  tally = EpochTally(16)
  tally.add(0, 8)
  tally.add(1, 4)
  assert not tally.full and tally.total == 12
  tally.add(1, 4)
  assert tally.full and tally.by_peer == {0: 8, 1: 8}
  assert tally.drop(1) == 8 and not tally.full and tally.drop(5) == 0


def test_a_late_peer_joins_with_weight_zero(tmp_path):
  config = _config()
  _run(config, tmp_path, _LateHostOne)
  # Exactly host 0's three micro-batches: host 1's zero Δ carried no weight.
  _assert_one_epoch(config, tmp_path, micro_batches=[3, 0], samples=(12, 0))


def _lora_config():
  """Rank-2 adapters on attention and MLP, four epochs (the LoRA tests share its run)."""
  config = _config(rounds=4, checkpoint_every=2)
  config.lora.rank, config.lora.targets = 2, ("attn", "mlp")
  return config


def test_lora_collaboration_trains_adapters_only_and_resumes_exactly_mid_epoch(tmp_path,
                                                                            monkeypatch):
  config = _lora_config()
  r, whole = _run(config, tmp_path / "whole")
  frozen = jax.tree.map(np.asarray, r.frozen)
  (end, _), _ = checkpointed_state(config, tmp_path / "whole", run=r)
  assert end.params.shape == (r.model.param_count,) and r.model.frozen_count > 0
  # The base after four optimizer steps: bit for bit what was loaded (and still readable: a
  # program that donated it, as accelerators do with their inputs, would have deleted it).
  fresh = train.build(config)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), fresh.frozen, frozen)
  assert whole["trainable_params"] == r.model.param_count

  # A crash in the middle of epoch 3 (after the checkpoint of epoch 2): the restart redoes
  # epoch 3 from the checkpointed data position and ends where the whole run did.
  calls = {"n": 0}
  done = collab.VirtualProgress.done

  def crash(self, host):
    calls["n"] += 1
    if calls["n"] == 2 * 5 + 2:  # epoch 3's second micro-batch (five a epoch)
      raise RuntimeError("host lost")
    done(self, host)

  monkeypatch.setattr(collab.VirtualProgress, "done", crash)
  with pytest.raises(RuntimeError, match="host lost"):
    _run(config, tmp_path / "cut")
  monkeypatch.setattr(collab.VirtualProgress, "done", done)
  assert json.loads((tmp_path / "cut" / collab.PROGRESS_FILE).read_text().splitlines()[-1]
                    )["epoch"] == 2
  _, resumed = _run(config, tmp_path / "cut")
  (cut, _), _ = checkpointed_state(config, tmp_path / "cut", run=fresh)
  np.testing.assert_array_equal(np.asarray(cut.params), np.asarray(end.params))
  assert resumed["eval_loss"] == whole["eval_loss"]


class _Store:
  """The coordination service's key-value calls, in memory, shared by threads."""

  def __init__(self):
    self.values, self.cond = {}, threading.Condition()

  def key_value_increment(self, key, by):
    with self.cond:
      self.values[key] = int(self.values.get(key, 0)) + by
      self.cond.notify_all()
      return self.values[key]

  def key_value_set(self, key, value, allow_overwrite=False):
    with self.cond:
      assert allow_overwrite or key not in self.values, key
      self.values[key] = value
      self.cond.notify_all()

  def key_value_dir_get(self, prefix):
    with self.cond:
      return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]

  def blocking_key_value_get(self, key, timeout_in_ms):
    with self.cond:
      if not self.cond.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
        raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
      return self.values[key]

  def key_value_delete(self, prefix):
    with self.cond:
      for k in [k for k in self.values if k.startswith(prefix)]:
        del self.values[k]


def test_store_progress_counts_across_peers_and_gives_a_late_one_weight_zero():
  store = _Store()
  peers = [collab.StoreProgress(16, samples, q, 2, timeout_s=5, client=store)
           for q, samples in enumerate((8, 2))]
  for p in peers:
    p.begin(1)
  # Peer 1 takes one micro-batch, then peer 0 fills the target while peer 1 is busy.
  assert peers[1].next_host() == 0
  peers[1].done(0)
  while peers[0].next_host() is not None:
    peers[0].done(0)
  assert peers[0].micro == 2 and peers[1].next_host() is None
  assert peers[0].live() == [16, 2]
  results = {}
  threads = [threading.Thread(target=lambda q=q: results.update(
      {q: peers[q].agree([(1.0 * q, 0.5)])})) for q in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert results[0] == results[1]
  assert [s.samples for s in results[0]] == [16, 2]

  # Epoch 2: peer 1 arrives when the batch is already full: it takes nothing, weight 0.
  for p in peers:
    p.begin(2)
  while peers[0].next_host() is not None:
    peers[0].done(0)
  assert peers[1].next_host() is None
  threads = [threading.Thread(target=lambda q=q: results.update(
      {q: peers[q].agree([(0.0, 0.0)])})) for q in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert [s.samples for s in results[1]] == [16, 0]
  assert not any(k.startswith("lowcomm/collab/1/") for k in store.values)  # cleaned up


def test_a_peer_with_a_quota_takes_exactly_it_whatever_the_counter_says():
  store = _Store()
  peers = [collab.StoreProgress(16, samples, q, 2, timeout_s=5, client=store, quota=quota)
           for q, (samples, quota) in enumerate(((8, 1), (2, 4)))]
  for p in peers:
    p.begin(1)
  for p in peers:
    while p.next_host() is not None:
      p.done(0)
  assert [p.micro for p in peers] == [1, 4]  # 8 + 8 samples, past nothing, short of nothing
  assert peers[0].live() == [8, 8]


def test_a_silent_peer_times_out_with_a_clear_error():
  store = _Store()
  peer = collab.StoreProgress(8, 8, 0, 2, timeout_s=0.2, client=store)
  peer.begin(1)
  peer.done(0)
  with pytest.raises(collab.CollabTimeout, match="peer 1 did not report epoch 1.*wait_timeout_s"):
    peer.agree([(0.0, 0.0)])


@pytest.mark.parametrize("field,value,message", [
    ("algorithm", "diloco", "algorithm='diloco'.*use --config.algorithm=ddp"),
    ("collab.target_batch_size", -1, "collab.target_batch_size=-1: must be >= 0"),
    ("collab.wait_timeout_s", 0.0, "collab.wait_timeout_s=0.0: must be > 0"),
    ("collab.link_gbps", -1.0, "collab.link_gbps=-1.0: must be >= 0"),
    ("collab.link_latency_s", -0.1, "collab.link_latency_s=-0.1: must be >= 0"),
    ("aggregate.rule", "median", "aggregate.rule='median': an epoch weighs workers"),
    ("data.batch_mode", "same", "data.batch_mode='same': peers reading the same windows")])
def test_bad_collab_fields_are_refused_by_name(field, value, message):
  config = _config()
  node, *rest = field.split(".")
  if rest:
    config[node][rest[0]] = value
  else:
    config[node] = value
  with pytest.raises(ConfigError, match=message):
    validate(config, num_devices=8)


def test_the_monitor_reports_epochs_rates_and_eta_and_writes_tensorboard(tmp_path):
  import sys
  sys.path.insert(0, str(REPO / "launch"))
  import monitor as monitor_lib
  from lowcomm_jax.run.metrics import EventWriter
  rows = tmp_path / collab.PROGRESS_FILE
  rows.write_text(
      json.dumps({"epoch": 1, "live": True, "time": 0, "samples": [8, 2], "target": 32}) + "\n"
      + json.dumps({"epoch": 1, "rounds": 5, "time": 1, "epoch_seconds": 2.0,
                    "samples": [32, 8], "seconds": [1.5, 1.9], "train_loss": 2.5,
                    "target": 32}) + "\n" + '{"epoch": 2, "ro')  # a row being written
  writer = EventWriter(tmp_path / "monitor")
  mon = monitor_lib.Monitor(tmp_path, writer)
  lines = mon.poll()
  assert lines[0] == "epoch 1: 10/32 samples (peer 0: 8, peer 1: 2)"
  assert lines[1].startswith("epoch 1/5  loss 2.5000  20.0 samples/s (peer 0: 16.0, "
                             "peer 1: 4.0)  2.00 s/epoch  ETA 0:08")
  assert mon.poll() == []  # the half-written row waits
  with rows.open("a") as f:
    f.write('unds": 5, "time": 2, "epoch_seconds": 1.0, "samples": [30, 10], "seconds": '
            '[1, 1], "train_loss": 2.0, "target": 32}\n')
  assert mon.poll()[0].startswith("epoch 2/5  loss 2.0000  40.0 samples/s")
  with rows.open("a") as f:  # a restart from epoch 1's checkpoint redoes epoch 2
    f.write(json.dumps({"resumed_at": 1, "time": 3}) + "\n")
  assert mon.poll() == ["resumed from the checkpoint of epoch 1"] and mon.epoch_seconds == []
  writer.close()
  assert list((tmp_path / "monitor").glob("events.out.tfevents.*"))


def test_a_codec_compresses_the_averaged_adapters(tmp_path):
  config = _lora_config()  # uncompressed: the LoRA test's run
  dense = train.run(config, tmp_path / "dense")
  config.compress.codec = "int8"
  int8 = train.run(config, tmp_path / "int8")
  # Under int8's 4x: its per-chunk scales weigh on rank-2 adapters of 32 to 128 columns
  # (about 2.1x with the MLP's adapters too; byte counts, no rounding in them).
  assert 2 < int8["compression_ratio"] <= 4
  assert int8["bytes_sent"] < dense["bytes_sent"] / 2
  assert int8["eval_loss"] == pytest.approx(dense["eval_loss"], rel=1e-3)
