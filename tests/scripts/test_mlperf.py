"""`jaxinfer bench mlperf` (jaxinfer/bench/mlperf.py) end to end on a tiny model: every scenario,
both SUTs, a few samples.

LoadGen itself measures the latencies, so these tests check what the
harness is responsible for: every issued query is answered with its real
tokens (no errors, token counts that LoadGen turns into throughput), the
first token is reported before the end (TTFT percentiles exist and are
below the request latency), and the report, table and plot are written.
"""

import json
from pathlib import Path

import pytest

from jaxinfer import bench

ROOT = Path(__file__).resolve().parents[2]

TINY = ROOT / "tests" / "data" / "tiny" / "llama3"
SMALL = ["--model", str(TINY), "--duration", "0.5", "--samples", "4", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "16", "--offline-qps", "8"]  # 5 step buckets to warm up


@pytest.mark.slow
def test_every_scenario_in_process(tmp_path, capsys):
  assert bench.main(["mlperf", *SMALL, "--sut", "inprocess", "--qps", "8", "--interactive-qps", "8",
                     "--out", str(tmp_path)]) == 0
  report = json.loads(next(tmp_path.glob("mlperf-*.json")).read_text())
  rows = {r["scenario"]: r for r in report["rows"]}
  assert set(rows) == {"Offline", "Server", "Interactive"}
  for r in rows.values():
    assert r["errors"] == 0, r["first_errors"]
    assert r["result"] in ("VALID", "INVALID")
    assert r["tokens_per_s"] > 0 and r["samples_per_s"] > 0
  assert rows["Offline"]["samples_issued"] >= 4
  for name in ("Server", "Interactive"):
    r = rows[name]
    assert r["queries"] >= 4
    assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] <= r["latency_p99_s"]
    assert r["tpot_p50_s"] > 0
  assert rows["Interactive"]["ttft_limit_s"] == 0.45 and rows["Server"]["ttft_limit_s"] == 2.0
  assert (tmp_path / report["plot"]).stat().st_size > 10_000
  table = capsys.readouterr().out
  assert "| Interactive | inprocess | 8.00 |" in table


@pytest.mark.slow
def test_server_scenario_over_grpc(tmp_path):
  assert bench.main(["mlperf", *SMALL, "--sut", "grpc", "--scenarios", "Server", "--qps", "8",
                     "--out", str(tmp_path)]) == 0
  report = json.loads(next(tmp_path.glob("mlperf-*.json")).read_text())
  [row] = report["rows"]
  assert row["sut"] == "grpc" and row["errors"] == 0, row["first_errors"]
  assert 0 < row["ttft_p50_s"] <= row["latency_p99_s"]


def test_a_sample_longer_than_the_model_is_refused_by_name(tmp_path):
  """A sample that cannot run (prompt longer than the model) is refused up front, by name."""
  data = tmp_path / "d.jsonl"
  data.write_text(json.dumps({"id": 0, "messages": [{"role": "user", "content": "hi " * 400}],
                              "max_tokens": 8}) + "\n")
  with pytest.raises(SystemExit, match="sample 0 has .* prompt tokens"):
    bench.main(["mlperf", *SMALL, "--dataset", str(data), "--scenarios", "Offline", "--out", str(tmp_path)])


def test_bad_arguments_are_named(capsys):
  with pytest.raises(SystemExit):
    bench.main(["mlperf", "--scenarios", "Batch"])
  assert "unknown scenario 'Batch'" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    bench.main(["mlperf", "--qps", "0"])
  assert "target QPS must be > 0" in capsys.readouterr().err
