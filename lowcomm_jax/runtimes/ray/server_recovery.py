"""A parameter server that died or stopped answering, replaced (pool.Pool.recover_server):
a new one from the last checkpoint (the standby, where one was built), the calls that
changed the dead one since then replayed in order, then the jobs whose pull from it failed
started again as they were. A dead worker is told from a dead server by pool.py."""

import collections
import time

from lowcomm_jax.parallel.server_names import GLOBAL


def recover(pool, why: str, server: str = GLOBAL) -> None:
  """A new server `server` from the last checkpoint, its calls since replayed in order,
  then the jobs whose pull from it failed started again as they were."""
  t0 = time.perf_counter()
  n = pool.counts
  try:  # (a server that only stopped answering must not live on beside the new one)
    pool.ray.kill(pool.servers[server], no_restart=True)
  except Exception:  # noqa: BLE001 - already gone
    pass
  restored, mark = pool.restore_latest(server)
  standby = pool.start_server(restored, server)
  actor = pool.servers[server]
  # Jobs out that pulled from the dead server keep their models (drift, checkpoints);
  # those whose pull failed start again, as they were, once the calls are replayed.
  held, failed = collections.Counter(), []
  for job in sorted(pool.jobs.values(), key=lambda j: j.order):
    if job.micro or job.server != server:  # (a micro-batch's θ is the driver's object)
      continue
    try:
      held[pool.ray.get(job.version)] += 1
    except pool.ray.exceptions.RayError:
      failed.append(job)
  actor.expect.remote(dict(held))
  calls = [(method, args) for name, method, args in pool.since_checkpoint if name == server]
  for method, args in calls:
    pool.ray.get(getattr(actor, method).remote(*args))
  actor.replayed.remote()
  replayed = len(calls)
  n.pushes_replayed += replayed
  n.server_restarts += 1
  for job in failed:
    pool.discard(job)
    pool.dispatch(job.worker, job.lr_step, job.steps, job.order)
  seconds = time.perf_counter() - t0
  n.recoveries.append({"what": "server", "server": server, "seconds": seconds,
                       "replayed": replayed, "from_checkpoint": mark, "standby": standby})
  pool.note("server_restarted", server=server, why=why, seconds=round(seconds, 3),
            replayed=replayed, checkpoint=mark, standby=standby)
  pool.start_standby()  # the next one (built while the run goes on)
