"""The simulator's flow model (sim/flows.py, sim/collectives.py) against hand-computed cases.

Each case is a topology and a set of transfers whose max-min fair times can be worked out
on paper; the model's times must agree within 1%. Prints a table and exits non-zero if a
case does not.

  python bench/network_validation.py [--out results.json]

SimGrid (its flow model, which this one follows) would be the other reference; there is no
wheel for it on PyPI and its source build is not attempted here (BUILD_NOTES.md).
"""

import argparse
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

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


def cases():
  """(name, model's seconds, hand-computed seconds)."""
  two = _net((0, 0, 1, 1))
  yield "one flow alone", deliveries(two, [_send(two, 0, 0, 2, GB)])[0], L + 8 * GB / B
  for k in (2, 4, 16):
    net = _net((0,) * k + (1,) * k)
    sends = [_send(net, 0, i, k + i, GB) for i in range(k)]
    yield f"{k} flows on one link", max(deliveries(net, sends)), L + 8 * k * GB / B
  # 1 GB and 2 GB together: half each for 16 s, then the rest of the larger alone (8 s).
  got = deliveries(two, [_send(two, 0, 0, 2, GB), _send(two, 0, 1, 3, 2 * GB)])
  yield "unequal sizes: the first", got[0], L + 16.0
  yield "unequal sizes: the second speeds up", got[1], L + 24.0
  # The second starts 4 s later: the first sent 4 Gb alone, both share the rest.
  got = deliveries(two, [_send(two, 0, 0, 2, GB), _send(two, 4.0, 1, 3, 0.5 * GB)])
  yield "staggered start", got[0], L + 4.0 + 2 * 4.0
  # Parking lot: region caps 1 Gb/s, links 10 Gb/s. A long flow 0→1 crosses region 0's
  # uplink and region 1's downlink; a short one shares each (0→2, 3→1): 0.5 Gb/s each.
  lot = _net((0, 1, 2, 3), inter_gbps=10.0, region_gbps=1.0)
  got = deliveries(lot, [_send(lot, 0, 0, 1, GB), _send(lot, 0, 0, 2, GB),
                         _send(lot, 0, 3, 1, GB)])
  for name, t in zip(("long", "short at the uplink", "short at the downlink"), got):
    yield f"parking lot: {name}", t, L + 16.0
  # Max-min leftover: region 0's 10 Gb/s uplink; one flow to region 1 over a 1 Gb/s link,
  # two to region 2 over 10 Gb/s: 1, then 4.5 and 4.5 (not 3.33 each).
  gbps = [[100.0, 1.0, 10.0], [1.0, 100.0, 10.0], [10.0, 10.0, 100.0]]
  left = _net((0, 0, 0, 1, 2, 2), inter_gbps=gbps, inter_latency_s=0.0, region_gbps=10.0)
  got = deliveries(left, [_send(left, 0, 0, 3, GB), _send(left, 0, 1, 4, GB),
                          _send(left, 0, 2, 5, GB)])
  yield "leftover: held by its link", got[0], 8.0
  yield "leftover: the others share the rest", got[1], 8.0 / 4.5 + 8.0 * (1 - 4.5 / 4.5)
  # Incast: 16 workers in 4 regions send 1 GB each to a server in a region of its own
  # (downlink 1 Gb/s): 1/16 Gb/s each, 128 s.
  inc = _net(tuple(w // 4 for w in range(16)), server_region=None)
  got = deliveries(inc, [_server(inc, 0, w, GB) for w in range(16)])
  yield "incast of 16 into the server's region", max(got), L + 128.0
  # The same with the server beside region 0's workers: region 0's downlink (1 Gb/s)
  # holds the other 12 to 1/12 Gb/s each; region 0's four share the rest of the server's
  # NIC, (100 − 1) / 4 Gb/s each.
  col = _net(tuple(w // 4 for w in range(16)), server_region=0)
  got = deliveries(col, [_server(col, 0, w, GB) for w in range(16)])
  yield "incast, server in region 0: local", max(got[:4]), LI + 8 * GB / ((BI - B) / 4)
  yield "incast, server in region 0: remote", max(got[4:]), L + 12 * 8.0
  # Collectives: 16 workers, 4 regions, n = 498 MB (gpt2_124m's fp32 Δ).
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


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", type=pathlib.Path)
  args = p.parse_args()
  rows = [{"case": name, "model_s": got, "hand_s": want, "rel_error": abs(got - want) / want}
          for name, got, want in cases()]
  print("| case | model s | hand s | rel. error |\n|---|---|---|---|")
  for r in rows:
    print(f"| {r['case']} | {r['model_s']:.6g} | {r['hand_s']:.6g} | {r['rel_error']:.1e} |")
  bad = [r["case"] for r in rows if r["rel_error"] > 0.01]
  if args.out:
    args.out.write_text(json.dumps(rows, indent=1))
  print(f"{len(rows) - len(bad)} of {len(rows)} cases within 1%")
  if bad:
    sys.exit(f"outside 1%: {bad}")


if __name__ == "__main__":
  main()
