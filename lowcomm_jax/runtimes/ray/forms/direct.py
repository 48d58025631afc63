"""The direct form: every member exchanges with every other at once, in two steps
(`sim.collectives.direct_allreduce_seconds` times it). What it moves depends on the sync:

  a dense mean (`sync_program.peer_reduces`), M members, Δ of n coordinates:
    member i cuts its Δ into M shards, shard j to member j   (all-to-all: a reduce-scatter)
    member j: the members' weighted mean of shard j (`Replica.reduce_shard`) to every member
    every member: the M reduced shards, the outer step (`Replica.apply_reduced`)
    per link: (M−1)/M·n out and in for each half: 2·(M−1)/M·n, a ring all-reduce's bytes
  a robust rule on dense rows (`sync_program.robust_shards`), S worker slots:
    the shards as above; member j's statistics of shard j of every row to every member
    (`robust_statistics`, [3S + 1]); with them added, its shard of the rule's result
    (`robust_shard`; centered clipping: each further iteration one more all-gather of the
    rows' distances, `robust_clip`); the result's shards all-gathered, the outer step
    (`apply_robust`)
    per link: the dense mean's bytes and (M−1)·(3S + 1) floats each way (S more for each
    further clipping iteration)
  a codec's payloads reduce-scattered (compress.reduce='scatter', `scatter_program.scatters`),
  S worker slots, each payload cut into S shards when it was encoded:
    member i's pieces to each owner (shard k's owner: member k mod M)   (all-to-all)
    the owner: its shards of every member's payload decoded, averaged, encoded once more
    (`Replica.scatter`), to every member; every member: the S reduced shards
    decoded, the outer step
    per link: 2·(M−1)/M payloads at M = S (an owner of more shards, more), where the
    all-gather of whole payloads is M−1
  anything else (a codec's payloads, an attack, a probe-loss signal: it reads whole rows):
    every member's row to every member, the parameter server's program over them
    (`apply_gathered`)
    per link: its payload to M−1 members, theirs from each (the ledger's all-gather)

`mean_of` is the same dense exchange for any vector of the workers' (DES-LOC's moments,
NoLoCo's consensus θ): member j's mean of shard j (`replica.mean_rows`), all-gathered.
"""

import time

import numpy as np

from lowcomm_jax.programs import scatter_program, sync_program
from lowcomm_jax.runtimes.ray.catch_up import nbytes
from lowcomm_jax.runtimes.ray.forms.base import Form, signals_of
from lowcomm_jax.runtimes.ray.replica import gathered_bytes, mean_rows, shard_bounds


class Direct(Form):
  name = "direct"

  def claims(self, rounds, members: list[int]) -> bool:
    return True  # (the last asked: any round the others leave)

  def messages(self, rounds, v: int, members: list[int], metas: dict) -> dict[int, dict]:
    sync = rounds.d.r.sync
    kind = ("robust" if sync_program.robust_shards(sync) else
            "mean" if sync_program.peer_reduces(sync) else
            "scatter" if scatter_program.scatters(sync) else "rows")
    tokens, losses = signals_of(metas, members)
    common = {"kind": kind, "tokens": tokens, "losses": losses}
    if kind == "scatter":  # (the senders' keys, which the owners decode with)
      common["keys"] = [metas[w]["codec_key"] for w in members]
    if kind == "rows":  # (what the server's program reads of each row's meta)
      common["metas"] = {w: {k: metas[w][k] for k in ("tokens", "loss", "codec_key")
                             if k in metas[w]} for w in members}
    return {w: {**common, "own": metas[w]["version"]} for w in members}

  def member(self, replica, ex, message: dict) -> dict:
    return _STEPS[message["kind"]](replica, ex, message)


def _mean(replica, ex, m: dict) -> dict:
  v, members, j = m["version"], ex.members, ex.index
  mine = ex.all_to_all("shards", replica.shards(m["own"], len(members)))
  scattered = time.time()
  reduced = ex.all_gather("mean", replica.reduce_shard(v, j, members, m["tokens"], mine))
  reduced_at = time.time()
  digest = replica.apply_reduced(v, members, m["tokens"], m["losses"], reduced)
  return {"hash": digest, **gathered_bytes(reduced, j),
          "moments": {"scattered": scattered, "reduced": reduced_at}}


def _robust(replica, ex, m: dict) -> dict:
  v, members, j = m["version"], ex.members, ex.index
  tokens, losses = m["tokens"], m["losses"]
  mine = ex.all_to_all("shards", replica.shards(m["own"], len(members)))
  scattered = time.time()
  statistics = ex.all_gather("statistics", replica.robust_statistics(v, j, members, mine))
  outs = ex.all_gather("robust 0", replica.robust_shard(v, j, members, tokens, losses,
                                                        statistics))
  for k in range(1, replica.clip_iters):  # centered clipping's further iterations
    outs = ex.all_gather(f"robust {k}", replica.robust_clip(j, outs))
  reduced_at = time.time()
  digest = replica.apply_robust(v, members, tokens, losses, statistics, outs)
  small = (len(members) - 1) * (statistics[0].nbytes
                                + 4 * replica.r.config.num_workers * (replica.clip_iters - 1))
  moved = gathered_bytes(outs, j)
  return {"hash": digest, "sent": moved["sent"] + small, "received": moved["received"] + small,
          "moments": {"scattered": scattered, "reduced": reduced_at}}


def _scatter(replica, ex, m: dict) -> dict:
  v, members, j = m["version"], ex.members, ex.index
  steps = replica.scatter
  pieces = steps.pieces(m["own"], len(members))
  packed = time.time()
  mine = ex.all_to_all("shards", pieces)
  scattered = time.time()
  own = steps.reduce(v, j, members, m["tokens"], m["keys"], mine)
  reduced = ex.all_gather("mean", own)
  reduced_at = time.time()
  digest = steps.apply(v, members, m["tokens"], m["losses"], reduced)
  others = [k for k in range(len(members)) if k != j]
  sent = sum(nbytes(pieces[k]) for k in others) + nbytes(own) * len(others)
  received = sum(nbytes(mine[k]) + nbytes(reduced[k]) for k in others)
  return {"hash": digest, "sent": int(sent), "received": int(received),
          "moments": {"packed": packed, **ex.arrived("shards"),
                      "scattered": scattered, "reduced": reduced_at}}


def _rows(replica, ex, m: dict) -> dict:
  members = ex.members
  rows = ex.all_gather("rows", replica.kept[m["own"]][0])
  digest = replica.apply_gathered(m["version"], {w: (row, m["metas"][w])
                                                 for w, row in zip(members, rows)})
  sizes = [nbytes(row) for row in rows]
  mine = sizes[ex.index]
  return {"hash": digest, "sent": int(mine * (len(members) - 1)),
          "received": int(sum(sizes) - mine)}


_STEPS = {"mean": _mean, "robust": _robust, "scatter": _scatter, "rows": _rows}


def mean_of(ex, vector: np.ndarray) -> tuple[np.ndarray, dict]:
  """The members' mean of one vector each (shards reduced, all-gathered): (the mean, this
  member's link's {"sent", "received"})."""
  pieces = [vector[a:b] for a, b in shard_bounds(vector.shape[0], len(ex.members))]
  reduced = ex.all_gather("mean", mean_rows(*ex.all_to_all("shards", pieces)))
  return np.concatenate(reduced), gathered_bytes(reduced, ex.index)


DIRECT = Direct()
