"""The members' side of a collective's failures (runtimes/ray/forms/exchange.py) and the
driver's reading of them (replicas.Replicas._lose_failed), in-process: a member that dies,
one that is slow, an attempt the driver calls off, and what an earlier attempt left behind."""

import threading
import time
import types

import numpy as np
import pytest

from lowcomm_jax.runtimes.ray import forms
from lowcomm_jax.runtimes.ray.replicas import Attempt, Replicas
from peer_members import run_members


def _mean_steps(vectors):
  return {w: (lambda ex, w=w: dict(zip(("mean", "moved"), forms.mean_of(ex, vectors[w]))))
          for w in vectors}


def test_a_member_that_dies_is_named_by_the_others_who_stage_nothing():
  """Member 1 dies as its part starts: the others wait for its shards until the attempt's
  deadline and report it missing, with nothing staged."""
  vectors = {w: np.full(12, float(w), np.float32) for w in range(3)}
  began = time.monotonic()
  outcome, transport = run_members([0, 1, 2], 0, _mean_steps(vectors), timeout_s=1.0, crash=1)
  assert outcome[1] is None  # (its part raised: in-process, its death)
  for w in (0, 2):
    assert outcome[w]["missing"] == [1] and "mean" not in outcome[w], outcome[w]
  assert time.monotonic() - began < 10
  assert all(a != 1 for a, _ in transport.moved)  # it sent nothing


def test_an_attempt_called_off_stops_its_members_waiting_at_once():
  """The driver calls the attempt off (another member died): a member waiting for a peer
  that never sends returns at once, naming nobody, with a long deadline still ahead."""
  mailbox = forms.Mailbox()
  ex = forms.Exchange(0, [0, 1], 5, 2, mailbox, forms.LocalTransport({0: mailbox}), 600.0)
  began = time.monotonic()
  threading.Timer(0.2, mailbox.abort, (5, 2)).start()
  with pytest.raises(forms.Failed, match="called off") as e:
    ex.gather("shards", [1])
  assert e.value.missing == [] and time.monotonic() - began < 5


def test_a_retry_reads_nothing_an_earlier_attempt_left():
  """Attempt 1 of version 3 got a delivery and was called off; attempt 2 among the same
  members waits for its own, and a delivery for the called-off attempt is dropped."""
  mailbox = forms.Mailbox()
  mailbox.put((3, 1, "shards"), 1, "old")
  mailbox.abort(3, 1)
  mailbox.put((3, 1, "shards"), 1, "late")  # (after the abort: dropped)
  ex = forms.Exchange(0, [0, 1], 3, 2, mailbox, forms.LocalTransport({0: mailbox}), 0.3)
  with pytest.raises(forms.Failed) as e:
    ex.gather("shards", [1])
  assert e.value.missing == [1]
  mailbox.put((3, 2, "shards"), 1, "new")
  ex = forms.Exchange(0, [0, 1], 3, 2, mailbox, forms.LocalTransport({0: mailbox}), 5.0)
  assert ex.gather("shards", [1]) == ["new"]


class _Pool:
  def __init__(self, alive):
    self.actors = {w: object() for w in alive}
    self.dead = set()
    self.lost = {}

  def worker_alive(self, w):
    return w not in self.dead

  def lose(self, w, why):
    self.actors.pop(w)
    self.lost[w] = why


def _lose(outcome, unanswered, alive=(0, 1, 2, 3), dead=()):
  pool = _Pool(alive)
  pool.dead = set(dead)
  rounds = types.SimpleNamespace(d=types.SimpleNamespace(
      pool=pool, c=types.SimpleNamespace(ray=types.SimpleNamespace(collective_timeout_s=9))),
      version=4, failures=(outcome, unanswered))
  Replicas._lose_failed(rounds, "a round's collective", [0, 1, 2, 3],
                        Attempt(1, forms.DIRECT, []))
  return pool.lost


def test_the_driver_loses_the_dead_else_whom_the_others_waited_for():
  failed = lambda *missing: {"failed": "x", "missing": list(missing)}
  # a member died: it alone is lost (the others' reports name it, or nobody)
  lost = _lose({0: failed(2), 1: failed(), 2: None, 3: failed(2)}, [], dead=[2])
  assert list(lost) == [2] and "died" in lost[2]
  # a slow member, alive: the others named it; it never answered
  lost = _lose({0: failed(3), 1: failed(3), 2: failed(3, 1)}, [3])
  assert list(lost) == [3] and "in vain" in lost[3]
  # nobody named, everyone answered and alive: the run stops, naming what it saw
  with pytest.raises(RuntimeError, match="alive and answered"):
    _lose({0: failed(), 1: failed(), 2: failed(), 3: failed()}, [])


@pytest.mark.parametrize("gbps,covered", [(100.0, True), (1e-5, False)])
def test_the_collective_timeout_is_held_against_a_rounds_bytes(gbps, covered):
  """The driver says in one line that ray.collective_timeout_s covers a round's bytes over
  the links sim.network describes, or refuses the config naming the field and the least
  value that does (10 kb/s: the smoke model's Δ takes minutes)."""
  from conftest import load_config
  from lowcomm_jax.assemble.build import build
  from lowcomm_jax.assemble.plan import make_plan, one_device
  from lowcomm_jax.errors import ConfigError
  from lowcomm_jax.runtimes.ray.replicas import timeout_covers_bytes
  c = load_config("smoke", **{"algorithm": "diloco", "num_workers": 3, "mesh.replica": 1,
                              "runtime": "ray", "sim.network.intra_gbps": gbps,
                              "ray.collective_timeout_s": 60.0})
  r = build(one_device(c), check_memory=False)
  plan = make_plan(r.config, r)
  if covered:
    line = timeout_covers_bytes(r.config, plan, reduces=True)
    assert line.startswith("ray.collective_timeout_s=60 covers") and "\n" not in line
  else:
    with pytest.raises(ConfigError, match=r"ray.collective_timeout_s=60.0: a round's bytes "
                                          r"among 3 workers take [\d.]+ s .* use at least"):
      timeout_covers_bytes(r.config, plan, reduces=True)
