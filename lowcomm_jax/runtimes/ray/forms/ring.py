"""The ring form: a dense mean passed around the members' ring (`collective_form` 'ring',
or 'auto' where the simulator's model picks the ring for the round's members and the
values go over sockets: `sim.collectives.seconds`). M members, Δ of n coordinates cut into
M chunks, member i sending only to member i + 1 and hearing only from member i − 1:

  reduce-scatter, M − 1 steps: at step s member i sends its running sum of chunk i − s;
      it adds its own weighted chunk (`Replica.sum_shard`) to the sum of chunk i − s − 1
      that comes from i − 1. After the last step it holds chunk i + 1 summed over every
      member, and divides it by every member's weight (`Replica.divide_piece`)
  all-gather, M − 1 steps: each step passes on the chunk last received (its own first)
  every member: the M chunks of the mean, the outer step (`Replica.apply_reduced`)
  per link: 2·(M−1)/M·n each way, as the direct form, but as one stream each way: no link
      ever has M − 1 senders at once (BENCHMARKS, issue 70: they overflow its queue)

Where a member stalls, the others wait around the ring behind it; each failed wait says
where in the ring it stopped (`Failed.waited_at`), and the driver blames the left
neighbour of the earliest wait (attempts.Attempts.lose_failed).
"""

import time

from lowcomm_jax.programs import sync_program
from lowcomm_jax.runtimes.ray.forms.base import Form, signals_of
from lowcomm_jax.runtimes.ray.forms.exchange import Failed
from lowcomm_jax.sim import collectives


class Ring(Form):
  name = "ring"

  def claims(self, rounds, members: list[int]) -> bool:
    d = rounds.d
    sync, how, net = d.r.sync, d.c.collective_form, d.plan.network
    if not sync_program.peer_reduces(sync) or sync_program.robust_shards(sync):
      return False
    if how == "ring":
      return True
    if (how != "auto" or d.c.ray.transport != "sockets"
        or max(members) >= len(net.worker_region)):
      return False  # (a value at a time through Ray's objects: the direct form)
    nbytes = 4 * d.r.model.layout.size * net.bytes_scale
    return collectives.seconds(net, "allreduce", members, nbytes)[1] == "ring"

  def messages(self, rounds, v: int, members: list[int], metas: dict) -> dict[int, dict]:
    tokens, losses = signals_of(metas, members)
    return {w: {"tokens": tokens, "losses": losses, "own": metas[w]["version"]}
            for w in members}

  def member(self, replica, ex, m: dict) -> dict:
    v, members, i, tokens = m["version"], ex.members, ex.index, m["tokens"]
    size = len(members)
    right, left = members[(i + 1) % size], members[(i - 1) % size]
    chunks = replica.shards(m["own"], size)
    mine = lambda c: replica.sum_shard(v, c, [ex.me], [tokens[i]], [chunks[c]], parts=size)
    moved = {"sent": 0, "received": 0}

    def step(phase: str, order: int, value):
      ex.send([right], phase, value)
      try:
        got = ex.gather(phase, [left])[0]
      except Failed as e:
        e.waited_at = order
        raise
      moved["sent"] += int(value.nbytes)
      moved["received"] += int(got.nbytes)
      return got

    running = mine(i)
    for s in range(size - 1):
      running = step(f"sum {s}", s, running) + mine((i - s - 1) % size)
    held = (i + 1) % size
    reduced = {held: replica.divide_piece(v, held, size, members, tokens, [running])}
    scattered = time.time()
    for s in range(size - 1):
      reduced[(i - s) % size] = step(f"mean {s}", size - 1 + s, reduced[(i + 1 - s) % size])
    reduced_at = time.time()
    digest = replica.apply_reduced(v, members, tokens, m["losses"],
                                   [reduced[c] for c in range(size)])
    return {"hash": digest, **moved, "moments": {"scattered": scattered, "reduced": reduced_at}}


RING = Ring()
