"""Signal-aware aggregation against bad data (the seed experiment of issue 18): workers of
which some read corrupted text, averaged uniformly or weighted by a signal.

  python -m lowcomm_jax.main --config=configs/sadp.py:noniid_weighted
  python -m lowcomm_jax.main --config=configs/sadp.py:iid_uniform --config.algorithm=diloco

Cases: iid_uniform, iid_weighted, noniid_uniform, noniid_weighted. `iid`: every worker
samples the whole of TinyShakespeare; `noniid`: worker w samples only the w-th contiguous
shard (data.partition). `weighted`: aggregate.signal (default loss_ema; also
grad_norm_stability, cosine). The defaults are the original's setting: DDP, 2 workers,
worker 1 reading text in which 30% of the tokens are swapped for random ones. For clean data
add --config.data.corrupt_workers="()"; for 8 workers, 2 of them corrupted,
--config.num_workers=8 --config.data.corrupt_workers="(6, 7)". bench/signal_aware.py runs
the grids.
"""

import pathlib
import runpy

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))
CASES = ("iid_uniform", "iid_weighted", "noniid_uniform", "noniid_weighted")


def get_config(case: str = "iid_weighted"):
  if case not in CASES:
    raise ValueError(f"config argument {case!r}: use one of {CASES}, e.g. "
                     "configs/sadp.py:noniid_weighted")
  data, weighting = case.split("_")
  c = _base["get_config"]()
  c.algorithm = "ddp"
  c.num_workers = 2
  c.rounds = 300  # ddp: one step per round
  c.inner_steps = 1
  c.eval_every = 25
  c.checkpoint_every = 100
  c.log_every = 5
  c.model.name = "small"
  c.data.seq_len = 64
  c.data.batch_size = 16
  c.data.partition = "contiguous" if data == "noniid" else "none"
  c.data.corrupt_workers = (1,)
  c.data.corruption = "token_swap"
  c.data.corruption_prob = 0.3
  c.aggregate.signal = "loss_ema" if weighting == "weighted" else "none"
  c.aggregate.warmup_rounds = 10
  return c
