"""BENCHMARKS.md opens with what holds today, made from its one table of claims
(bench/claims.py): the opening matches the table, every verdict uses a defined word, every
row links to a heading or file that exists."""

import pytest

from conftest import REPO, bench_module

claims = bench_module("claims")


def test_the_opening_is_what_the_table_of_claims_makes():
  text = (REPO / "BENCHMARKS.md").read_text()
  rows = claims.table(text)
  assert len(rows) > 200
  assert claims.problems(text, rows) == []
  assert claims.rendered(text) == text, "run: python bench/claims.py --write"


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
  text = (REPO / "BENCHMARKS.md").read_text()
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
