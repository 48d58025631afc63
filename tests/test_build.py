"""build.build: a run built again in the same process reuses its program functions (and with
them JAX's traces and executables); a program is built anew exactly when something it reads
changed."""

from lowcomm_jax.runtimes.spmd import train


def _functions(r):
  return {"local": r.programs.local[0][0], "sync": r.programs.syncs[0], "eval": r.programs.eval,
          "init_workers": r.programs.init_workers[0], "state": r.state_spec.init,
          "initial_params": r.state_spec.initial_params}


def test_the_same_run_built_again_gets_the_same_programs_and_a_changed_one_new_ones(
    smoke_config):
  first = train.build(smoke_config())
  again = train.build(smoke_config())
  assert _functions(again) == _functions(first)
  assert again.data.streams[0] is not first.data.streams[0]  # data streams are never shared
  # What each change reaches. Any change: the sync and the state init (cached by the whole
  # config). The outer rule, the codec and a shape (seq_len: the same functions trace again
  # for it) nothing else; the number of rounds the inner schedule (the local programs and
  # the workers' optimizer state); the seed the initial parameters; the model everything.
  for changed, new in [({"outer.lr": 0.5}, {"sync", "state"}),
                       ({"data.seq_len": 16}, {"sync", "state"}),
                       ({"compress.codec": "int8"}, {"sync", "state"}),
                       ({"rounds": 4}, {"local", "init_workers", "sync", "state"}),
                       ({"seed": 3}, {"sync", "state", "initial_params"}),
                       ({"optimizer.lr": 1e-3}, {"local", "init_workers", "sync", "state"}),
                       ({"model.name": "small"}, set(_functions(first)))]:
    other = _functions(train.build(smoke_config(**changed)))
    assert {k for k, f in other.items() if f is not _functions(first)[k]} == new, changed


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
