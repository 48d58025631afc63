"""The Ray runtime's config problems (`runtime`, `ray.*`), each 'field=value: fix'. Plain
Python: nothing here imports Ray, so a bad config fails in a second."""

import ml_collections

from lowcomm_jax.errors import Problems
from lowcomm_jax.runtimes.ray import chaos

def problems(c: ml_collections.ConfigDict, num_processes: int, algorithm) -> list[str]:
  """Problems of `runtime='ray'` with `algorithm` (None: unknown name, reported elsewhere)."""
  out = Problems(c)
  _check_processes(c, out.check, num_processes, algorithm)
  _check_fields(c, out.check)
  from lowcomm_jax.runtimes.ray import forms  # (its members' steps import JAX)
  forms.config_problems(c, out.check, algorithm)
  _check_chaos(c, out, algorithm)
  return list(out)


def _check_processes(c, check, num_processes: int, algorithm) -> None:
  """What one driver process and its workers' own processes need."""
  y = c.ray
  if algorithm is not None:  # (its declarations say what it needs: algorithms/base.py)
    check(algorithm.partial_rounds(c) or y.min_quorum == 0, "ray.min_quorum",
          f"{c.algorithm} needs every live worker in each round (its segments sync "
          "different fragments, its workers read the outer state, or their optimizer states "
          "are averaged between rounds): use 0 (every live worker)")
  check(num_processes == 1, "runtime", "one process drives a Ray run and Ray starts the "
        "others; launch it without jax.distributed")
  devices = c.mesh.data * c.model.tp.size  # a worker's own mesh
  check(devices == 1 or y.gpus_per_worker in (0, devices), "ray.gpus_per_worker",
        f"a worker runs on mesh.data × model.tp.size = {devices} devices: give it "
        f"{devices} GPUs, or 0 to run it on {devices} CPU devices")
  # The server's rounds go through the run's Sync (sync_program.make_server_sync); a round
  # some workers missed combines the present ones, which buckets do not define.
  check(c.aggregate.bucket <= 1, "aggregate.bucket",
        "buckets of a quorum round that some workers missed are not defined; use "
        "aggregate.bucket=0 on runtime='ray', or run on runtime='spmd'")
  check(c.data.batch_mode == "different", "data.batch_mode",
        "Ray workers read their own streams at their own pace; use 'different'")
  check(y.apply_order in ("arrival", "dispatch"), "ray.apply_order",
        "use 'arrival' or 'dispatch'")
  check(not (y.apply_order == "dispatch" and y.min_quorum > 0), "ray.apply_order",
        "'dispatch' takes results in the order jobs started, so a quorum round would wait "
        "for the slowest; use 'arrival' with ray.min_quorum")


def _check_fields(c, check) -> None:
  """ray.*'s own values."""
  y = c.ray
  check(y.num_cpus >= 0, "ray.num_cpus", "must be >= 0 (0: every core)")
  check(y.gpus_per_worker >= 0, "ray.gpus_per_worker", "must be >= 0")
  check(y.recover_timeout_s > 0, "ray.recover_timeout_s", "must be > 0")
  check(0 <= y.min_quorum <= c.num_workers, "ray.min_quorum",
        f"must be in 0..num_workers ({c.num_workers}); 0: every live worker")
  check(y.grace_s >= 0, "ray.grace_s", "must be >= 0")
  # Round 1's collective compiles its programs on every member: seconds, not milliseconds.
  check(y.collective_timeout_s >= 5, "ray.collective_timeout_s",
        "must be >= 5 seconds (a round's first collective compiles its programs); the "
        "default 600 also covers a big model's shards over slow links")
  check(y.transport in ("sockets", "objects"), "ray.transport",
        "'sockets' (straight over TCP, the default) or 'objects' (through Ray's object store)")
  check(y.sends_in_flight >= 0, "ray.sends_in_flight",
        "must be >= 0 (0: a member sends all its values at once)")
  check(y.sends_in_flight == 0 or y.transport == "sockets", "ray.sends_in_flight",
        "paces sends over ray.transport='sockets' only (through the object store receivers "
        "pull); set it to 0 or use sockets")
  sizes = list(y.batch_sizes)
  check(not sizes or (len(sizes) == c.num_workers and min(sizes) >= 1), "ray.batch_sizes",
        f"give one batch size >= 1 per worker ({c.num_workers}), or () for data.batch_size")
  check(not sizes or c.collab.target_batch_size > 0, "ray.batch_sizes",
        "per-worker batch sizes are for collaborative epochs (collab.target_batch_size > 0), "
        "where samples weigh each peer; elsewhere give a host table's batch_size per row")
  nodes = list(y.worker_nodes)
  check(len(nodes) <= c.num_workers and all(isinstance(n, str) for n in nodes),
        "ray.worker_nodes", f"give at most one resource name per worker ({c.num_workers}), "
        "'' for anywhere, e.g. ('node0', 'node1')")
  check(isinstance(y.server_node, str), "ray.server_node", "give a resource name, or ''")
  sleeps = list(y.step_sleep_s)
  check(not sleeps or (len(sleeps) == c.num_workers and min(sleeps) >= 0),
        "ray.step_sleep_s", f"give one non-negative number per worker ({c.num_workers})")


def _check_chaos(c, out: Problems, algorithm) -> None:
  """ray.chaos's events: parsed, naming workers and tiers that exist, and the failures
  this run's round form has."""
  check, y = out.check, c.ray
  try:
    events = chaos.parse(y.chaos)
  except ValueError as e:
    out.append(f"ray.chaos: {e}")
  else:
    killed = {}  # worker -> the push count it was killed at (until it rejoins)
    tiers = sorted({float(h.tier) for h in c.hosts} or {1.0})
    for e in events:
      if e.action == "add_worker":
        check(e.tier in tiers, "ray.chaos",
              f"{e}: a joining worker trains one of the run's tiers {tiers} (the host "
              "table's), so its programs and evaluation widths exist; use one of them")
      if e.action in ("kill_worker", *chaos.WAITS, *chaos.IN_SYNC):
        check(0 <= e.worker < c.num_workers, "ray.chaos",
              f"{e} names worker {e.worker}; workers are 0..{c.num_workers - 1}")
      if e.action == "kill_worker":
        killed[e.worker] = e.after
      if e.action == "rejoin_worker":
        check(killed.get(e.worker, e.after) < e.after, "ray.chaos",
              f"{e}: only a worker killed earlier (kill_worker=K@M, M < N) rejoins, once "
              "per kill")
        killed.pop(e.worker, None)
    check(sum(e.action == "kill_server" for e in events) <= 1, "ray.chaos",
          "the server is killed at most once")
    if algorithm is not None:
      from lowcomm_jax.runtimes.ray import forms
      peers = forms.among_workers(c, algorithm)
      check(not (peers and any(e.action == "kill_server" for e in events)), "ray.chaos",
            "kill_server: this run's rounds have no server (the quorum's workers reduce "
            "among themselves); set collective_form='server' to test the server's")
      for action in chaos.IN_SYNC:
        check(peers or not any(e.action == action for e in events), "ray.chaos",
              f"{action}: this run has no collective among workers (its rounds go "
              "through the server); it is the peer form's: collective_form other than "
              "'server', or kill_worker here")
      check(not (peers and y.standby_server), "ray.standby_server",
            "this run's rounds have no server (the quorum's workers reduce among "
            "themselves); set it False, or collective_form='server'")
      # In the peer form a joiner takes its row from a live peer with its replica (heals.py);
      # a server would have only θ₀ for it.
      rule = algorithm.worker_rule(c)
      check(not (peers and rule is not None and rule.reads_sync_state
                 and any(e.action == "flip_bit" for e in events)), "ray.chaos",
            f"flip_bit: {c.algorithm}'s members each hold their own θ_i after a pair swap, "
            "so no hashes are compared for it to fail; it tests a collective's (DiLoCo's)")
      joins = any(e.action == "add_worker" for e in events)
      check(not (joins and rule is not None and rule.reads_sync_state and not peers),
            "ray.chaos", f"{c.algorithm}'s workers keep their own row of the sync's state, "
            "and the server's row for a worker that joins mid-run would start from θ₀: use "
            "kill_worker/rejoin_worker (a rejoining worker keeps its row), or the peer form "
            "(collective_form other than 'server'), where a joiner takes a live peer's row")
      if joins:  # the algorithm's own limits on the worker count hold for every slot
        slots = chaos.with_worker_slots(c)
        for problem in algorithm.problems(slots):
          check(not problem.startswith("num_workers="), "ray.chaos",
                f"its joiners make {slots.num_workers} worker slots, and {problem}")


def config_defaults() -> ml_collections.ConfigDict:
  """The `ray` section: the Ray runtime's own fields (`runtime='ray'`; config/defaults.py
  puts it in every config)."""
  s = ml_collections.ConfigDict()
  s.address = ""  # '' : start a Ray inside this process; 'auto' or 'host:port': join one
  s.num_cpus = 0  # a Ray started here: CPUs it may schedule (0: every core)
  s.bind_address = ""  # a Ray started here: the address its services listen on
  # | ('' : Ray's default; '127.0.0.1' keeps every port on this machine)
  s.gpus_per_worker = 0.0  # GPUs each worker actor holds (0.5: two workers share one)
  s.worker_nodes = ()  # per worker: a custom resource its actor needs, which pins it to
  # | the node started with it (`ray start --resources='{"node2": 1}'`); () : anywhere,
  # | an entry '': that worker anywhere
  s.server_node = ""  # the same for every server process ('': anywhere)
  s.apply_order = "arrival"  # 'arrival': pushes applied as they come | 'dispatch': in
  # | the order their jobs started (reproducible runs: tests, comparison with the simulator)
  s.step_sleep_s = ()  # per worker: seconds slept per inner step (imposed slowness)
  s.batch_sizes = ()  # collaborative epochs: per worker, its micro-batch in samples (a
  # | bigger GPU, a bigger batch); () or a worker that joins later: data.batch_size
  # Quorum rounds (synchronous algorithms): a round closes once min_quorum workers have
  # contributed from its θ and grace_s seconds have passed since, or when every live worker
  # has; later contributions fold into the next round (weighted by tokens, staleness kept).
  s.min_quorum = 0  # workers a round needs (0: every live worker)
  s.grace_s = 0.0  # seconds a reached quorum waits for the others
  s.recover_timeout_s = 120.0  # a restarted server or worker must answer within this
  s.collective_timeout_s = 600.0  # the peer form (collective_form): a round's
  # | collective gives up on members that have not finished within this, and is tried
  # | again among the others (>= 5 s: round 1 compiles its programs)
  s.transport = "sockets"  # the peer form: how members send each other their values:
  # | 'sockets' straight over TCP (ZeroMQ, a port per worker on its node's address) |
  # | 'objects' through Ray's object store (where only Ray's own ports are open; each
  # | value is asked for, then pulled: slower on slow links, BENCHMARKS issue 70)
  s.sends_in_flight = 0  # the peer form over sockets: at most this many of a member's
  # | values in flight at once, each sent once the ones before it are receipted, to the
  # | members after it in turn (fewer TCP flows filling its uplink at once) | 0: all at once
  s.standby_server = False  # keep a server process built and idle: a dead server's
  # | successor skips the process start (one more process and θ's memory on its node)
  s.chaos = ()  # failures on cue (tests, benchmarks), each 'what@N' (N pushes applied):
  # | 'kill_worker=K@N', 'add_worker@N' (the next free id joins), 'rejoin_worker=K@N' (a
  # | killed worker back where its data stream was), 'kill_server@N' (once: it restarts from
  # | the last checkpoint, the pushes since replayed), 'delay_worker=K:S@N' (S s per push),
  # | 'crash_in_sync=K@N' (the peer form: K dies in the middle of the next collective),
  # | 'crash_after_staging=K@N' (the same, once K has staged the round),
  # | 'stall_in_sync=K:S@N' (the peer form: K waits S s inside the next collective),
  # | 'flip_bit=K@N' (the peer form: a bit of the next θ K stages flips; the run must stop)
  return s
