"""Arrival times of a set of transfers in SimGrid, for bench/network_validation.py.

Reads a case (JSON on stdin: the network as the simulator describes it and the transfers)
and prints the arrival times (JSON list). Only the standard library and SimGrid's Python
bindings (Debian: python3-simgrid), so it runs under whichever Python has them.

The platform mirrors sim/network.py: each node has a split-duplex NIC (its region's
intra-region bandwidth), each region a split-duplex uplink/downlink, each ordered pair of
regions its own link carrying the pair's latency. SimGrid runs its CM02 model (max-min
sharing, no TCP window bound, no latency or bandwidth correction factors), the model the
simulator's flows follow.
"""

import json
import sys
import tempfile

import simgrid


def platform(case: dict) -> str:
  regions, nodes = len(case["bandwidth_bps"]), case["nodes"]
  bw, lat = case["bandwidth_bps"], case["latency_s"]
  out = ['<?xml version="1.0"?>', '<!DOCTYPE platform SYSTEM "https://simgrid.org/simgrid.dtd">',
         '<platform version="4.1">', '<zone id="world" routing="Full">']
  for name, region in nodes.items():
    out.append(f'<host id="{name}" speed="1Gf"/>')
    out.append(f'<link id="nic_{name}" bandwidth="{bw[region][region]}Bps" latency="0s" '
               'sharing_policy="SPLITDUPLEX"/>')
  for r in range(regions):
    out.append(f'<link id="region{r}" bandwidth="{case["region_bps"][r]}Bps" latency="0s" '
               'sharing_policy="SPLITDUPLEX"/>')
    for s in range(regions):
      if r != s:
        out.append(f'<link id="link{r}_{s}" bandwidth="{bw[r][s]}Bps" '
                   f'latency="{lat[r][s]}s"/>')
  # An intra-region route's latency goes on a per-pair link of its own (no bandwidth limit).
  for r in range(regions):
    out.append(f'<link id="intra{r}" bandwidth="1e18Bps" latency="{lat[r][r]}s" '
               'sharing_policy="FATPIPE"/>')
  for a, ra in nodes.items():
    for b, rb in nodes.items():
      if a == b:
        continue
      links = [f'<link_ctn id="nic_{a}" direction="UP"/>']
      if ra == rb:
        links.append(f'<link_ctn id="intra{ra}"/>')
      else:
        links += [f'<link_ctn id="region{ra}" direction="UP"/>', f'<link_ctn id="link{ra}_{rb}"/>',
                  f'<link_ctn id="region{rb}" direction="DOWN"/>']
      links.append(f'<link_ctn id="nic_{b}" direction="DOWN"/>')
      out.append(f'<route src="{a}" dst="{b}" symmetrical="NO">{"".join(links)}</route>')
  out += ["</zone>", "</platform>"]
  return "\n".join(out)


def main() -> None:
  case = json.load(sys.stdin)
  engine = simgrid.Engine(["simgrid_flows", "--cfg=network/model:CM02",
                           "--cfg=network/TCP-gamma:0", "--cfg=network/crosstraffic:0",
                           "--log=root.thresh:critical"])
  with tempfile.NamedTemporaryFile("w", suffix=".xml") as f:
    f.write(platform(case))
    f.flush()
    engine.load_platform(f.name)
  arrived = [None] * len(case["transfers"])

  def sender(box, start, nbytes):
    if start > 0:
      simgrid.this_actor.sleep_for(start)
    simgrid.Mailbox.by_name(box).put("payload", round(nbytes))

  def receiver(box, i):
    simgrid.Mailbox.by_name(box).get()
    arrived[i] = simgrid.Engine.clock

  for i, (start, src, dst, nbytes) in enumerate(case["transfers"]):
    simgrid.Actor.create(f"send{i}", simgrid.Host.by_name(src), sender, f"box{i}", start, nbytes)
    simgrid.Actor.create(f"recv{i}", simgrid.Host.by_name(dst), receiver, f"box{i}", i)
  engine.run()
  print(json.dumps(arrived))


if __name__ == "__main__":
  main()
