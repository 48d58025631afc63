"""How a Ray run moves from mark to mark: the progress policy the driver (driver.py) runs.

The algorithm declares which (`Algorithm.progress`):
- 'pushes' (pushes.py): asynchronous; each finished job's push is applied at once and its
  worker starts the next; a mark per round-equivalent (W·H inner steps applied).
- 'rounds' (quorum.py): synchronous, in quorum rounds; a mark per round.
- 'epochs' (epochs.py): collaborative epochs of a target batch; a mark per epoch.

A policy holds the mode's own state and answers the driver's questions; the driver holds
what every mode shares (the pool of actors, the counts, checkpoints, the run loop's side).
`d` is that driver: a policy reads its `c`, `r`, `plan`, `pool`, `counts`, `ray`,
`regions` and calls `d.idle_start()`.
"""


class Progress:
  """The defaults every mode shares; a mode overrides what differs."""

  unit = "round"  # what a mark is, in log lines
  late_figures = False  # whether the figures count contributions from an older round's θ

  def __init__(self, d):
    self.d = d

  def start_next(self, worker: int, clock: int | None = None) -> None:
    """`worker`'s next job, if the mode has one for it (`clock`: the inner lr step of jobs
    started together)."""
    raise NotImplementedError

  def work_to_mark(self) -> bool:
    """Takes results until the next mark or the end of the budget; whether the run is
    finished."""
    raise NotImplementedError

  def mark(self) -> int:
    raise NotImplementedError

  def step_count(self) -> int:
    """The run's steps so far, as metrics rows count them (per worker)."""
    return self.d.counts.applied_steps // self.d.c.num_workers

  def tokens(self) -> int:
    return self.d.r.tokens(self.d.counts.applied_steps)

  def figures(self) -> dict:
    """The mode's own figures, beside the shared ones (a metrics row and the summary)."""
    return {}

  def jobs_to_resume(self) -> list:
    """The jobs in flight a checkpoint keeps (a resumed run starts them again)."""
    return sorted(self.d.pool.jobs.values(), key=lambda j: j.order)

  def restore_global(self, state: dict | None) -> None:
    """A checkpoint's global server state (None: fresh) as the run opens: the servers."""
    d = self.d
    d.pool.start_server(state)

  def global_call(self, method: str):
    """`method` of the global state's holder (evaluate, param_norm)."""
    return self.d.pool.call(method)

  def global_states(self, in_flight: list[dict]) -> dict:
    """What a checkpoint keeps of the global state, by server: each server's state, with
    the models the jobs in flight pulled."""
    ray, pool = self.d.ray, self.d.pool
    return {name: ray.get(actor.state.remote(
                [j["version"] for j in in_flight if j["server"] == name]))
            for name, actor in pool.servers.items()}

  def resume_job(self, job: dict) -> None:
    """A checkpoint's job in flight, started again as it was."""
    self.d.pool.dispatch(job["worker"], job["lr_step"], job["steps"], job["order"],
                         job["version"])

  def opened(self) -> None:
    """The run (re)started, its actors up, before the jobs a checkpoint kept start again."""

  def on_lose(self, worker: int) -> None:
    """A worker died (its job is already dropped by the pool)."""

  def summary(self) -> dict:
    """What only the summary adds for this mode."""
    return {}
