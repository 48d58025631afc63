"""The hierarchical form: a dense mean reduced by region (`collective_form`
'hierarchical', or 'auto' where the simulator's model of the network times it faster than
the direct form for the round's members: `sim.collectives`). The regions' leaders (each
region's first member) are the only members whose bytes cross between regions:

  region r (k members): each member's Δ in k shards, all-to-all inside the region; member
      j's undivided sum of shard j (`Replica.sum_shard`) to its leader
  leader of r: the region's sums joined and cut into G pieces, piece h to leader h
  leader h: the regions' sums of piece h added and divided by every member's weight
      (`Replica.divide_piece`), all-gathered among the leaders
  leader of r: the mean cut into its region's k shards, shard j to member j
  member j: its shard all-gathered inside its region, the outer step (`apply_reduced`)

Each link's bytes: `replica.hierarchical_bytes` (every phase has its mirror)."""

import time

import numpy as np

from lowcomm_jax.programs import sync_program
from lowcomm_jax.runtimes.ray.forms.base import Form, signals_of
from lowcomm_jax.runtimes.ray.replica import hierarchical_bytes, shard_bounds
from lowcomm_jax.sim import collectives


def regions_of(rounds, members: list[int]) -> list[list[int]] | None:
  """The members by region (each region's in worker order), where the round's dense mean
  reduces by region: `collective_form` 'hierarchical', or 'auto' where the
  simulator's model says it is faster for these members than the direct form; else None."""
  d = rounds.d
  how, net = d.c.collective_form, d.plan.network
  if (how not in ("auto", "hierarchical") or not sync_program.peer_reduces(d.r.sync)
      or max(members) >= len(net.worker_region)):
    return None  # (a joined worker's id is past the network's placement: direct)
  by_region = {}
  for w in members:
    by_region.setdefault(net.worker_region[w], []).append(w)
  if len(by_region) < 2:
    return None
  if how == "auto":
    nbytes = 4 * d.r.model.layout.size * net.bytes_scale
    if (collectives.hierarchical_allreduce_seconds(net, members, nbytes)
        >= collectives.direct_allreduce_seconds(net, members, nbytes)):
      return None
  return [by_region[k] for k in sorted(by_region)]


def _cut(whole: np.ndarray, parts: int) -> list[np.ndarray]:
  return [whole[a:b] for a, b in shard_bounds(whole.shape[0], parts)]


class Hierarchical(Form):
  name = "hierarchical"
  tally = "hierarchical_collectives"

  def claims(self, rounds, members: list[int]) -> bool:
    return regions_of(rounds, members) is not None

  def messages(self, rounds, v: int, members: list[int], metas: dict) -> dict[int, dict]:
    tokens, losses = signals_of(metas, members)
    common = {"groups": regions_of(rounds, members), "tokens": tokens, "losses": losses}
    return {w: {**common, "own": metas[w]["version"]} for w in members}

  def member(self, replica, ex, m: dict) -> dict:
    v, members, groups = m["version"], ex.members, m["groups"]
    tokens = dict(zip(members, m["tokens"]))
    group = next(g for g in groups if ex.me in g)
    leaders = [g[0] for g in groups]
    j, k = group.index(ex.me), len(group)
    mine = ex.all_to_all("shards", replica.shards(m["own"], k), among=group)
    scattered = time.time()
    total = replica.sum_shard(v, j, group, [tokens[w] for w in group], mine)
    ex.send([group[0]], "sums", total)
    if ex.me == group[0]:  # the leader: the leaders' exchange, then its region's shards
      sums = ex.gather("sums", group, own=total)
      pieces = ex.all_to_all("pieces", _cut(np.concatenate(sums), len(groups)), among=leaders)
      h = leaders.index(ex.me)
      mean = ex.all_gather("mean", replica.divide_piece(v, h, len(groups), members,
                                                        m["tokens"], pieces), among=leaders)
      spread = _cut(np.concatenate(mean), k)
      for w, shard in zip(group, spread):
        ex.send([w], "spread", shard)
      own = spread[0]
    else:
      own = ex.gather("spread", [group[0]])[0]
    reduced = ex.all_gather("relay", own, among=group)
    reduced_at = time.time()
    digest = replica.apply_reduced(v, members, m["tokens"], m["losses"], reduced)
    n = int(sum(x.shape[0] for x in reduced))
    return {"hash": digest, **hierarchical_bytes(n, groups)[ex.me],
            "moments": {"scattered": scattered, "reduced": reduced_at}}


HIERARCHICAL = Hierarchical()
