"""Will the run's states fit? A per-device estimate, checked before anything is allocated.

Without it, a worker count too large for the devices compiles for a minute and then dies
with XLA's RESOURCE_EXHAUSTED. The estimate counts what each replica device holds:

  replicated     θ_global, the outer rule's state (momentum; DDP: the AdamW moments), and
                 the outer step's temporaries (the averaged Δ, the new θ)
  per worker     its own parameters θ_w (full width, where the algorithm keeps them across
                 rounds: Streaming DiLoCo), its inner optimizer state (AdamW: 2x its tier's parameters), its codec error
                 buffer, its Δ, and while its round runs its θ copy, gradient and
                 activations (workers on a device are vmapped: they all run at once)

A run whose workers' states are stacked on one device and whose jobs run `jobs_per_call`
at a time (the simulator's: `sim.jobs_per_call`) counts only that many jobs' temporaries
(`choose_sim_width` picks the widest that fits).

It is rough (XLA's temporaries vary) and errs low, so it refuses only runs that cannot fit.
LOWCOMM_MEMORY_CHECK=0 skips it.
"""

import logging
import math
import os

import jax
import numpy as np

from lowcomm_jax.errors import ConfigError
from lowcomm_jax.parallel import ledger


class OutOfMemory(ConfigError):
  """The run's states do not fit its devices (a ConfigError: the fix is a config field)."""


def _gib(n: float) -> str:
  return f"{n / 2**30:,.2f} GiB"


def available_bytes(devices) -> tuple[int, str]:
  """(bytes one device may use, where that figure came from)."""
  device = devices[0]
  if device.platform != "cpu":
    limits = [(d.memory_stats() or {}).get("bytes_limit", 0) for d in devices]
    if all(limits):
      return int(min(limits)), f"{device.platform} bytes_limit"
    return 0, ""  # a device that does not say: nothing to compare with
  # CPU devices share the host's RAM: what is free now, split over this process's devices.
  free = 0
  try:
    with open("/proc/meminfo") as f:
      fields = dict(line.split(":", 1) for line in f)
    free = int(fields["MemAvailable"].split()[0]) * 1024
  except (OSError, KeyError, ValueError):
    try:
      free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
      return 0, ""
  local = max(jax.local_device_count(), 1)
  return free // local, f"host RAM available / {local} CPU device(s)"


def activation_bytes(model_cfg, batch: int, seq_len: int, tp: int,
                     hidden: int | None = None) -> int:
  """Rough bytes a training step keeps for backprop. Per block and token: the norms' inputs
  and the residuals (~6 d_model), the key/value projections (2 × kv heads × head dim), the
  FFN's hidden activations (2 per unit, 3 with SwiGLU's gate; `hidden`: a tier's units,
  default d_ff) and, where attention is XLA's (or has dropout), the scores and their softmax
  (2 per head and position; cuDNN's flash attention keeps none). Per token: the logits' compute-dtype copy
  where the loss runs in pieces, else float32 logits, softmax and gradient (4 per entry).
  With the round's two parameter copies (`estimate`), it is 5–29% below XLA's buffer
  assignment on an H200 for gpt2_124m and smollm2_135m at every tier (BENCHMARKS.md,
  memory by tier): it errs low, as the check needs."""
  c = model_cfg
  itemsize = 2 if c.dtype == "bfloat16" else 4
  ffn = (3 if c.mlp == "swiglu" else 2) * (c.d_ff if hidden is None else hidden)
  per_block = 6 * c.d_model + 2 * c.kv_heads * c.head_dim + ffn
  if c.attention != "cudnn" or c.dropout > 0:  # attention dropout materializes the scores
    per_block += 2 * c.n_head * seq_len
  chunked = 0 < c.loss_chunk < seq_len
  per_token = c.n_layer * per_block / tp + (1 if chunked else 4) * (c.vocab_size or 0)
  return int(batch * seq_len * per_token * itemsize)


def step_temporaries(model_cfg, param_bytes: int, batch: int, seq_len: int, tp: int,
                     hidden: int | None = None) -> int:
  """A training step's temporaries for a model (or tier) of `param_bytes`: the activations
  (activation_bytes) and two parameter-sized copies (the gradients and the update)."""
  return 2 * param_bytes + activation_bytes(model_cfg, batch, seq_len, tp, hidden=hidden)


def estimate(r, jobs_per_call: int | None = None) -> dict[str, int]:
  """Bytes per replica device of spec.Run `r`, by component (see the module docstring).
  `jobs_per_call`: the workers' states are one stack and their jobs run this many at a
  time (the simulator); None: every worker of a device runs at once (the runner)."""
  stacked = jobs_per_call is not None
  c = r.config
  local_replicas = max(r.topology.local_mesh.shape["replica"], 1)
  global_replicas = max(r.topology.mesh.shape["replica"], 1)
  tp, data = max(c.model.tp.size, 1), max(c.mesh.data, 1)
  params = ledger.tree_bytes(r.state_spec.abstract.params)
  codec_state, rule_state = r.state_spec.abstract.outer
  # Without donation (CPU) a round's new worker states sit beside the old ones.
  copies = 1 if r.topology.mesh.devices.flat[0].platform != "cpu" else 2
  if stacked:  # the stack is written in place; a call's own lanes go in and out
    copies = 1
  out = {"params": params, "outer_state": ledger.tree_bytes(rule_state),
         "outer_temporaries": 2 * params,
         "codec_buffers": math.ceil(ledger.tree_bytes(codec_state) / global_replicas),
         "inner_optimizer": 0, "worker_params": 0, "deltas": 0, "round_temporaries": 0,
         # LoRA: the frozen base, replicated on every device
         "frozen_base": ledger.tree_bytes(r.frozen)}
  # LoRA merges W + s·A·B in float32 per worker and backprop makes a full-size gradient of
  # each merged kernel: two float32 copies of the model per worker, at most.
  merged = 2 * 4 * r.model.frozen_count
  for i in r.topology.local_hosts:
    h = r.topology.hosts[i]
    per_device = math.ceil(len(h.worker_ids) / local_replicas)
    tier = r.model.tier_bytes[h.tier]
    if r.algorithm.local_steps:
      out["inner_optimizer"] += copies * per_device * tier["optimizer_bytes"]
    if r.algorithm.keeps_worker_params(c):  # each worker's own θ_w, full width
      out["worker_params"] += copies * per_device * params
    out["deltas"] += per_device * params
    if stacked and not r.algorithm.synchronous:  # each job out holds the θ it pulled
      out["pulled_snapshots"] = out.get("pulled_snapshots", 0) + per_device * params
    # Hosts run one after another: only the largest round's temporaries count. The
    # simulator runs its jobs `jobs_per_call` at a time.
    at_once = min(per_device, jobs_per_call) if stacked else per_device
    lanes_in_out = 2 * (tier["optimizer_bytes"] + (params if r.algorithm.keeps_worker_params(c)
                                                   else 0)) if stacked else 0
    running = at_once * (merged + lanes_in_out + step_temporaries(
        r.model.cfg, tier["param_bytes"], h.batch_size // data, c.data.seq_len, tp,
        hidden=h.hidden))
    out["round_temporaries"] = max(out["round_temporaries"], running)
  return out


def sim_width(c) -> int:
  """The simulator's jobs per call as configured (`sim.jobs_per_call`; 0, automatic, is
  estimated at 1, the least it needs)."""
  return max(int(c.sim.jobs_per_call), 1)


def choose_sim_width(r) -> int:
  """The simulator's synchronous jobs per call: `sim.jobs_per_call`, or (0) every worker
  (one call a round, as the runner vmaps its workers on one device) if their temporaries
  fit twice over beside the run's states (the estimate errs low), else the widest power of
  two that does."""
  c = r.config
  if c.sim.jobs_per_call:
    return int(c.sim.jobs_per_call)
  have, _ = available_bytes(list(r.topology.local_mesh.devices.flat))
  parts = estimate(r, jobs_per_call=1)
  one_job, rest = parts["round_temporaries"], sum(parts.values()) - parts["round_temporaries"]
  workers = max(c.num_workers, 1)
  for width in [workers] + [1 << k for k in range(workers.bit_length() - 1, -1, -1)]:
    if not have or rest + 2 * width * one_job <= have:
      return width
  return 1


def check(r, jobs_per_call: int | None = None) -> None:
  """Raises OutOfMemory when spec.Run `r` needs more per device than a device has
  (`jobs_per_call`: as `estimate`'s)."""
  if os.environ.get("LOWCOMM_MEMORY_CHECK", "1") == "0":
    return
  devices = list(r.topology.local_mesh.devices.flat)
  have, source = available_bytes(devices)
  parts = estimate(r, jobs_per_call)
  need = sum(parts.values())
  fits = not have or need <= have  # a backend that does not say: nothing to compare with
  if have:
    logging.info("memory: about %s per device of %s (%s)", _gib(need), _gib(have), source)
  if jax.process_count() > 1:  # all stop together, or the others hang in the next collective
    from jax.experimental import multihost_utils
    fits_everywhere = multihost_utils.process_allgather(np.asarray(fits))
    if fits and not np.all(fits_everywhere):
      raise OutOfMemory([f"num_workers={r.config.num_workers}: another process's devices "
                         "cannot hold its workers (its log says how much it needs); lower "
                         "--config.num_workers or spread the workers over more devices"])
  if fits:
    return
  c = r.config
  workers = max(len(r.topology.hosts[i].worker_ids) for i in r.topology.local_hosts)
  per_device = math.ceil(workers / max(r.topology.local_mesh.shape["replica"], 1))
  largest = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
  if jobs_per_call is not None:
    raise OutOfMemory([
        f"num_workers={c.num_workers}: the simulation needs about {_gib(need)} but "
        f"{_gib(have)} is available ({source}) with {jobs_per_call} job(s) per call "
        f"(largest: {', '.join(f'{k} {_gib(v)}' for k, v in largest)}). Lower "
        "--config.num_workers, --config.sim.jobs_per_call (0: chosen to fit) or the model "
        "(model.name, data.batch_size), or set LOWCOMM_MEMORY_CHECK=0 to try anyway"])
  raise OutOfMemory([
      f"num_workers={c.num_workers}: needs about {_gib(need)} per device but "
      f"{_gib(have)} is available ({source}); {per_device} worker(s) per device "
      f"(largest: {', '.join(f'{k} {_gib(v)}' for k, v in largest)}). Lower "
      "--config.num_workers (or data.batch_size / model.name), spread the workers over more "
      "devices (mesh.replica, more processes), or set LOWCOMM_MEMORY_CHECK=0 to try anyway"])
