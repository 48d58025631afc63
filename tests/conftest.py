"""Test set-up: 8 forced host devices compiling fast (the CPU backend, on a GPU host too),
offline data from ../shared/data, a private cache."""

import importlib.util
import os
import pathlib
import pkgutil
import re
import runpy
import subprocess
import sys
import tempfile
from typing import NamedTuple

# The suite's programs are tiny and run a few steps: compiling them is most of its time. XLA's
# CPU backend without LLVM optimization and with its older per-op emitters compiles them
# about 3.5x faster (BUILD_NOTES: "Fast-compile flags for the suite").
_FAST_COMPILE_WANTED = ("--xla_backend_optimization_level=0 "
                        "--xla_llvm_disable_expensive_passes=true "
                        "--xla_cpu_use_fusion_emitters=false")
_KNOWN_FLAGS = "LOWCOMM_TEST_FAST_COMPILE"  # the probe's answer, inherited by the workers


def _known_to_xla(flags: str) -> str:
  """`flags` less those this jaxlib's XLA does not know. XLA kills a process whose XLA_FLAGS
  name an unknown flag (jax 0.11 dropped --xla_cpu_use_fusion_emitters: the suite died
  silently on a GPU host), so a child process tries them once and each flag it names
  unknown is dropped; the answer is passed on in the environment."""
  if _KNOWN_FLAGS in os.environ:
    return os.environ[_KNOWN_FLAGS]
  kept = flags.split()
  for _ in range(len(kept)):
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"],
                           env=dict(os.environ, XLA_FLAGS=" ".join(kept), JAX_PLATFORMS="cpu"),
                           capture_output=True, text=True)
    unknown = re.search(r"Unknown flags? in XLA_FLAGS: (--[\w-]+)", probe.stderr)
    if probe.returncode == 0 or unknown is None:
      break  # known, or a failure of another kind: the tests will report it
    kept = [f for f in kept if f.split("=")[0] != unknown.group(1)]
  os.environ[_KNOWN_FLAGS] = " ".join(kept)
  return os.environ[_KNOWN_FLAGS]


FAST_COMPILE = _known_to_xla(_FAST_COMPILE_WANTED)


def xla_flags(devices: int | None = None) -> str:
  """XLA_FLAGS for a test's subprocess: the fast compile, and `devices` forced host devices
  (None: the launcher or the process picks)."""
  forced = f"--xla_force_host_platform_device_count={devices} " if devices else ""
  return forced + FAST_COMPILE


os.environ.setdefault("XLA_FLAGS", xla_flags(8))


def _nvidia_gpu() -> bool:
  """A jax CUDA plugin is installed (a jax_plugins.xla_cuda* module, as jax discovers them)
  and an NVIDIA device is visible (the nodes jax/_src/hardware_utils.py looks for); found
  without importing jax."""
  spec = importlib.util.find_spec("jax_plugins")
  plugin = spec is not None and any(m.name.startswith("xla_cuda") for m in
                                    pkgutil.iter_modules(spec.submodule_search_locations))
  device = any(os.path.exists(d) for d in ("/dev/nvidia0", "/dev/dxg"))
  return plugin and device and os.environ.get("CUDA_VISIBLE_DEVICES") not in ("", "-1")


# The suite's numerics (8 host devices, bit-identical results) are the CPU backend's, and on a
# GPU host JAX would default to its one GPU: the CPU is the default backend everywhere. The
# suite's pytest processes also reach the GPU for tests/test_gpu.py (the first platform
# listed is the default); the programs the tests start (CLI runs, several processes of one
# run) see the CPU only, so they never share the one GPU. A JAX_PLATFORMS the user set wins.
_TEST_PLATFORMS = "LOWCOMM_TEST_JAX_PLATFORMS"  # JAX_PLATFORMS of this suite's pytest processes
_NVIDIA_GPU = _nvidia_gpu()
if "JAX_PLATFORMS" not in os.environ:
  os.environ["JAX_PLATFORMS"] = "cpu"
  if _NVIDIA_GPU:
    os.environ[_TEST_PLATFORMS] = "cpu,cuda"
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the workers share it
TEST_PLATFORMS = os.environ.get(_TEST_PLATFORMS, os.environ["JAX_PLATFORMS"])
if TEST_PLATFORMS != os.environ["JAX_PLATFORMS"]:
  import jax
  jax.config.update("jax_platforms", TEST_PLATFORMS)  # before any backend starts
GPU_PRESENT = _NVIDIA_GPU and (TEST_PLATFORMS == "" or
                               bool({"cuda", "gpu"} & set(TEST_PLATFORMS.split(","))))
GPU_REASON = "needs an NVIDIA GPU (jax CUDA plugin and a device) that JAX_PLATFORMS allows"
_DEFAULT_COMPILE_CHILD = "LOWCOMM_TEST_DEFAULT_COMPILE"
REPO = pathlib.Path(__file__).resolve().parents[1]
_SHARED_DATA = REPO.parent / "shared" / "data"
if _SHARED_DATA.is_dir():
  os.environ.setdefault("LOWCOMM_DATA_DIR", str(_SHARED_DATA))
  os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(_SHARED_DATA / "tiktoken"))
os.environ.setdefault("LOWCOMM_CACHE_DIR", tempfile.mkdtemp(prefix="lowcomm_cache_"))
# Many tests (and the CLI subprocesses they start, which inherit this) compile the same tiny
# programs; JAX's persistent compilation cache lets later ones load them instead.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="lowcomm_jax_cache_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

requires_gpu = pytest.mark.skipif(not GPU_PRESENT, reason=GPU_REASON)


def set_fields(tree, overrides: dict):
  """Sets dotted fields of a config (or nested dict) in place: {'outer.lr': 1.0}."""
  for dotted, value in overrides.items():
    node = tree
    *parents, leaf = dotted.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return tree


def bench_module(name: str):
  """bench/<name>.py as a module, its sibling imports (`import stats`) found as when it runs
  as `python bench/<name>.py`: bench/ goes first on sys.path, here only."""
  bench = str(REPO / "bench")
  if bench not in sys.path:
    sys.path.insert(0, bench)
  return importlib.import_module(name)


def load_config(name: str, **overrides):
  """configs/<name>.py with dotted-field overrides, e.g. load_config('smoke', **{'outer.lr': 1.0})."""
  return set_fields(runpy.run_path(str(REPO / "configs" / f"{name}.py"))["get_config"](),
                    overrides)


def sim_and_runner_config(algorithm: str, **overrides):
  """Four simulated workers, 3 rounds of H = 2, a checkpoint every round, on the simulator's
  layout (one replica device). The runner (train_rounds, train.run) is handed the same
  config: it reads no sim.* field, and a config built again gets the same programs back
  (program_cache). With a checkpoint every round no sync is held for the next round's
  program, so train.run runs train_rounds' programs."""
  return load_config("smoke", algorithm=algorithm, rounds=3, inner_steps=2, num_workers=4,
                     **{"runtime": "simulator", "eval_every": 3, "checkpoint_every": 1,
                        "mesh.replica": 1, **overrides})


@pytest.fixture
def smoke_config():
  return lambda **overrides: load_config("smoke", **overrides)


def train_rounds(config, rounds: int, *, record: list | None = None):
  """Builds `config` and trains `rounds` rounds the way train.run does, without the files.
  `record`: a list to append each sync call to (`record_syncs`).

  Returns (run, global state, this process's worker states, last round's metrics)."""
  from lowcomm_jax.runtimes.spmd import train
  r = train.build(config)
  fns = train.jitted_steps(r)
  if record is not None:
    record_syncs(fns, record)
  with r.partitioner():
    state, workers = train.init_run(r, fns)
    for _ in range(rounds):
      batches = [s.next_round(h.inner_steps) for s, h in zip(r.data.streams, r.topology.hosts)]
      state, workers, metrics, _ = train.train_round(
          r, fns, state, workers, batches, [h.inner_steps for h in r.topology.hosts])
  return r, state, workers, metrics


class SyncCall(NamedTuple):
  """One call of a sync program, in NumPy: θ before, the workers' Δ [W, N], θ after."""
  theta: np.ndarray
  deltas: np.ndarray
  new_theta: np.ndarray


def record_syncs(fns, calls: list | None = None) -> list[SyncCall]:
  """Wraps each of `fns`' sync programs (train.jitted_steps) so that every call appends a
  `SyncCall` to `calls` (a new list by default), which it returns."""
  calls = [] if calls is None else calls

  def recording(sync):
    def call(state, deltas_R, signals, metrics=True):
      theta, deltas = np.asarray(state.params), np.asarray(deltas_R)
      state, out = sync(state, deltas_R, signals, metrics=metrics)
      calls.append(SyncCall(theta, deltas, np.asarray(state.params)))
      return state, out
    return call

  fns.syncs[:] = [recording(sync) for sync in fns.syncs]
  return calls


@pytest.fixture(scope="session")
def ray_cluster():
  """One local Ray per test process, as a run starts one (cluster.connect, 2 CPUs), shared
  by every module that runs Ray in-process and shut down once at the end. With a Ray per
  module, a test process that ran both modules started Ray a second time after
  `ray.shutdown()`; CI at a678ecb lost a test process mid-test that way (the likely
  cause, not proven), and one start per process leaves nothing to restart."""
  ray = pytest.importorskip("ray")
  from lowcomm_jax.runtimes.ray import cluster
  assert cluster.connect(load_config("smoke", runtime="ray", num_workers=2,
                                     **{"mesh.replica": 1, "ray.num_cpus": 2}))
  yield
  ray.shutdown()


def driver_gets_at_saves(monkeypatch) -> list[dict]:
  """Makes every Ray driver of this test count what its `ray.get`s return while it saves a
  checkpoint (bench/ray_overheads.py `count_saves`): {"received": pickled bytes, "seconds"}
  per checkpoint, in the list returned."""
  return bench_module("ray_overheads").count_saves(monkeypatch.setattr)


def ray_checkpoint(config, workdir) -> tuple[dict, dict, dict]:
  """The newest checkpoint of the Ray run in `workdir`: (each server's state by name, the
  driver's meta, each worker's state)."""
  from lowcomm_jax.runtimes.ray import checkpoints
  from lowcomm_jax.run.files import RunFiles
  files = RunFiles(config, workdir)
  try:
    mark = files.open_checkpoints()
    return checkpoints.restore(files.ckpt, checkpoints.run_of(config), mark)
  finally:
    files.close()


def checkpointed_state(config, workdir, run=None):
  """((global state, worker states), data-stream states) of the workdir's latest checkpoint,
  restored to the shapes of `run` (default: `config` built; pass the run where building it
  again costs, as a LoRA build initializing its frozen base)."""
  from lowcomm_jax.runtimes.spmd import train
  from lowcomm_jax.run.checkpoint import Checkpointer, abstract_with_shardings
  r = run if run is not None else train.build(config)
  ckpt = Checkpointer(pathlib.Path(workdir) / "checkpoints", max_to_keep=2)
  state, _, workers, data = ckpt.restore(
      ckpt.latest_round(), abstract_with_shardings(r.state_spec.abstract, r.state_spec.shardings),
      r.abstract_workers())
  ckpt.close()
  return (state, workers), data


def assert_run_resumes_exactly(config, tmp_path, stop_after_rounds: int):
  """`config` trained straight and stopped after `stop_after_rounds` then resumed: the same
  summary (losses, bytes) and the same checkpointed global state, worker states and data
  streams, bit for bit. Returns (the straight run's summary, its checkpointed global
  state)."""
  import jax
  from lowcomm_jax.runtimes.spmd import train
  straight = train.run(config, tmp_path / "straight")
  stopped = train.run(config, tmp_path / "resumed", stop_after_rounds=stop_after_rounds)
  assert stopped == {"stopped_at_round": stop_after_rounds}
  resumed = train.run(config, tmp_path / "resumed")
  for key in ("eval_loss", "train_loss", "bytes_sent", "bytes_received"):
    assert resumed[key] == straight[key], key
  (a, wa), da = checkpointed_state(config, tmp_path / "straight")
  (b, wb), db = checkpointed_state(config, tmp_path / "resumed")
  jax.tree.map(np.testing.assert_array_equal, (a, wa, da), (b, wb, db))
  return straight, a


def assert_simulator_equals_runner(config, tmp_path, rounds: int = 3) -> dict:
  """`config` simulated (sim_and_runner_config) ends at the runner's θ after `rounds` rounds,
  bit for bit, and the simulation stopped after one checkpoint and resumed is the same.
  Returns the simulation's summary."""
  from lowcomm_jax.runtimes.simulator import simulate
  summary = simulate.run(config, tmp_path / "whole")
  assert summary["algorithm"] == config.algorithm
  assert summary["total_inner_steps"] == rounds * config.num_workers * config.inner_steps
  _, state, _, _ = train_rounds(config, rounds)
  np.testing.assert_array_equal(
      np.asarray(simulate.final_global_params(config, tmp_path / "whole")),
      np.asarray(state.params))
  assert_simulation_resumes_exactly(config, tmp_path / "whole", summary, tmp_path / "split")
  return summary


def assert_simulation_resumes_exactly(config, whole_dir, whole_summary, split_dir,
                                      stop_after_checkpoints: int = 1):
  """`config` simulated again in `split_dir`, stopped after that many checkpoints and
  resumed: the same summary (clock, bytes, losses, per-worker records) and the same final
  model, bit for bit, as the uninterrupted run in `whole_dir`."""
  from lowcomm_jax.runtimes.simulator import simulate
  stopped = simulate.run(config, split_dir, stop_after_checkpoints=stop_after_checkpoints)
  assert stopped["stopped_at"] == stop_after_checkpoints, stopped
  resumed = simulate.run(config, split_dir)
  for key in ("eval_loss", "train_loss", "virtual_seconds", "mean_staleness", "mean_drift",
              "total_inner_steps", "bytes_sent", "workers"):
    assert resumed[key] == whole_summary[key], key
  np.testing.assert_array_equal(np.asarray(simulate.final_global_params(config, split_dir)),
                                np.asarray(simulate.final_global_params(config, whole_dir)))


def rerun_with_default_compile(request) -> bool:
  """For a test of a claim that holds as XLA compiles by default (two programs bit-identical):
  in the suite, reruns the test in a child pytest with XLA's default CPU compilation (the
  suite's FAST_COMPILE emits reductions in another order in each program), checks that it
  passed and returns True (the test then returns). In that child it returns False."""
  if os.environ.get(_DEFAULT_COMPILE_CHILD):
    return False
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             **{_DEFAULT_COMPILE_CHILD: "1"})
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                         "--durations=0", request.node.nodeid], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
  return True


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "bf16": 2, "f16": 2, "s16": 2,
                "u16": 2, "f32": 4, "s32": 4, "u32": 4}


def all_gathered_bytes(hlo: str) -> int:
  """Bytes of the results of a compiled program's all-gathers (tuples included): what every
  device receives, its own share with it."""
  total = 0
  for line in hlo.splitlines():
    m = re.search(r"= (\(.*?\)|\S+) all-gather(-start)?\(", line)
    if m:
      for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
        total += _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
  return total


def pytest_collection_modifyitems(config, items):
  """The `slow` marker on every test over slow_marker.SLOW_OVER_S seconds in one of the clean
  CI runs recorded in tests/durations.txt (a measured rule, not a judgement per test), but those
  marked `quick`: the quick set's real Ray rounds (test_ray_quick.py), kept in by intent."""
  import slow_marker
  slow = slow_marker.slow(slow_marker.read())
  for item in items:
    if item.nodeid in slow and item.get_closest_marker("quick") is None:
      item.add_marker(pytest.mark.slow)
