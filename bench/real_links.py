"""Real processes over real slow links on one machine (issue 54, part 1: the links).

Each node is a network namespace joined to a bridge in the root namespace by a veth pair.
Its NIC is rate-limited both ways with `tc`'s token bucket (`tbf`): egress inside the
namespace is the node's uplink, egress on the bridge side its downlink. Addresses come from
a private test range (a /24 of 10.213.0.0/16 per run tag) and nothing is routed off the
machine. The
kernel here has no `netem`, so links add no delay: at these payloads (MBs over 10-100 Mb/s)
a transfer's time is its bytes over the rate, and 10-150 ms of latency would be a few
percent of it.

Everything made is named with one run tag (`lc<tag>...`), and torn down on exit, on
Ctrl-C, on SIGTERM and on error: the namespaces (their veth ends and every process still
running in them go with them), the bridge side's veths and the bridge. `leftovers()` lists
anything of the tag still there.

  python bench/real_links.py --nodes 2 --mbps 80 -- CMD ...   # CMD runs with the links up;
                                                              # node i is NODE<i> in its env
  python bench/real_links.py --nodes 2 --mbps 80 --probe 10   # time 10 MB node 0 -> node 1
  python bench/real_links.py --mbps 50 --throughput 0.1 1 3 10 30   # Ray objects of those MB
      # from node 0 to node 1: the fraction of line rate Ray's transport uses
  python bench/real_links.py --nodes 3 --ray -- python my_driver.py   # a Ray cluster over
      # the links: the head in node 0, a raylet in each other node, each offering the custom
      # resource node<i>; the command runs in node 0 with RAY_ADDRESS set

Ray runs inside the namespaces only, so tearing them down stops it: `ray stop` is never
called, because it would kill every Ray on the machine. Its token authentication is off
(`RAY_AUTH_MODE=disabled`): `ray start` turns it on by default, and nodes in other
namespaces then fail to join.

Needs root and the `ip` and `tc` tools (iproute2); it refuses in one line otherwise.
"""

import argparse
import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

SUBNET = "10.213"  # a private test range: 10.213.<k>.<i+1> per node, .254 the bridge


class LinksError(RuntimeError):
  """The machine cannot build the links (not root, no iproute2, no namespaces)."""


def preflight() -> None:
  """Raises LinksError, one line naming what is missing, unless links can be built here."""
  if os.geteuid() != 0:
    raise LinksError("bench/real_links.py needs root (network namespaces and tc); "
                     "run it as root or with sudo")
  missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
  if missing:
    raise LinksError(f"bench/real_links.py needs {' and '.join(missing)} (iproute2): "
                     "apt-get install iproute2")
  probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
  if probe.returncode:
    raise LinksError(f"bench/real_links.py: `ip netns` does not work here: "
                     f"{probe.stderr.strip()}")


def _run(*args: str) -> None:
  done = subprocess.run(args, capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f"`{' '.join(args)}` failed: {done.stderr.strip()}")


def tbf(device: str, mbps: float, namespace: str | None = None,
        queue_ms: float = 200.0) -> list[str]:
  """The `tc` command that limits `device`'s egress to `mbps` (a bucket of 10 ms of
  traffic, at least 32 KiB: tbf needs one timer tick's worth, and a small bucket starves TCP
  at high rates), queueing at most `queue_ms` of traffic before it drops. The queue is one
  FIFO for everything the node sends (this kernel has tbf and pfifo, no fq_codel), so a
  node's ACKs wait behind its data: at 200 ms, raw TCP both ways at once over a 20 Mb/s
  link moved 6.25 MB in 2.6 s one way and 3.5–3.7 s the other (2.6 s alone); at 20 ms,
  2.6–2.9 s both (BENCHMARKS, issue 70)."""
  burst = max(32 * 1024, int(mbps * 1e6 / 8 / 100))
  prefix = ["ip", "netns", "exec", namespace] if namespace else []
  return prefix + ["tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate",
                   f"{mbps}mbit", "burst", str(burst), "latency", f"{queue_ms:g}ms"]


def ack_first(device: str, mbps: float, namespace: str | None = None,
              queue_ms: float = 200.0) -> list[list[str]]:
  """The `tc` commands that limit `device`'s egress to `mbps` as `tbf` does, but send pure
  ACKs (IP packets under 128 bytes) ahead of the queued data (htb, two classes; a u32
  filter on the IP total length), as routers with ACK priority do: a node's ACKs for what
  it receives no longer wait behind what it sends. The data's FIFO holds `queue_ms`."""
  prefix = ["ip", "netns", "exec", namespace] if namespace else []
  rate = f"{mbps}mbit"
  limit = max(16 * 1024, int(mbps * 1e6 / 8 * queue_ms / 1000))
  tc = prefix + ["tc"]
  return [tc + ["qdisc", "replace", "dev", device, "root", "handle", "1:", "htb", "default", "20",
                "r2q", "1000"],
          tc + ["class", "add", "dev", device, "parent", "1:", "classid", "1:1", "htb", "rate",
                rate, "ceil", rate],
          tc + ["class", "add", "dev", device, "parent", "1:1", "classid", "1:10", "htb", "rate",
                f"{mbps / 10}mbit", "ceil", rate, "prio", "0"],
          tc + ["class", "add", "dev", device, "parent", "1:1", "classid", "1:20", "htb", "rate",
                f"{mbps * 9 / 10}mbit", "ceil", rate, "prio", "1"],
          tc + ["qdisc", "add", "dev", device, "parent", "1:20", "handle", "20:", "bfifo", "limit",
                str(limit)],
          tc + ["filter", "add", "dev", device, "parent", "1:", "protocol", "ip", "prio", "1",
                "u32", "match", "u16", "0x0000", "0xff80", "at", "2", "flowid", "1:10"]]


class Links:
  """`nodes` namespaces behind links of `mbps` each way (a number, or one per node).

      with Links(2, 80) as links:
        links.run(0, ["python", "-c", "..."])   # in node 0's namespace
        links.address(1)                        # node 1's address
  """

  def __init__(self, nodes: int, mbps, *, tag: str | None = None, subnet: str | None = None,
               regions=None, region_mbps=None, queue_ms: float = 200.0, modem: bool = False,
               acks_first: bool = False, idle_restart: bool = True):
    """`mbps`: every node's NIC, each way (a number, or one per node). `regions`: each
    node's region (None: every node on the one bridge); `region_mbps`: each region's uplink
    and downlink, shared by every transfer between it and the other regions. `queue_ms`:
    each link's queue, in ms of its traffic (`tbf`). `modem`: each node's link is limited in
    a box of its own between the node and the bridge (a namespace bridging two veths), as a
    home router or an ISP's line is, rather than at the node's own NIC: the node's TCP then
    meets the queue and its drops as a router's, not as its own qdisc's back-pressure."""
    if nodes < 1 or nodes > 200:
      raise ValueError(f"nodes={nodes}: use 1 to 200")
    self.nodes = nodes
    self.mbps = list(mbps) if isinstance(mbps, (list, tuple)) else [float(mbps)] * nodes
    if len(self.mbps) != nodes or min(self.mbps) <= 0:
      raise ValueError(f"mbps={mbps}: one positive rate, or one per node ({nodes})")
    self.regions = list(regions) if regions is not None else None
    self.region_mbps = list(region_mbps) if region_mbps is not None else []
    self.queue_ms, self.modem, self.acks_first = queue_ms, modem, acks_first
    # False: the nodes' TCP keeps its window across idle spells (the kernel's
    # tcp_slow_start_after_idle=0, per namespace): a diagnosis of a round's fixed cost
    self.idle_restart = idle_restart
    if self.regions is not None and (
        len(self.regions) != nodes or min(self.regions) < 0
        or max(self.regions) >= len(self.region_mbps) or min(self.region_mbps) <= 0):
      raise ValueError(f"regions={regions}, region_mbps={region_mbps}: one region per node "
                       f"({nodes}), each with a positive uplink rate")
    self.tag = tag or f"{os.getpid() % 100000:05d}"  # interface names: 15 characters at most
    self.bridge = f"lc{self.tag}b"
    # One /24 per tag, so that runs side by side (a test suite's workers) do not share one.
    self.subnet = subnet or f"{SUBNET}.{int(self.tag) % 250}"
    self._up = False

  def namespace(self, i: int) -> str:
    return f"lc{self.tag}n{i}"

  def region_namespace(self, k: int) -> str:
    """Region k's switch: a bridge of its nodes' links and its uplink to the core bridge."""
    return f"lc{self.tag}r{k}"

  def modem_namespace(self, i: int) -> str:
    return f"lc{self.tag}m{i}"

  def _host_veth(self, i: int) -> str:
    return f"lc{self.tag}v{i}"

  def address(self, i: int) -> str:
    return f"{self.subnet}.{i + 1}"

  def up(self) -> "Links":
    """One flat subnet on bridges (no routing): a node's link ends on the core bridge, or on
    its region's bridge, whose uplink ends on the core bridge. Each link is limited both
    ways: egress at each end."""
    preflight()
    self._up = True  # from here on, down() cleans up whatever part was made
    _run("ip", "link", "add", self.bridge, "type", "bridge")
    _run("ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
    _run("ip", "link", "set", self.bridge, "up")
    for k, mbps in enumerate(self.region_mbps if self.regions is not None else []):
      ns, up = self.region_namespace(k), f"lc{self.tag}u{k}"
      _run("ip", "netns", "add", ns)
      _run("ip", "-n", ns, "link", "add", "name", "sw", "type", "bridge")  # ('br' would parse
      _run("ip", "-n", ns, "link", "set", "sw", "up")  # as an abbreviated keyword)
      _run("ip", "link", "add", up, "type", "veth", "peer", "name", f"{up}p")
      _run("ip", "link", "set", f"{up}p", "netns", ns)
      _run("ip", "-n", ns, "link", "set", "dev", f"{up}p", "name", "uplink")
      _run("ip", "-n", ns, "link", "set", "dev", "uplink", "master", "sw")
      _run("ip", "-n", ns, "link", "set", "dev", "uplink", "up")
      _run("ip", "link", "set", up, "master", self.bridge)
      _run("ip", "link", "set", up, "up")
      _run(*tbf("uplink", mbps, ns, self.queue_ms))  # the region's uplink
      _run(*tbf(up, mbps, queue_ms=self.queue_ms))  # its downlink
    for i in range(self.nodes):
      ns, veth = self.namespace(i), self._host_veth(i)
      switch = self.region_namespace(self.regions[i]) if self.regions is not None else None
      on_switch = ["ip", "-n", switch] if switch else ["ip"]
      _run("ip", "netns", "add", ns)
      _run("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
      if self.modem:  # node's eth0 -> lan | the modem's bridge | wan -> veth (on the switch)
        box, lan = self.modem_namespace(i), f"lc{self.tag}l{i}"
        _run("ip", "netns", "add", box)
        _run("ip", "-n", box, "link", "add", "name", "sw", "type", "bridge")
        _run("ip", "-n", box, "link", "set", "sw", "up")
        _run("ip", "link", "add", lan, "type", "veth", "peer", "name", f"{lan}p")
        for end, name in ((lan, "lan"), (f"{veth}p", "wan")):
          _run("ip", "link", "set", end, "netns", box)
          _run("ip", "-n", box, "link", "set", "dev", end, "name", name)
          _run("ip", "-n", box, "link", "set", "dev", name, "master", "sw")
          _run("ip", "-n", box, "link", "set", "dev", name, "up")
        node_end = f"{lan}p"
      else:
        node_end = f"{veth}p"
      _run("ip", "link", "set", node_end, "netns", ns)
      _run("ip", "-n", ns, "link", "set", node_end, "name", "eth0")
      _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
      _run("ip", "-n", ns, "link", "set", "eth0", "up")
      _run("ip", "-n", ns, "link", "set", "lo", "up")
      if not self.idle_restart:
        _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w",
             "net.ipv4.tcp_slow_start_after_idle=0")
      if switch:
        _run("ip", "link", "set", veth, "netns", switch)
      _run(*on_switch, "link", "set", veth, "master", "sw" if switch else self.bridge)
      _run(*on_switch, "link", "set", veth, "up")
      for device, where in self._shaped(i):  # its uplink, then its downlink
        if self.acks_first:
          for command in ack_first(device, self.mbps[i], where, self.queue_ms):
            _run(*command)
        else:
          _run(*tbf(device, self.mbps[i], where, self.queue_ms))
    return self

  def _shaped(self, i: int) -> list[tuple[str, str | None]]:
    """Node i's uplink and downlink: (device, its namespace), each limited on egress."""
    if self.modem:
      return [("wan", self.modem_namespace(i)), ("lan", self.modem_namespace(i))]
    switch = self.region_namespace(self.regions[i]) if self.regions is not None else None
    return [("eth0", self.namespace(i)), (self._host_veth(i), switch)]

  def link_bytes(self) -> list[tuple[int, int]]:
    """Per node, (bytes sent, bytes received) through its link so far, as the kernel's
    `tbf` counters give them (every packet: Ray's data and control, TCP and IP headers)."""
    def sent(device: str, namespace: str | None) -> int:
      where = ["-n", namespace] if namespace else []
      text = subprocess.run(["tc", *where, "-s", "qdisc", "show", "dev", device],
                            capture_output=True, text=True, check=True).stdout
      return int(re.search(r"Sent (\d+) bytes", text)[1])
    return [tuple(sent(device, where) for device, where in self._shaped(i))
            for i in range(self.nodes)]

  def losses(self) -> list[dict]:
    """Per node, so far: the packets its shaped links dropped (`tbf`'s queue full: up, down)
    and its TCP's retransmitted segments and retransmission timeouts (the node's namespace's
    /proc/net/snmp and netstat): where a phase's time beyond its bytes is lost packets."""
    def dropped(device: str, namespace: str | None) -> int:
      where = ["-n", namespace] if namespace else []
      text = subprocess.run(["tc", *where, "-s", "qdisc", "show", "dev", device],
                            capture_output=True, text=True, check=True).stdout
      return sum(int(n) for n in re.findall(r"dropped (\d+)", text))

    def tcp(i: int) -> dict:
      text = subprocess.run(["ip", "netns", "exec", self.namespace(i), "cat",
                             "/proc/net/snmp", "/proc/net/netstat"],
                            capture_output=True, text=True, check=True).stdout.splitlines()
      fields = {}
      for names, values in zip(text[::2], text[1::2]):  # "Tcp: a b ..." then its values
        fields.update(zip(names.split()[1:], values.split()[1:]))
      return {"retrans_segs": int(fields.get("RetransSegs", 0)),
              "timeouts": int(fields.get("TCPTimeouts", 0))}
    return [{"dropped": [dropped(device, where) for device, where in self._shaped(i)], **tcp(i)}
            for i in range(self.nodes)]

  def veth_bytes(self) -> list[tuple[int, int]]:
    """Per node, (bytes sent, bytes received) so far by the bridge side of its veth pair
    (/sys counters: a file read, cheap enough to sample while a run goes, where
    `link_bytes` starts two `tc` processes a node). Links of one region only."""
    if self.regions is not None:  # (with a modem too, the veth's far end is on the bridge)
      raise ValueError("veth_bytes reads the bridge's veths: links of one region only")
    out = []
    for i in range(self.nodes):
      stats = pathlib.Path("/sys/class/net") / self._host_veth(i) / "statistics"
      # the bridge side receives what the node sends, and sends what it receives
      out.append((int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())))
    return out

  def run(self, i: int, command: list[str], **kwargs) -> subprocess.Popen:
    """`command` started in node i's namespace."""
    return subprocess.Popen(["ip", "netns", "exec", self.namespace(i), *command], **kwargs)

  def start_ray(self, port: int = 6379) -> str:
    """A Ray cluster over the links: the head in node 0 (its files under `ray_dir`), a
    raylet in each other node, node i offering the resource `node<i>` and one CPU. Returns
    the head's address."""
    head = f"{self.address(0)}:{port}"
    for i in range(self.nodes):
      where = ([f"--head", f"--port={port}", "--include-dashboard=false",
                f"--temp-dir={self.ray_dir}"] if i == 0 else [f"--address={head}"])
      done = subprocess.run(
          ["ip", "netns", "exec", self.namespace(i), ray_command(), "start", *where,
           f"--node-ip-address={self.address(i)}", "--num-cpus=1",
           f"--resources={{\"node{i}\": 1}}", "--disable-usage-stats"],
          capture_output=True, text=True, env=ray_env())
      if done.returncode:
        raise RuntimeError(f"ray start in node {i} failed: {done.stderr.strip()[-300:]}")
    return head

  @property
  def ray_dir(self) -> str:
    return f"/tmp/lcray{self.tag}"

  def down(self) -> None:
    """Removes everything of this tag; safe to call twice, or after a partial `up`."""
    if not self._up:
      return
    for i in range(self.nodes):
      ns = self.namespace(i)
      deadline = time.monotonic() + 10  # SIGKILL lands asynchronously: wait until none is left
      while (pids := self._pids(ns)) and time.monotonic() < deadline:
        for pid in pids:
          with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
      subprocess.run(["ip", "netns", "del", ns], capture_output=True)
      subprocess.run(["ip", "link", "del", self._host_veth(i)], capture_output=True)
      if self.modem:
        subprocess.run(["ip", "netns", "del", self.modem_namespace(i)], capture_output=True)
    for k in range(len(self.region_mbps) if self.regions is not None else 0):
      # (its bridge and the veths on it with it; the uplink's root end at once, as a
      # namespace's devices go lazily)
      subprocess.run(["ip", "link", "del", f"lc{self.tag}u{k}"], capture_output=True)
      subprocess.run(["ip", "netns", "del", self.region_namespace(k)], capture_output=True)
    subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
    shutil.rmtree(self.ray_dir, ignore_errors=True)
    self._up = False

  @staticmethod
  def _pids(namespace: str) -> list[int]:
    """Live processes in `namespace` (zombies, already dead, left out)."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    live = []
    for pid in listed.stdout.split():
      with contextlib.suppress(OSError):
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state != "Z":
          live.append(int(pid))
    return live

  def leftovers(self) -> list[str]:
    """Namespaces, links and Ray files of this tag that still exist."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    mine = f"lc{self.tag}"
    found = [line.split()[0] for line in names.splitlines() if line.startswith(mine)]
    found += [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()
              if f" {mine}" in line]
    return found + ([self.ray_dir] if os.path.exists(self.ray_dir) else [])

  def __enter__(self) -> "Links":
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so the links come down.
    self._old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
      return self.up()
    except BaseException:
      self.down()
      signal.signal(signal.SIGTERM, self._old_term)
      raise

  def __exit__(self, *exc) -> None:
    try:
      self.down()
    finally:
      signal.signal(signal.SIGTERM, self._old_term)


def ray_command() -> str:
  """The `ray` of the Python running this (beside `sys.executable`: a venv's python called
  without activating the venv has no `ray` on PATH), else PATH's."""
  beside = pathlib.Path(sys.executable).with_name("ray")
  return str(beside) if beside.exists() else "ray"


def ray_env() -> dict:
  """The environment of every Ray process of the links: token authentication off (on by
  default since `ray start` enables it, and a node in another namespace then cannot join)."""
  return dict(os.environ, RAY_AUTH_MODE="disabled", RAY_worker_niceness="0")


def _raise_interrupt(signum, frame):
  raise KeyboardInterrupt(f"signal {signum}")


# A receiver and a sender in plain sockets: what a transfer over the links takes.
_RECEIVE = """
import socket, sys, time
s = socket.create_server(("0.0.0.0", {port}))
print("ready", flush=True)
conn, _ = s.accept()
got, t0 = 0, None
while got < {nbytes}:
  chunk = conn.recv(1 << 20)
  if not chunk:
    break
  t0 = t0 or time.perf_counter()
  got += len(chunk)
print(got, time.perf_counter() - t0, flush=True)
"""
_SEND = """
import socket
c = socket.create_connection(("{host}", {port}))
c.sendall(bytes({nbytes}))
c.close()
"""


def probe(links: Links, src: int, dst: int, nbytes: int, port: int = 47123) -> float:
  """Seconds to move `nbytes` over TCP from node `src` to node `dst`, first byte to last,
  as the receiver sees it."""
  receiver = links.run(dst, [sys.executable, "-c", _RECEIVE.format(port=port, nbytes=nbytes)],
                       stdout=subprocess.PIPE, text=True)
  try:
    assert receiver.stdout.readline().strip() == "ready"
    sender = links.run(src, [sys.executable, "-c", _SEND.format(
        host=links.address(dst), port=port, nbytes=nbytes)])
    sender.wait(timeout=600)
    got, seconds = receiver.stdout.readline().split()
    receiver.wait(timeout=60)
  finally:
    receiver.kill()
  if int(got) != nbytes:
    raise RuntimeError(f"probe: {got} of {nbytes} bytes arrived")
  return float(seconds)


_THROUGHPUT = """
import json, os, sys, time, numpy as np, ray
ray.init(address=os.environ["RAY_ADDRESS"])
make = ray.remote(resources={"node0": 0.01})(lambda n: np.ones(n, np.uint8))
take = ray.remote(resources={"node1": 0.01})(lambda x: int(x.size))
for mb in json.loads(sys.argv[1]):
  for repeat in range(3):
    ref = make.remote(int(mb * 1e6))
    ray.wait([ref])
    t = time.perf_counter()
    assert ray.get(take.remote(ref)) == int(mb * 1e6)
    print(json.dumps({"mb": mb, "repeat": repeat, "seconds": time.perf_counter() - t}),
          flush=True)
"""


def throughput(links: Links, sizes_mb: list[float], mbps: float) -> list[dict]:
  """Each size moved 3 times as a Ray object from node 0 to node 1 (made there, read here:
  the read includes scheduling the reading task), and the fraction of line rate used."""
  env = dict(ray_env(), RAY_ADDRESS=links.start_ray())
  driver = links.run(0, [sys.executable, "-c", _THROUGHPUT, json.dumps(sizes_mb)], env=env,
                     stdout=subprocess.PIPE, text=True)
  out, _ = driver.communicate(timeout=3600)
  if driver.returncode:
    raise RuntimeError(f"the throughput driver failed (rc {driver.returncode})")
  rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
  for r in rows:
    r["line_rate_fraction"] = r["mb"] * 8e6 / (mbps * 1e6) / r["seconds"]
  return rows


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--nodes", type=int, default=2)
  p.add_argument("--mbps", type=float, default=80.0, help="every node's NIC, each way")
  p.add_argument("--regions", type=int, nargs="+", metavar="R",
                 help="each node's region (default: every node on one bridge)")
  p.add_argument("--region_mbps", type=float, nargs="+", metavar="MBPS",
                 help="each region's uplink and downlink")
  p.add_argument("--probe", type=float, help="MB to time from node 0 to node 1, then exit")
  p.add_argument("--probe_to", type=int, default=1, help="the probe's receiving node")
  p.add_argument("--throughput", type=float, nargs="+", metavar="MB",
                 help="Ray objects of these sizes from node 0 to node 1, 3 times each")
  p.add_argument("--ray", action="store_true",
                 help="start a Ray cluster over the links; the command runs in node 0")
  p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD: run with the links up")
  a = p.parse_args()
  try:
    preflight()
  except LinksError as e:
    sys.exit(f"error: {e}")
  with Links(a.nodes, a.mbps, regions=a.regions, region_mbps=a.region_mbps) as links:
    if a.throughput:
      for r in throughput(links, a.throughput, a.mbps):
        print(f"{r['mb']:g} MB: {r['seconds']:.3f} s, {r['line_rate_fraction']:.1%} of "
              f"{a.mbps:g} Mb/s", flush=True)
      return
    if a.probe:
      nbytes = int(a.probe * 1e6)
      seconds = probe(links, 0, a.probe_to, nbytes)
      print(f"{a.probe:g} MB node 0 -> {a.probe_to} in {seconds:.3f} s: "
            f"{nbytes * 8 / 1e6 / seconds:.1f} Mb/s")
      return
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    env = dict(ray_env(), **{f"NODE{i}": links.address(i) for i in range(a.nodes)},
               **{f"NODE{i}_NS": links.namespace(i) for i in range(a.nodes)})
    if a.ray:
      env["RAY_ADDRESS"] = links.start_ray()
      if command:  # the driver beside the head: a Ray driver needs a raylet on its node
        driver = links.run(0, command, env=env)
        sys.exit(driver.wait())
    elif command:
      sys.exit(subprocess.run(command, env=env).returncode)


if __name__ == "__main__":
  main()
