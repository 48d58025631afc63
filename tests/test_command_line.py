"""Bad command lines: one line naming the flag and the fix, exit 2, no traceback, at once."""

import subprocess
import sys

import pytest

from conftest import REPO
from lowcomm_jax.config import command_line
from lowcomm_jax.config.command_line import UsageError

CASES = [
    (["--config=configs/smoke.py", "--config.num_worker=2"],
     "--config.num_worker: no config field 'num_worker'; did you mean num_workers?"),
    (["--config=configs/smoke.py", "--config.optimizer.learning_rate=0.01"],
     "--config.optimizer.learning_rate: optimizer has no field 'learning_rate'; did you mean lr?"),
    (["--config=configs/smoke.py", "--config.outer.halos.syncevery=3"],
     "outer.halos has no field 'syncevery'; did you mean sync_every?"),
    (["--config=configs/smoke.py", "--config.sim.network.bogus=1"],
     "sim.network has no field 'bogus'; fields here: "),
    (["--config=configs/nope.py"], "--config=configs/nope.py: no such file configs/nope.py"),
    (["--config=configs/sim_sweep.py:bogus"],
     "--config=configs/sim_sweep.py:bogus: config argument 'bogus': use METHOD,LEVEL"),
    (["--config=configs/diloco_hetero.py", "--config.hosts[4].tier=0.5"],
     "--config.hosts[4].tier: hosts has 4 rows (0..3)"),
    (["--config=configs/smoke.py", "--config.hosts[0].tier=0.5"],
     "--config.hosts[0].tier: hosts is empty"),
    (["--config", "configs/smoke.py", "--config.rounds[0]=1"], "rounds is not a list"),
    (["--config=configs/sim_sweep.py:diloco,cpu"],
     "config argument 'diloco,cpu': use METHOD,LEVEL[,SIZE] with METHOD one of"),
    (["--config=configs/sim_geo.py:halos,huge"],
     "config argument 'halos,huge': size 'huge' is not one of ['cpu', 'pythia']"),
]


@pytest.mark.parametrize("argv,message", CASES)
def test_each_problem_is_named_with_its_fix(argv, message, monkeypatch):
  monkeypatch.chdir(REPO)
  with pytest.raises(UsageError) as e:
    command_line.check(argv)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_good_overrides_pass(monkeypatch):
  monkeypatch.chdir(REPO)
  config = command_line.check(["--config=configs/diloco_hetero.py", "--config.hosts[3].tier=0.5",
                               "--config.sim.network.inter_gbps", "2", "--workdir=x"])
  assert config.num_workers == 4  # the file's config, before overrides


WORKDIRS = {"configs/sim_geo.py:halos": "runs/sim_geo_halos",
            "configs/sim_geo.py:halos,cpu": "runs/sim_geo_halos_cpu",
            "configs/sim_sweep.py:diloco,very,cpu": "runs/sim_sweep_diloco_very_cpu",
            "configs/async_hetero.py:cpu": "runs/async_hetero_cpu"}


@pytest.mark.parametrize("arg,model,tokenizer", [
    ("configs/sim_geo.py:halos", "pythia_14m", "gpt2"),
    ("configs/sim_geo.py:halos,cpu", "small", "byte"),
    ("configs/sim_sweep.py:diloco,very,cpu", "small", "byte"),
    ("configs/async_hetero.py:cpu", "small", "byte"),
])
def test_a_study_config_takes_a_size_and_each_variant_has_its_own_workdir(arg, model, tokenizer,
                                                                         monkeypatch):
  from lowcomm_jax.main import default_workdir
  monkeypatch.chdir(REPO)
  config = command_line.check([f"--config={arg}"])
  assert (config.model.name, config.data.tokenizer) == (model, tokenizer)
  assert default_workdir(arg) == WORKDIRS[arg]
  assert default_workdir("configs/smoke.py") == "runs/smoke"
  assert default_workdir("configs/sim_geo.py:halos,") == "runs/sim_geo_halos"
  assert default_workdir("configs/x.py:a/../../etc") == "runs/x_a-..-..-etc"


def _main(*args):
  return subprocess.run([sys.executable, "-m", "lowcomm_jax.main", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv,message", [
    *CASES[:2], CASES[4], CASES[6],
    (["--config=configs/smoke.py", "--config.rounds=abc"], "flag --config.rounds=abc: invalid"),
    (["--config=configs/smoke.py", "stray"], "unexpected arguments ['stray']"),
    ([], "Flag --config must have a value"),
    (["--config=configs/smoke.py", "--config.num_workers=0", "--workdir=/nonexistent/never"],
     "invalid config: num_workers=0: need at least one worker"),
])
def test_the_cli_prints_one_line_and_exits_2(argv, message):
  proc = _main(*argv)
  assert proc.returncode == 2, proc.stderr
  lines = [l for l in proc.stderr.splitlines() if l.startswith("lowcomm_jax: error:")]
  assert len(lines) == 1 and message in lines[0], proc.stderr
  assert "Traceback" not in proc.stderr


def test_print_config_shows_resolved_values_with_their_meaning():
  proc = _main("--config=configs/smoke.py", "--config.outer.lr=0.25", "--print_config")
  assert proc.returncode == 0, proc.stderr
  line = next(l for l in proc.stdout.splitlines() if l.startswith("outer.lr"))
  assert "0.25" in line and "outer learning rate" in line
  assert "--print_config" in _main("--help").stdout
