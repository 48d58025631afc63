"""Fields that were silently accepted (or crashed later): each refused at start-up with its
field and its fix (issue 14), and a worker count that cannot fit refused before allocating."""

import time

import pytest

from conftest import load_config
from lowcomm_jax.config import check
from lowcomm_jax.assemble import memory
from lowcomm_jax.parallel import distributed
from lowcomm_jax.config.check import ConfigError


def _problems(config, environ=None, **kwargs) -> list[str]:
  kwargs.setdefault("num_devices", 8)
  if environ is not None:  # distributed checks read the environment; keep it controlled
    return distributed.problems(config, environ)
  with pytest.raises(ConfigError) as e:
    check.validate(config, **kwargs)
  return e.value.problems


@pytest.mark.parametrize("field, value, expected", [
    ("seed", -1, "seed=-1: must be >= 0"),
    ("optimizer.decay_steps", -5, "optimizer.decay_steps=-5: must be >= 0"),
    ("optimizer.b1", 1.0, "optimizer.b1=1.0: AdamW's moment decay must be in [0, 1)"),
    ("optimizer.b2", -0.1, "optimizer.b2=-0.1: AdamW's moment decay must be in [0, 1)"),
    ("optimizer.min_lr_ratio", 1.5, "optimizer.min_lr_ratio=1.5: must be in [0, 1]"),
    ("optimizer.min_lr_ratio", -0.1, "optimizer.min_lr_ratio=-0.1: must be in [0, 1]"),
    ("optimizer.weight_decay", -0.01, "optimizer.weight_decay=-0.01: must be >= 0"),
    ("model.vocab_size", -1, "model.vocab_size=-1: must be >= 0"),
    ("model.tp.sync", "fancy", "model.tp.sync='fancy': use one of"),
    ("outer.dn_buffer", -1, "outer.dn_buffer=-1: must be >= 0"),
    ("outer.dn_c", -0.5, "outer.dn_c=-0.5: Delayed Nesterov's c must be >= 0"),
])
def test_a_bad_value_names_its_field_and_fix(field, value, expected):
  problems = _problems(load_config("smoke", **{field: value}))
  assert any(p.startswith(expected) for p in problems), problems


@pytest.mark.parametrize("codec, chunk, k", [("sparseloco", 64, 4096), ("sparseloco", 8, 33),
                                             ("topk", 16, 200)])
def test_k_beyond_half_a_chunk_is_refused_not_silently_capped(codec, chunk, k):
  config = load_config("smoke", **{"compress.codec": codec, "compress.chunk": chunk,
                                   "compress.k": k})
  problems = _problems(config)
  assert any(p.startswith(f"compress.k={k}: a {chunk}x{chunk} chunk sends at most half its "
                          f"entries ({chunk * chunk // 2})") for p in problems), problems


def test_k_within_the_chunk_and_the_shipped_codec_configs_pass():
  config = load_config("smoke", **{"compress.codec": "sparseloco", "compress.k": 2048})
  check.validate(config, num_devices=8)
  check.validate(load_config("diloco_sparseloco"), num_devices=8)
  check.validate(load_config("ddp_demo"), num_devices=8)


def test_k_with_per_tensor_topk_is_unused_and_refused():
  config = load_config("smoke", **{"compress.codec": "topk", "compress.chunk": 0,
                                   "compress.k": 10})
  assert any(p.startswith("compress.k=10: topk with chunk=0 keeps compress.density")
             for p in _problems(config))


def test_error_feedback_off_is_refused_for_codecs_that_always_keep_it():
  config = load_config("smoke", **{"compress.codec": "sparseloco",
                                   "compress.error_feedback": False})
  assert any(p.startswith("compress.error_feedback=False: sparseloco always keeps")
             for p in _problems(config))


def test_sim_fields_without_the_simulator_are_refused_as_ignored():
  config = load_config("smoke", **{"sim.heterogeneity": "very", "sim.network.inter_gbps": 2.0})
  problems = _problems(config)
  assert ("sim.heterogeneity='very': ignored unless runtime is 'simulator'; set "
          "--config.runtime=simulator or leave them at their defaults" in problems), problems
  assert ("sim.network.inter_gbps=2.0: ignored unless runtime is 'simulator' or 'ray'; set "
          "--config.runtime=simulator or leave them at their defaults" in problems), problems
  # Tuples from the command line equal the base's lists: not a change.
  check.validate(load_config("smoke", **{"sim.speeds": []}), num_devices=8)


def test_processes_without_a_coordinator_are_refused():
  config = load_config("smoke", **{"distributed.num_processes": 2})
  problems = _problems(config, environ={})
  assert any(p.startswith("distributed.num_processes=2: no coordinator to join") for p in
             problems), problems
  assert not _problems(config, environ={"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"})
  assert not _problems(config, environ={"SLURM_NTASKS": "2"})


@pytest.mark.parametrize("field, value, expected", [
    ("coordinator_address", "10.0.0.1", "distributed.coordinator_address='10.0.0.1': use "
     "'host:port'"),
    ("coordinator_bind_address", "0.0.0.0:99999", "distributed.coordinator_bind_address="
     "'0.0.0.0:99999': use 'host:port'"),
    ("join_timeout_s", 0, "distributed.join_timeout_s=0: must be >= 1 second"),
    ("heartbeat_timeout_s", 0, "distributed.heartbeat_timeout_s=0: must be >= 1 second"),
    ("process_id", 2, "distributed.process_id=2: must be in [0, 2)"),
    ("num_processes", -1, "distributed.num_processes=-1: must be >= 0"),
])
def test_distributed_fields(field, value, expected):
  overrides = {f"distributed.{field}": value}
  if field == "process_id":
    overrides.update({"distributed.num_processes": 2,
                      "distributed.coordinator_address": "127.0.0.1:1234"})
  problems = _problems(load_config("smoke", **overrides), environ={})
  assert any(p.startswith(expected) for p in problems), problems
  # validate() reports them too.
  assert any(p.startswith(expected) for p in _problems(load_config("smoke", **overrides)))


def test_ipv6_and_named_coordinators_are_accepted():
  for address in ("[::1]:1234", "node-7.cluster:61000", "127.0.0.1:1"):
    config = load_config("smoke", **{"distributed.coordinator_address": address,
                                     "distributed.coordinator_bind_address": address})
    assert not distributed.problems(config, {}), address


def test_workers_that_cannot_fit_are_refused_before_allocating(monkeypatch, smoke_config):
  from lowcomm_jax.assemble import build
  # A 64 MiB device: 4096 tiny workers (AdamW states alone ~1 GiB) cannot fit.
  monkeypatch.setattr(memory, "available_bytes", lambda devices: (64 * 2**20, "a test device"))
  t0 = time.time()
  with pytest.raises(memory.OutOfMemory) as e:
    build.build(smoke_config(num_workers=4096))
  assert time.time() - t0 < 30
  (message,) = e.value.problems
  assert message.startswith("num_workers=4096: needs about ")
  assert "per device but 0.06 GiB is available (a test device)" in message
  assert "Lower --config.num_workers" in message
  assert isinstance(e.value, ConfigError)  # main.py reports it in one line, exit code 2
  # The same run on the host's real memory fits (the estimate errs low, never refuses
  # what fits), and the escape hatch skips the check.
  monkeypatch.setenv("LOWCOMM_MEMORY_CHECK", "0")
  build.build(smoke_config(num_workers=4096))


def test_memory_estimate_counts_adamw_states_and_codec_buffers(smoke_config):
  from lowcomm_jax.assemble import build
  r = build.build(smoke_config(num_workers=8, **{"compress.codec": "sparseloco"}))
  parts = memory.estimate(r)
  params = r.model.param_bytes
  per_device = 8 // r.topology.local_mesh.shape["replica"]
  copies = 2  # CPU: worker states are not donated
  assert parts["params"] == params
  assert parts["inner_optimizer"] >= copies * per_device * 2 * params  # AdamW: mu and nu
  # One error buffer per worker (+ counters).
  buffers = 8 * params // r.topology.mesh.shape["replica"]
  assert buffers <= parts["codec_buffers"] < buffers + 1024
  assert parts["deltas"] == per_device * params
  assert parts["round_temporaries"] > per_device * 2 * params  # θ copy, gradient, activations


@pytest.mark.parametrize("overrides, expected", [
    # Asked of the algorithm's declarations (synchronous, local_steps, robust_aggregation),
    # never of its name: each message names the algorithms that do qualify.
    ({"algorithm": "async", "runtime": "simulator", "attack.workers": (1,)},
     "attack.workers=(1,): attacks are applied in synchronous syncs; use one of ['ddp', "
     "'diloco', 'streaming', 'one_step_delay', 'eager', 'overlap', 'noloco', 'pier', "
     "'desloc']"),
    ({"collab.target_batch_size": 32, "data.batch_mode": "different"},
     "algorithm='diloco': collaborative epochs average gradients at θ and take one optimizer "
     "step per epoch; use --config.algorithm=ddp (or set --config.collab.target_batch_size=0)"),
    ({"algorithm": "streaming", "runtime": "simulator", "collective_form": "server"},
     "collective_form='server': streaming's simulator schedule has no parameter "
     "server's form; use auto, ring or hierarchical"),
    ({"algorithm": "halos", "runtime": "simulator", "aggregate.rule": "median"},
     "aggregate.rule='median': halos combines contributions its own way; use one of ['ddp', "
     "'diloco', 'streaming', 'one_step_delay', 'overlap', 'pier', 'desloc']"),
])
def test_what_an_algorithm_declares_decides_what_it_may_be_combined_with(overrides, expected):
  assert expected in _problems(load_config("smoke", **overrides))


def test_the_field_that_picked_the_simulator_names_the_runtime_field():
  """`sim.enabled` is gone: a config file that still sets it, or a command line, gets one
  line naming `runtime`; a workdir written with it resumes as runtime='simulator'."""
  from lowcomm_jax.config import command_line
  from lowcomm_jax.run import identity
  config = load_config("smoke")
  with config.unlocked():
    config.sim.enabled = True
  problems = _problems(config)
  assert any(p.startswith("sim.enabled: gone") and "--config.runtime=simulator" in p
             for p in problems), problems
  with pytest.raises(command_line.UsageError, match=r"^--config\.sim\.enabled: gone; use "
                     r"--config\.runtime=simulator"):
    command_line.check_override(load_config("smoke"), "sim.enabled")
  old = {"runtime": "spmd", "sim": {"enabled": True, "step_seconds": 0.1}}
  assert identity.upgraded(old) == {"runtime": "simulator", "sim": {"step_seconds": 0.1}}
  assert identity.upgraded({"runtime": "ray", "sim": {"enabled": False}})["runtime"] == "ray"
  with pytest.raises(check.ConfigError, match=r"runtime='lockstep': use one of \['spmd', "
                     r"'simulator', 'ray'\]"):
    check.validate(load_config("smoke", runtime="lockstep"), num_devices=8)


def test_the_field_that_picked_a_rounds_collective_names_collective_form():
  """`sim.network.collective` moved to `collective_form` (both the simulator and Ray read
  it): a config file that still sets it, or a command line, gets one line naming the new
  field; a workdir written with it resumes with its value in the new field."""
  from lowcomm_jax.config import command_line
  from lowcomm_jax.run import identity
  config = load_config("smoke")
  with config.unlocked():
    config.sim.network.collective = "hierarchical"
  problems = _problems(config)
  assert problems == ["sim.network.collective='hierarchical': moved; set "
                      "--config.collective_form=hierarchical (and drop "
                      "sim.network.collective)"], problems
  with pytest.raises(command_line.UsageError, match=r"^--config\.sim\.network\.collective: "
                     r"gone; use --config\.collective_form"):
    command_line.check_override(load_config("smoke"), "sim.network.collective")
  old = {"runtime": "ray", "sim": {"step_seconds": 0.1,
                                   "network": {"collective": "server", "regions": 2}}}
  assert identity.upgraded(old) == {"runtime": "ray", "collective_form": "server",
                                    "sim": {"step_seconds": 0.1, "network": {"regions": 2}}}
