"""BENCHMARKS.md opens with what holds today, made from its one table of claims
(bench/claims.py): the opening matches the table, every verdict uses a defined word, every
row links to a heading or file that exists."""

import pytest

from conftest import REPO, bench_module

claims = bench_module("claims")


def _texts():
  return (REPO / "BENCHMARKS.md").read_text(), (REPO / "BENCHMARKS_ARCHIVE.md").read_text()


def test_the_opening_is_what_the_table_of_claims_makes():
  text, archive = _texts()
  rows = claims.table(text)
  assert len(rows) > 200
  assert claims.problems(text, rows) == []
  assert claims.rendered(text, archive) == text, "run: python bench/claims.py --write"


def test_superseded_claims_live_in_the_archive_and_still_resolve():
  text, archive = _texts()
  archived = claims.table(archive, claims.ARCHIVE_TABLE)
  assert len(archived) >= 43 and all(r.verdict.startswith("superseded") for r in archived)
  assert claims.problems(archive, archived, archived=True) == []
  assert f"{len(archived)} superseded ones in the [archive](BENCHMARKS_ARCHIVE.md)" in text
  # a row that links into BENCHMARKS.md is checked against BENCHMARKS.md's headings
  assert any(r.section.startswith("[") and "(BENCHMARKS.md#" in r.section for r in archived)
  bad = archived[0]._replace(section="[x](BENCHMARKS.md#no-such-heading)")
  assert "no heading of BENCHMARKS.md has the anchor #no-such-heading" in \
      claims.problems(archive, [bad], archived=True)[0]


def test_a_superseded_claim_outside_the_archive_or_a_current_one_in_it_is_named():
  text, archive = _texts()
  current = claims.table(text)[0]
  old = claims.table(archive, claims.ARCHIVE_TABLE)[0]
  assert "move the row there" in claims.problems(text, [old._replace(
      section=current.section)])[0]
  assert "keeps only superseded claims" in claims.problems(archive, [current._replace(
      section=old.section)], archived=True)[0]


@pytest.mark.parametrize("verdict,group", [
    ("holds (worse)", "hold"), ("exact", "hold"), ("met", "hold"),
    ("correlated (Spearman p < 0.05)", "hold"), ("on every seed (range, no test)", "hold"),
    ("not distinguishable (int8, int4); fp8 lower on every seed", "not distinguishable"),
    ("not correlated at p < 0.05", "not distinguishable"),
    ("not met", "not met or reversed"), ("reversed (worse than DiLoCo)", "not met or reversed"),
    ("untested (goal: met on one run)", None), ("superseded (issue 30)", None),
])
def test_each_verdict_word_has_its_group(verdict, group):
  assert claims.group_of(verdict) == group


def test_a_verdict_word_counts_only_whole():
  with pytest.raises(ValueError, match="starts with none of the words"):
    claims.group_of("metric moved")


def test_a_bad_row_is_named():
  text, _ = _texts()
  row = claims.table(text)[0]
  bad = [row._replace(verdict="probably"), row._replace(topic="Misc"),
         row._replace(section="[x](#no-such-heading)"), row._replace(section="plain words")]
  found = claims.problems(text, bad)
  assert len(found) == 4
  assert "'probably' starts with none of the words" in found[0]
  assert "topic 'Misc'" in found[1] and "#no-such-heading" in found[2]
  assert "not a [name](#anchor) link" in found[3]


def test_anchors_follow_githubs_rule():
  assert claims.anchor("Issue 31: DDP's loss at a thousandth of its bytes (`bench/frontier.py`)") \
      == "issue-31-ddps-loss-at-a-thousandth-of-its-bytes-benchfrontierpy"
  assert claims.anchor("Geo-distributed: 4 regions × 4 workers") == \
      "geo-distributed-4-regions--4-workers"
  assert claims.anchors("## A\n## A\n") == {"a", "a-1"}
  assert claims.anchors("```bash\n# a comment\n```\n## B\n") == {"b"}
