"""Collaborative LoRA fine-tuning by peers that come and go (the Ray runtime).

Three peers, each a JAX process of its own (a Ray actor), take micro-batches of 8 at their
own speed until the target batch of 48 samples is reached; then each sends its mean
gradient of the LoRA adapters and the server takes one AdamW step on their sample-weighted
mean (an epoch; lowcomm_jax/runtimes/ray/epochs.py). A peer that crashes loses only its
unsent samples of that epoch, a peer that joins is counted from its first micro-batch, and
nobody waits for a micro-batch past `ray.grace_s` once the target is reached. On one machine
(a local Ray starts inside the process):

    python -m lowcomm_jax.main --config=configs/ray_collab.py --workdir=runs/ray_collab

Try a crash and a newcomer: --config.ray.chaos="('kill_worker=1@10','add_worker@20')"
(counts of micro-batches). On a cluster, see configs/ray_async.py and docs/ray.md.
"""

import pathlib
import runpy

# collab_lora.py's model, adapters and optimizer; here the peers are Ray actors
_collab = runpy.run_path(str(pathlib.Path(__file__).with_name("collab_lora.py")))


def get_config():
  c = _collab["get_config"]()
  c.runtime = "ray"
  c.hosts = []  # no host table on Ray (a peer's own micro-batch: ray.batch_sizes)
  c.num_workers = 3  # peers
  c.data.batch_size = 8  # each peer's micro-batch (unless ray.batch_sizes)
  c.collab.target_batch_size = 48
  c.log_every = 1
  c.ray.grace_s = 5.0  # the longest anyone waits for a micro-batch once the target is in
  return c
