"""The simulator's flow model (sim/flows.py, sim/collectives.py) against hand-computed cases.

Each case is a topology and a set of transfers whose max-min fair times can be worked out
on paper; the model's times must agree within 1%. Prints a table and exits non-zero if a
case does not.

  python bench/network_validation.py [--out results.json]

Where SimGrid's Python bindings are installed (Debian: `apt install python3-simgrid`; PyPI
has no wheel), the flow cases also run in SimGrid's CM02 model (bench/simgrid_flows.py),
and the model must agree with it within 1% too. The collectives are checked by hand only.
"""

import argparse
import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]

from lowcomm_jax.sim import Network, collectives  # noqa: E402
from lowcomm_jax.sim.flows import deliveries  # noqa: E402

GB = 1e9  # bytes
L, B = 0.05, 1e9  # between regions: 50 ms, 1 Gb/s
LI, BI = 1e-4, 100e9  # inside a region (each NIC): 0.1 ms, 100 Gb/s


def _net(worker_regions, **kw):
  args = dict(num_workers=len(worker_regions), regions=max(worker_regions) + 1,
              worker_regions=worker_regions, intra_gbps=BI / 1e9, intra_latency_s=LI,
              inter_gbps=B / 1e9, inter_latency_s=L)
  return Network.build(**{**args, **kw})


def _send(net, start, a, b, nbytes):
  return (start, f"w{a}", net.worker_region[a], f"w{b}", net.worker_region[b], nbytes)


def _server(net, start, a, nbytes):
  """Worker `a` to the server (in the network's server region)."""
  return (start, f"w{a}", net.worker_region[a], "server", net.server_region, nbytes)


def flow_cases():
  """(name, network, transfers, which arrival: an index or 'max', hand-computed seconds)."""
  two = _net((0, 0, 1, 1))
  yield "one flow alone", two, [_send(two, 0, 0, 2, GB)], 0, L + 8 * GB / B
  for k in (2, 4, 16):
    net = _net((0,) * k + (1,) * k)
    yield (f"{k} flows on one link", net, [_send(net, 0, i, k + i, GB) for i in range(k)],
           "max", L + 8 * k * GB / B)
  # 1 GB and 2 GB together: half each for 16 s, then the rest of the larger alone (8 s).
  both = [_send(two, 0, 0, 2, GB), _send(two, 0, 1, 3, 2 * GB)]
  yield "unequal sizes: the first", two, both, 0, L + 16.0
  yield "unequal sizes: the second speeds up", two, both, 1, L + 24.0
  # The second starts 4 s later: the first sent 4 Gb alone, both share the rest.
  yield ("staggered start", two, [_send(two, 0, 0, 2, GB), _send(two, 4.0, 1, 3, 0.5 * GB)],
         0, L + 4.0 + 2 * 4.0)
  # Parking lot: region caps 1 Gb/s, links 10 Gb/s. A long flow 0→1 crosses region 0's
  # uplink and region 1's downlink; a short one shares each (0→2, 3→1): 0.5 Gb/s each.
  lot = _net((0, 1, 2, 3), inter_gbps=10.0, region_gbps=1.0)
  sends = [_send(lot, 0, 0, 1, GB), _send(lot, 0, 0, 2, GB), _send(lot, 0, 3, 1, GB)]
  for i, name in enumerate(("long", "short at the uplink", "short at the downlink")):
    yield f"parking lot: {name}", lot, sends, i, L + 16.0
  # Max-min leftover: region 0's 10 Gb/s uplink; one flow to region 1 over a 1 Gb/s link,
  # two to region 2 over 10 Gb/s: 1, then 4.5 and 4.5 (not 3.33 each).
  gbps = [[100.0, 1.0, 10.0], [1.0, 100.0, 10.0], [10.0, 10.0, 100.0]]
  left = _net((0, 0, 0, 1, 2, 2), inter_gbps=gbps, inter_latency_s=0.0, region_gbps=10.0)
  sends = [_send(left, 0, 0, 3, GB), _send(left, 0, 1, 4, GB), _send(left, 0, 2, 5, GB)]
  yield "leftover: held by its link", left, sends, 0, 8.0
  yield "leftover: the others share the rest", left, sends, 1, 8.0 / 4.5
  # Incast: 16 workers in 4 regions send 1 GB each to a server in a region of its own
  # (downlink 1 Gb/s): 1/16 Gb/s each, 128 s.
  inc = _net(tuple(w // 4 for w in range(16)), server_region=None)
  yield ("incast of 16 into the server's region", inc,
         [_server(inc, 0, w, GB) for w in range(16)], "max", L + 128.0)
  # The same with the server beside region 0's workers: region 0's downlink (1 Gb/s)
  # holds the other 12 to 1/12 Gb/s each; region 0's four share the rest of the server's
  # NIC, (100 − 1) / 4 Gb/s each.
  col = _net(tuple(w // 4 for w in range(16)), server_region=0)
  sends = [_server(col, 0, w, GB) for w in range(16)]
  yield "incast, server in region 0: local", col, sends, 0, LI + 8 * GB / ((BI - B) / 4)
  yield "incast, server in region 0: remote", col, sends, "max", L + 12 * 8.0


def collective_cases():
  """(name, model's seconds, hand-computed seconds): 16 workers in 4 regions, n = 498 MB
  (gpt2_124m's fp32 Δ)."""
  n, placed = 498e6, _net(tuple(w // 4 for w in range(16)))
  yield ("ring all-reduce 4x4", collectives.ring_allreduce_seconds(placed, range(16), n),
         30 * (L + 8 * n / 16 / B))
  inside = 3 * (LI + 8 * n / 4 / BI) + (LI + 8 * n / 4 / (BI / 3))
  yield ("hierarchical all-reduce 4x4",
         collectives.hierarchical_allreduce_seconds(placed, range(16), n),
         2 * inside + 6 * (L + 8 * n / 4 / B))
  m = 1e6  # compressed payloads: all-gathered
  yield ("ring all-gather 4x4", collectives.ring_allgather_seconds(placed, range(16), m),
         15 * (L + 8 * m / B))
  yield ("hierarchical all-gather 4x4",
         collectives.hierarchical_allgather_seconds(placed, range(16), m),
         (LI + 8 * 3 * m / BI) + 3 * (L + 8 * 4 * m / B) + (LI + 8 * 3 * 15 * m / BI))


def _pick(arrivals, which):
  return max(arrivals) if which == "max" else arrivals[which]


def _simgrid_python() -> str | None:
  """A Python with SimGrid's bindings: this one, or Debian's python3-simgrid."""
  for python in (sys.executable, "/usr/bin/python3"):
    probe = subprocess.run([python, "-c", "import simgrid"], capture_output=True)
    if probe.returncode == 0:
      return python
  return None


def simgrid_arrivals(python: str, net: Network, transfers) -> list[float]:
  nodes = {src: ra for _, src, ra, _, _, _ in transfers}
  nodes.update({dst: rb for _, _, _, dst, rb, _ in transfers})
  case = {"nodes": nodes, "bandwidth_bps": (net.bandwidth_bps / 8).tolist(),
          "latency_s": net.latency_s.tolist(), "region_bps": (net.region_bps / 8).tolist(),
          "transfers": [(start, src, dst, nbytes * net.bytes_scale)
                        for start, src, _, dst, _, nbytes in transfers]}
  out = subprocess.run([python, str(REPO / "bench" / "simgrid_flows.py")], check=True,
                       input=json.dumps(case), capture_output=True, text=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", type=pathlib.Path)
  args = p.parse_args()
  python = _simgrid_python()
  rows = []
  for name, net, transfers, which, want in flow_cases():
    row = {"case": name, "model_s": _pick(deliveries(net, transfers), which), "hand_s": want}
    if python:
      row["simgrid_s"] = _pick(simgrid_arrivals(python, net, transfers), which)
    rows.append(row)
  rows += [{"case": name, "model_s": got, "hand_s": want}
           for name, got, want in collective_cases()]
  for r in rows:
    r["rel_error"] = abs(r["model_s"] - r["hand_s"]) / r["hand_s"]
    if "simgrid_s" in r:
      r["rel_error_simgrid"] = abs(r["model_s"] - r["simgrid_s"]) / r["simgrid_s"]
  print("| case | model s | hand s | rel. error | SimGrid s | rel. error |\n"
        "|---|---|---|---|---|---|")
  for r in rows:
    sg = (f"{r['simgrid_s']:.6g} | {r['rel_error_simgrid']:.1e}" if "simgrid_s" in r
          else "| ")
    print(f"| {r['case']} | {r['model_s']:.6g} | {r['hand_s']:.6g} | {r['rel_error']:.1e} "
          f"| {sg} |")
  bad = [r["case"] for r in rows
         if max(r["rel_error"], r.get("rel_error_simgrid", 0.0)) > 0.01]
  if args.out:
    args.out.write_text(json.dumps(rows, indent=1))
  print(f"{len(rows) - len(bad)} of {len(rows)} cases within 1%"
        + ("" if python else " (SimGrid not installed: hand cases only)"))
  if bad:
    sys.exit(f"outside 1%: {bad}")


if __name__ == "__main__":
  main()
