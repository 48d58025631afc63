"""Asynchronous pushes on the Ray runtime (`Algorithm.progress` 'pushes': async, async_dn,
halos): a finished job's push is applied at once with the algorithm's server rule, and its
worker starts the next job. Progress is counted as in the simulator, in round-equivalents
(W·H inner steps applied); the budget is W·rounds·H. HALoS's regional servers exchange
with the global one as their pushes come in (regions.py)."""

from lowcomm_jax.runtimes.ray.progress import Progress


class Pushes(Progress):

  unit = "round-equivalent"

  def __init__(self, d, form):
    super().__init__(d, form)
    self.per_mark = d.c.num_workers * d.c.inner_steps  # a round-equivalent: W·H steps

  def start_next(self, worker: int, clock: int | None = None) -> None:
    """`worker`'s next job, if the budget has steps left. Inner lr schedules run on the
    run's clock, as in the simulator: the inner steps of the jobs started before, per
    worker (`clock`: the same for jobs started together)."""
    d = self.d
    n = d.counts
    remaining = d.plan.total_steps - n.dispatched_steps
    if remaining <= 0:
      return
    steps = min(d.pool.rows.inner_steps_of(worker), remaining)
    if clock is None:
      clock = n.dispatched_steps // d.c.num_workers
    n.dispatched_steps += steps
    d.pool.dispatch(worker, clock, steps)

  def _budget_spent(self) -> bool:
    return self.d.counts.applied_steps >= self.d.plan.total_steps

  def mark(self) -> int:
    return self.d.counts.applied_steps // self.per_mark

  def _take(self, job) -> bool:
    """A finished job: its push applied, and the idle workers' next jobs started (this
    one's, and any steps a lost job left). False if the job failed."""
    d = self.d
    meta = d.pool.result(job)
    if meta is None:
      d.idle_start()  # a lost job's steps go to whoever is idle
      return False
    n = d.counts
    self.form.heals.count(meta)  # (a joiner's first push tells what it took)
    info = d.pool.call("push", meta, job.sent, server=job.server, changes=True)
    n.applied_steps += job.steps
    d.timeline.applied(n.applied_steps)
    d.timeline.job(job, meta)
    if d.regions is not None:
      n.global_pushes += d.regions.pushed(
          d.pool, job.server, n.dispatched_steps >= d.plan.total_steps)
    n.contributed(job.worker, meta, info["staleness"], info["drift"])
    d.pool.chaos()
    d.idle_start()
    return True

  def work_to_mark(self) -> bool:
    d, mark = self.d, self.mark()
    while True:
      if not d.pool.jobs and not self._budget_spent():
        d.idle_start()  # steps left behind by a worker lost while the others idled
        if not d.pool.jobs:
          raise RuntimeError("no live worker can take the remaining inner steps")
      if not d.pool.jobs:
        break
      if self._take(d.pool.next_done()) and self.mark() != mark:
        break
    finished = not d.pool.jobs and self._budget_spent()
    if finished and d.regions is not None:
      d.counts.global_pushes += d.regions.flush(d.pool)
    return finished

  def summary(self) -> dict:  # (no rounds: the server form's round_form is not said)
    regions = self.d.regions is not None
    return {**self.form.heals.summary(),
            **({"global_pushes": self.d.counts.global_pushes} if regions else {})}
