"""Collective forms of the Ray runtime's peer form: how a synchronous round's members
combine their contributions among themselves, with no process in the middle.

Each form is one module (base.Form: what the driver tells each member, and what a member
does); `FORMS` is the registry, and `for_round` the one place that picks a form for a
round; config.py says which forms a config's rounds have (`collective_form`), so nothing
outside this package compares a form's name. `exchange.py` is how the members reach each
other (their mailboxes, an attempt's sends and gathers); `sockets.py` carries the values
straight over TCP (the default transport), `exchange.RayTransport` through Ray's object store.

  direct        every member with every other: a dense mean reduce-scattered and
                all-gathered, a robust rule shard by shard, or whole rows all-gathered
  hierarchical  a dense mean by region, the regions' leaders between them
  ring          a dense mean around the members' ring, one stream each way per link
  pairs         each member with its round's peer alone (NoLoCo's swaps)

server.py is the server form (`ServerForm`): θ on parameter-server actors, whose rule
combines the contributions; with the driver's side of the members' forms
(replicas.Replicas), it is one of the two forms a progress policy is given (progress.py).
"""

from lowcomm_jax.runtimes.ray.forms.base import Form, take_part
from lowcomm_jax.runtimes.ray.forms.config import among_workers, config_problems
from lowcomm_jax.runtimes.ray.forms.direct import DIRECT, mean_of
from lowcomm_jax.runtimes.ray.forms.exchange import (Exchange, Failed, LocalTransport, Mailbox,
                                                     RayTransport)
from lowcomm_jax.runtimes.ray.forms.hierarchical import HIERARCHICAL, regions_of
from lowcomm_jax.runtimes.ray.forms.pairs import PAIRS
from lowcomm_jax.runtimes.ray.forms.ring import RING
from lowcomm_jax.runtimes.ray.forms.sockets import Postbox, SocketTransport, transport_for

# In the order `for_round` asks them: the first form that claims a round runs it.
FORMS: dict[str, Form] = {f.name: f for f in (PAIRS, HIERARCHICAL, RING, DIRECT)}


def get(name: str) -> Form:
  return FORMS[name]


def for_round(rounds, members: list[int]) -> Form:
  """The form of a round among `members` (`rounds`: the driver's Replicas): the first in
  FORMS that claims it (pair swaps where the sync swaps with a peer, by region or around
  a ring where the simulator's model says so, else direct)."""
  return next(f for f in FORMS.values() if f.claims(rounds, members))


__all__ = ["among_workers", "config_problems", "DIRECT", "FORMS", "HIERARCHICAL", "PAIRS", "RING",
           "Exchange", "Failed", "Form", "LocalTransport", "Mailbox", "Postbox",
           "RayTransport", "SocketTransport", "for_round", "get", "mean_of", "regions_of",
           "take_part", "transport_for"]
