"""The server form: θ and the outer state held by parameter-server actors (server.py), which
combine the workers' contributions (`collective_form='server'`, and every run whose rounds
have no form among the workers: asynchronous pushes, a worker rule that reads the sync's
state; `config.among_workers`). A worker's job pulls θ from its server and pushes its
payload back (sender.py); the driver moves references and tells the server when a round
closes. Its member side is the server actor's own rule (programs/servers.py), so it has no
`base.Form` beside the collective forms: it is the driver's side alone, the `form` a
progress policy (progress.py) is given."""

from lowcomm_jax.runtimes.ray.heals import Heals
from lowcomm_jax.runtimes.ray.server import average_parts


class ServerForm:
  """The driver's side of rounds through the server actors (`d`: the driver)."""

  def __init__(self, d):
    self.d = d
    self.heals = Heals(d)  # a joiner's per-worker state, from a live peer (heals.py)
    d.pool.heal_for = self.heals.state_for
    self._average = (d.ray.remote(num_cpus=0)(average_parts)  # (DES-LOC's moments)
                     if d.r.worker_state_sync is not None else None)

  # --- what the driver asks of the global state -------------------------------------------

  def restore_global(self, state: dict | None) -> None:
    """A checkpoint's global server state ({"part": where}: the server reads it; None:
    fresh) as the run opens: the servers."""
    self.d.pool.start_server(state)

  def opened(self) -> None:
    pass

  def global_call(self, method: str):
    return self.d.pool.call(method)

  def global_parts(self, where: dict, in_flight: list[dict]) -> dict:
    """Each server writes its part (with the models the jobs in flight pulled)."""
    ray, pool = self.d.ray, self.d.pool
    written = {name: actor.save_part.remote(
                   where, [j["version"] for j in in_flight if j["server"] == name])
               for name, actor in pool.servers.items()}
    return {name: ray.get(ref) for name, ref in written.items()}

  def resume_job(self, job: dict) -> None:
    """A checkpoint's job in flight, started again as it was (from the model it pulled)."""
    self.d.pool.dispatch(job["worker"], job["lr_step"], job["steps"], job["order"],
                         job["version"])

  def on_lose(self, worker: int) -> None:
    pass

  def summary(self) -> dict:
    return {"round_form": "server", **self.heals.summary()}

  # --- a round -----------------------------------------------------------------------------

  def dispatch(self, worker: int, lr_step: int, steps: int) -> None:
    """A job of `steps` inner steps from the server's newest θ."""
    self.d.pool.dispatch(worker, lr_step, steps)

  def contribute(self, worker: int, meta: dict, sent, segments: int) -> int | None:
    """The contribution into the open round (the server's row of its worker); its
    staleness in syncs, or None where no round of its segment is open."""
    del worker, segments
    self.heals.count(meta)
    info = self.d.pool.call("contribute", meta, sent, changes=True)
    return None if info.get("dropped") else info["staleness"]

  def close_segment(self, steps: int) -> None:
    """The open segment's sync, on the server; `steps`: its contributions' inner steps."""
    d, n = self.d, self.d.counts
    d.pool.call("close_round", changes=True)
    n.applied_steps += steps
    d.timeline.applied(n.applied_steps)

  def after_start(self) -> None:
    pass

  def finish(self) -> None:
    pass

  def state_average(self, workers: list[int], parts) -> int | None:
    """Every worker's parts in, their mean (a Ray task) out to each: the bytes of the
    parts sent; None after losing a worker that died before every part was in. One that
    dies taking the mean is lost, the others keep theirs."""
    d, pool = self.d, self.d.pool
    errors = (d.ray.exceptions.RayActorError, d.ray.exceptions.RayTaskError)
    sent = {w: pool.actors[w].state_parts.options(num_returns=2).remote(parts)
            for w in workers}
    try:
      metas = d.ray.get([meta for meta, _ in sent.values()])
    except errors:
      self._lose_dead(workers)
      return None
    mean = self._average.remote(*[ref for _, ref in sent.values()])
    for w in workers:
      try:
        d.ray.get(pool.actors[w].set_state_parts.remote(parts, mean))
      except errors:
        self._lose_dead([w])
    return sum(meta["bytes"] for meta in metas)

  def _lose_dead(self, workers) -> None:
    pool = self.d.pool
    dead = [w for w in workers if w in pool.actors and not pool.worker_alive(w)]
    if not dead:
      raise RuntimeError(f"a state average failed and workers {workers} are all alive")
    for w in dead:
      pool.lose(w, "died in a state average")

  # --- a collaborative epoch ---------------------------------------------------------------

  def open_theta(self) -> tuple[int, object]:
    """(version, the reference of θ) the open epoch's micro-batches start from."""
    version, params = self.d.pool.call("theta")
    return version, self.d.ray.put(params)

  def dispatch_micro(self, worker: int, theta: tuple[int, object]) -> None:
    self.d.pool.dispatch_micro(worker, *theta)

  def contribute_epoch(self, worker: int, meta: dict, sent) -> int:
    """A peer's mean gradient into the open epoch's step; its staleness in epochs."""
    del worker
    return self.d.pool.call("contribute", meta, sent, changes=True)["staleness"]

  def close_epoch(self, by_peer: dict[int, int]) -> set:
    """The epoch's step (the server's) over `by_peer`'s contributions; the peers whose
    contributions it applied."""
    self.d.pool.call("close_round", changes=True)
    return set(by_peer)
