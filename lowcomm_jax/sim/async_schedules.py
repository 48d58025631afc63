"""Asynchronous schedules: Local-SGD workers behind one server (async, async_dn; HALoS's regional
servers extend it in algorithms/halos.py). Every transfer (a pull, a contribution, a push between
servers) is a flow sharing the links with the others in flight (sim/flows.py)."""

import dataclasses

from lowcomm_jax.sim.collectives import SERVER, node
from lowcomm_jax.sim.events import Event, EventLoop
from lowcomm_jax.sim.flows import TICK, Flows
from lowcomm_jax.parallel.server_names import GLOBAL
from lowcomm_jax.sim.schedules import Backend, Job, Plan, Schedule


class AsyncWorkers(Schedule):
  """Asynchronous Local-SGD: a worker pulls the latest parameters of its server (their
  version is the one when it asks), computes H steps, sends its pseudo-gradient; the
  server applies it on arrival (outer rule: plain Nesterov or Delayed Nesterov, the
  backend's) and the worker pulls again, until the budget of inner steps is spent.
  Events: 'pulled' (the parameters arrived), 'computed', 'arrive' (at the server)."""

  def __init__(self, plan: Plan, backend: Backend):
    super().__init__(plan, backend)
    self.flows = Flows(plan.network)
    # collective='server': the server takes one contribution at a time, in the order they
    # are ready, as the Ray driver hands them over (the others wait, computed, at their
    # workers); else each is sent as soon as it is computed.
    self.one_at_a_time = plan.collective == SERVER
    self.waiting: list[dict] = []  # computed jobs whose contribution has not left
    self.taking = False  # one_at_a_time: a contribution is on its way in

  def server_of(self, worker: int) -> str:
    return GLOBAL

  def server_region(self, server: str) -> int:
    return self.plan.network.server_region

  def _send(self, loop: EventLoop, src, dst, nbytes: int, kind: str, **data) -> None:
    """A transfer between nodes, workers (ints) or servers (names); `kind` with `data` is
    the event at its arrival."""
    ends = [(node(n), self.plan.network.worker_region[n]) if isinstance(n, int)
            else (n, self.server_region(n)) for n in (src, dst)]
    self.flows.send(loop, *ends[0], *ends[1], nbytes, kind, data)

  def start(self, loop: EventLoop) -> None:
    for w in range(self.plan.num_workers):
      self._dispatch(loop, w)

  def _dispatch(self, loop: EventLoop, worker: int) -> bool:
    p = self.plan
    remaining = p.total_steps - self.dispatched_steps
    if remaining <= 0:
      return False
    job = self._new_job(loop, worker, self.server_of(worker),
                        min(p.inner_steps[worker], remaining))
    self.acct.bytes_sent += p.delta_bytes
    self.acct.server_bytes_sent += p.param_bytes
    self._send(loop, job.server, worker, p.param_bytes, "pulled", job=dataclasses.asdict(job))
    return True

  def handle(self, event: Event, loop: EventLoop) -> None:
    if event.kind == TICK:
      self.flows.handle(loop)
    elif event.kind == "pulled":
      job = event.data["job"]
      loop.schedule(loop.now + job["compute_seconds"], "computed", job=job)
    elif event.kind == "computed":
      self.waiting.append(event.data["job"])
      self._send_next(loop)
    elif event.kind == "arrive":
      self.taking = False
      self._arrive(loop, Job(**event.data["job"]))
      self._send_next(loop)
    else:
      self._server_event(event, loop)

  def _send_next(self, loop: EventLoop) -> None:
    """The contributions that may leave now: every waiting one, or the first if the server
    takes them one at a time and is free."""
    while self.waiting and not self.taking:
      job = self.waiting.pop(0)
      self.taking = self.one_at_a_time
      self._send(loop, job["worker"], job["server"], self.plan.delta_bytes, "arrive", job=job)

  def _server_event(self, event: Event, loop: EventLoop) -> None:
    raise ValueError(f"unexpected event {event.kind!r}")

  def _arrive(self, loop: EventLoop, job: Job) -> None:
    staleness = self.backend.version(job.server) - job.version
    drift, loss = self.backend.apply_job(job)
    self._applied(job, staleness, drift, loss)
    self._dispatch(loop, job.worker)

  def state_dict(self) -> dict:
    return {**super().state_dict(), "flows": self.flows.state_dict(),
            "waiting": list(self.waiting), "taking": self.taking}

  def load_state(self, state: dict) -> None:
    super().load_state(state)
    self.flows.load_state(state["flows"])
    self.waiting, self.taking = list(state.get("waiting", [])), state.get("taking", False)
