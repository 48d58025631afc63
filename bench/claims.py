"""BENCHMARKS.md's opening, "What holds today, by topic", made from its one table of claims.

Every claim lives in one table, the appendix "Every claim" at the end of BENCHMARKS.md:
topic, issue, section (a link to where its numbers are), claim, runs, verdict. This script
writes the opening from it: per topic the claims that hold, then those not distinguishable,
then those not met or reversed. Untested claims stay in the appendix only. A superseded
claim moves to the archive (BENCHMARKS_ARCHIVE.md's table "Superseded claims", the same
columns), with any section whose every claim is superseded; its links are checked there
(to the archive's own headings, or to BENCHMARKS.md's as `BENCHMARKS.md#anchor`). The
counts are computed here, so they cannot drift from the tables.

  python bench/claims.py --write    # regenerate the opening in place
  python bench/claims.py --check    # exit 1 if the opening, a verdict word or a link is off
"""

import argparse
import collections
import pathlib
import re
import sys
import unicodedata

REPO = pathlib.Path(__file__).resolve().parents[1]
PATH = REPO / "BENCHMARKS.md"
ARCHIVE_PATH = REPO / "BENCHMARKS_ARCHIVE.md"
ARCHIVE_TABLE = "## Superseded claims"
BEGIN, END = "<!-- claims:begin (bench/claims.py --write) -->", "<!-- claims:end -->"
APPENDIX = "## Appendix: every claim"
COLUMNS = ["topic", "issue", "section", "claim", "runs", "verdict"]

# The groups of the opening, in order, by the verdict's first words. A verdict may say more
# after them ("holds (worse)", "not distinguishable (int8, int4); fp8 lower on every seed").
GROUPS = [
    ("hold", ("holds", "exact", "met", "correlated", "on every seed")),
    ("not distinguishable", ("not distinguishable", "not correlated")),
    ("not met or reversed", ("not met", "reversed")),
]
APPENDIX_ONLY = ("untested", "superseded")

# Topics in the order the opening shows them.
TOPICS = [
    "Local-SGD algorithms: loss against DDP and each other",
    "Compression and the loss-vs-bytes frontier",
    "Heterogeneous hosts and MatFormer tiers",
    "Aggregation: signal-aware and robust",
    "Simulator: asynchronous methods, networks, time to loss",
    "Ray runtime: real processes, failures, goodput",
    "Fine-tuning and collaborative epochs",
    "Data pipeline",
    "Speed and start-up (CPU and GPU)",
    "Refactors that changed no number",
]

Row = collections.namedtuple("Row", COLUMNS)


def group_of(verdict: str) -> str | None:
  """The opening's group of `verdict`; None for the appendix-only verdicts."""
  v = verdict.lower()
  starts = lambda words: re.match(rf"{re.escape(words)}\b", v) is not None  # whole words
  if any(starts(w) for w in APPENDIX_ONLY):
    return None
  for name, prefixes in GROUPS:
    if any(starts(p) for p in prefixes):
      return name
  raise ValueError(f"verdict {verdict!r} starts with none of the words BENCHMARKS.md defines")


def anchor(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  text = heading.strip().lower()
  kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LN")
  return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
  """Every heading's anchor (a repeated heading gets -1, -2, ... as on GitHub); a `#` line
  inside a fenced code block is a comment, not a heading."""
  seen = collections.Counter()
  out, fenced = set(), False
  for line in text.splitlines():
    if line.lstrip().startswith(("```", "~~~")):
      fenced = not fenced
    elif not fenced and (m := re.match(r"^#{1,6} (.+)$", line)):
      a = anchor(m.group(1))
      out.add(a if not seen[a] else f"{a}-{seen[a]}")
      seen[a] += 1
  return out


def _cells(line: str) -> list[str]:
  return [c.strip() for c in line.strip().strip("|").split(" | ")]


def table(text: str, heading: str = APPENDIX) -> list[Row]:
  """The rows of the table under `heading` (BENCHMARKS.md's appendix, or the archive's)."""
  start = text.index(heading)
  rows, header_seen = [], False
  for line in text[start:].splitlines()[1:]:
    if line.startswith("## "):
      break
    if not line.startswith("|"):
      continue
    cells = _cells(line)
    if not header_seen:
      if cells != COLUMNS:
        raise ValueError(f"{heading}: the table's columns must be {COLUMNS}, not {cells}")
      header_seen = True
      continue
    if set(line.replace("|", "").strip()) <= set("-: "):
      continue
    if len(cells) != len(COLUMNS):
      raise ValueError(f"{heading}: a row has {len(cells)} cells, not {len(COLUMNS)}: "
                       f"{line[:80]}")
    rows.append(Row(*cells))
  return rows


def _superseded(r: Row) -> bool:
  return r.verdict.lower().startswith("superseded")


def problems(text: str, rows: list[Row], archived: bool = False) -> list[str]:
  """What is wrong with a table (`text`'s; `archived`: the archive's): unknown topics or
  verdict words, dead links, a superseded claim outside the archive or a current one in
  it."""
  out, targets = [], anchors(text)
  for r in rows:
    where = f"issue {r.issue}, {r.claim[:50]!r}"
    if r.topic not in TOPICS:
      out.append(f"{where}: topic {r.topic!r} is not one of bench/claims.py's TOPICS")
    try:
      group_of(r.verdict)
    except ValueError as e:
      out.append(f"{where}: {e}")
    if _superseded(r) != archived:
      out.append(f"{where}: verdict {r.verdict!r} " + (
          "is not superseded: the archive keeps only superseded claims" if archived else
          f"belongs in {ARCHIVE_PATH.name}'s {ARCHIVE_TABLE[3:]!r}: move the row there"))
    link = re.fullmatch(r"\[[^\]]+\]\(([^)]+)\)", r.section)
    if not link:
      out.append(f"{where}: section {r.section!r} is not a [name](#anchor) link")
      continue
    file, _, anchor_ = link.group(1).partition("#")
    if file and not (REPO / file).exists():
      out.append(f"{where}: no file {file}")
    elif anchor_ and anchor_ not in (anchors((REPO / file).read_text()) if file else targets):
      out.append(f"{where}: no heading of {file or 'this file'} has the anchor #{anchor_}")
  return out


def opening(rows: list[Row], superseded: int) -> str:
  """The generated opening, between the markers (`superseded`: the archive's rows)."""
  counts = collections.Counter(group_of(r.verdict) or r.verdict.split()[0].lower()
                               for r in rows)
  lines = [BEGIN, "", "## What holds today, by topic", "",
           f"Made by `python bench/claims.py --write` from the {len(rows)} rows of the "
           f"[appendix](#appendix-every-claim), the one table of claims (a test checks that "
           f"this part matches it). Today: {counts['hold']} hold, "
           f"{counts['not distinguishable']} are not distinguishable, "
           f"{counts['not met or reversed']} are not met or reversed; "
           f"{counts['untested']} untested claims are in the appendix only, and "
           f"{superseded} superseded ones in the [archive]({ARCHIVE_PATH.name}). The "
           "verdict words are defined there. Each section link goes to the numbers and the "
           "command that produced them.", ""]
  for topic in TOPICS:
    current = [r for r in rows if r.topic == topic and group_of(r.verdict)]
    if not current:
      continue
    lines += [f"### {topic}", "", "| claim | runs | verdict | numbers |",
              "|---|---|---|---|"]
    for name, _ in GROUPS:
      for r in current:
        if group_of(r.verdict) == name:
          lines.append(f"| {r.claim} (issue {r.issue}) | {r.runs} | {r.verdict} | "
                       f"{r.section} |")
    lines.append("")
  return "\n".join(lines + [END])


def rendered(text: str, archive: str) -> str:
  """`text` with its opening regenerated (`archive`: the archive's text)."""
  start, end = text.index(BEGIN), text.index(END) + len(END)
  return (text[:start] + opening(table(text), len(table(archive, ARCHIVE_TABLE)))
          + text[end:])


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  mode = p.add_mutually_exclusive_group(required=True)
  mode.add_argument("--write", action="store_true")
  mode.add_argument("--check", action="store_true")
  a = p.parse_args()
  text, archive = PATH.read_text(), ARCHIVE_PATH.read_text()
  found = problems(text, table(text)) + problems(archive, table(archive, ARCHIVE_TABLE), True)
  if found:
    sys.exit("BENCHMARKS.md's and its archive's tables of claims:\n" + "\n".join(found))
  new = rendered(text, archive)
  if a.write:
    PATH.write_text(new)
  elif new != text:
    sys.exit("BENCHMARKS.md's opening differs from its table of claims: "
             "run python bench/claims.py --write")


if __name__ == "__main__":
  main()
