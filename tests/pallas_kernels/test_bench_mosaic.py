"""`jaxinfer bench mosaic --smoke` (jaxinfer/bench/mosaic.py) runs end to end on a CPU (interpret
mode) and writes its JSON."""

import json

import pytest

from jaxinfer import bench
from pallas_kernels.ragged_paged_attention_mgpu import MOSAIC_AVAILABLE

pytestmark = [
    pytest.mark.mosaic,
    pytest.mark.skipif(not MOSAIC_AVAILABLE,
                       reason="Mosaic GPU interpret mode needs jax >= 0.11 (Python 3.12 venv)"),
]


def test_smoke_run_writes_report(tmp_path):
  out = tmp_path / "mosaic.json"
  assert bench.main(["mosaic", "--smoke", "--reps", "1", "--out", str(out)]) == 0
  report = json.loads(out.read_text())
  for field in ("device", "jax_version", "commit", "command", "date", "smoke", "ceilings",
                "results", "wall_s"):
    assert field in report
  assert report["smoke"] is True and report["ceilings"]["hbm_gb_s"] > 0
  rows = report["results"]
  assert not [r for r in rows if "error" in r], [r["error"] for r in rows if "error" in r]
  impls = {r["impl"] for r in rows}
  assert {"pallas", "mosaic", "mosaic_ws", "mosaic_split3", "mosaic_ws_split3"} <= impls
  assert any(i.startswith("sdpa_") for i in impls)
  # Every kernel agrees with the XLA reference (bf16) and has a bandwidth figure.
  assert all(r["max_abs_err_vs_xla_reference"] < 0.05 and r["us"] > 0 and r["gb_s"] > 0
             for r in rows)
  assert [r["block_sizes"]["num_stages"] for r in rows if "block_sizes" in r] == [3]  # the sweep
  # The fp8 cache section: both kernels on 1-byte values, bytes counted with their scales.
  fp8 = [r for r in rows if r["kv_dtype"] == "float8_e4m3fn" and r["section"] == "decode"]
  assert {r["impl"] for r in fp8} == {"pallas", "mosaic", "mosaic_ws"}
  bf16 = next(r for r in rows if r["kv_dtype"] == "bfloat16")
  assert all(r["kv_bytes"] * 2 * r["D"] == bf16["kv_bytes"] * (r["D"] + 4) for r in fp8)
  # MLA decode: both MLA kernels on a bf16 and an fp8 latent (scales per 64 values counted).
  mla = [r for r in rows if r["section"] == "mla_decode"]
  assert sorted((r["impl"], r["kv_dtype"]) for r in mla) == [
      (impl, kv) for impl in ("mosaic", "mosaic_ws", "pallas") for kv in ("bfloat16", "float8_e4m3fn")]
  L = mla[0]["R"] + mla[0]["E"]
  assert {r["kv_bytes"] for r in mla} == {mla[0]["kv_bytes"], mla[0]["kv_bytes"] // (2 * L) * (L + 4 * 2)}
