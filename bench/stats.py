"""The statistics every claim in BENCHMARKS.md uses: paired differences over seeds with a
95% t interval and a verdict, and rank correlations with their p-values."""

import math
import statistics

from scipy import stats as scipy_stats


def paired(a, b, *, higher_is_better: bool) -> dict:
  """a − b over paired seeds: mean, sd, the 95% t interval of the mean, and the verdict
  for the claim "a is better than b": holds (the interval excludes 0 on a's side),
  reversed (on b's side) or not distinguishable."""
  d = [x - y for x, y in zip(a, b, strict=True)]
  n, mean = len(d), statistics.fmean(d)
  sd = statistics.stdev(d) if n > 1 else math.nan
  half = scipy_stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n) if n > 1 else math.inf
  low, high = mean - half, mean + half
  better = (low > 0) if higher_is_better else (high < 0)
  worse = (high < 0) if higher_is_better else (low > 0)
  verdict = "holds" if better else "reversed" if worse else "not distinguishable"
  return {"n": n, "mean": mean, "sd": sd, "ci95": (low, high), "verdict": verdict,
          "differences": d}


def percent(a, b) -> list[float]:
  """a against b in % (100·(a/b − 1)), seed by seed."""
  return [100 * (x / y - 1) for x, y in zip(a, b, strict=True)]


def mean_sd(values) -> tuple[float, float]:
  values = list(values)
  return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def spearman(x, y) -> tuple[float, float]:
  """(ρ, two-sided p), ties ranked by their mean rank."""
  result = scipy_stats.spearmanr(x, y)
  return float(result.statistic), float(result.pvalue)


def crossing(rows: list[dict], target: float, keys: tuple[str, ...]) -> tuple | None:
  """The values of `keys` where `eval_loss` first reaches `target` in `rows` (evaluations in
  order), linear between the evaluations on either side; None if it never does."""
  before = None
  for r in rows:
    if r["eval_loss"] <= target:
      if before is None:
        return tuple(r[k] for k in keys)
      f = (before["eval_loss"] - target) / (before["eval_loss"] - r["eval_loss"])
      return tuple(before[k] + f * (r[k] - before[k]) for k in keys)
    before = r
  return None
