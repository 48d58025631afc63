import json

from conftest import set_fields
from lowcomm_jax import report


def test_markdown_table_reads_summaries(tmp_path):
  run = tmp_path / "diloco"
  run.mkdir()
  (run / "summary.json").write_text(json.dumps({
      "algorithm": "diloco", "num_workers": 4, "inner_steps": 20, "rounds": 15,
      "eval_loss": 2.25, "tokens": 2457600, "bytes_sent": 2**20 * 3,
      "bytes_sent_ddp_equivalent": 2**20 * 60, "wall_seconds": 117.4}))
  table = report.markdown_table([run])
  assert "| diloco | diloco | 4 | 20 | 15 | 2.2500 | 2,457,600 | 3.0 | 20.0 | 117 |" in table


def test_simulated_runs_get_the_simulator_columns_and_a_virtual_time_plot(tmp_path):
  runs = []
  for name, loss in (("async_dn", 3.1), ("diloco", 3.3)):
    run = tmp_path / name
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({
        "algorithm": name, "simulated": True, "heterogeneity": "very", "dylu": False,
        "num_workers": 2, "total_inner_steps": 400, "eval_loss": loss, "virtual_seconds": 52.25,
        "mean_staleness": 1.5, "mean_drift": 0.0123, "bytes_sent": 2**20,
        "bytes_sent_ddp_equivalent": 2**22,
        "workers": [{"idle_fraction": 0.1}, {"idle_fraction": 0.3}]}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": i, "virtual_seconds": 10.0 * i, "total_inner_steps": 80 * i, "bytes_sent": 99 * i,
         "tokens": 512 * i, "eval_loss": loss + 1 / i}) + "\n" for i in range(1, 6)))
    runs.append(run)
  table = report.markdown_table(runs)
  assert "| async_dn | async_dn | very | False | 2 | 400 | 3.1000 | 52.2 | 1.50 | 0.0123 | 0.20 | 1.0 |" \
      in table
  fig = report.plot(runs, tmp_path / "curves.png")
  assert (tmp_path / "curves.png").stat().st_size > 10_000
  assert [ax.get_xlabel() for ax in fig.axes] == [
      "bytes sent per worker (MiB)", "tokens (all workers)", "virtual seconds"]


def _run(tmp_path, name, config=None, bytes_per_round=2**20, loss=3.0):
  """A fake finished workdir: summary.json, metrics.jsonl (5 rounds) and maybe config.json."""
  run = tmp_path / name
  run.mkdir()
  (run / "summary.json").write_text(json.dumps({
      "algorithm": "diloco", "num_workers": 2, "inner_steps": 10, "rounds": 5, "eval_loss": loss,
      "tokens": 5 * 4096, "bytes_sent": 5 * bytes_per_round,
      "bytes_sent_ddp_equivalent": 50 * bytes_per_round, "wall_seconds": 3.0}))
  (run / "metrics.jsonl").write_text("".join(json.dumps(
      {"step": 10 * i, "round": i, "tokens": 4096 * i, "bytes_sent": bytes_per_round * i,
       "train_loss": loss + 1.5 / i, **({"eval_loss": loss + 1 / i} if i % 2 else {})}) + "\n"
      for i in range(1, 6)))
  if config is not None:
    (run / "config.json").write_text(json.dumps(
        {"config": config, "command": ["python", "-m", "lowcomm_jax.main"], "resumes": []}))
  return run


def _config(**changes):
  c = {"algorithm": "diloco", "seed": 0, "hosts": [],
       "outer": {"lr": 0.7, "nesterov": True, "halos": {"sync_every": 8}},
       "sim": {"network": {"inter_gbps": 1.0, "worker_regions": []}}}
  return set_fields(c, changes)


def test_config_diff_shows_exactly_the_differing_fields(tmp_path):
  hetero = [{"tier": 1.0, "workers": 1, "batch_size": 0, "inner_steps": 0, "speed": 0.0},
            {"tier": 0.25, "workers": 2, "batch_size": 0, "inner_steps": 0, "speed": 0.0}]
  runs = [_run(tmp_path, "a", _config()),
          _run(tmp_path, "b", _config(**{"outer.lr": 0.5, "sim.network.inter_gbps": 2.5})),
          _run(tmp_path, "c", _config(**{"outer.halos.sync_every": 4, "hosts": hetero})),
          _run(tmp_path, "old")]
  diff = report.config_diff(runs).splitlines()
  assert diff == [
      "| field | a | b | c |",
      "|---|---|---|---|",
      "| hosts | [] | [] | [host(tier=1.0, workers=1), host(tier=0.25, workers=2)] |",
      "| outer.lr | 0.7 | 0.5 | 0.7 |",
      "| outer.halos.sync_every | 8 | 8 | 4 |",
      "| sim.network.inter_gbps | 1.0 | 2.5 | 1.0 |",
      "",  # the note is not a table row
      "No readable config.json (not compared): old.",
  ]
  assert report.config_diff(runs[:1]) == ""  # nothing to compare a lone run with
  same = _run(tmp_path, "a_again", _config())
  assert report.config_diff([runs[0], same]) == "The configs of a, a_again are identical."


def test_config_diff_marks_fields_only_some_runs_have(tmp_path):
  newer = _config()
  newer["resume_allow"] = "seed"
  diff = report.config_diff([_run(tmp_path, "a", _config()), _run(tmp_path, "b", newer)])
  assert diff.splitlines()[2:] == ["| resume_allow | — | 'seed' |"]


def test_main_prints_the_table_then_the_config_diff(tmp_path, capsys):
  runs = [_run(tmp_path, "a", _config()), _run(tmp_path, "b", _config(seed=1))]
  report.main([str(r) for r in runs])
  out = capsys.readouterr().out
  assert (out.index("| run |") < out.index("Config fields that differ:")
          < out.index("| seed | 0 | 1 |"))


def test_plot_has_eval_loss_vs_bytes_beside_eval_loss_vs_tokens(tmp_path):
  import matplotlib.pyplot as plt
  runs = [_run(tmp_path, "ddp", bytes_per_round=2**30, loss=2.9),
          _run(tmp_path, "diloco", bytes_per_round=2**24, loss=3.0)]
  fig = report.plot(runs, tmp_path / "curves.png")
  assert (tmp_path / "curves.png").stat().st_size > 10_000
  bytes_ax, tokens_ax, train_ax = fig.axes
  assert bytes_ax.get_xlabel() == "bytes sent per worker (GiB, log scale)"
  assert bytes_ax.get_xscale() == "log"  # the runs differ 64x
  assert bytes_ax.get_ylabel() == tokens_ax.get_ylabel() == "eval loss"
  assert tokens_ax.get_xlabel() == "tokens (all workers)"
  assert "bytes sent" in bytes_ax.get_title() and "tokens" in tokens_ax.get_title()
  assert train_ax.get_ylabel() == "train loss"
  for ax in (bytes_ax, tokens_ax):
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["ddp", "diloco"]
  ddp_line = bytes_ax.get_lines()[0]
  assert list(ddp_line.get_xdata()) == [1.0, 3.0, 5.0]  # eval rounds 1, 3, 5, in GiB
  assert list(tokens_ax.get_lines()[1].get_xdata()) == [4096, 3 * 4096, 5 * 4096]
  plt.close(fig)


def test_metrics_rows_skip_resume_events_and_a_line_cut_short(tmp_path):
  (tmp_path / "metrics.jsonl").write_text(
      '{"step": 2, "train_loss": 3.0}\n{"step": 2, "event": "resume", "round": 1}\n'
      '{"step": 4, "train_lo\n{"step": 4, "train_loss": 2.5}\n')
  assert report.read_metrics(tmp_path) == [{"step": 2, "train_loss": 3.0},
                                           {"step": 4, "train_loss": 2.5}]


def test_a_run_is_finished_once_its_summary_is_there_and_read_back_as_written(tmp_path):
  assert not report.has_summary(tmp_path)  # still running, or cut off
  (tmp_path / "summary.json").write_text(json.dumps({"eval_loss": 2.5, "bytes_sent": 3}))
  assert report.has_summary(tmp_path)
  assert report.read_summary(str(tmp_path)) == {"eval_loss": 2.5, "bytes_sent": 3}
