"""A round's exchange alone, on real links (issue 70): W members, each a Ray actor in a
network namespace of its own behind a tbf-limited link (bench/real_links.py), hold a fixed Δ
of N floats (no training, so the machine's 2 cores do not stretch the transfers) and close
rounds in a form of the Ray runtime's (`--form`: the ring, the default, or direct), as its
members do: the driver sends each member one message (runtimes/ray/forms: the members' real
exchange, mailboxes and transport, `--transport`), the members reduce-scatter and
all-gather among themselves, each stages θ' and reports its hash, and the driver commits.
The driver sits in a node of its own.

Per round: its sync time (the driver's first message to the last commit) over the ring's
bytes time 2·(W−1)/W·4N·8/B, the exchange alone (to the last member's end of its
all-gather: what follows is each member's outer step and hash, compute on the machine's
shared cores), and the driver's CPU seconds (its whole process: Ray's threads included).
Round 0 of each run warms up (imports, connections) and is not counted.

  python bench/exchange_rig.py --workers 2 4 8 16 --mbps 20 --runs 3 --rounds 3 \\
      --queue_ms 200 --modem --out /tmp/exchange_rig   # needs root; results.jsonl, as it goes
      # (--transport sockets objects --form ring direct: a set of runs per value)
  python bench/exchange_rig.py --report /tmp/exchange_rig   # the table and the CPU fit
"""

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np


def simulated(workers: int, n: int, mbps: float) -> tuple[float, str]:
  """The simulator's time of the round's all-reduce over the rig's links (`auto`: the form
  it picks, and its seconds): every NIC at `mbps`, no latency (sim/collectives.py)."""
  from lowcomm_jax.sim import collectives
  from lowcomm_jax.sim.network import Network
  gbps = mbps / 1000
  net = Network.build(num_workers=workers, regions=1, intra_gbps=gbps, intra_latency_s=0.0,
                      inter_gbps=gbps, inter_latency_s=0.0)
  return collectives.seconds(net, "allreduce", list(range(workers)), 4 * n)


def ring_seconds(workers: int, n: int, mbps: float) -> float:
  """A ring all-reduce's bytes time: 2·(W−1)/W of the payload through each link."""
  return 2 * (workers - 1) / workers * 4 * n * 8 / (mbps * 1e6)


class RigReplica:
  """What a member computes in a dense mean (replica.Replica's steps, in NumPy on a fixed
  Δ): its shards, a shard's mean (direct) or weighted sum and its division (ring), the
  outer step and its hash."""

  def __init__(self, n: int, worker: int, seed: int):
    self.delta = np.random.default_rng(seed * 1000 + worker).standard_normal(n).astype(np.float32)
    self.params = np.zeros(n, np.float32)
    self.staged = None
    self.applied = None  # the last apply's (wall, this thread's CPU) seconds

  def shards(self, version: int, members: int) -> list[np.ndarray]:
    del version  # (the same Δ every round)
    from lowcomm_jax.runtimes.ray.replica import shard_bounds
    return [self.delta[a:b] for a, b in shard_bounds(self.delta.shape[0], members)]

  def reduce_shard(self, version, index, members, tokens, shards) -> np.ndarray:
    weights = np.asarray(tokens, np.float32)[:, None]
    return (np.stack(shards) * weights).sum(0) / weights.sum()

  def sum_shard(self, version, index, group, tokens, shards, parts=None) -> np.ndarray:
    return (np.stack(shards) * np.asarray(tokens, np.float32)[:, None]).sum(0)

  def divide_piece(self, version, index, groups, members, tokens, pieces) -> np.ndarray:
    return np.sum(pieces, axis=0) / np.float32(sum(tokens))

  def apply_reduced(self, version, members, tokens, losses, reduced) -> str:
    from lowcomm_jax.runtimes.ray.replica import params_hash
    wall, cpu = time.perf_counter(), time.thread_time()
    new = self.params - 0.7 * np.concatenate(reduced)
    self.staged = (version, new)
    digest = params_hash(new)
    self.applied = (time.perf_counter() - wall, time.thread_time() - cpu)
    return digest

  def commit(self, version: int) -> int:
    staged_version, params = self.staged
    assert staged_version == version
    self.params = params
    return version + 1


class RigMember:
  """A member: its replica, its mailbox, and the runtime's one entry point per collective
  (as WorkerProcess hosts it: `exchange`, with `deliver` and `abort` for its peers)."""

  def __init__(self, worker: int, n: int, seed: int, transport: str):
    import ray
    from lowcomm_jax.runtimes.ray import forms
    self.worker, self.forms = worker, forms
    self.replica = RigReplica(n, worker, seed)
    self.mailbox = forms.Mailbox()
    self.postbox = (forms.Postbox(self.mailbox, ray.util.get_node_ip_address())
                    if transport == "sockets" else None)

  def ready(self):
    return None if self.postbox is None else self.postbox.address

  def exchange(self, message: dict) -> dict:
    import ray
    form = self.forms.get(message["form"])
    transport = self.forms.transport_for(message, self.postbox, ray)
    out = self.forms.take_part(self.worker, message, self.mailbox, transport,
                               lambda ex: form.member(self.replica, ex, message),
                               lambda: None)
    return {**out, "applied": self.replica.applied}

  def deliver(self, tag, sender, box) -> None:
    self.mailbox.put(tuple(tag), sender, box)

  def abort(self, version, attempt) -> None:
    self.mailbox.abort(version, attempt)

  def commit(self, version: int) -> int:
    return self.replica.commit(version)


def drive(workers: int, n: int, rounds: int, seed: int, mbps: float, transport: str,
          form: str) -> None:
  """The driver (in node 0): W members on nodes 1..W, rounds + 1 rounds; a JSON line per
  counted round on stdout."""
  import ray
  ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
  remote = ray.remote(num_cpus=0, max_concurrency=8)(RigMember)
  actors = [remote.options(resources={f"node{w + 1}": 0.01}).remote(w, n, seed, transport)
            for w in range(workers)]
  addresses = ray.get([a.ready.remote() for a in actors])
  members = list(range(workers))
  handles = dict(zip(members, actors))
  for version in range(rounds + 1):
    cpu, began, wall = time.process_time(), time.perf_counter(), time.time()
    common = {"form": form, "kind": "mean", "version": version, "attempt": version + 1,
              "members": members, "handles": handles, "timeout_s": 600.0, "crash": None,
              "tokens": [1.0] * workers, "losses": [0.0] * workers, "own": version}
    if transport == "sockets":
      common["addresses"] = dict(zip(members, addresses))
    outcome = ray.get([a.exchange.remote(common) for a in actors])
    staged = time.perf_counter()
    hashes = {o.get("hash") for o in outcome}
    assert len(hashes) == 1 and None not in hashes, outcome
    ray.get([a.commit.remote(version) for a in actors])
    sync = time.perf_counter() - began
    if version:
      ring = ring_seconds(workers, n, mbps)
      print(json.dumps({"workers": workers, "n": n, "mbps": mbps, "seed": seed,
                        "transport": transport, "form": form,
                        "round": version, "sync_s": round(sync, 4),
                        "staged_s": round(staged - began, 4), "ring_s": round(ring, 4),
                        "ratio": round(sync / ring, 4),
                        "driver_cpu_s": round(time.process_time() - cpu, 4),
                        "sent_per_member": outcome[0]["sent"],
                        # each phase's end, the last member's, from the driver's first message
                        "phases_s": {k: round(max(o["moments"][k] for o in outcome) - wall, 4)
                                     for k in ("began", "scattered", "reduced", "staged")},
                        # each member's own tail: its all-gather's end to its staged θ'
                        "tails_s": [round(o["moments"]["staged"] - o["moments"]["reduced"], 4)
                                    for o in outcome],
                        "applied": [o["applied"] for o in outcome]}),
            flush=True)


def run(workers_list, n: int, mbps: float, runs: int, rounds: int, out: pathlib.Path,
        queue_ms: float, transport: str, form: str, modem: bool) -> None:
  """Each W: links for W + 1 nodes (queues of `queue_ms`), a Ray cluster over them, `runs`
  runs of the driver; each counted round a line of out/results.jsonl, with the nodes'
  kernel byte counts."""
  import real_links
  out.mkdir(parents=True, exist_ok=True)
  results = out / "results.jsonl"
  for workers in workers_list:
    with real_links.Links(workers + 1, mbps, queue_ms=queue_ms, modem=modem,
                          acks_first=modem) as links:
      env = dict(real_links.ray_env(), RAY_ADDRESS=links.start_ray())
      for seed in range(runs):
        before = links.link_bytes()
        driver = links.run(0, [sys.executable, __file__, "--drive", str(workers), "--n", str(n),
                               "--rounds", str(rounds), "--seed", str(seed), "--mbps",
                               str(mbps), "--transport", transport, "--form", form],
                              env=env, stdout=subprocess.PIPE, text=True)
        lines, _ = driver.communicate(timeout=3600)
        if driver.returncode:
          raise RuntimeError(f"the rig's driver failed at W={workers} (rc {driver.returncode})")
        after = links.link_bytes()
        moved = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]
        with results.open("a") as f:
          for line in lines.splitlines():
            if line.startswith("{"):
              row = {**json.loads(line), "queue_ms": queue_ms, "modem": modem}
              # the kernel's counts over the whole run (rounds + 1 rounds, and start-up):
              # the driver's node, and the members' mean, per round
              row["node_bytes_per_round"] = {
                  "driver": [x / (rounds + 1) for x in moved[0]],
                  "member_mean": [statistics.mean(m[k] for m in moved[1:]) / (rounds + 1)
                                  for k in (0, 1)]}
              f.write(json.dumps(row) + "\n")
              print(line, flush=True)


def report(out: pathlib.Path) -> str:
  rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
  by_w = {}
  for r in rows:
    link = "modem, ACKs first" if r.get("modem") else "node's NIC"
    by_w.setdefault((link, r.get("form", "direct"), r.get("transport", "objects"),
                     r.get("queue_ms", 200.0), r["workers"]), []).append(r)
  lines = ["| link shaped at | form | transport | queue ms | W | rounds | ring's bytes s | sync s (mean ± sd) | sync / ring: mean (min–max) | "
           "exchange / ring: mean (min–max) | "
           "driver CPU s a round | a member's link MB a round (out, in) | simulator (auto) s | "
           "real / simulated (min–max), rounds within ±15% |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  fits = {}
  for key in sorted(by_w):
    link, form, transport, queue, w = key
    rs = by_w[key]
    ratios = [r["ratio"] for r in rs]
    # the exchange alone: to the last member's end of its all-gather (what follows, each
    # member's outer step and hash, is compute on the machine's shared cores)
    exchange = [r["phases_s"]["reduced"] / r["ring_s"] for r in rs]
    syncs = [r["sync_s"] for r in rs]
    cpu = statistics.mean(r["driver_cpu_s"] for r in rs)
    fits.setdefault(key[:-1], []).append((w, cpu))
    moved = rs[0]["node_bytes_per_round"]["member_mean"]
    lines.append(f"| {link} | {form} | {transport} | {queue:g} | {w} | {len(rs)} | {rs[0]['ring_s']:.2f} | {statistics.mean(syncs):.2f} ± "
                 f"{statistics.stdev(syncs) if len(syncs) > 1 else 0:.2f} | "
                 f"{statistics.mean(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f}) | "
                 f"{statistics.mean(exchange):.3f} ({min(exchange):.3f}–{max(exchange):.3f}) | "
                 f"{cpu:.4f} | {moved[0] / 1e6:.2f}, {moved[1] / 1e6:.2f} | "
                 + _against_simulator(w, rs[0]["n"], rs[0]["mbps"], syncs))
  lines += _tails(rows)
  for (link, form, transport, queue), points in fits.items():
    if len(points) > 2:
      ws, cpus = zip(*points)
      slope, intercept = np.polyfit(ws, cpus, 1)
      quad = np.polyfit(ws, cpus, 2)
      lines.append(f"\n{link}, {form}, {transport}, queue {queue:g} ms: the driver's CPU a round, least squares over W: "
                   f"{intercept:.4f} + {slope:.5f}·W s (a quadratic fit's W² term: "
                   f"{quad[0]:.2e} s)")
  return "\n".join(lines)


def _tails(rows: list[dict]) -> list[str]:
  """Per W, what follows the exchange (rows that recorded it): the round's longest member
  tail (its all-gather's end to its staged θ') and a member's apply CPU seconds."""
  by_w = {}
  for r in rows:
    if "tails_s" in r:
      by_w.setdefault(r["workers"], []).append(r)
  if not by_w:
    return []
  out = ["", "| W | a member's tail, the round's longest (min–max) s | a member's apply CPU s "
         "(mean) |", "|---|---|---|"]
  for w, rs in sorted(by_w.items()):
    longest = [max(r["tails_s"]) for r in rs]
    cpu = statistics.mean(cpu for r in rs for _, cpu in r["applied"])
    out.append(f"| {w} | {min(longest):.3f}–{max(longest):.3f} | {cpu:.3f} |")
  return out


def _against_simulator(workers: int, n: int, mbps: float, syncs: list[float]) -> str:
  predicted, form = simulated(workers, n, mbps)
  ratios = [x / predicted for x in syncs]
  within = sum(abs(x - 1) <= 0.15 for x in ratios)
  return (f"{predicted:.2f} ({form}) | {min(ratios):.3f}–{max(ratios):.3f}, "
          f"{within} of {len(ratios)} |")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16])
  p.add_argument("--mbps", type=float, default=20.0, help="every node's link, each way")
  p.add_argument("--queue_ms", type=float, nargs="+", default=[20.0, 200.0],
                 help="each link's queue in ms of its traffic; a set of runs per value")
  p.add_argument("--n", type=int, default=0,
                 help="floats in Δ (0: the ring's bytes take 5 s at W = 2)")
  p.add_argument("--transport", nargs="+", choices=["sockets", "objects"],
                 default=["sockets"], help="ray.transport: a set of runs per value")
  p.add_argument("--form", nargs="+", choices=["direct", "ring"], default=["ring"],
                 help="the collective form: a set of runs per value")
  p.add_argument("--modem", action="store_true",
                 help="links shaped in a box beside each node, ACKs first (real_links.Links)")
  p.add_argument("--runs", type=int, default=3)
  p.add_argument("--rounds", type=int, default=3, help="counted rounds a run (one more warms up)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", type=pathlib.Path)
  p.add_argument("--report", type=pathlib.Path)
  p.add_argument("--drive", type=int, help=argparse.SUPPRESS)  # (the driver, in node 0)
  a = p.parse_args()
  n = a.n or int(5.0 * a.mbps * 1e6 / 8 / 4)  # W = 2: 2·(1/2)·4N bytes in 5 s
  if a.drive:
    drive(a.drive, n, a.rounds, a.seed, a.mbps, a.transport[0], a.form[0])
  elif a.report:
    print(report(a.report))
  else:
    for form in a.form:
      for transport in a.transport:
        for queue_ms in a.queue_ms:
          run(a.workers, n, a.mbps, a.runs, a.rounds, a.out, queue_ms, transport, form,
              a.modem)
    print(report(a.out))


if __name__ == "__main__":
  main()
