"""A replica one round behind takes that round's inputs, not a whole replica (the peer form).

Every member of a round ends it in the same state because each runs the same last step (the
outer step on the reduced mean, `Replica.apply_reduced`; on a robust rule's result,
`apply_robust`; on a codec's reduced shards, `ScatterShards.apply`) on the same bytes from
the same θ and outer state. A replica still at the round's version reaches the members'
state by running that step itself on what they applied: the mean (P floats), the robust
rule's result and statistics, or the codec's encoded reduced shards, with the round's
members, tokens and losses. A whole replica is θ and the outer state: 2P for DiLoCo's
Nesterov momentum, 3P with a trimmed mean's state. Where the source did not commit that round
itself (it adopted since, or its round was a parameter server's program over every row, or
a pair swap), it hands over its whole replica instead. The straggler checks the θ it reaches
against the hash of the source's: a catch-up that misses fails its adopt, and the driver
loses that worker rather than let its replica drift. The bytes each adopt carried are told
in the worker's next contribution (the summary's `rounds_caught_up`, `replicas_adopted`
and their `_bytes`).
"""

import jax
import numpy as np


class LastRound:
  """What a replica applied in its round being closed (`note`) and in its last committed one
  (`kept`): what it hands a straggler one round behind."""

  def __init__(self):
    self.noted = None  # (round version, the step's name, its inputs, θ's hash) when staged
    self.kept = None  # {"version", "step", "args", "hash"}: the last round it committed

  def note(self, round_version: int, step: str, args: tuple, digest: str) -> str:
    """The round staged at `round_version` by `step` on `args`, to θ of hash `digest`
    (returned: the step's own return)."""
    self.noted = (round_version, step, args, digest)
    return digest

  def committed(self, round_version: int, params_hash: str | None) -> None:
    """The round staged at `round_version` is now the replica's (`params_hash`: of the θ
    committed, where it is not the staged one: a delayed sync's θ' taken before). Its inputs
    are kept where its last step noted them and reached that θ; else nothing is (a parameter
    server's program, a pair swap)."""
    noted, self.noted = self.noted, None
    self.kept = None
    if (noted is not None and noted[0] == round_version
        and params_hash in (None, noted[3])):
      self.kept = {"version": round_version, "step": noted[1], "args": noted[2],
                   "hash": noted[3]}

  def clear(self) -> None:
    """The replica moved by other means (an adopt, a roll back, a skipped round)."""
    self.noted = self.kept = None


def serve(replica, behind: int | None) -> dict:
  """What a peer one round behind (at version `behind`) takes from `replica`: {"round": the
  inputs of round `behind`} where `replica` committed that round itself and holds its result,
  else the whole replica (`Replica.share`)."""
  kept = replica.last.kept
  if (behind is not None and kept is not None and kept["version"] == behind
      and replica.version == behind + 1 and replica.pending is None):
    return {"round": kept}
  return replica.share()


def apply(replica, record: dict) -> int:
  """Round `record["version"]` run on `replica` from its inputs and committed; the version.
  Raises if the θ reached is not the source's (the replicas would diverge)."""
  from lowcomm_jax.runtimes.ray.replica import params_hash
  steps = {"apply_reduced": replica.apply_reduced, "apply_robust": replica.apply_robust,
           "scatter": replica.scatter.apply if replica.scatter else None}
  version, contributed = int(record["version"]), dict(replica.kept)
  steps[record["step"]](version, *record["args"])
  replica.commit(version)
  replica.kept = contributed  # (its own late contribution goes into the open round)
  if params_hash(replica.params) != record["hash"]:
    raise RuntimeError(f"worker {replica.worker}: round {version} run again from its inputs "
                       "did not reach its members' θ; the replicas would diverge")
  return replica.version


def nbytes(state: dict) -> int:
  """The bytes of what an adopt carries (the arrays' buffers)."""
  return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(state)))
