"""scripts/bench_sampling.py end to end at a toy size: every case runs both samplers."""

import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
bench_sampling = importlib.import_module("bench_sampling")


def test_every_case_runs_and_is_recorded(tmp_path, capsys):
  out = tmp_path / "sampling.json"
  assert bench_sampling.main(["--batch", "4", "--vocab", "1024", "--iters", "1", "--widths", "64",
                              "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert [r["case"] for r in result["rows"]] == list(bench_sampling.CASES)
  assert result["rows"][-1]["fallback_rows"] == 4  # flat logits: every row sorts
  assert {r["case"] for r in result["width_sweep"]} == set(bench_sampling.SWEEP)
  assert result["cpu_model"] and result["commit"]
  assert "| greedy |" in capsys.readouterr().out
