"""Every codec end to end through `train.run`: under DiLoCo with and without a two-tier host
table, on the tiny model; DDP with no codec and with DeMo (DDP-only), flat and tiered. Unit
tests of the codecs map every output over the workers; only the runner's outer step needs
θ_global unmapped, which is where random-k once failed (its receivers' keys came from
per-worker state)."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from lowcomm_jax import compress
from lowcomm_jax.runtimes.spmd import driver
from lowcomm_jax.runtimes.spmd import train
from lowcomm_jax.aggregate import compressed_mean
from lowcomm_jax.assemble.hosts import host
from lowcomm_jax.model.matformer import tier_mask
from lowcomm_jax.assemble.jitted import jitted_steps

from conftest import load_config, record_syncs

TIERED = [host(tier=1.0), host(tier=0.5)]
# Every codec under DiLoCo (the main job), flat (the compressed mean) and tiered (the nested
# one). DDP's sync is the same aggregator with the inner optimizer as its outer rule, and
# nothing in it depends on the codec but DeMo's sign descent: DDP runs with no codec (the
# plain all-reduce) and with DeMo, flat and tiered. (DDP with each other codec, flat, once
# ran here too: the same aggregator and rule as these cases, at ~8 s each.)
CASES = ([(codec, "diloco", tiers) for codec in compress.CODECS if codec != "demo"
          for tiers in (False, True)]
         + [("none", "ddp", False), ("demo", "ddp", False), ("demo", "ddp", True)])
# Dense fp32 bytes / bytes sent, per round: bounds from each codec's wire format on the
# tiny model (its small tensors cost the sparse codecs their per-chunk overheads).
RATIO = {"none": (1, 1), "int8": (3.5, 4), "fp8": (3.5, 4), "int4": (6.5, 8),
         "topk": (10, 1e4), "randomk": (30, 100), "sparseloco": (10, 1e4), "demo": (10, 1e4),
         "muloco": (4, 16)}


def _config(codec, algorithm, tiers):
  # One plain outer step on the decoded mean ĝ: θ_1 = θ_0 − ĝ (DiLoCo: lr 1, no momentum),
  # θ_0 − lr·ĝ (DDP: SGD at its peak lr), θ_0 − lr·sign(ĝ) (DeMo's sign descent, no decay).
  step = ({"outer.lr": 1.0, "outer.momentum": 0.0} if algorithm == "diloco" else
          {"optimizer.name": "sgd", "optimizer.warmup_steps": 0, "optimizer.grad_clip": 0.0,
           "optimizer.weight_decay": 0.0})
  c = load_config("smoke", algorithm=algorithm, rounds=1, eval_batches=1,
                  checkpoint_every=0, log_every=1, inner_steps=1 if algorithm == "ddp" else 2,
                  **{"compress.codec": codec, "data.seq_len": 16, "data.batch_size": 2, **step})
  if tiers:
    c.hosts = TIERED
  return c


@functools.cache
def _dense_tree():
  """The model's parameter tree (shapes only): what every codec encodes each round."""
  return train.build(_config("none", "diloco", False)).model.layout.abstract


@pytest.mark.parametrize("codec,algorithm,tiers", CASES,
                         ids=[f"{c}-{a}-{'tiers' if t else 'flat'}" for c, a, t in CASES])
def test_codec_trains_end_to_end(tmp_path, monkeypatch, codec, algorithm, tiers):
  config = _config(codec, algorithm, tiers)
  built, calls = [], []  # the run train.run built, and its sync's calls

  def recording(r, **kwargs):
    built.append(r)
    fns = jitted_steps(r, **kwargs)
    record_syncs(fns, calls)
    return fns
  monkeypatch.setattr(driver, "jitted_steps", recording)
  summary = train.run(config, tmp_path)
  assert math.isfinite(summary["eval_loss"]) and math.isfinite(summary["train_loss"])
  assert summary["codec"] == codec
  (call,) = calls
  _check_the_decoded_step(built[0], call)
  dense = summary["params"] * 4  # fp32
  made = compress.make_codec(config.compress, lr=config.optimizer.lr)
  # Per worker per round: an all-gather of the packed payload, or the plain mean's all-reduce.
  payload = dense if made is None else made.payload_bytes(_dense_tree())
  received = payload * (1 if made is None else config.num_workers - 1)
  assert summary["bytes_sent"] == payload * config.rounds
  assert summary["bytes_received"] == received * config.rounds
  assert summary["compression_ratio"] == pytest.approx(dense / payload)
  low, high = RATIO[codec]
  assert low <= summary["compression_ratio"] <= high
  last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
  assert last["bytes_sent"] == summary["bytes_sent"]
  assert math.isfinite(last["eval_loss"])


@functools.cache
def _roundtrips(compress_config, lr, layout):
  """(Δ[R, N], keys[R]) -> each worker's Δ encoded and decoded on its own, as one program
  (the flat and tiered cases of a codec share it)."""
  made = compress.make_codec(compress_config, lr=lr)

  def roundtrip(delta, key):
    tree = layout.unravel(delta)
    return layout.ravel(made.roundtrip(tree, made.init(tree), key)[0])
  return jax.jit(jax.vmap(roundtrip))


def _check_the_decoded_step(r, call):
  """θ_1 against θ_0 and the step on the workers' Δ each encoded and decoded by the codec on
  its own, with the key the sender had (round 0, worker w), averaged over the senders (with
  tiers: each FFN unit over the workers whose tier trains it)."""
  config, layout = r.config, r.model.layout
  theta0, deltas, theta1 = call
  made = compress.make_codec(config.compress, lr=config.optimizer.lr)
  round_key = jax.random.fold_in(jax.random.key(config.seed), 0)
  keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(round_key, jnp.arange(len(deltas)))
  decoded = (np.asarray(_roundtrips(ml_collections.FrozenConfigDict(config.compress),
                                    config.optimizer.lr, layout)(deltas, keys), np.float64)
             if made is not None else deltas.astype(np.float64))
  hidden = [h.hidden for h in r.topology.hosts for _ in h.worker_ids]
  masks = [np.asarray(layout.ravel(jax.tree.map(lambda a, x: np.broadcast_to(a, x.shape),
                                                tier_mask(layout.abstract, m), layout.abstract)))
           for m in hidden]
  mean = sum(a * d for a, d in zip(masks, decoded)) / np.maximum(sum(masks), 1)
  # What float32 round-off of the sums can reach: a little of the terms' size (a mean of
  # nearly cancelling values is relatively far less exact than its terms).
  terms = sum(a * np.abs(d) for a, d in zip(masks, decoded)) / np.maximum(sum(masks), 1)
  lr = 1.0 if config.algorithm == "diloco" else config.optimizer.lr
  if config.compress.codec == "demo":  # a sign: compared where round-off cannot flip it
    step, clear = lr * np.sign(mean), np.abs(mean) > 1e-5 * terms
  else:
    step, clear = lr * mean, np.ones(mean.shape, bool)
  # Up to float32 round-off: of θ_0 − step (an ulp of θ) and of the sums.
  error = np.where(clear, np.abs(theta1 - (theta0 - step)), 0.0)
  bound = 2 * np.spacing(np.maximum(np.abs(theta0), np.abs(theta1))) + 1e-5 * lr * terms
  worst = int(np.argmax(error - bound))
  assert error[worst] <= bound[worst], (worst, theta0[worst], theta1[worst], step[worst])
  assert clear.mean() > 0.99
  # A lossy codec's values are not the workers' own: the check above saw the codec's.
  plain = sum(a * d for a, d in zip(masks, deltas)) / np.maximum(sum(masks), 1)
  assert (made is None) == np.allclose(mean, plain, rtol=1e-6, atol=0)


@pytest.mark.parametrize("codec", compress.CODECS[1:])
def test_compressed_mean_is_unmapped_given_the_global_round(codec):
  # The runner's contract in one vmap: the mean comes out unmapped (out_axes=None) when the
  # round is passed in; random-k's receivers need it to regenerate the senders' positions.
  config = load_config("smoke", **{"compress.codec": codec})
  tx = compressed_mean(compress.make_codec(config.compress, lr=0.1), seed=1)

  @jax.jit  # one program, not one per op
  def both():
    tree = {"w": jnp.arange(96.0).reshape(8, 12) / 96, "b": jnp.ones((5,))}
    updates = jax.tree.map(lambda x: jnp.stack([x, -2 * x, x + 1]), tree)
    state = jax.tree.map(lambda x: jnp.broadcast_to(x, (3,) + x.shape), tx.init(tree))
    state = state._replace(count=state.count + 4)  # the counter and the round agree
    mean, _ = jax.vmap(lambda u, s, r: tx.update(u, s, round_index=r), in_axes=(0, 0, None),
                       out_axes=(None, 0), axis_name="replica")(updates, state, 4)
    mapped, _ = jax.vmap(tx.update, axis_name="replica")(updates, state)
    return mean, mapped
  mean, mapped = both()
  jax.tree.map(lambda m, e: np.testing.assert_allclose(m, e[0], rtol=1e-6), mean, mapped)
