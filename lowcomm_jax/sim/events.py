"""A deterministic discrete-event loop on a virtual clock.

Events are (time, sequence number, kind, data) kept in a heap; the sequence number breaks
ties in the order events were scheduled, so the same schedule calls give the same order on
every run. `data` is plain JSON (ints, floats, strings, lists, dicts) so the queue can be
checkpointed and restored as it is.
"""

import heapq
from typing import Any, NamedTuple


class Event(NamedTuple):
  time: float
  seq: int
  kind: str
  data: dict[str, Any]


class EventLoop:

  def __init__(self):
    self.now = 0.0
    self._heap: list[Event] = []
    self._seq = 0

  def schedule(self, at: float, kind: str, **data) -> None:
    """Adds an event at virtual time `at` (never before now)."""
    if at < self.now:
      raise ValueError(f"event {kind!r} at t={at} is in the past (now {self.now})")
    heapq.heappush(self._heap, Event(float(at), self._seq, kind, data))
    self._seq += 1

  def cancel(self, kind: str) -> None:
    """Drops every pending event of `kind` (a rescheduled timer)."""
    kept = [e for e in self._heap if e.kind != kind]
    if len(kept) != len(self._heap):
      self._heap = kept
      heapq.heapify(self._heap)

  def __len__(self) -> int:
    return len(self._heap)

  def pop_simultaneous(self) -> list[Event]:
    """Every event at the earliest pending time, in scheduling order; advances the clock."""
    first = heapq.heappop(self._heap)
    batch = [first]
    while self._heap and self._heap[0].time == first.time:
      batch.append(heapq.heappop(self._heap))
    self.now = first.time
    return batch

  def state_dict(self) -> dict:
    return {"now": self.now, "seq": self._seq,
            "events": [[e.time, e.seq, e.kind, e.data] for e in sorted(self._heap)]}

  @classmethod
  def from_state(cls, state: dict) -> "EventLoop":
    loop = cls()
    loop.now, loop._seq = float(state["now"]), int(state["seq"])
    loop._heap = [Event(float(t), int(s), k, d) for t, s, k, d in state["events"]]
    heapq.heapify(loop._heap)
    return loop
