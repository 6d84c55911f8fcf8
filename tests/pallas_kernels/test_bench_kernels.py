"""`jaxinfer bench kernels --smoke` (jaxinfer/bench/kernels.py), in-process with its timer stubbed: every kernel still runs
once at the smoke shapes (outputs checked against the references), and every derived number
in the JSON report is the hand-worked one for the smoke shapes at 50 us a call."""

import json

import jax
import pytest

from jaxinfer import bench
from jaxinfer.bench import kernels as bench_kernels

US = 50.0  # what the stubbed timer says every call takes


@pytest.fixture
def report(tmp_path, monkeypatch, capsys):
  def time_us(fn, *args, shapes):
    jax.block_until_ready(fn(*args))
    return US

  monkeypatch.setattr(bench_kernels, "time_us", time_us)
  out = tmp_path / "kernels.json"
  assert bench.main(["kernels", "--smoke", "--out", str(out)]) == 0
  assert f"wrote {out}" in capsys.readouterr().out
  return json.loads(out.read_text())


def test_smoke_report_numbers_are_the_hand_worked_ones(report):
  assert report["smoke"] is True and report["command"] == f"jaxinfer bench kernels --smoke --out {report['command'].split()[-1]}"
  assert {"device", "jax_version", "commit", "date", "shapes", "machine", "load_average_before"} <= set(report)
  # Copy: 4 MiB of bf16 read and written = 8 MiB in 50 us; matmul: 2 n^3 flops at n = 256.
  assert report["ceilings"] == pytest.approx({
      "copy_bytes": 8 * 2**20, "copy_us": US, "hbm_gb_s": 8 * 2**20 / 50e3,  # 167.77216 GB/s
      "matmul_n": 256, "matmul_us": US, "matmul_tflop_s": 2 * 256**3 / 50e6})  # 0.67108864
  rows = {}
  for r in report["results"]:
    rows.setdefault(r["section"], {})[(r["impl"], r.get("mode"))] = r
  assert {s: sorted(i for i, _ in v) for s, v in rows.items()} == {
      "decode": ["pallas", "sdpa_xla_dense", "xla_reference"],  # no cuDNN on the CPU
      "mixed": ["pallas", "xla_reference"],
      "prefill": ["pallas", "sdpa_xla"],
      "accept": ["engine_sample_accept", "jnp_reference", "jnp_reference", "pallas", "pallas"]}
  # Decode: 3 sequences x 40 tokens, K and V, 2 kv heads x 64 dims of bf16 = 61440 bytes.
  for r in rows["decode"].values():
    assert (r["kv_bytes"], r["us"], r["speedup_of_pallas"]) == (61440, US, 1.0)
    assert (r["gb_s"], r["pct_of_copy_bw"]) == pytest.approx((1.2288, 0.732421875))
  # Mixed: kv lengths 40 + 40 + 30 + 24 = 134 tokens -> 68608 bytes; 1 + 1 + 4 + 24 = 30 query tokens.
  for r in rows["mixed"].values():
    assert (r["kv_bytes"], r["T"]) == (68608, 30)
    assert (r["gb_s"], r["pct_of_copy_bw"]) == pytest.approx((1.37216, 0.81787109375))
  # Prefill: 2 * B * Hq * D * T * (T + 1) = 2 * 1 * 4 * 64 * 48 * 49 flops over the causal triangle.
  for r in rows["prefill"].values():
    assert r["flops"] == 1204224
    assert (r["tflop_s"], r["pct_of_matmul"]) == pytest.approx((0.02408448, 3.5888671875))
  # Accept: float32 logits [3, 3, 300] read once (+ draft probs [3, 2, 300] for full_q).
  for (impl, mode), r in rows["accept"].items():
    assert (r["mode"], r["bytes_read_once"]) == (mode, {"point_mass": 10800, "full_q": 18000}[mode])
    assert r["gb_s"] == pytest.approx({"point_mass": 0.216, "full_q": 0.36}[mode])
    assert r["integer_mismatches_vs_reference"] == 0
  assert ("engine_sample_accept", "full_q") not in rows["accept"]  # the engine has no full-q acceptance
  # The kernels agree with their baselines even in the smoke run (bf16 inputs).
  assert all(r["max_abs_err_vs_xla_reference"] < 0.05
             for r in (rows["decode"][("pallas", None)], rows["mixed"][("pallas", None)]))


@pytest.mark.skipif(jax.devices()[0].platform == "gpu",
                    reason="this machine has a GPU, so --gpu would not fail")
def test_gpu_mode_without_gpu_is_a_clear_error(capsys):
  with pytest.raises(SystemExit) as e:
    bench.main(["kernels", "--gpu"])
  assert e.value.code == 2
  assert "--gpu asked for, but JAX sees no GPU" in capsys.readouterr().err
