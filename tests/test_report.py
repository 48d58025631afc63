import json

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
