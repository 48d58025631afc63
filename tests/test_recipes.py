"""configs/recipe_*.py are bench/frontier.py's points at the settings its tuning picked
(BENCHMARKS.md, "DDP's loss at a thousandth of its bytes"): every field equal, so the
frontier's losses and bytes are what a recipe gives on seed 0."""

import argparse

import pytest

from conftest import bench_module, load_config
from lowcomm_jax.run.identity import flatten

frontier = bench_module("frontier")

# bench/frontier.py's picks.json of the run BENCHMARKS.md reports (commit d5f0439's grid).
PICKS = {"ddp_adamw": {"point": "lr0.002_cos", "lr": 0.002, "schedule": "cos"},
         "ddp_muon": {"point": "lr0.02_cos", "lr": 0.02, "schedule": "cos"},
         "diloco_adamw": {"point": "lr0.002_o10m05", "lr": 0.002, "outer": "o10m05"},
         "diloco_muon": {"point": "lr0.02_o10m05", "lr": 0.02, "outer": "o10m05"}}
RECIPES = {"recipe_ddp": "ddp_muon", "recipe_10x": "diloco_muon_h10",
           "recipe_100x": "diloco_muon_h50_fp8", "recipe_500x": "diloco_muon_h50_muloco",
           "recipe_1000x": "diloco_muon_h50_sparseloco"}
# What a run a user starts may differ in without changing a number of the frontier's.
NOT_COMPARED = {"checkpoint_every"}


@pytest.mark.parametrize("recipe, point", RECIPES.items())
def test_a_recipe_is_its_frontier_point(recipe, point):
  args = argparse.Namespace(workers=4, model="small", batch_size=8, seq_len=32, steps=400)
  fields = frontier.frontier_points(args.steps, 20, PICKS)[point][1]
  expected = flatten(frontier.config(args, fields, seed=0).to_dict())
  got = flatten(load_config(recipe).to_dict())
  differ = {k: (got.get(k), expected.get(k)) for k in expected.keys() | got.keys()
            if k not in NOT_COMPARED and got.get(k) != expected.get(k)}
  assert not differ, f"{recipe} is not the frontier's {point}: {differ}"
