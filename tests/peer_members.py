"""A Ray round's members in one process: each member's real part of a collective form
(runtimes/ray/forms: `Form.messages` on the driver's side, `Form.member` on each member,
`forms.take_part` around it) in a thread of its own, the members reaching each other through
their mailboxes (`LocalTransport`) as Ray's actors do through `deliver`. The transport
counts every value that crosses between two members, so a test reads the bytes each link
really carried."""

import collections
import concurrent.futures
import types

import jax
import numpy as np

from lowcomm_jax.assemble.plan import make_plan
from lowcomm_jax.runtimes.ray import forms


class CountingTransport(forms.LocalTransport):
  """`LocalTransport` that counts what crosses: `moved[(sender, receiver)]` bytes."""

  def __init__(self, mailboxes):
    super().__init__(mailboxes)
    self.moved = collections.Counter()

  def deliver(self, to, tag, sender, box):
    self.moved[(sender, to)] += sum(np.asarray(x).nbytes for x in jax.tree.leaves(box))
    super().deliver(to, tag, sender, box)

  def links(self, members) -> dict[int, list[int]]:
    """{member: [bytes sent, bytes received]}."""
    out = {w: [0, 0] for w in members}
    for (a, b), n in self.moved.items():
      out[a][0] += n
      out[b][1] += n
    return out


class Died(Exception):
  """A member's death, in-process (chaos' crash_in_sync)."""


def run_members(members, version, steps, *, attempt=1, timeout_s=60.0, crash=None):
  """`steps[w](exchange)` of each member in its own thread: ({member: its outcome, None for
  the one that died}, the transport). `crash`: the member that dies as its part starts."""
  mailboxes = {w: forms.Mailbox() for w in members}
  transport = CountingTransport(mailboxes)
  message = {"version": version, "attempt": attempt, "members": list(members),
             "timeout_s": timeout_s, "crash": crash}

  def died():
    raise Died

  def outcome(future):
    try:
      return future.result()
    except Died:
      return None

  with concurrent.futures.ThreadPoolExecutor(len(members)) as pool:
    futures = {w: pool.submit(forms.take_part, w, message, mailboxes[w], transport, steps[w],
                              died) for w in members}
    return {w: outcome(f) for w, f in futures.items()}, transport


def rounds_of(r):
  """What a form's driver side reads of the driver (`Replicas`: its run, config, plan)."""
  return types.SimpleNamespace(d=types.SimpleNamespace(c=r.config, r=r, server_run=r,
                                                       plan=make_plan(r.config, r)))


def form_round(replicas, version, rows, *, form=None, extra=None, timeout_s=60.0):
  """Round `version` among `rows`' workers ({worker: (what it sent, meta)}, kept on their
  replicas already) as the Ray runtime closes it: the form the driver picks
  (`forms.for_round`, or `form`), its message to each member (with `extra` over it), each
  member's steps on its own replica. ({member: outcome}, the transport)."""
  members = sorted(rows)
  r = replicas[members[0]].r
  rounds = rounds_of(r)
  form = form or forms.for_round(rounds, members)
  messages = form.messages(rounds, version, members, {w: rows[w][1] for w in members})
  for w in members:
    messages[w].update(extra or {}, form=form.name)
  steps = {w: (lambda ex, w=w: form.member(replicas[w], ex, {**ex_message(ex), **messages[w]}))
           for w in members}
  outcome, transport = run_members(members, version, steps, timeout_s=timeout_s)
  for w, out in outcome.items():
    assert "failed" not in out, (w, out)
  return outcome, transport


def ex_message(ex) -> dict:
  """What every member is told besides its form's message (`attempts.Attempts.start`)."""
  return {"version": ex.version, "attempt": ex.attempt, "members": ex.members}
