"""How a collective's members reach each other without the driver: each member's mailbox
(what the others sent it, by round, attempt, phase and sender) and `Exchange`, one member's
view of one attempt of one collective (send, gather, all-gather, all-to-all).

The driver starts an attempt with one message to each member and reads one outcome back;
everything between is member to member. A transport moves the values: by default straight
over TCP (sockets.py: each member's postbox files what arrives in its mailbox); through
Ray's object store (`RayTransport`, ray.transport='objects') a sender puts its value once,
so the object is owned by the sender, and calls each receiver's `deliver` with its
reference (wrapped, so Ray does not fetch it before the call); the receiver fetches every
reference of a phase at once when it needs them. In one process (`LocalTransport`, the
tests') the mailboxes are shared.

A member stops waiting, and its attempt ends staging nothing, when the driver calls the
attempt off (`abort`: another member died), when a peer's object is lost with its owner,
or past the attempt's deadline; its outcome then names the members it still waited for.

A member may keep a few of its values in flight at once rather than all
(`ray.sends_in_flight`, over sockets): each value then asks its receiver for a receipt, and
the member sends its next only once all but `in_flight − 1` of those before it are
receipted, to the members after it in turn. Sent all at once, a member's W − 1 values
leave through W − 1 TCP connections whose starts together overflow its uplink's queue
(BENCHMARKS, issue 71: the scatter's losses are at the uplinks).
"""

import threading
import time


class Failed(Exception):
  """This member's part of an attempt ended without staging: `missing` are the members it
  still waited for (where the driver called the attempt off too: whom it waited for then).
  `waited_at`: where in its form's order of waits it stopped, where the form waits in a
  chain (the ring: the earliest wait is next to the member that stalled)."""

  def __init__(self, why: str, missing=(), waited_at: int | None = None):
    super().__init__(why)
    self.missing, self.waited_at = list(missing), waited_at


class Mailbox:
  """What the other members sent this one, by (version, attempt, phase) and sender; the
  attempts the driver called off. Thread-safe: deliveries come on the actor's other
  threads while its exchange waits."""

  def __init__(self):
    self._items: dict = {}  # ((version, attempt, phase), sender) -> box
    self._off: set = set()  # (version, attempt) called off
    self._arrived = threading.Condition()
    self.arrivals: dict = {}  # (version, attempt, phase) -> [first, last] arrival (time.time)

  def put(self, tag: tuple, sender: int, box) -> None:
    with self._arrived:
      if tag[:2] not in self._off:
        self._items[(tag, sender)] = box
        now = time.time()
        self.arrivals[tag] = [self.arrivals.get(tag, [now])[0], now]
        self._arrived.notify_all()

  def abort(self, version: int, attempt: int) -> None:
    with self._arrived:
      self._off.add((version, attempt))
      self._arrived.notify_all()

  def open(self, version: int, attempt: int) -> None:
    """An attempt starts here: what earlier attempts and versions left is let go."""
    with self._arrived:
      old = lambda key: key[:2] < (version, attempt)
      self._items = {k: box for k, box in self._items.items() if not old(k[0])}
      self.arrivals = {k: t for k, t in self.arrivals.items() if not old(k)}
      self._off = {k for k in self._off if not old(k)}

  def take(self, tag: tuple, senders: list[int], deadline: float) -> list:
    """The boxes `senders` sent under `tag`, in their order, once all are in."""
    with self._arrived:
      while True:
        missing = [s for s in senders if (tag, s) not in self._items]
        if tag[:2] in self._off:
          raise Failed(f"round {tag[0]} attempt {tag[1]} was called off", missing)
        if not missing:
          return [self._items.pop((tag, s)) for s in senders]
        left = deadline - time.monotonic()
        if left <= 0:
          raise Failed(f"members {missing} sent no {tag[2]!r} of round {tag[0]} in time",
                       missing)
        self._arrived.wait(left)


def receipt_tag(tag: tuple) -> tuple:
  """The tag under which a receiver acknowledges the value sent under `tag`."""
  return (*tag[:2], f"{tag[2]}/receipt")


class LocalTransport:
  """Members in one process (the tests' rounds, one thread each): values go as they are;
  with `in_flight`, each is receipted as it is filed."""

  def __init__(self, mailboxes: dict[int, Mailbox], in_flight: int = 0):
    self.mailboxes, self.in_flight = mailboxes, in_flight

  def pack(self, value):
    return value

  def deliver(self, to: int, tag: tuple, sender: int, box) -> None:
    self.mailboxes[to].put(tag, sender, box)
    if self.in_flight:
      self.mailboxes[sender].put(receipt_tag(tag), to, None)

  def unpack(self, boxes: list, deadline: float) -> list:
    del deadline
    return list(boxes)


class RayTransport:
  """Members as Ray actors (`handles`: worker -> actor handle): a value is put once in the
  sender's object store, and each receiver's `deliver` gets its reference."""

  in_flight = 0  # (receivers pull: nothing to pace)

  def __init__(self, ray, handles: dict):
    self.ray, self.handles = ray, handles

  def pack(self, value):
    return [self.ray.put(value)]  # (in a list: Ray passes the reference, not the value)

  def deliver(self, to: int, tag: tuple, sender: int, box) -> None:
    self.handles[to].deliver.remote(tag, sender, box)

  def unpack(self, boxes: list, deadline: float) -> list:
    ray = self.ray
    try:
      return ray.get([box[0] for box in boxes], timeout=max(1.0, deadline - time.monotonic()))
    except ray.exceptions.ObjectLostError as e:  # (its owner, the sender, died)
      raise Failed(f"a peer's object was lost: {type(e).__name__}") from e
    except ray.exceptions.GetTimeoutError as e:
      raise Failed("a peer's objects did not arrive in time") from e


class Exchange:
  """Member `me`'s view of one attempt of a collective among `members` (worker order):
  what it sends whom, and what it waits for. Its own values never leave it."""

  def __init__(self, me: int, members: list[int], version: int, attempt: int,
               mailbox: Mailbox, transport, timeout_s: float):
    self.me, self.members, self.version, self.attempt = me, list(members), version, attempt
    self.index = self.members.index(me)
    self.mailbox, self.transport = mailbox, transport
    self.deadline = time.monotonic() + timeout_s
    self.in_flight = transport.in_flight  # (0: every value sent at once)
    self._unreceipted: list[tuple[tuple, int]] = []  # (tag, receiver), oldest first
    mailbox.open(version, attempt)

  def _tag(self, phase: str) -> tuple:
    return (self.version, self.attempt, phase)

  def send(self, to: list[int], phase: str, value) -> None:
    """`value` to each member of `to` (itself excepted: it keeps its own), to the members
    after it first where it keeps only `in_flight` values in flight."""
    others = [w for w in self._in_turn(to) if w != self.me]
    if others:
      box = self.transport.pack(value)
      for w in others:
        self._deliver(w, phase, box)

  def _in_turn(self, to: list[int]) -> list[int]:
    """`to` from the member after this one on, round the members' order (so that, sent in
    turn, each member's first value goes to another receiver)."""
    if not self.in_flight:
      return list(to)
    n = len(self.members)
    place = lambda w: ((self.members.index(w) - self.index) % n if w in self.members else n)
    return sorted(to, key=place)

  def _deliver(self, to: int, phase: str, box) -> None:
    """One value out, once at most `in_flight` − 1 sent before it await their receipts."""
    tag = self._tag(phase)
    if self.in_flight:
      while len(self._unreceipted) >= self.in_flight:
        oldest, receiver = self._unreceipted.pop(0)
        self.mailbox.take(receipt_tag(oldest), [receiver], self.deadline)
      self._unreceipted.append((tag, to))
    self.transport.deliver(to, tag, self.me, box)

  def gather(self, phase: str, senders: list[int], own=None) -> list:
    """What each of `senders` sent under `phase`, in their order (`own` in its own place)."""
    others = [w for w in senders if w != self.me]
    boxes = self.mailbox.take(self._tag(phase), others, self.deadline)
    got = dict(zip(others, self.transport.unpack(boxes, self.deadline)))
    return [own if w == self.me else got[w] for w in senders]

  def all_gather(self, phase: str, value, among: list[int] | None = None) -> list:
    """Every member's `value` (of `among`, by default every member), in their order."""
    among = self.members if among is None else among
    self.send(among, phase, value)
    return self.gather(phase, among, own=value)

  def all_to_all(self, phase: str, pieces: list, among: list[int] | None = None) -> list:
    """Piece k of `pieces` to the k-th of `among`: what each of them sent this member."""
    among = self.members if among is None else among
    piece_of = dict(zip(among, pieces))
    for w in self._in_turn(among):
      self.send([w], phase, piece_of[w])
    return self.gather(phase, among, own=pieces[among.index(self.me)])

  def arrived(self, phase: str) -> dict:
    """When the first and the last of the others' values of `phase` came in."""
    first, last = self.mailbox.arrivals.get(self._tag(phase), [None, None])
    return {} if first is None else {f"{phase}_first_in": first, f"{phase}_last_in": last}
