"""What a collective form is (`Form`), and how a member takes part in one (`take_part`).

A form has two sides:
- the driver's (`messages`): once a round's members are known, one message per member
  saying the round (version, attempt, members and their actor handles, signals, the form's
  own plan, such as the regions). The driver sends nothing else until every member has
  answered;
- a member's (`member`): its whole part of the round, run by the member's one entry point
  (`WorkerProcess.exchange`), moving bytes to and from the other members through an
  `exchange.Exchange` and computing with its replica (replica.py); it stages the round's
  new state and returns one outcome: the hash of what it staged and its link's bytes.

The driver compares the hashes and commits (replicas.py: the two-phase commit), or, where an
attempt failed, loses the members that died or that the others waited for in vain, and
starts a new attempt among the rest.
"""

import time

from lowcomm_jax.runtimes.ray.forms.exchange import Exchange, Failed


class Form:
  """A collective form. `name` is its registry key (forms/__init__.py)."""

  name = ""
  same_state = True  # every member stages the same state (the driver compares the hashes)
  tally = None  # the summary's count of the rounds this form closed, if it keeps one

  def claims(self, rounds, members: list[int]) -> bool:
    """Whether this form runs a round among `members` (`rounds`: the driver's Replicas:
    its run, config and network), asked in the registry's order."""
    raise NotImplementedError

  def messages(self, rounds, v: int, members: list[int], metas: dict) -> dict[int, dict]:
    """The driver's side: {member: what it is told} for round `v` among `members`
    (`rounds`: the driver's `Replicas`, for the run and the network; `metas`: each
    member's contribution's meta). The common fields (version, attempt, members, handles,
    chaos) are added by the caller."""
    raise NotImplementedError

  def member(self, replica, ex: Exchange, message: dict) -> dict:
    """A member's side: its part of the round through `ex`, staged on `replica`:
    {"hash", "sent", "received"}."""
    raise NotImplementedError


def signals_of(metas: dict, members: list[int]) -> tuple[list[float], list[float]]:
  """The members' tokens and train losses, in member order (what each member's outer step
  weighs and its signals read)."""
  return ([float(metas[w]["tokens"]) for w in members],
          [float(metas[w].get("loss", 0.0)) for w in members])


def take_part(me: int, message: dict, mailbox, transport, steps, crash) -> dict:
  """Member `me`'s part of the attempt `message` names: `steps(exchange)` -> its outcome,
  with its moments; {"failed": why, "missing": [members]} where the attempt ended without
  it staging (`crash()` first where chaos names it to die in this collective, or once it
  staged: "crash_staged"; a sleep first where chaos holds it back: "stall")."""
  ex = Exchange(me, message["members"], message["version"], message["attempt"], mailbox,
                transport, message["timeout_s"])
  if message.get("crash") == me:
    crash()
  if (message.get("stall") or [None])[0] == me:
    time.sleep(message["stall"][1])
  began = time.time()
  try:
    out = steps(ex)
  except Failed as e:
    return {"failed": str(e), "missing": e.missing,
            **({} if e.waited_at is None else {"waited_at": e.waited_at})}
  if message.get("crash_staged") == me:
    crash()
  return {**out, "moments": {"began": began, **out.get("moments", {}), "staged": time.time()}}
