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


def test_a_rebuilt_run_counts_its_sync_bytes_once(smoke_config, monkeypatch):
  from lowcomm_jax.parallel import ledger
  calls = []
  real = ledger.count_bytes
  monkeypatch.setattr(ledger, "count_bytes", lambda *a, **k: calls.append(1) or real(*a, **k))
  config = smoke_config(**{"compress.codec": "int4", "seed": 7})  # built nowhere else
  first = train.build(config).sync_bytes()
  assert len(calls) == 1 and first[0].sent > 0
  assert train.build(config).sync_bytes() == first and len(calls) == 1
  # Another codec: another program, counted anew, other bytes.
  int8 = train.build(smoke_config(**{"compress.codec": "int8", "seed": 7})).sync_bytes()
  assert len(calls) == 2 and int8[0].sent > first[0].sent
