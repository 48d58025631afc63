"""build.build: a run built again in the same process reuses its program functions (and with
them JAX's traces and executables); anything the programs depend on gives new ones."""

from lowcomm_jax import train


def _functions(r):
  return (r.programs.local[0][0], r.programs.syncs[0], r.programs.eval, r.state_spec.init)


def test_the_same_run_built_again_gets_the_same_programs_and_a_changed_one_new_ones(
    smoke_config):
  first = train.build(smoke_config())
  again = train.build(smoke_config())
  assert _functions(again) == _functions(first)
  assert again.data.streams[0] is not first.data.streams[0]  # data streams are never shared
  for changed in ({"outer.lr": 0.5}, {"rounds": 4}, {"data.seq_len": 16},
                  {"compress.codec": "int8"}):
    other = train.build(smoke_config(**changed))
    assert all(a is not b for a, b in zip(_functions(other), _functions(first))), changed
