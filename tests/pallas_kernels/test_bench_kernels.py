"""scripts/bench_kernels.py --smoke runs end to end on CPU and writes a complete JSON report."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_writes_report(tmp_path):
  out = tmp_path / "kernels.json"
  proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_kernels.py"), "--smoke",
                         "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(out.read_text())
  for field in ("device", "jax_version", "git_commit", "command", "date", "smoke", "ceilings",
                "results"):
    assert field in report
  assert report["smoke"] is True
  assert report["ceilings"]["hbm_gb_s"] > 0 and report["ceilings"]["matmul_tflop_s"] > 0
  by_section = {}
  for row in report["results"]:
    by_section.setdefault(row["section"], []).append(row)
    assert row["us"] > 0 and row["speedup_of_pallas"] > 0
  assert set(by_section) == {"decode", "mixed", "prefill", "accept"}
  impls = {section: {r["impl"] for r in rows} for section, rows in by_section.items()}
  assert {"pallas", "xla_reference"} <= impls["decode"]
  assert any(i.startswith("sdpa_") for i in impls["decode"])
  assert any(i.startswith("sdpa_") for i in impls["prefill"])
  for row in by_section["decode"] + by_section["mixed"]:
    assert row["gb_s"] > 0 and row["pct_of_copy_bw"] > 0
  for row in by_section["prefill"]:
    assert row["tflop_s"] > 0 and row["pct_of_matmul"] > 0
  # The accept kernel: sampled drafts of both kinds, timed against its reference and (point-mass)
  # today's engine path, with integer outputs equal to the reference's.
  assert {r["mode"] for r in by_section["accept"]} == {"point_mass", "full_q"}  # greedy: GPU only
  assert {"pallas", "jnp_reference", "engine_sample_accept"} <= impls["accept"]
  assert all(r["integer_mismatches_vs_reference"] == 0 and r["gb_s"] > 0 for r in by_section["accept"])
  # The kernels agree with their baselines even in the smoke run (bf16 inputs).
  pallas_rows = [r for r in by_section["decode"] + by_section["mixed"] if r["impl"] == "pallas"]
  assert all(r["max_abs_err_vs_xla_reference"] < 0.05 for r in pallas_rows)
  assert "pallas" in proc.stdout and "wrote" in proc.stdout


@pytest.mark.skipif(jax.devices()[0].platform == "gpu",
                    reason="this machine has a GPU, so --gpu would not fail")
def test_gpu_mode_without_gpu_is_a_clear_error():
  proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_kernels.py"), "--gpu"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 2
  assert "--gpu asked for, but JAX sees no GPU" in proc.stderr
