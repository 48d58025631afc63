"""summary.json's common part (run/summary.py): every runtime writes the same keys, with the
types and meanings written down there. The Ray runtime's runs are held to it in
tests/test_ray_quick.py (a real Ray round in each form)."""

import json

import pytest

from conftest import load_config
from lowcomm_jax.run import summary as summary_lib


def _config(runtime: str, **overrides):
  return load_config("smoke", **{"runtime": runtime, "num_workers": 2, "rounds": 2,
                                 "inner_steps": 2, "eval_every": 2, "checkpoint_every": 2,
                                 "log_every": 1, "mesh.replica": 1, **overrides})


@pytest.mark.parametrize("runtime", ["spmd", "simulator"])
def test_every_runtime_writes_the_common_keys(tmp_path, runtime):
  if runtime == "spmd":
    from lowcomm_jax.runtimes.spmd import train as runner
  else:
    from lowcomm_jax.runtimes.simulator import simulate as runner
  returned = runner.run(_config(runtime), tmp_path)
  written = json.loads((tmp_path / "summary.json").read_text())
  assert summary_lib.problems(written) == []
  assert written["runtime"] == runtime and returned["runtime"] == runtime
  assert written["tokens"] == 2 * 2 * 2 * 4 * 32  # rounds · workers · H · batch · seq_len
  assert written["params"] == written["trainable_params"] > 0


def test_a_missing_or_mistyped_common_key_is_named():
  good = {key: (types[0]() if types[0] is not float else 1.0)
          for key, (types, _) in summary_lib.COMMON.items()}
  assert summary_lib.problems(good) == []
  del good["tokens"]
  good["eval_loss"] = "2.3"
  good["num_workers"] = True  # (a bool is an int to Python, not a count)
  lines = summary_lib.problems(good)
  assert len(lines) == 3
  assert lines[0].startswith("summary.json's 'num_workers' is True, not int")
  assert any(line.startswith("summary.json lacks 'tokens' (training tokens") for line in lines)
