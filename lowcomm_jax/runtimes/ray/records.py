"""A driver that can die: the driver's record of each closed round, kept by the workers.

On a cluster started apart from the driver (`ray.address`: cluster.detached) the actors
are Ray's detached actors, named, in the run's namespace, so they outlive a driver that
dies. As each round of the peer form closes, before the next jobs start, the driver hands
every live worker its record of that round: what a checkpoint's meta would hold (its
counts, membership, data positions, the jobs in flight), the replicas' version and the
next job's order. Each worker acknowledges it; its replica keeps the θ and outer state of
the round before until then (a driver that dies between a commit and its record leaves
the members one commit ahead of their newest record, and they step back).

The same command run again (`take_up`) finds the live workers, takes the newest record any
of them holds, and goes on from that round: each worker steps back to where the record
left it (`WorkerProcess.resume_at`: its state before any job started since, its replica
at the record's version), the jobs in flight are started again, a worker behind adopts a
current peer's replica, and a worker the record counts but that is gone is lost. The
round in flight when the driver died is the only work lost; with `ray.apply_order =
'dispatch'` the run then ends bit-equal to one never interrupted. With no live worker
holding a record (or a newer checkpoint), it resumes from the checkpoint as before, and
whatever it found of an earlier driver is stopped first.

Which runs keep records: quorum rounds in the peer form whose collective closes before the
next jobs start (`journals`): not the server form, NoLoCo's pair swaps, a delayed sync's
overlap or Streaming's segments, which resume from their checkpoint.
"""

import logging
import time

from lowcomm_jax.runtimes.ray import cluster
from lowcomm_jax.runtimes.ray.replicas import Replicas


def journals(d) -> bool:
  """Whether the driver `d` hands its workers a record of each closed round."""
  form = d.progress.form
  return (cluster.detached(d.c) and d.r.algorithm.progress(d.c) == "rounds"
          and isinstance(form, Replicas) and d.r.sync.partners is None
          and not form.overlaps  # (one segment: no Streaming fragments, no τ beside them)
          and len(d.r.algorithm.segments(d.c, d.c.inner_steps)) == 1)


def send(d) -> None:
  """The record of the round just closed to every live worker that is up, each
  acknowledged before the next jobs start (a worker that dies meanwhile is lost)."""
  pool = d.pool
  record = d.record()
  pool.answers({w: pool.actors[w].keep_record.remote(record) for w in pool.up()},
               "taking the round's record")
  if d.taken_up_at is not None:  # the first round committed since a driver ran again
    seconds = time.perf_counter() - d.taken_up_at
    d.counts.recoveries.append({"what": "driver", "seconds": seconds,
                                "round": record["mark"], "at": time.time()})
    d.taken_up_at = None


def found(d) -> tuple[dict, list]:
  """The run's actors alive on the cluster (an earlier driver's): ({worker id: (its actor,
  its newest record or None)}, every other actor of the run: servers, and workers that do
  not answer)."""
  ray, workers = d.ray, {}
  actors = {name: ray.get_actor(name) for name in ray.util.list_named_actors()}
  others = [a for name, a in actors.items() if not name.startswith("worker_")]
  asked = [(a, a.resume_point.remote()) for name, a in actors.items()  # (all at once)
           if name.startswith("worker_")]
  for actor, ref in asked:
    try:
      point = ray.get(ref, timeout=d.c.ray.recover_timeout_s)
      workers[point["worker"]] = (actor, point["record"])
    except (ray.exceptions.RayError, KeyError) as e:
      logging.warning("ray: a worker of an earlier driver does not answer (%s)",
                      type(e).__name__)
      others.append(actor)
  return workers, others


def take_up(d, latest: int | None) -> tuple[dict, dict] | None:
  """(the newest record the run's live workers hold, {worker id: its actor} of the workers
  it counts that hold a record themselves), if the record is at or past the checkpoint
  `latest` and this run keeps records (`step_back` then takes them up). Otherwise None,
  and nothing of an earlier driver is left running. A worker holding no record (one that
  was starting, or adopting a peer's replica, when its driver died) is stopped: calls of
  the dead driver may still be queued in it."""
  if not cluster.detached(d.c):
    return None
  workers, others = found(d)
  records = [rec for _, rec in workers.values() if rec is not None]
  newest = max(records, key=lambda rec: rec["mark"], default=None)
  if (newest is None or not journals(d)
      or (latest is not None and newest["mark"] < latest)):
    _stop(d, [actor for actor, _ in workers.values()] + others)
    if workers or others:
      logging.info("ray: stopped %d actors of an earlier driver; resuming from %s",
                   len(workers) + len(others),
                   "the last checkpoint" if latest is not None else "the start")
    return None
  counted = {int(w) for w, (_, rec) in workers.items()
             if str(w) in newest["live"] and rec is not None}
  _stop(d, others + [actor for w, (actor, _) in workers.items() if w not in counted])
  return newest, {w: actor for w, (actor, _) in workers.items() if w in counted}


def step_back(d, record: dict, workers: dict) -> dict:
  """The driver's pool takes up `workers` ({id: actor}), each stepped back to `record`;
  a worker the record counts that is gone is lost, and its job in flight with it (taken
  out of the record's). {worker: the version its replica holds}."""
  pool = d.pool
  for w, actor in sorted(workers.items()):  # each as a process started here
    pool.actors[w], pool.jobs_done[w] = actor, 1  # (its programs compiled already)
  held = pool.answers({w: pool.actors[w].resume_at.remote(record) for w in list(pool.actors)},
                      f"stepping back to round {record['mark']}")
  # The record's workers not taken up are lost here (one taken up that died stepping back
  # was lost by `answers`).
  for w in sorted({int(w) for w in record["live"]} - set(workers)):
    pool.lost.append(w)
    d.counts.workers_lost += 1
    pool.note("worker_lost", worker=w, why="not alive when the driver ran again")
  for job in [j for j in record["in_flight"] if j["worker"] not in held]:
    record["in_flight"].remove(job)
    d.counts.pushes_dropped += 1
    d.counts.dispatched_steps -= job["steps"]
  logging.info("ray: took up round %d from the live workers %s (replicas at %s)",
               record["mark"], sorted(held), sorted(set(held.values())))
  return held


def _stop(d, actors) -> None:
  for actor in actors:
    try:
      d.ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
      pass


def began_since(record: dict, worker: int, running: int | None) -> bool:
  """Whether the job `running` (its order) began after `record`'s round closed, or is the
  worker's job the record keeps in flight: then the worker's state at the record is the
  one it held before that job."""
  unpushed = next((j["order"] for j in record["in_flight"] if j["worker"] == worker), None)
  return running is not None and (running == unpushed or running >= record["next_order"])
