"""One peer's share of a collaborative epoch (`Algorithm.progress` 'epochs': DDP with
`collab.target_batch_size`), as every runtime drives it: the lockstep runner keeps one per
local host (runtimes/spmd/collab.py), the Ray runtime one per peer actor (runtimes/ray/
worker.py). Who takes the next micro-batch and when the epoch is full are the runtime's
(a virtual clock, the coordination service's counter, the Ray driver's count); what a
micro-batch adds and what the peer sends into the epoch's step are here, once, and so is
the epoch's count: when it is full (`EpochTally`) and the figures and summary it leaves."""

import time

import jax
import jax.numpy as jnp
import numpy as np


@jax.jit
def _mean(sums_GxN, samples_G):
  return sums_GxN / jnp.maximum(samples_G, 1.0)[:, None]


class PeerEpoch:
  """Σ B·∇L(θ) per worker over the micro-batches a peer took at the epoch's θ
  (`accumulate`: steps.make_accumulate's program, run on `view`), with the samples each
  worker counted, Σ B·loss per worker and the compute seconds. A micro-batch is run, then
  counted (`run`, `count`): a runtime that learns only later whether it belongs to the
  epoch (the Ray worker's, collected while it ran) counts it then, or never."""

  def __init__(self, accumulate, view, sums_GxN, worker_ids_G, version: int = 0):
    self.accumulate, self.view, self.ids = accumulate, view, worker_ids_G
    self.version = version  # the θ it is at, as the runtime numbers them
    self.sums = sums_GxN
    self.micro = 0  # micro-batches counted
    self.samples = 0  # each worker's samples counted (every worker takes the same batch size)
    self.loss_sums = np.zeros(sums_GxN.shape[0])  # Σ over each worker's samples of its loss
    self.seconds = 0.0  # compute seconds of the counted micro-batches

  def run(self, batch_GxBxL1) -> tuple:
    """(new sums, each worker's loss [G], seconds) of one micro-batch at the epoch's θ;
    it waits for the program, so a micro-batch counts once it is done."""
    start = time.perf_counter()
    sums, losses = self.accumulate(self.view, self.sums, batch_GxBxL1, self.ids,
                                   np.int32(self.micro))
    losses = np.asarray(losses)
    return sums, losses, time.perf_counter() - start

  def count(self, sums, losses_G: np.ndarray, samples: int, seconds: float) -> None:
    """A micro-batch of `samples` per worker (`run`'s sums and losses) counted in."""
    self.sums = sums
    self.micro += 1
    self.samples += samples
    self.loss_sums = self.loss_sums + losses_G.astype(np.float64) * samples
    self.seconds += seconds

  def mean_gradient(self, samples_G=None):
    """Each worker's mean gradient Σ B·g / Σ B [G, N]: what it sends into the epoch's step,
    which weighs it by its samples × seq_len (its tokens). `samples_G`: the samples every
    process agreed on (the runner's, placed as the sums are); else this peer's own count."""
    if samples_G is None:
      samples_G = np.full(self.sums.shape[0], self.samples, np.float32)
    return _mean(self.sums, samples_G)


class EpochTally:
  """One epoch's samples toward the collaboration's target batch, by peer (a host of the
  runner, a peer actor of the Ray runtime): the epoch is full once the samples counted reach
  `target`. What counts is each runtime's (the runner's micro-batches in turn or through
  the coordination service's counter, the Ray driver's finished micro-batches); the rule
  is this one."""

  def __init__(self, target: int):
    self.target = target
    self.by_peer: dict[int, int] = {}

  def add(self, peer: int, samples: int) -> None:
    self.by_peer[peer] = self.by_peer.get(peer, 0) + samples

  def drop(self, peer: int) -> int:
    """A peer's samples taken out of the count (it died with them); how many."""
    return self.by_peer.pop(peer, 0)

  @property
  def total(self) -> int:
    return sum(self.by_peer.values())

  @property
  def full(self) -> bool:
    return reached(self.total, self.target)


def reached(samples: int, target: int) -> bool:
  """Whether `samples` counted fill an epoch of `target` (where the count is kept elsewhere:
  the coordination service's counter)."""
  return samples >= target


def epoch_figures(samples: int, wall_s: float) -> dict:
  """An epoch's figures as every runtime's metrics rows name them."""
  return {"samples": samples, "epoch_seconds": wall_s,
          "samples_per_s": samples / wall_s if wall_s else 0.0}


def collab_summary(target: int, epochs: int, samples: int) -> dict:
  """summary.json's "collab": the target batch, the epochs closed and the samples in them."""
  return {"target_batch_size": target, "epochs": epochs, "samples": samples}
