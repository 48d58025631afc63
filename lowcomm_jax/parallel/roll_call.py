"""The roll call before `jax.distributed` joins: who is missing, named, within a timeout.

Each process p > 0 connects to process 0 on the coordinator's port and says its id; process
0 answers "go" once all are present. JAX's own join waits out its timeout and then aborts
every process with "another task died", naming nobody; the roll call fails after
`distributed.join_timeout_s` naming the processes that never came. It listens only while
the processes join and is unauthenticated, like the coordinator (docs/trust-model.md).
"""

import ipaddress
import logging
import socket
import time

_HELLO = "lowcomm-join-v1"
_POLL_S = 0.25  # between a peer's attempts to reach process 0
_READ_S = 2.0  # for a connected peer to say who it is
_SAY_FIRST_S, _SAY_EVERY_S = 2.0, 10.0  # a waiting process says so after 2 s, then every 10 s


class _Waiting:
  """Says, while a process waits, whom it waits for and how long it will."""

  def __init__(self, deadline: float):
    self.deadline, self.next = deadline, time.monotonic() + _SAY_FIRST_S

  def __call__(self, what: str) -> None:
    now = time.monotonic()
    if now >= self.next:
      self.next = now + _SAY_EVERY_S
      logging.info("%s (giving up in %.0f s: distributed.join_timeout_s)", what,
                   max(self.deadline - now, 0))


class DistributedError(RuntimeError):
  """The processes could not join. `str()` is one line: who is missing and the fix."""


def split_address(address: str) -> tuple[str, int]:
  host, _, port = address.rpartition(":")
  return host.strip("[]"), int(port)


def roll_call(address: str, bind: str, num: int, pid: int, timeout_s: float) -> None:
  """Returns once all `num` processes are present; raises DistributedError naming the
  missing ones (process 0) or the unreachable coordinator (the others) after `timeout_s`."""
  if not 0 <= pid < num:
    raise DistributedError(f"process id {pid} is not in [0, {num}); set "
                           "distributed.process_id (or JAX_PROCESS_ID) to 0..num_processes-1")
  if pid == 0:
    _collect(address, bind, num, timeout_s)
  else:
    _report(address, num, pid, timeout_s)


def _listen(bind: str) -> socket.socket:
  host, port = split_address(bind)
  if host in ("", "::"):  # every interface, IPv4 too where the system allows
    return socket.create_server(("::", port), family=socket.AF_INET6,
                                dualstack_ipv6=socket.has_dualstack_ipv6())
  try:
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
  except ValueError:  # a name: listen where it resolves
    family = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)[0][0]
  return socket.create_server((host, port), family=family)


def _collect(address: str, bind: str, num: int, timeout_s: float) -> None:
  """Process 0: wait on `bind` for processes 1..num-1, then release them all."""
  try:
    server = _listen(bind)
  except OSError as e:
    raise DistributedError(
        f"process 0 cannot listen on {bind} ({e.strerror or e}); free that port or set "
        "distributed.coordinator_address / coordinator_bind_address to one of this host's "
        "addresses") from None
  deadline = time.monotonic() + timeout_s
  joined: dict[int, socket.socket] = {}
  notes = []
  waiting = _Waiting(deadline)
  try:
    while len(joined) < num - 1:
      missing = [i for i in range(1, num) if i not in joined]
      waiting(f"process 0: waiting on {address} for process{'es' if len(missing) > 1 else ''} "
              f"{_ids(missing)} of {num}")
      left = deadline - time.monotonic()
      if left <= 0:
        reason = (f"process{'es' if len(missing) > 1 else ''} {_ids(missing)} of {num} did "
                  f"not join {address} within distributed.join_timeout_s={timeout_s:g}"
                  + (f" ({'; '.join(notes)})" if notes else "")
                  + f"; start {'them' if len(missing) > 1 else 'it'} with the same "
                  "coordinator_address and num_processes, or raise join_timeout_s")
        for conn in joined.values():
          _send(conn, f"stop {reason}")
        raise DistributedError(reason)
      server.settimeout(min(left, 1.0))
      try:
        conn, _ = server.accept()
      except TimeoutError:
        continue
      conn.settimeout(_READ_S)
      words = _read_line(conn).split()
      if len(words) != 3 or words[0] != _HELLO or not all(w.isdigit() for w in words[1:]):
        conn.close()  # not one of ours (a port scan, a stray client): ignore it
        continue
      their_pid, their_num = int(words[1]), int(words[2])
      if their_pid in joined and not _alive(joined[their_pid]):
        joined.pop(their_pid).close()  # that process died and was restarted: take the new one
      if their_num != num or not 0 < their_pid < num or their_pid in joined:
        why = (f"process 0 runs {num} processes, not {their_num}" if their_num != num else
               f"process id {their_pid} is {'taken' if their_pid in joined else 'invalid'}")
        notes.append(f"refused a process: {why}")
        _send(conn, f"stop {why}; give every process the same num_processes and its own "
                    "process_id")
        conn.close()
        continue
      joined[their_pid] = conn
    for conn in joined.values():
      _send(conn, "go")
    for conn in joined.values():  # they close first: no TIME_WAIT on the coordinator's port
      conn.settimeout(_READ_S)
      try:
        conn.recv(1)
      except OSError:
        pass
  finally:
    for conn in joined.values():
      conn.close()
    server.close()


def _report(address: str, num: int, pid: int, timeout_s: float) -> None:
  """Process pid > 0: tell process 0 we are here, then wait for its word."""
  host, port = split_address(address)
  deadline = time.monotonic() + timeout_s
  waiting = _Waiting(deadline)
  while True:
    try:
      conn = socket.create_connection((host, port), timeout=_READ_S)
      break
    except OSError as e:
      waiting(f"process {pid}: waiting for process 0 (the coordinator) at {address}")
      if time.monotonic() >= deadline:
        raise DistributedError(
            f"process {pid} could not reach process 0 (the coordinator) at {address} within "
            f"distributed.join_timeout_s={timeout_s:g} ({e.strerror or e}); start process 0, "
            "check the address and that its port is open between the hosts") from None
      time.sleep(_POLL_S)
  with conn:
    _send(conn, f"{_HELLO} {pid} {num}")
    logging.info("process %d: reached process 0 at %s; it starts the run when all %d "
                 "processes are present", pid, address, num)
    # Process 0 answers when all are present, or at its own deadline: allow it that long.
    conn.settimeout(max(deadline - time.monotonic(), 0) + timeout_s + 5)
    try:
      answer = _read_line(conn)
    except OSError:
      answer = ""
  if answer == "go":
    return
  if answer.startswith("stop "):
    raise DistributedError(f"process {pid}: process 0 stopped the join: {answer[5:]}")
  raise DistributedError(f"process {pid}: {address} did not answer the join "
                         f"({answer[:60]!r}); is it process 0 of this run (same "
                         "coordinator_address)?")


def _alive(conn: socket.socket) -> bool:
  """Whether the peer on `conn` is still connected (a dead one has closed or reset it)."""
  conn.setblocking(False)
  try:
    return bool(conn.recv(1, socket.MSG_PEEK))
  except BlockingIOError:
    return True  # connected, nothing to read
  except OSError:
    return False
  finally:
    conn.settimeout(_READ_S)


def _ids(ids: list[int]) -> str:
  shown = ", ".join(map(str, ids[:12]))
  return shown if len(ids) <= 12 else f"{shown}, ... ({len(ids)} in all)"


def _send(conn: socket.socket, line: str) -> None:
  try:
    conn.sendall((line + "\n").encode())
  except OSError:
    pass  # it left; its own error says why


def _read_line(conn: socket.socket, limit: int = 1024) -> str:
  data = b""
  try:
    while not data.endswith(b"\n") and len(data) < limit:
      chunk = conn.recv(limit - len(data))
      if not chunk:
        break
      data += chunk
  except OSError:
    pass
  return data.decode(errors="replace").strip()
