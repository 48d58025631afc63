"""Chaos hooks (`ray.chaos`): failures and arrivals at fixed counts of applied pushes, so
tests and benchmarks exercise membership changes and recovery the same way every time.

Each event is 'what@N', N applied pushes (N >= 1; in collaborative epochs, N micro-batches
counted):
  kill_worker=K@N     kill worker K (its job in flight is lost)
  rejoin_worker=K@N   worker K (killed earlier) starts again where its data stream was
  add_worker@N        a new worker joins (the next free id), full width
  add_worker=tier:T@N the same, training MatFormer tier T (one of the host table's tiers)
  kill_server@N       the (global) server dies; it restarts from the last checkpoint and
                      the calls that changed it since are replayed
  delay_worker=K:S@N  from then on, worker K's pushes wait S seconds before they are sent
  crash_in_sync=K@N   worker K's process dies in the middle of the next round's collective
                      (the peer form: it has taken its peers' shards and not answered)
  crash_after_staging=K@N  worker K's process dies in the next round's collective once it
                      has staged the round (its peers have its shards, and stage it too)
  stall_in_sync=K:S@N worker K, alive, waits S seconds inside the next round's collective
                      before its part (the peer form: past ray.collective_timeout_s its
                      peers stop waiting, and the round goes on without it)
  flip_bit=K@N        one bit of the next θ worker K stages flips (the peer form: silent
                      data corruption, as a bad memory cell makes): the members' hashes
                      differ, and the run must stop before any of them commits
"""

import dataclasses
import re

import numpy as np

ACTIONS = ("kill_worker", "rejoin_worker", "add_worker", "kill_server", "delay_worker",
           "crash_in_sync", "crash_after_staging", "stall_in_sync", "flip_bit")
# inside the peer form's collectives: told in the next one's message (`in_sync`), or not
MESSAGED = ("crash_in_sync", "crash_after_staging", "stall_in_sync")
IN_SYNC = (*MESSAGED, "flip_bit")
WAITS = ("delay_worker", "stall_in_sync")  # events of a worker and seconds (K:S)
_FORM = re.compile(r"^(?P<action>[a-z_]+)(=(tier:(?P<tier>[0-9.]+)|(?P<worker>\d+)"
                   r"(:(?P<seconds>[0-9.]+))?))?@(?P<after>\d+)$")


@dataclasses.dataclass(frozen=True)
class ChaosEvent:
  action: str
  after: int  # applied pushes
  worker: int = -1
  seconds: float = 0.0
  tier: float = 1.0  # add_worker: the MatFormer tier the new worker trains

  def __str__(self) -> str:
    target = ("" if self.worker < 0 else f"={self.worker}") + (
        f"=tier:{self.tier:g}" if self.tier != 1.0 else "")
    return f"{self.action}{target}{f':{self.seconds:g}' if self.seconds else ''}@{self.after}"


def parse(events) -> list[ChaosEvent]:
  """The events, ordered by push count; ValueError names the first bad one and the form."""
  out = []
  for text in events:
    m = _FORM.match(str(text).strip())
    action = m and m["action"]
    needs_worker = action in ("kill_worker", "rejoin_worker", "delay_worker", *IN_SYNC)
    ok = (m is not None and action in ACTIONS and int(m["after"]) >= 1
          and needs_worker == (m["worker"] is not None)
          and (action in WAITS) == (m["seconds"] is not None)
          and (m["tier"] is None or (action == "add_worker" and 0 < float(m["tier"]) <= 1)))
    if not ok:
      raise ValueError(f"{text!r} is not a chaos event; use one of 'kill_worker=K@N', "
                       "'rejoin_worker=K@N', 'add_worker@N', 'add_worker=tier:T@N' "
                       "(0 < T <= 1), 'kill_server@N', 'delay_worker=K:S@N', "
                       "'crash_in_sync=K@N', 'crash_after_staging=K@N', "
                       "'stall_in_sync=K:S@N', 'flip_bit=K@N' (N >= 1 applied pushes)")
    out.append(ChaosEvent(action, int(m["after"]), int(m["worker"] or -1) if needs_worker
                          else -1, float(m["seconds"] or 0.0), float(m["tier"] or 1.0)))
  return sorted(out, key=lambda e: e.after)


def with_worker_slots(config):
  """`config` with a worker for every id the run may use: the ones it starts with and one
  per `add_worker` event (each takes the next free id), so a parameter server keeps a row
  per id and a joining worker finds its own. With a host table, each added worker is a host
  row of its event's tier (the config's batch size and H)."""
  from lowcomm_jax.assemble.hosts import host
  added = [e for e in parse(config.ray.chaos) if e.action == "add_worker"]
  if not added:
    return config
  out = config.copy_and_resolve_references()
  out.num_workers = config.num_workers + len(added)
  if list(config.hosts):
    out.hosts = list(out.hosts) + [host(e.tier) for e in added]
  return out


def in_sync(e: ChaosEvent) -> dict:
  """What the next collective's message carries for event `e` (forms/base.take_part)."""
  if e.action == "stall_in_sync":
    return {"stall": [e.worker, e.seconds]}
  return {"crash" if e.action == "crash_in_sync" else "crash_staged": e.worker}


def flip_one_bit(params) -> np.ndarray:
  """`params` (float32) with one bit of its middle coordinate's mantissa flipped."""
  out = np.array(params, dtype=np.float32)
  out.view(np.uint32)[out.size // 2] ^= np.uint32(1 << 22)
  return out
