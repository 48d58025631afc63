"""The reduced-sync tensor-parallel experiment at full scale: GPT-2 124M on OpenWebText,
one worker whose model is split over `model.tp.size` GPUs, one run per sync plan.

  # once: nanoGPT's data/openwebtext/prepare.py output works as is (train.bin, val.bin), or
  python -m lowcomm_jax.data.prepare --input=owt.jsonl --tokenizer=gpt2 --out=data/openwebtext \
      --workers=16
  CUDA_VISIBLE_DEVICES=0,1,2,3 python -m lowcomm_jax.main --config=configs/tp_owt_124m.py:spd \
      --config.data.path=data/openwebtext --workdir=runs/tp_owt_spd

Plans (after the colon): standard (24 all-reduces per forward), spd (12), grouped_k2 / _k3 /
_k4 / _k6 (6, 4, 3, 2), selective (spd + attention syncs in blocks 0 and 11). 20,000 steps
of nanoGPT's GPT-2 recipe (AdamW lr 6e-4, betas 0.9/0.95, weight decay 0.1, 2,000 warmup
steps, cosine to 6e-5) at 32 × 1024 tokens a step (nanoGPT's ~0.5M-token batch comes from
gradient accumulation, which the runner does not do: 655M tokens in all). bfloat16 compute
is refused under TP for now (BUILD_NOTES), so the model computes in float32.
"""

import pathlib
import runpy

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))
_sweep = runpy.run_path(str(pathlib.Path(__file__).with_name("tp_sweep.py")))


def get_config(plan: str = "standard"):
  c = _sweep["get_config"](plan)  # the same plan names as the CPU sweep
  c.rounds = 20_000  # ddp: one step per round
  c.eval_every = 500
  c.eval_batches = 40
  c.checkpoint_every = 1_000
  c.log_every = 50
  c.model.name = "gpt2_124m"
  c.model.tp.size = 4
  c.data.path = "data/openwebtext"  # nanoGPT's layout; override with --config.data.path
  c.data.tokenizer = "gpt2"
  c.data.seq_len = 1024
  c.data.batch_size = 32
  c.optimizer.lr = 6e-4
  c.optimizer.b1, c.optimizer.b2 = 0.9, 0.95
  c.optimizer.weight_decay = 0.1
  c.optimizer.warmup_steps = 2_000
  c.optimizer.grad_clip = 1.0
  c.optimizer.min_lr_ratio = 0.1  # to 6e-5
  return c
