"""The members' side of a collective's failures (runtimes/ray/forms/exchange.py) and the
driver's reading of them (attempts.Attempts.lose_failed), in-process: a member that dies,
one that is slow, an attempt the driver calls off, and what an earlier attempt left behind."""

import threading
import time
import types

import numpy as np
import pytest

from lowcomm_jax.runtimes.ray import forms
from lowcomm_jax.runtimes.ray.attempts import Attempt, Attempts
from conftest import bench_module
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
  that never sends returns at once, with a long deadline still ahead, naming whom it
  still waited for (the driver reads every member's waits, not only the first failure's)."""
  mailbox = forms.Mailbox()
  ex = forms.Exchange(0, [0, 1], 5, 2, mailbox, forms.LocalTransport({0: mailbox}), 600.0)
  began = time.monotonic()
  threading.Timer(0.2, mailbox.abort, (5, 2)).start()
  with pytest.raises(forms.Failed, match="called off") as e:
    ex.gather("shards", [1])
  assert e.value.missing == [1] and time.monotonic() - began < 5


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
  attempts = Attempts(types.SimpleNamespace(
      pool=pool, c=types.SimpleNamespace(ray=types.SimpleNamespace(collective_timeout_s=9))))
  attempts.failures = (outcome, unanswered)
  attempts.lose_failed("a round's collective", 4, sorted(set(alive) | set(outcome)),
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
  from lowcomm_jax.runtimes.ray.attempts import timeout_covers_bytes
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


def _mean_in_threads(members, message, mailboxes, transport_of, vectors) -> dict:
  """Each member's real part of a dense mean of `vectors`, one thread a member, through
  `transport_of(w)`: {member: its outcome}."""
  steps = _mean_steps(vectors)
  outcome = {}
  threads = [threading.Thread(target=lambda w=w: outcome.__setitem__(w, forms.take_part(
      w, message, mailboxes[w], transport_of(w), steps[w], None))) for w in members]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  return outcome


class _SlowTransport(forms.LocalTransport):
  """Each value filed (and receipted) `delay` s after it is sent, as over a slow link;
  `sent`: (time, sender, receiver, tag) of each value a member handed over, `filed`: when
  each was filed, by (sender, receiver, tag)."""

  def __init__(self, mailboxes, in_flight, delay):
    super().__init__(mailboxes, in_flight)
    self.delay, self.sent, self.filed, self._lock = delay, [], {}, threading.Lock()

  def deliver(self, to, tag, sender, box):
    with self._lock:
      self.sent.append((time.monotonic(), sender, to, tag))
    threading.Timer(self.delay, self._file, (to, tag, sender, box)).start()

  def _file(self, to, tag, sender, box):
    with self._lock:
      self.filed[(sender, to, tag)] = time.monotonic()
    super().deliver(to, tag, sender, box)


@pytest.mark.parametrize("in_flight", [0, 1, 2])
def test_a_member_keeps_at_most_its_sends_in_flight_and_sends_to_the_next_first(in_flight):
  """ray.sends_in_flight (forms/exchange.py): each value out waits for the receipts of all
  but in_flight − 1 sent before it, in turn from the member after the sender; all at once
  with 0. Every member ends with the same mean either way."""
  members, delay = [0, 1, 2, 3], 0.5
  mailboxes = {w: forms.Mailbox() for w in members}
  transport = _SlowTransport(mailboxes, in_flight, delay)
  vectors = {w: np.arange(8, dtype=np.float32) * (w + 1) for w in members}
  message = {"version": 1, "attempt": 1, "members": members, "timeout_s": 30.0}
  outcome = _mean_in_threads(members, message, mailboxes, lambda w: transport, vectors)
  for w in members:
    np.testing.assert_allclose(outcome[w]["mean"], np.arange(8) * 2.5)
  for w in members:  # its first phase: a piece to each other member
    sends = [(t, (a, to, tag)) for t, a, to, tag in transport.sent if a == w][:3]
    if in_flight:  # in turn from the next member
      assert [value[1] for _, value in sends] == [(w + k) % 4 for k in (1, 2, 3)], sends
    filed = [transport.filed[value] for _, value in sends]
    times = [t for t, _ in sends]
    if in_flight == 1:  # each only once the one before it was filed
      assert times[1] >= filed[0] and times[2] >= filed[1], (times, filed)
    elif in_flight == 2:  # the second before the first was filed, the third only after
      assert times[1] < filed[0] <= times[2], (times, filed)
    else:  # all three before any was filed
      assert times[2] < filed[0], (times, filed)


@pytest.mark.parametrize("in_flight", [0, 1])
def test_sockets_carry_a_collective_between_members_and_drop_a_strangers_message(in_flight):
  """ray.transport='sockets' (forms/sockets.py): three members' postboxes on 127.0.0.1,
  each member's real part of a dense mean through them, every member ending with the same
  mean (with `in_flight` 1, each value sent only once the one before it was receipted
  back through the postboxes); a message without the receiver's token is dropped unread,
  and a member that left (not in the next message's addresses) has its socket closed."""
  import zmq
  members = [0, 1, 2]
  mailboxes = {w: forms.Mailbox() for w in members}
  boxes = {w: forms.Postbox(mailboxes[w], "127.0.0.1") for w in members}
  try:
    addresses = {w: boxes[w].address for w in members}
    vectors = {w: np.arange(10, dtype=np.float32) * (w + 1) for w in members}
    message = {"version": 3, "attempt": 1, "members": members, "timeout_s": 30.0,
               "crash": None}
    outcome = _mean_in_threads(
        members, message, mailboxes,
        lambda w: forms.SocketTransport(boxes[w], addresses, in_flight), vectors)
    for w in members:
      np.testing.assert_allclose(outcome[w]["mean"], np.arange(10) * 2.0)
    # A stranger's message, well formed but without the receiver's token, is never filed
    # (given time to arrive), and the postbox still takes the real one after it.
    import pickle
    stranger = zmq.Context.instance().socket(zmq.PUSH)
    stranger.connect(addresses[0][0])
    stranger.send_multipart([b"x" * 16, pickle.dumps(((4, 1, "p"), 1)),
                             pickle.dumps(np.zeros(3))])
    stranger.close(linger=1000)
    time.sleep(0.5)
    assert [tag for tag, _ in mailboxes[0]._items if tag[0] == 4] == []
    # (what it holds of round 3: receipts of its last values, if it paced them)
    assert all(tag[2].endswith("/receipt") for tag, _ in mailboxes[0]._items)
    assert bool(mailboxes[0]._items) == bool(in_flight)
    boxes[1].send(addresses[0], (4, 1, "p"), 1, np.ones(3))
    assert mailboxes[0].take((4, 1, "p"), [1], time.monotonic() + 10)[0].sum() == 3.0
    # The driver's message names the pacing (attempts.py puts ray.sends_in_flight there).
    assert forms.transport_for({"addresses": addresses, "sends_in_flight": in_flight},
                               boxes[0], None).in_flight == in_flight
    # Member 2 left: the next transport closes the socket to it.
    assert addresses[2][0] in boxes[0]._outboxes
    forms.SocketTransport(boxes[0], {w: addresses[w] for w in (0, 1)})
    assert addresses[2][0] not in boxes[0]._outboxes
  finally:
    for box in boxes.values():
      box.close()


def test_a_ring_stalled_at_one_member_is_named_by_the_earliest_wait_alone():
  """The ring form (forms/ring.py): its members' real parts on NumPy replicas (the
  exchange rig's), 5 members. First a whole round: every member stages the same θ', the
  tokens' weighted mean of the rows. Then member 2 stalls before its part: the others wait
  around the ring behind it, each saying where it stopped; every member but 3 waits for
  a neighbour that is itself waiting, and the driver loses member 2 alone (the left
  neighbour of the earliest wait), not the neighbours further round."""
  rig = bench_module("exchange_rig")
  members = list(range(5))
  tokens = [1.0, 2.0, 3.0, 4.0, 5.0]

  def steps_of(version):
    replicas = {w: rig.RigReplica(23, w, 0) for w in members}
    message = {"version": version, "tokens": tokens, "losses": [0.0] * 5, "own": 0}
    return replicas, {w: (lambda ex, w=w: forms.RING.member(replicas[w], ex, message))
                      for w in members}

  replicas, steps = steps_of(0)
  outcome, transport = run_members(members, 0, steps)
  assert len({outcome[w]["hash"] for w in members}) == 1
  mean = sum(t * replicas[w].delta for w, t in zip(members, tokens)) / sum(tokens)
  np.testing.assert_allclose(replicas[0].staged[1], -0.7 * mean, rtol=1e-5, atol=1e-7)
  assert set(transport.moved) == {(w, (w + 1) % 5) for w in members}  # neighbours only

  _, steps = steps_of(1)
  stalled = steps[2]
  steps[2] = lambda ex: (time.sleep(4.0), stalled(ex))[1]
  outcome, _ = run_members(members, 1, steps, timeout_s=2.0)
  waits = {w: (outcome[w]["waited_at"], outcome[w]["missing"]) for w in (0, 1, 3, 4)}
  assert waits[3] == (0, [2]) and all(at > 0 for w, (at, _) in waits.items() if w != 3), waits
  assert list(_lose(outcome, [], alive=tuple(members))) == [2]
