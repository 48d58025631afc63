"""Time to fixed target losses over a slow wide-area network, in the simulator, against tuned
baselines, over seeds.

16 workers in 4 regions (100 Gb/s NICs; 1 Gb/s and 50 ms between regions, each region's
uplink and downlink 1 Gb/s), the parameter server in a fifth region of its own, transfers
sharing links max-min fairly (sim/flows.py), synchronous collectives ring or hierarchical,
whichever is faster (sim/collectives.py). `moderate` speeds (0.5–1×). The same tokens for
every method: 150 inner steps per worker (`--budget 3`: the methods other than DDP may
run 3× as long, to reach targets they cannot reach at equal tokens).

The CPU trains the byte-level `small` model, but the clock is that of `gpt2_124m` on
A100-class GPUs: an inner step takes STEP_SECONDS at speed 1 and every payload travels as
if it were BYTES_SCALE times larger (sim.network.bytes_scale), so the ratio of
communication to computation is that of the large model over these links.

What is measured, per method at its tuned point and per seed:
- the targets: the tuned DDP's mean final eval loss over the seeds, +1%, +3%, +10%;
- the time to each target, interpolated linearly in virtual time between the two
  evaluations around the crossing (evaluations every round-equivalent);
- the compute-only floor: the virtual time the same schedule needs, with free
  communication, to apply as many inner steps as the run had applied at the crossing
  (a replay of the schedule, sim/replay.py: time never depends on the math);
- synchronous methods' variants that change only the clock (DDP's gradients in bf16:
  half the bytes; a flat ring instead of the faster collective) are replays of the same
  trained run.

Tuning, on a seed of its own (`--tune_seed`, 100) that no tested run uses: DDP's lr ×
warmup × batch (gradient accumulation: 3 micro-batches per step is 3× the batch and a third
of the steps), 12 points; DiLoCo's H × outer lr/momentum, with and without DyLU, 12 points;
async DN + DyLU's H × outer lr/momentum, 4; HALoS's outer lr/momentum, 2. DDP is picked by
final loss (it sets the targets); the others by the most targets reached (those of DDP's
pick on the tuning seed), then the time to the tightest of them. The picked points then run
on seeds 0 .. seeds − 1, which give every number reported.

  python bench/wan_time_to_loss.py [--jobs 2] [--seeds 3] [--budget 1] [--workdir DIR]

Writes <workdir>/wan.md and result.json (bench/results/wan by default); finished runs are
reused, so a cut-off run continues where it stopped.
"""

import argparse
import itertools
import json
import os
import pathlib
import runpy
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))

import sim_grid  # noqa: E402
import stats  # noqa: E402
from lowcomm_jax.report import read_metrics, read_summary  # noqa: E402

GPT2_PARAMS = 124_475_904  # gpt2_124m (vocab 50304), as bench/mfu.py counts it
# gpt2_124m on an A100 (312 TFLOP/s bf16 dense) at 40% MFU, 16 × 1024 tokens per step:
# 855 MFLOP per token (model/flops.py) -> 16384 · 855e6 / (0.4 · 312e12) s.
STEP_SECONDS = 16384 * 855e6 / (0.4 * 312e12)
SMALL_PARAMS = 858_880  # the byte-level `small` model
STEPS = 150  # inner steps per worker: the same tokens for every method
TARGETS = (1.01, 1.03, 1.10)  # × the tuned DDP's final eval loss
TUNE_SEED = 100  # where every method picks its point; the tested seeds are 0 .. seeds − 1
OUTER = {"o07m09": {"outer.lr": 0.7, "outer.momentum": 0.9},
         "o10m05": {"outer.lr": 1.0, "outer.momentum": 0.5}}
FREE = {"sim.network.bytes_scale": 1e-12, "sim.network.intra_latency_s": 0.0,
        "sim.network.inter_latency_s": 0.0}


def _ddp(lr: float, warmup: int, accumulate: int) -> dict:
  # Gradient accumulation: `accumulate` micro-batches per step is a batch that many times
  # larger for that many times the compute, and that many times fewer syncs. `warmup` is in
  # micro-batches, as STEPS is.
  return {"algorithm": "ddp", "optimizer.lr": lr, "inner_steps": 1,
          "rounds": STEPS // accumulate, "data.batch_size": 8 * accumulate,
          "sim.step_seconds": STEP_SECONDS * accumulate,
          "optimizer.decay_steps": STEPS // accumulate, "eval_every": 10 // accumulate or 1,
          "log_every": 10 // accumulate or 1, "optimizer.warmup_steps": warmup // accumulate}


def _local(algorithm: str, h: int, outer: str, budget: float, **fields) -> dict:
  rounds = int(STEPS * budget) // h
  return {"algorithm": algorithm, "inner_steps": h, "rounds": rounds, **OUTER[outer],
          "optimizer.decay_steps": rounds * h, **fields}


def grids(budget: float = 1.0) -> dict:
  """method -> {point name: fields}; the first point of each is its authors' default. The
  methods other than DDP get `budget` times DDP's tokens (DDP sets the targets at 1×)."""
  x = "" if budget == 1 else f"_x{budget:g}"
  local = lambda *a, **f: _local(*a, budget, **f)
  return {
      # The same number of points as DiLoCo's grid: lr × warmup × batch (accumulation).
      "ddp": {f"lr{lr:g}_w{w}_a{a}": _ddp(lr, w, a)
              for lr, w, a in itertools.product((1e-3, 3e-3, 1e-2), (10, 30), (1, 3))},
      "diloco": {**{f"H{h}_{o}{x}": local("diloco", h, o) for h, o in
                    itertools.product((10, 5, 25, 50), OUTER)},
                 **{f"H{h}_{o}_dylu{x}": local("diloco", h, o, **{"outer.dylu": True})
                    for h, o in itertools.product((10, 25), OUTER)}},
      "async_dn_dylu": {f"H{h}_{o}{x}": local("async_dn", h, o, **{"outer.dylu": True})
                        for h, o in itertools.product((10, 25), OUTER)},
      "halos": {f"H10_{o}{x}": local("halos", 10, o, **{"outer.dylu": True,
                                                        "outer.halos.sync_every": 4})
                for o in OUTER},
  }


GRIDS = grids()
SYNCHRONOUS = ("ddp", "diloco")


def case_name(method: str, point: str, seed: int) -> str:
  return f"{method}.{point}.s{seed}"


def config(fields: dict, seed: int):
  c = runpy.run_path(str(REPO / "configs" / "base.py"))["get_config"]()
  c.update_from_flattened_dict({
      "num_workers": 16, "model.name": "small", "data.tokenizer": "byte",
      "data.batch_size": 8, "data.seq_len": 32, "optimizer.warmup_steps": 20,
      "optimizer.decay_steps": STEPS, "eval_every": 1, "eval_batches": 4,
      "checkpoint_every": 0, "log_every": 1,
      "runtime": "simulator", "sim.heterogeneity": "moderate", "sim.step_seconds": STEP_SECONDS,
      "sim.network.regions": 4, "sim.network.intra_gbps": 100.0,
      "sim.network.inter_gbps": 1.0, "sim.network.inter_latency_s": 0.05,
      "sim.network.bytes_scale": GPT2_PARAMS / SMALL_PARAMS, "seed": seed})
  c.update_from_flattened_dict(fields)
  return c


def all_cases(seeds: int, tune_seed: int) -> dict[str, tuple[dict, int]]:
  """Every case this bench may run: name -> (fields, seed)."""
  out = {}
  for method, grid in GRIDS.items():
    for point, fields in grid.items():
      for seed in [*range(seeds), tune_seed]:
        out[case_name(method, point, seed)] = (fields, seed)
  return out


# --- reading runs ---------------------------------------------------------------------

def _rows(workdir: pathlib.Path, name: str) -> list[dict]:
  return [r for r in read_metrics(workdir / name) if "eval_loss" in r]


def _summary(workdir: pathlib.Path, name: str) -> dict:
  return read_summary(workdir / name)


def crossing(rows: list[dict], target: float) -> tuple[float, float] | None:
  """(virtual seconds, inner steps applied) where the eval loss first reaches `target`,
  linear between the evaluations on either side; None if it never does."""
  return stats.crossing(rows, target, ("virtual_seconds", "total_inner_steps"))


class Clocks:
  """Replays, cached per (case fields, seed, network)."""

  def __init__(self):
    self.cache = {}

  def seconds_at(self, fields: dict, seed: int, network: dict, steps: float) -> float | None:
    from lowcomm_jax.sim import replay
    key = json.dumps([fields, seed, network], sort_keys=True)
    if key not in self.cache:
      from lowcomm_jax.runtimes.simulator import simulate
      self.cache[key] = simulate.clock(config({**fields, **network}, seed))
    return replay.seconds_at(self.cache[key], steps)


# --- tuning and the report -------------------------------------------------------------

def targets(workdir: pathlib.Path, seeds, ddp_point: str) -> list[float]:
  """+1/+3/+10% over DDP's `ddp_point` mean final loss on `seeds` (the tested seeds for the
  report; the tuning seed alone for the other methods' picks)."""
  losses = [_summary(workdir, case_name("ddp", ddp_point, s))["eval_loss"] for s in seeds]
  base = stats.mean_sd(losses)[0]
  return [base * t for t in TARGETS]


def tuned_ddp(workdir: pathlib.Path, tune_seed: int) -> str:
  """DDP's point by its final loss on the tuning seed (it sets the targets)."""
  return min(GRIDS["ddp"],
             key=lambda p: _summary(workdir, case_name("ddp", p, tune_seed))["eval_loss"])



def score(rows: list[dict], goals: list[float]) -> tuple:
  """Smaller is better: more targets reached, then sooner at the tightest, then lower loss."""
  reached = [crossing(rows, g) for g in goals]
  hits = [c for c in reached if c is not None]
  return (-len(hits), hits[0][0] if hits else 0.0, rows[-1]["eval_loss"])


def tuned(workdir: pathlib.Path, method: str, goals: list[float], tune_seed: int) -> str:
  grid = GRIDS[method]
  if len(grid) == 1:  # picked elsewhere (--picks_from)
    return next(iter(grid))
  return min(grid, key=lambda p: score(_rows(workdir, case_name(method, p, tune_seed)), goals))


def method_rows(workdir, method, point, seeds, goals, clocks) -> list[dict]:
  """Per seed: time, steps and floor at each target, final loss, virtual seconds."""
  fields = GRIDS[method][point]
  out = []
  for seed in range(seeds):
    name = case_name(method, point, seed)
    rows, summary = _rows(workdir, name), _summary(workdir, name)
    per = {"seed": seed, "eval_loss": summary["eval_loss"],
           "virtual_seconds": summary["virtual_seconds"],
           "collective": summary.get("collective"), "regions": summary.get("regions"),
           "targets": []}
    for goal in goals:
      hit = crossing(rows, goal)
      if hit is None:
        per["targets"].append(None)
        continue
      t, steps = hit
      entry = {"seconds": t, "steps": steps,
               "floor": clocks.seconds_at(fields, seed, FREE, steps)}
      if method in SYNCHRONOUS:  # clock-only variants of the same trained run
        entry["ring"] = clocks.seconds_at(fields, seed, {"collective_form": "ring"},
                                          steps)
      if method.startswith("ddp"):
        entry["bf16"] = clocks.seconds_at(fields, seed, {
            "sim.network.bytes_scale": GPT2_PARAMS / SMALL_PARAMS / 2}, steps)
      per["targets"].append(entry)
    out.append(per)
  return out


def _fmt(values, f="{:.1f}"):
  if any(v is None for v in values):
    reached = sum(v is not None for v in values)
    return f"never ({reached}/{len(values)} seeds reach it)" if reached else "never"
  m, sd = stats.mean_sd(values)
  return f"{f.format(m)} ± {f.format(sd)}"


def _first_hit(per_seed: list[dict]) -> dict:
  return next((h for p in per_seed for h in p["targets"] if h), {})


def fastest(results: dict, goals: list[float]) -> list[str]:
  """Per target: the method with the least mean time among those reaching it on every
  seed, its ratio to its floor, and the goal (≤ 1.2× floor, ≥ 2× faster than DiLoCo)."""
  out = []
  for i, t in enumerate(TARGETS):
    times = {m: [p["targets"][i] for p in per_seed] for m, per_seed in results.items()}
    every = {m: h for m, h in times.items() if all(h)}
    if not every:
      out.append(f"- +{round((t - 1) * 100)}%: no method reaches it on every seed.")
      continue
    best = min(every, key=lambda m: stats.mean_sd(h["seconds"] for h in every[m])[0])
    mean = stats.mean_sd(h["seconds"] for h in every[best])[0]
    floor = stats.mean_sd(h["seconds"] / h["floor"] for h in every[best])[0]
    line = (f"- +{round((t - 1) * 100)}%: fastest **{best}**, {mean:.1f} virtual s, "
            f"{floor:.2f}× its floor (goal ≤ 1.2×: {'met' if floor <= 1.2 else 'not met'})")
    if "diloco" in every and best != "diloco":
      speedup = stats.mean_sd(d["seconds"] / b["seconds"]
                              for b, d in zip(every[best], every["diloco"]))[0]
      line += f"; {speedup:.2f}× faster than tuned DiLoCo (goal ≥ 2×: " \
              f"{'met' if speedup >= 2 else 'not met'})"
    elif "diloco" not in every:
      line += "; tuned DiLoCo does not reach it on every seed"
    out.append(line)
  return out


def report(workdir: pathlib.Path, seeds: int, picks: dict, goals: list[float],
           results: dict) -> str:
  lines = [f"Targets (the tuned DDP `{picks['ddp']}`'s mean final eval loss over {seeds} seeds, "
           f"+1% / +3% / +10%): " + ", ".join(f"{g:.4f}" for g in goals), "",
           "| method (tuned point) | final eval loss | virtual s (whole run) | "
           + " | ".join(f"time to +{round((t - 1) * 100)}% | × floor" for t in TARGETS)
           + " |", "|---|---|---|" + "---|---|" * len(TARGETS)]
  for method, per_seed in results.items():
    variants = [("seconds", f"{method} (`{picks[method]}`)")]
    variants += [(k, f"{method}, {label} (clock replay)") for k, label in
                 (("bf16", "bf16 gradients"), ("ring", "flat ring")) if k in _first_hit(per_seed)]
    for key, label in variants:
      whole = key == "seconds"
      cells = [label, _fmt([p["eval_loss"] for p in per_seed], "{:.4f}") if whole else "same",
               _fmt([p["virtual_seconds"] for p in per_seed]) if whole else ""]
      for i in range(len(goals)):
        hits = [p["targets"][i] for p in per_seed]
        cells.append(_fmt([h and h[key] for h in hits]))
        cells.append(_fmt([h and h["floor"] and h[key] / h["floor"] for h in hits], "{:.2f}"))
      lines.append("| " + " | ".join(cells) + " |")
  lines += ["", *fastest(results, goals), "",
            "Paired over seeds (time to target, seconds; the claim: the method is faster):",
            "", "| method | against | target | difference (mean ± sd) | 95% interval | "
            "speed-up (mean ± sd) | verdict |", "|---|---|---|---|---|---|---|"]
  for method, per_seed in results.items():
    for base in ("diloco", "ddp"):
      if method in (base, "ddp") or base not in results:
        continue
      for i, t in enumerate(TARGETS):
        a = [p["targets"][i] for p in per_seed]
        b = [p["targets"][i] for p in results[base]]
        if any(x is None for x in a + b):
          reached = lambda hits: f"{sum(x is not None for x in hits)}/{len(hits)} seeds"
          verdict = f"not compared: {method} reaches it on {reached(a)}, {base} on {reached(b)}"
          lines.append(f"| {method} | {base} | +{round((t - 1) * 100)}% | | | | {verdict} |")
          continue
        d = stats.paired([x["seconds"] for x in a], [x["seconds"] for x in b],
                         higher_is_better=False)
        ratio = [y["seconds"] / x["seconds"] for x, y in zip(a, b)]
        lines.append(f"| {method} | {base} | +{round((t - 1) * 100)}% | "
                     f"{d['mean']:+.1f} ± {d['sd']:.1f} | {d['ci95'][0]:+.1f} to "
                     f"{d['ci95'][1]:+.1f} | {_fmt(ratio, '{:.2f}')}× | {d['verdict']} |")
  return "\n".join(lines)


def tuning_table(workdir: pathlib.Path, tune_seed: int, picks: dict, goals: list[float],
                 methods: list[str]) -> str:
  """Every grid point of `methods` on the tuning seed: its final loss and when it reaches
  the tuning targets (DDP's pick on that seed, +1% / +3% / +10%)."""
  lines = [f"| method | point | final eval loss (seed {tune_seed}) | "
           + " | ".join(f"time to +{round((t - 1) * 100)}%" for t in TARGETS)
           + " | picked |", "|---|---|---|" + "---|" * len(TARGETS) + "---|"]
  for method in methods:
    for point in GRIDS[method]:
      name = case_name(method, point, tune_seed)
      rows = _rows(workdir, name)
      times = ["never" if (h := crossing(rows, g)) is None else f"{h[0]:.1f}" for g in goals]
      lines.append(f"| {method} | {point} | {_summary(workdir, name)['eval_loss']:.4f} | "
                   + " | ".join(times)
                   + f" | {'**yes**' if picks.get(method) == point else ''} |")
  return "\n".join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seeds", type=int, default=3)
  p.add_argument("--tune_seed", type=int, default=TUNE_SEED,
                 help="the seed every method's point is picked on (not one of the tested)")
  p.add_argument("--jobs", type=int, default=2)
  p.add_argument("--workdir", type=pathlib.Path, default=REPO / "bench/results/wan")
  p.add_argument("--budget", type=float, default=1.0,
                 help="the tokens of the methods other than DDP, in DDP's (1: equal tokens)")
  p.add_argument("--picks_from", type=pathlib.Path,
                 help="a result.json: run only the points it picked (tuned at another budget)")
  p.add_argument("--only", help=argparse.SUPPRESS)
  args = p.parse_args()
  global GRIDS
  GRIDS = grids(args.budget)
  if args.picks_from:  # the local methods' picked points only, at this budget
    earlier = json.loads(args.picks_from.read_text())
    if earlier.get("tune_seed") != args.tune_seed:
      p.error(f"--picks_from {args.picks_from}: its points were picked on "
              f"{'seed ' + str(earlier['tune_seed']) if 'tune_seed' in earlier else 'a tested seed'}"
              f", not --tune_seed {args.tune_seed}; rerun it at --budget 1 first")
    picked = earlier["picks"]
    x = "" if args.budget == 1 else f"_x{args.budget:g}"
    GRIDS = {m: grid if m == "ddp" else {picked[m] + x: grid[picked[m] + x]}
             for m, grid in GRIDS.items()}
  if args.tune_seed < args.seeds:
    p.error(f"--tune_seed {args.tune_seed} is one of the tested seeds 0..{args.seeds - 1}")
  cases = all_cases(args.seeds, args.tune_seed)
  if args.only:
    fields, seed = cases[args.only]
    sim_grid.run_case(config(fields, seed), args.workdir / args.only)
    return
  forward = [a for a in sys.argv[1:]]
  # 1. Every grid on the tuning seed (a grid of one point was picked elsewhere).
  first = [case_name(m, pt, args.tune_seed) for m, grid in GRIDS.items() if len(grid) > 1
           for pt in grid]
  if failed := sim_grid.run_grid(__file__, first, args.workdir, args.jobs, forward):
    sys.exit(f"failed: {failed} (logs in {args.workdir / 'logs'})")
  picks = {"ddp": tuned_ddp(args.workdir, args.tune_seed)}
  tune_goals = targets(args.workdir, [args.tune_seed], picks["ddp"])
  for method in GRIDS:
    if method != "ddp":
      picks[method] = tuned(args.workdir, method, tune_goals, args.tune_seed)
  print("tuned:", picks, flush=True)
  # 2. The picked points on the tested seeds; the targets are DDP's mean over them.
  second = [case_name(m, pt, s) for m, pt in picks.items() for s in range(args.seeds)]
  if failed := sim_grid.run_grid(__file__, second, args.workdir, args.jobs, forward):
    sys.exit(f"failed: {failed} (logs in {args.workdir / 'logs'})")
  goals = targets(args.workdir, range(args.seeds), picks["ddp"])
  print("targets:", [round(g, 4) for g in goals], flush=True)
  clocks = Clocks()
  results = {m: method_rows(args.workdir, m, pt, args.seeds, goals, clocks)
             for m, pt in picks.items()}
  tuned_here = [m for m in GRIDS if len(GRIDS[m]) > 1]  # the others were --picks_from's
  tuning = {m: {pt: score(_rows(args.workdir, case_name(m, pt, args.tune_seed)), tune_goals)
                for pt in GRIDS[m]} for m in tuned_here if m != "ddp"}
  table = (report(args.workdir, args.seeds, picks, goals, results)
           + f"\n\nTuning (seed {args.tune_seed}; targets "
           + ", ".join(f"{g:.4f}" for g in tune_goals) + "):\n\n"
           + tuning_table(args.workdir, args.tune_seed, picks, tune_goals, tuned_here))
  print(table)
  tag = "" if args.budget == 1 else f"_x{args.budget:g}"
  (args.workdir / f"wan{tag}.md").write_text(table + "\n")
  (args.workdir / f"result{tag}.json").write_text(json.dumps(
      {"picks": picks, "targets": goals, "results": results, "tune_seed": args.tune_seed,
       "tuning_goals": tune_goals, "tuning": tuning},
      indent=1))


if __name__ == "__main__":
  main()
