"""Collaborative LoRA fine-tuning by peers that come and go (the Ray runtime).

Three peers, each a JAX process of its own (a Ray actor), take micro-batches of 8 at their
own speed until the target batch of 48 samples is reached; then each sends its mean
gradient of the LoRA adapters and the server takes one AdamW step on their sample-weighted
mean (an epoch; lowcomm_jax/ray_runtime/epochs.py). A peer that crashes loses only its
unsent samples of that epoch, a peer that joins is counted from its first micro-batch, and
nobody waits for a micro-batch past `ray.grace_s` once the target is reached. On one machine
(a local Ray starts inside the process):

    python -m lowcomm_jax.main --config=configs/ray_collab.py --workdir=runs/ray_collab

Try a crash and a newcomer: --config.ray.chaos="('kill_worker=1@10','add_worker@20')"
(counts of micro-batches). On a cluster, see configs/ray_async.py and README.md.
"""

import pathlib
import runpy

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config():
  c = _base["get_config"]()
  c.runtime = "ray"
  c.algorithm = "ddp"
  c.inner_steps = 1
  c.num_workers = 3  # peers
  c.collab.target_batch_size = 48
  c.rounds = 30  # epochs
  c.eval_every = 10
  c.checkpoint_every = 10
  c.log_every = 1
  c.ray.grace_s = 5.0  # the longest anyone waits for a micro-batch once the target is in
  c.model.name = "tiny_llama"
  c.data.seq_len = 64
  c.data.batch_size = 8  # every peer's micro-batch
  c.lora.rank = 4
  c.lora.alpha = 8.0
  c.lora.targets = ("attn", "mlp")
  c.optimizer.name = "adamw"
  c.optimizer.lr = 1e-3
  c.optimizer.warmup_steps = 3
  return c
