"""A schedule's clock without the training: when each inner step is applied.

Virtual time never depends on the math (a schedule sees versions, times and bytes only), so
a plan's schedule run against a backend that only counts versions gives the same clock
as the full simulation: (virtual seconds, inner steps applied) after every event. Benches
use it to time one trained run under other networks (free communication: the compute-only
floor at the same applied steps; halved bytes; another collective), and to check that a
simulation's times come from its schedule alone.
"""

from lowcomm_jax.sim.events import EventLoop
from lowcomm_jax.parallel.server_names import GLOBAL
from lowcomm_jax.sim.schedules import Plan


class CountingBackend:
  """The Backend protocol with no training: versions move as the real servers' would."""

  def __init__(self, segments: int = 1, config=None):
    self.versions, self.segments = {}, segments
    self.config = config  # what some schedules read (NoLoCo's pairings: its seed)

  def version(self, server):
    return self.versions.setdefault(server, 0)

  def _bump(self, server):
    self.versions[server] = self.version(server) + 1

  def start_job(self, job):
    pass

  def apply_job(self, job):
    self._bump(job.server)
    return None, 0.0

  def sync_round(self, jobs):
    self._bump(GLOBAL)
    return [0.0] * len(jobs), None, 0

  def sync_segment(self, jobs, segment):
    if segment == self.segments - 1:
      self._bump(GLOBAL)
    return [0.0] * len(jobs), None, 0

  def push_update(self, src, msg):
    pass

  def apply_push(self, dst, msg):
    self._bump(dst)

  def send_params(self, src, msg):
    pass

  def merge(self, dst, msg, alpha):
    pass


def clock(plan: Plan, make_schedule, config=None) -> list[tuple[float, int]]:
  """[(virtual seconds, inner steps applied)] at each instant the count changed, and when
  the schedule drained, for the schedule `make_schedule(plan, backend)` builds (an
  Algorithm's `schedule`)."""
  backend = CountingBackend(max(len(plan.fragment_bytes), 1), config)
  schedule, loop = make_schedule(plan, backend), EventLoop()
  schedule.start(loop)
  points = [(0.0, 0)]
  while len(loop):
    for event in loop.pop_simultaneous():
      schedule.handle(event, loop)
    if schedule.acct.applied_steps != points[-1][1]:
      points.append((loop.now, schedule.acct.applied_steps))
  if loop.now != points[-1][0]:  # servers still talking after the last step (HALoS)
    points.append((loop.now, schedule.acct.applied_steps))
  return points


def seconds_at(points: list[tuple[float, int]], steps: float) -> float | None:
  """The virtual time at which `steps` inner steps had been applied (None: never)."""
  return next((t for t, s in points if s >= steps), None)
