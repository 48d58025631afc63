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

Where θ is held and how a round's contributions are combined is the policy's `form`, given
to it (composition, not a subclass): `forms.server.ServerForm` (the server actors hold θ;
every mode can run through them) or `replicas.Replicas` (each worker holds a replica and a
round closes with a collective among its members: quorum rounds and epochs, where
`forms.among_workers` says so; `pair_rounds.PairReplicas` for pair swaps). A form answers:

  restore_global(state), opened(), global_call(method), global_parts(where, in_flight),
  resume_job(job), on_lose(worker), summary()   what the driver asks of the global state
  dispatch(worker, lr_step, steps)             a job from the open round's θ
  contribute(worker, meta, sent, segments)     a contribution kept for the round's close:
                                               its staleness, None if no round of it is open
  close_segment(steps) / after_start()         the round's combine, and what follows once
                                               the next jobs have started
  state_average(workers, parts)                a workers' state average (DES-LOC)
  open_theta(), dispatch_micro(worker, theta),
  contribute_epoch(worker, meta, sent),
  close_epoch(by_peer)                         a collaborative epoch's θ, micro-batches, a
                                               peer's mean gradient kept, the step
  finish()                                     the run's end (a collective in flight settled)
"""


class Progress:
  """The defaults every mode shares; a mode overrides what differs."""

  unit = "round"  # what a mark is, in log lines
  late_figures = False  # whether the figures count contributions from an older round's θ

  def __init__(self, d, form):
    self.d, self.form = d, form

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
    """A checkpoint's global state (None: fresh) as the run opens."""
    self.form.restore_global(state)

  def global_call(self, method: str):
    """`method` of the global state's holder (evaluate, param_norm)."""
    return self.form.global_call(method)

  def global_parts(self, where: dict, in_flight: list[dict]) -> dict:
    """The global state's parts of checkpoint `where`, written where the state is: each
    server's record (checkpoints.write_server), by name."""
    return self.form.global_parts(where, in_flight)

  def resume_job(self, job: dict) -> None:
    """A checkpoint's job in flight, started again."""
    self.form.resume_job(job)

  def opened(self) -> None:
    """The run (re)started, its actors up, before the jobs a checkpoint kept start again."""
    self.form.opened()

  def on_lose(self, worker: int) -> None:
    """A worker died (its job is already dropped by the pool)."""
    self.form.on_lose(worker)

  def summary(self) -> dict:
    """What only the summary adds for this mode (and its form)."""
    return self.form.summary()
