"""Real processes over real slow links, and the simulator's replay of them (issue 54):
4 workers of the byte-level `small` model (a 3.4 MB pseudo-gradient), on links that make
the sync matter; synchronous rounds among the workers, or through a parameter server with
--config.collective_form=server (issue 61). The same file runs three ways:

  bench/real_vs_sim.py --cases ARG    Ray over namespaces and `tbf` links built from
                                      sim.network (every NIC, region uplinks; root)
  as it is (runtime='ray')            Ray on one machine, links unlimited (sim.network
                                      only describes them)
  --config.runtime=simulator           the simulator, on the links as sim.network gives them

ARG is 'METHOD,H,MBPS[,PLACE[,MODEL]]':
  METHOD  diloco | async_dn | int8 (DiLoCo, int8 payloads all-gathered) | int8s (int8
          payloads reduce-scattered: compress.reduce='scatter') | sparseloco (DiLoCo + SparseLoCo)
          | ddp (a gradient per step) | median (DiLoCo, the coordinate-wise median of the
          workers' Δ) | streaming (2 fragments, each applied τ = H/2 − 1 steps after it is
          sent and mixed with α = 0.5)
  H       inner steps per round (a job)
  MBPS    every node's NIC, each way, in Mb/s
  PLACE   flat (default: one region, the server a node beside the workers) | own (2 regions
          of 2 workers, each behind an uplink of MBPS/4, the server in a region of its own
          behind one too) | colocated (the same regions, the server in region 0)
  MODEL   a preset of lowcomm_jax.model.presets (default `small`; `small12`, 3× its layers,
          makes a payload 2.8× larger)

The links add no delay (the machine has no netem), so every latency here is 0. Only an
evaluation at the end, and one checkpoint: the timeline (summary.json) is rounds alone.
"""

import pathlib
import runpy

from lowcomm_jax.model.presets import PRESETS

_base = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))

METHODS = ("diloco", "async_dn", "int8", "int8s", "sparseloco", "ddp", "median", "streaming")
PLACES = ("flat", "own", "colocated")


def get_config(arg: str = "diloco,10,20"):
  parts = arg.split(",")
  if len(parts) not in (3, 4, 5) or parts[0] not in METHODS or (
      len(parts) >= 4 and parts[3] not in PLACES) or (
      len(parts) == 5 and parts[4] not in PRESETS):
    raise ValueError(f"config argument {arg!r}: use METHOD,H,MBPS[,PLACE[,MODEL]] with METHOD "
                     f"in {METHODS}, PLACE in {PLACES} and MODEL in {sorted(PRESETS)}")
  method, h, mbps = parts[0], int(parts[1]), float(parts[2])
  place = parts[3] if len(parts) > 3 else "flat"
  model = parts[4] if len(parts) > 4 else "small"
  c = _base["get_config"]()
  c.runtime = "ray"
  c.model.name = model
  c.data.tokenizer = "byte"
  c.data.seq_len = 64
  c.data.batch_size = 8
  c.num_workers = 4
  c.mesh.replica = 1
  c.inner_steps = h
  c.rounds = 6 if h <= 10 else 4
  c.eval_every = 0
  c.eval_batches = 2
  c.checkpoint_every = 0
  c.optimizer.warmup_steps = 10
  c.algorithm = {"async_dn": "async_dn", "ddp": "ddp", "streaming": "streaming"}.get(
      method, "diloco")
  if method == "streaming":
    c.streaming.fragments, c.streaming.overlap_steps, c.streaming.mix = 2, h // 2 - 1, 0.5
  if method == "ddp":
    c.inner_steps = 1
  if method in ("int8", "int8s"):
    c.compress.codec = "int8"
    c.compress.reduce = "scatter" if method == "int8s" else "gather"
  if method == "median":
    c.aggregate.rule = "median"
  if method == "sparseloco":
    c.compress.codec = "sparseloco"
    c.outer.lr, c.outer.momentum = 1.0, 0.0
  n = c.sim.network
  n.intra_gbps = mbps / 1000
  n.intra_latency_s = n.inter_latency_s = 0.0
  n.bytes_scale = 1.0
  if place == "flat":
    n.regions, n.server_region = 1, 0
  else:
    n.regions, n.inter_gbps = 2, mbps / 4000
    n.server_region = -1 if place == "own" else 0
  return c
