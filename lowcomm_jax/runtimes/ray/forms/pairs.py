"""The pairs form (a sync of pair swaps, `Sync.partners`: NoLoCo): each member sends its
payload (θ_i, `Replica.swap_payload`) to its round's peer alone and stages its own new row
of the sync's state (`apply_swap`): N bytes each way per member, no all-reduce. A member
whose peer is not in the round keeps its own model (`Sync.fill_absent`'s rule). Each
member's staged row is its own, so the hashes differ by design (`same_state` False)."""

from lowcomm_jax.runtimes.ray.forms.base import Form


class Pairs(Form):
  name = "pairs"
  same_state = False

  def claims(self, rounds, members: list[int]) -> bool:
    return rounds.d.r.sync.partners is not None

  def messages(self, rounds, v: int, members: list[int], metas: dict) -> dict[int, dict]:
    peer = rounds.d.server_run.sync.partners(v)  # (every worker slot's, a joiner's too)
    return {w: {"own": metas[w]["version"], "peer": peer[w] if peer[w] in members else None}
            for w in members}

  def member(self, replica, ex, m: dict) -> dict:
    payload, peer = replica.swap_payload(m["own"]), m["peer"]
    if peer is None:
      theirs = None
    else:
      ex.send([peer], "swap", payload)
      theirs = ex.gather("swap", [peer], own=payload)[0]
    digest = replica.apply_swap(m["version"], payload, theirs)
    moved = 0 if theirs is None else int(payload.nbytes)
    return {"hash": digest, "sent": moved, "received": moved}


PAIRS = Pairs()
