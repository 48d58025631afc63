import pytest

from lowcomm_jax.assemble.hosts import dylu_inner_steps


def test_dylu_scales_h_by_relative_speed_and_rounds_up():
  assert dylu_inner_steps(20, [4.0, 2.0, 1.0, 0.3]) == [20, 10, 5, 2]  # 20*0.075=1.5 -> 2
  assert dylu_inner_steps(20, [1.0, 1.0]) == [20, 20]
  assert dylu_inner_steps(10, [100.0, 1.0]) == [10, 1]  # never below one step
  assert dylu_inner_steps(20, [0.3, 0.3 * 0.5]) == [20, 10]


def test_dylu_rejects_non_positive_speeds():
  with pytest.raises(ValueError):
    dylu_inner_steps(20, [1.0, 0.0])


def test_h_is_settled_by_dylu_only_when_it_is_on_and_every_speed_is_known():
  from conftest import load_config
  from lowcomm_jax.assemble.hosts import settle_inner_steps
  on = load_config("smoke", inner_steps=20, **{"outer.dylu": True})
  assert settle_inner_steps(on, [20, 8], [4.0, 1.0]) == [20, 5]
  assert settle_inner_steps(on, [20, 8], [4.0, 0.0]) == [20, 8]  # one to measure: configured
  assert settle_inner_steps(on, [20, 8]) == [20, 8]
  off = load_config("smoke", inner_steps=20)
  assert settle_inner_steps(off, [20, 8], [4.0, 1.0]) == [20, 8]
