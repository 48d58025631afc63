"""What each recipe's sync costs a gpt2_124m step over a slow link, by the simulator's own
network model (sim/collectives.py), for README's recipe table.

Each recipe's codec is built from its config and sized on gpt2_124m's parameters (exact
wire bytes: `Codec.payload_bytes`, shapes only, nothing allocated). As the simulator does,
a dense payload is all-reduced and a compressed one all-gathered, over `--workers` workers
whose NICs run at `--gbps`, in one region, without latency, by the faster of ring and
hierarchical. A local method syncs once every H steps, so its cost per step is its
collective's time over H. `--step_ms` is the step it is compared with (38 ms: gpt2_124m at
batch 16 × 1024 on an H200, BENCHMARKS.md issue 28).

  python bench/recipe_sync.py [--workers 4] [--gbps 1] [--step_ms 38]
  python bench/recipe_sync.py --by_workers 2 8 16 64 [--gbps 1]
      # each codec's sync against W (issue 71): all-gathered, and for the quantizers
      # reduce-scattered (compress.reduce='scatter'), by the same model's direct exchange
"""

import argparse
import pathlib
import runpy

import jax
from flax import nnx

from lowcomm_jax.compress import make_codec
from lowcomm_jax.model.gpt import GPT
from lowcomm_jax.model.presets import get_preset
from lowcomm_jax.sim import collectives
from lowcomm_jax.sim.network import Network

REPO = pathlib.Path(__file__).resolve().parents[1]
RECIPES = ("recipe_ddp", "recipe_10x", "recipe_100x", "recipe_500x", "recipe_1000x")


def gpt2_shapes():
  """gpt2_124m's parameter tree as shapes (vocabulary 50304, as the GPT-2 tokenizer gives)."""
  cfg = get_preset("gpt2_124m", tokenizer_vocab=50257)
  model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def rows(workers: int, gbps: float, step_s: float) -> list[dict]:
  like = gpt2_shapes()
  dense = sum(x.size * 4 for x in jax.tree.leaves(like))  # fp32
  net = Network.build(num_workers=workers, regions=1, intra_gbps=gbps, intra_latency_s=0.0,
                      inter_gbps=gbps, inter_latency_s=0.0)
  out = []
  for name in RECIPES:
    c = runpy.run_path(str(REPO / "configs" / f"{name}.py"))["get_config"]()
    codec = make_codec(c.compress, lr=c.optimizer.lr)
    nbytes = dense if codec is None else codec.payload_bytes(like)
    op = "allreduce" if codec is None else "allgather"
    seconds, how = collectives.seconds(net, op, range(workers), nbytes)
    h = c.inner_steps  # 1 for DDP
    out.append({"recipe": name, "codec": c.compress.codec, "H": h, "payload_mb": nbytes / 1e6,
                "op": op, "collective": how, "sync_s": seconds, "per_step_s": seconds / h,
                "x_step": seconds / h / step_s})
  return out


def by_workers(workers: list[int], gbps: float) -> list[dict]:
  """Each codec's one sync of gpt2_124m at each W, as the simulator times it (direct, one
  region, no latency): its payloads all-gathered, and for a quantizer (`scatters`) also
  reduce-scattered with `compress.reduce='scatter'` (the sharded codec's own bytes)."""
  from lowcomm_jax import compress
  like = gpt2_shapes()
  base = runpy.run_path(str(REPO / "configs" / "base.py"))["get_config"]()
  out = []
  for name, spec in compress.REGISTRY.items():
    for reduce in ("gather", "scatter") if spec.scatters else ("gather",):
      for w in workers:
        z = base.compress.copy_and_resolve_references()
        z.update(codec=name, reduce=reduce)
        nbytes = make_codec(z, shards=w).payload_bytes(like)
        net = Network.build(num_workers=w, regions=1, intra_gbps=gbps, intra_latency_s=0.0,
                            inter_gbps=gbps, inter_latency_s=0.0)
        op = "allgather" if reduce == "gather" else "allreduce"
        seconds, _ = collectives.seconds(net, op, range(w), nbytes, "direct")
        out.append({"codec": name, "reduce": reduce, "W": w, "payload_mb": nbytes / 1e6,
                    "sync_s": seconds})
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workers", type=int, default=4)
  p.add_argument("--gbps", type=float, default=1.0)
  p.add_argument("--step_ms", type=float, default=38.0)
  p.add_argument("--by_workers", type=int, nargs="+", help="each codec's sync against W")
  a = p.parse_args()
  if a.by_workers:
    table = by_workers(a.by_workers, a.gbps)
    print(f"one sync of gpt2_124m, {a.gbps:g} Gb/s NICs, direct, seconds at W =")
    print("| codec | reduce | payload MB | " + " | ".join(map(str, a.by_workers)) + " |")
    print("|---|---|---|" + "---|" * len(a.by_workers))
    for k in range(0, len(table), len(a.by_workers)):
      row = table[k:k + len(a.by_workers)]
      print(f"| {row[0]['codec']} | {row[0]['reduce']} | {row[-1]['payload_mb']:.1f} | "
            + " | ".join(f"{r['sync_s']:.2f}" for r in row) + " |")
    return
  print(f"{a.workers} workers, {a.gbps:g} Gb/s NICs, against a {a.step_ms:g} ms step")
  print("| recipe | codec | H | payload MB | collective | one sync s | per step | × the step |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows(a.workers, a.gbps, a.step_ms / 1e3):
    per_step = (f"{r['per_step_s']:.2f} s" if r["per_step_s"] >= 0.1
                else f"{r['per_step_s'] * 1e3:.1f} ms")
    print(f"| {r['recipe']} | {r['codec']} | {r['H']} | {r['payload_mb']:.1f} | "
          f"{r['op']} ({r['collective']}) | {r['sync_s']:.2f} | {per_step} | "
          f"{r['x_step']:.2f} |")


if __name__ == "__main__":
  main()
