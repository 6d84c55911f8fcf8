"""`jaxinfer bench simd-peak` and `cpu-tiles` (jaxinfer/bench/simd_peak.py, cpu_tiles.py): the
C++ harnesses compile and run here, and their rows are what the results carry."""

import json
import platform
import shutil

import pytest

from jaxinfer import bench

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not shutil.which("g++"),
                                reason="the CPU harnesses are AVX2 C++ built with g++ (an x86-64 CPU)")


def test_simd_peak_sets_every_form_against_fp32_fma(tmp_path):
  out = tmp_path / "simd.json"
  assert bench.main(["simd-peak", "--out", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [r["form"] for r in rows][:4] == ["fp32 fma", "int16 madd+add", "int8 maddubs+madd+add", "int8 maddubs x2"]
  assert rows[0]["vs_fp32_fma"] == 1.0 and all(r["macs_per_ns"] > 0 for r in rows)


@pytest.mark.slow
def test_cpu_tiles_times_each_shape_in_cache_and_from_dram(tmp_path):
  out = tmp_path / "tiles.json"
  assert bench.main(["cpu-tiles", "--passes", "1", "--cache-passes", "1", "--dram-layers", "3",
                     "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert [(r["shape"], r["weights"], r["layers"]) for r in result["rows"]] == [
      (s, w, n) for s in ("wq/wo D->D", "gate/up D->F", "down F->D") for w, n in (("cache", 2), ("DRAM", 3))]
  assert all(r["int8_us"] > 0 and r["int4_us"] > 0 for r in result["rows"])
