"""Metric names that the writers (Run.evaluation, the run loop) and the readers (report.py)
share, without importing either side."""

WIDTH_KEY = "eval_loss/tier_"  # + the width: the eval loss of one MatFormer width


def width_key(width: float) -> str:
  """The metric name of the eval loss at FFN width `width` (eval_loss/tier_0.25)."""
  return f"{WIDTH_KEY}{width:g}"


def widths_of(row: dict) -> dict[str, float]:
  """{width as written ('0.25'): eval loss} of a metrics row's per-width eval losses."""
  return {k.removeprefix(WIDTH_KEY): v for k, v in row.items() if k.startswith(WIDTH_KEY)}
