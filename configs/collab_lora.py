"""Collaborative LoRA fine-tuning: two unequal peers reach a target batch together.

Peer 0 (say an A100) takes micro-batches of 8 sequences, peer 1 (a T4, half as fast) of 2; together
they fill a target batch of 32 samples, then the sample-weighted mean gradient of the LoRA adapters
takes one AdamW step (an epoch; lowcomm_jax/runtimes/spmd/collab.py). Only the adapters cross the
network. (LAMB, the large-batch optimizer, barely moves LoRA's zero-initialized B: its trust ratio
scales B's step by B's own norm; BENCHMARKS.md measures it.)

One process runs both peers on a virtual clock (speeds order their turns); with
`python launch/local.py --num_processes 2 --monitor -- --config=configs/collab_lora.py`
each peer is its own process, the slower one slowed down to its speed, and a monitor shows
the collaboration's progress. For a real model set --config.model.init_from=PATH (a .gguf,
.safetensors or Hugging Face folder; launch/fetch_smollm2.py fetches SmolLM2-135M) and
--config.data.tokenizer to its tokenizer (the .gguf itself, for a GGUF).
"""

import pathlib
import runpy

from lowcomm_jax.assemble.hosts import host

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config():
  c = _base["get_config"]()
  c.algorithm = "ddp"
  c.inner_steps = 1
  c.collab.target_batch_size = 32
  c.hosts = [host(1.0, batch_size=8, speed=1.0), host(1.0, batch_size=2, speed=0.5)]
  c.num_workers = 2
  c.rounds = 30  # epochs
  c.eval_every = 10
  c.checkpoint_every = 10
  c.model.name = "tiny_llama"
  c.data.seq_len = 64
  c.lora.rank = 4
  c.lora.alpha = 8.0
  c.lora.targets = ("attn", "mlp")
  c.optimizer.name = "adamw"
  c.optimizer.lr = 1e-3
  c.optimizer.warmup_steps = 3
  return c
