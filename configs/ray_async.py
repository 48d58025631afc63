"""Asynchronous Local-SGD with Delayed Nesterov on real processes (the Ray runtime).

One process drives; Ray runs a parameter-server actor and one JAX process per worker. Each
worker pulls the latest global model, takes H AdamW steps on its own data and pushes its
pseudo-gradient; the server applies each push as it arrives (Delayed Nesterov: momentum
refreshed once per N = 4 pushes). Workers may crash, leave or join mid-run; the run goes on
(see `ray.chaos` in configs/base.py to try it). On one machine (a local Ray starts inside
the process; on a CPU the byte-level `tiny` model):

    python -m lowcomm_jax.main --config=configs/ray_async.py

On a cluster: `RAY_worker_niceness=0 ray start --head` on one host, the same with
`--address=HEAD:6379` on the others, then add --config.ray.address=auto (docs/ray.md: GPUs,
ports, priority; docs/trust-model.md: who can reach them).
"""

import pathlib
import runpy

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config():
  c = _base["get_config"]()
  c.runtime = "ray"
  c.algorithm = "async_dn"
  c.num_workers = 4
  c.rounds = 10  # budget: num_workers * rounds * inner_steps inner steps in all
  c.inner_steps = 10
  c.eval_every = 5  # round-equivalents (num_workers * inner_steps steps applied)
  c.checkpoint_every = 2
  c.log_every = 1
  c.optimizer.warmup_steps = 10
  c.model.name = "tiny"
  c.data.seq_len = 64
  c.data.batch_size = 8
  return c
