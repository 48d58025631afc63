"""The virtual workers' plan (`make_plan`): speeds, each worker's H, the network and the
bytes a sync moves, from the config and the built run. The simulator schedules by it; the
Ray runtime builds its servers' rules and DyLU's H from it. `one_device` is the config both
build their run from: virtual workers share one device, vmapped.
"""

import copy

import ml_collections

from lowcomm_jax.assemble.hosts import settle_inner_steps
from lowcomm_jax.assemble.spec import Run
from lowcomm_jax.parallel import ledger
from lowcomm_jax.sim import Network, Plan, SpeedModel


def make_plan(c: ml_collections.ConfigDict, r: Run) -> Plan:
  s, n = c.sim, c.sim.network
  speeds = SpeedModel.build(
      num_workers=c.num_workers, level=s.heterogeneity, explicit=tuple(s.speeds),
      step_seconds=s.step_seconds, jitter=s.jitter, straggler_prob=s.straggler_prob,
      straggler_slowdown=s.straggler_slowdown, seed=c.seed)
  inner = settle_inner_steps(c, [c.inner_steps] * c.num_workers, speeds.speeds)
  network = Network.build(
      num_workers=c.num_workers, regions=n.regions, worker_regions=tuple(n.worker_regions),
      intra_gbps=n.intra_gbps, intra_latency_s=n.intra_latency_s,
      inter_gbps=n.inter_gbps_matrix or n.inter_gbps,
      inter_latency_s=n.inter_latency_matrix or n.inter_latency_s, bytes_scale=n.bytes_scale,
      region_gbps=n.region_gbps, server_region=None if n.server_region < 0 else n.server_region,
      server_link=(n.inter_gbps, n.inter_latency_s),
      exchange_efficiency=n.exchange_efficiency, exchange_member_s=n.exchange_member_s)
  params = r.model.layout.abstract
  wire = r.sync.payload_bytes
  # A codec's reduce-scatter is the direct form's (each shard's owner re-encodes it once), not
  # a ring's, which would re-encode at every hop.
  scatters = r.sync.codec is not None and r.sync.codec.sharded is not None
  first = r.segments(c.inner_steps)[0]
  return Plan(inner_steps=inner, rounds=c.rounds,
              total_steps=c.num_workers * c.rounds * c.inner_steps, speeds=speeds,
              network=network,
              delta_bytes=wire(params),
              param_bytes=ledger.tree_bytes(params),
              gathers=r.sync.codec is not None and not scatters,
              collective="direct" if scatters and c.collective_form == "auto" else c.collective_form, exchange_rule=r.algorithm.exchange_rule(c),
              fragment_bytes=tuple(wire(r.model.layout.fragment(p).abstract)
                                   for p in range(r.model.layout.num_fragments)),
              overlap_steps=first.mix_at)


def one_device(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Virtual workers share one device (vmapped), whatever the machine has."""
  c = copy.deepcopy(config)
  with c.unlocked():
    c.mesh.replica = 1
  return c
