"""Members' values sent straight over TCP (ZeroMQ), the Ray runtime's default transport
(`ray.transport='sockets'`).

Each member binds one receiving socket on its node's address (`Postbox`); a sender pushes
a value to it as one message, and the postbox's thread puts it in the member's mailbox.
A value crosses its link once, with no request before it: Ray's object store, by contrast,
asks the owner where the object is and then pulls it, several small messages that wait
behind the phase's bulk data in the same link queue (BUILD_NOTES: "The members' transport").

A message is [the receiver's token, (tag, sender[, receiver, reply address]), value's
pickle, its buffers]. The token is random per postbox and handed out only with its address
(through the driver's message), so a stray connection to the port is dropped before
anything of it is unpickled. A message with a reply address (`ray.sends_in_flight`) is
receipted once filed: a small message back, under the tag's receipt (exchange.py).
"""

import pickle
import secrets
import threading

from lowcomm_jax.runtimes.ray.forms.exchange import receipt_tag

_STOP = b"stop"


def _zmq():
  try:
    import zmq
  except ImportError as e:
    raise ImportError("ray.transport='sockets' needs pyzmq: pip install 'lowcomm_jax[ray]' "
                      "(or set ray.transport='objects')") from e
  return zmq


class Postbox:
  """One member's receiving socket and the thread that files what arrives in `mailbox`."""

  def __init__(self, mailbox, host: str):
    zmq = _zmq()
    self.mailbox, self.token = mailbox, secrets.token_bytes(16)
    self._context = zmq.Context.instance()
    self._inbox = self._context.socket(zmq.PULL)
    self._inbox.setsockopt(zmq.RCVHWM, 0)  # (no limit: a phase's values are all awaited)
    self._inbox.bind(f"tcp://{host}:*")
    self.endpoint = self._inbox.getsockopt_string(zmq.LAST_ENDPOINT)
    self._outboxes: dict = {}  # endpoint -> PUSH socket
    self._send_lock = threading.Lock()  # (ZeroMQ sockets are not thread-safe)
    self._thread = threading.Thread(target=self._receive, daemon=True, name="postbox")
    self._thread.start()

  @property
  def address(self) -> tuple[str, bytes]:
    return (self.endpoint, self.token)

  def _receive(self) -> None:
    while True:
      frames = self._inbox.recv_multipart(copy=False)
      if frames[0].bytes != self.token:
        continue  # not from a member of this run
      if len(frames) == 2 and frames[1].bytes == _STOP:
        self._inbox.close(linger=0)
        return
      tag, sender, *receipt = pickle.loads(frames[1].bytes)
      value = pickle.loads(frames[2].bytes, buffers=[f.buffer for f in frames[3:]])
      self.mailbox.put(tuple(tag), int(sender), value)
      if receipt:  # (receiver, the sender's address): it has what it was sent
        receiver, reply = receipt
        self.send(tuple(reply), receipt_tag(tuple(tag)), receiver, None)

  def send(self, address: tuple[str, bytes], tag: tuple, sender: int, value,
           receipt: tuple | None = None) -> None:
    """`value` to the postbox at `address` (queued: ZeroMQ's thread sends it); with
    `receipt` (the receiver's id, this postbox's address), receipted once filed."""
    endpoint, token = address
    buffers = []
    body = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    header = pickle.dumps((tag, sender, *(receipt or ())))
    frames = [token, header, body, *(b.raw() for b in buffers)]
    with self._send_lock:
      self._outbox(endpoint).send_multipart(frames, copy=True)

  def _outbox(self, endpoint: str):
    if endpoint not in self._outboxes:
      zmq = _zmq()
      sock = self._context.socket(zmq.PUSH)
      sock.setsockopt(zmq.SNDHWM, 0)
      sock.setsockopt(zmq.LINGER, 0)
      sock.connect(endpoint)
      self._outboxes[endpoint] = sock
    return self._outboxes[endpoint]

  def forget(self, keep: set[str]) -> None:
    """Closes the sockets to every endpoint not in `keep` (members that left: what was
    queued to them is dropped)."""
    with self._send_lock:
      for endpoint in set(self._outboxes) - keep:
        self._outboxes.pop(endpoint).close(linger=0)

  def close(self) -> None:
    self.forget(set())
    stop = self._context.socket(_zmq().PUSH)
    stop.connect(self.endpoint)
    stop.send_multipart([self.token, _STOP])
    stop.close(linger=1000)
    self._thread.join(timeout=5)


class SocketTransport:
  """A collective's values through the members' postboxes (`addresses`: every live
  worker's (endpoint, token), from the driver's message: the sockets to any other are
  closed, so nothing stays queued for a worker that is gone). `in_flight` > 0: each value
  asks for a receipt (the member paces its sends by them: exchange.py)."""

  def __init__(self, postbox: Postbox, addresses: dict, in_flight: int = 0):
    self.postbox, self.addresses, self.in_flight = postbox, addresses, in_flight
    postbox.forget({endpoint for endpoint, _ in addresses.values()})

  def pack(self, value):
    return value

  def deliver(self, to: int, tag: tuple, sender: int, box) -> None:
    if to in self.addresses:  # (else it was gone when the driver asked: the attempt fails)
      receipt = (to, self.addresses[sender]) if self.in_flight else None
      self.postbox.send(self.addresses[to], tag, sender, box, receipt)

  def unpack(self, boxes: list, deadline: float) -> list:
    del deadline
    return list(boxes)


def transport_for(message: dict, postbox: Postbox | None, ray):
  """The transport of a collective `message` names: its members' postboxes where it
  carries their addresses (ray.transport='sockets'), else Ray's object store."""
  from lowcomm_jax.runtimes.ray.forms.exchange import RayTransport
  if "addresses" in message:
    return SocketTransport(postbox, message["addresses"], message.get("sends_in_flight", 0))
  return RayTransport(ray, message["handles"])
