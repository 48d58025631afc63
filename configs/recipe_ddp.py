"""The reference the recipes are measured against: DDP with Muon, tuned on bench/frontier.py's
grid (inner lr {0.01, 0.02, 0.05} x cosine or held; Muon's AdamW part at 5e-3). 4 workers,
400 steps of 8 x 32 byte tokens each on TinyShakespeare, the `small` model: the frontier's
scale (BENCHMARKS.md, "DDP's loss at a thousandth of its bytes"). Every step sends a full
fp32 gradient. The recipe_<N>x.py files change only how the workers sync.

    python -m lowcomm_jax.main --config=configs/recipe_ddp.py

The lr was tuned at this scale; for a larger model or longer run retune it (the frontier
runs the same grid: `python bench/frontier.py --model gpt2_124m ...`).
"""

import pathlib
import runpy

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))

STEPS = 400  # inner steps per worker: the token budget


def get_config():
  c = _base["get_config"]()
  c.algorithm = "ddp"
  c.num_workers = 4
  c.model.name = "small"
  c.data.tokenizer = "byte"
  c.data.batch_size = 8
  c.data.seq_len = 32
  c.optimizer.name = "muon"
  c.optimizer.lr = 0.02
  c.optimizer.adam_lr = 5e-3
  c.optimizer.min_lr_ratio = 0.1  # cosine to 10%
  c.optimizer.warmup_steps = STEPS // 20
  c.inner_steps = 1
  c.rounds = STEPS
  c.eval_every = 20
  c.log_every = 20
  c.checkpoint_every = 100
  return c


def local_sgd(c, inner_steps: int, codec: str = "none"):
  """`c` turned into the frontier's DiLoCo point: H = `inner_steps` on the same tokens, the
  outer rule its tuning picked (Nesterov, lr 1.0, momentum 0.5), `codec` on the wire."""
  c.algorithm = "diloco"
  c.inner_steps = inner_steps
  c.rounds = STEPS // inner_steps
  c.eval_every = 1
  c.log_every = 1
  c.checkpoint_every = max(c.rounds // 4, 1)
  c.outer.lr = 1.0
  c.outer.momentum = 0.5
  c.compress.codec = codec
  return c
