"""scripts/gpu_diag.py: `--smoke` runs every phase on the CPU and writes its JSON (and one HLO
file per batch size); the trace summary and the control-flow count on inputs worked out by hand."""

import json

import pytest

from helpers import load_script

gpu_diag = load_script("gpu_diag")


# `mosaic`: scripts/test_mosaic.sh runs it again under jax >= 0.11, where the Mosaic phases run
# (in interpret mode) instead of saying why not.
@pytest.mark.mosaic
def test_smoke_runs_every_phase(tmp_path):
  out = tmp_path / "diag.json"
  assert gpu_diag.main(["--smoke", "--out", str(out)]) == 0
  report = json.loads(out.read_text())
  assert report["smoke"] is True and "commit" in report and report["wall_s"] > 0
  phases = report["phases"]
  assert list(phases) == list(gpu_diag.PHASES)
  assert not [p for p, v in phases.items() if "error" in v], {p: v["error"] for p, v in phases.items() if "error" in v}
  assert phases["env"]["jax"] and phases["env"]["backend"] == "cpu"
  assert phases["ceilings"]["hbm_gb_s"] > 0 and phases["ceilings"]["read_gb_s"] > 0
  for B in gpu_diag.SMOKE_PLAN.batches:
    case = phases["step"][f"B{B}"]
    shipped, plain = case["variants"]["shipped"], case["variants"]["no_cmd_buffers"]
    assert shipped["ms_per_step"] > 0 and plain["ms_per_step"] > 0 and shipped["launch_ms_median"] > 0
    assert plain["compiler_options"] == {"xla_gpu_enable_command_buffer": ""}
    # The third variant only where the shipped program still branches or loops.
    flow = case["variants"]["cmd_buffers_control_flow"]
    assert ("skipped" in flow) == (not any(case["control_flow"].values()))
    assert case["engine_step"]["ms_per_step"] > 0
    assert (tmp_path / case["hlo_file"]).read_text().startswith("HloModule")
    trace = phases["trace"][f"B{B}"]
    assert trace["kernels_per_step"] > 0 and trace["steps"] == gpu_diag.SMOKE_PLAN.trace_steps
  assert len(list(tmp_path.iterdir())) <= 8
  attention = phases["attention"]["B3-kv40"]["impls"]
  by = {r["impl"]: r for r in attention}
  assert by["pallas"]["max_abs_err_vs_xla_reference"] < 0.05 and by["pallas"]["us"] > 0
  if gpu_diag.MOSAIC_AVAILABLE:
    assert by["mosaic"]["max_abs_err_vs_xla_reference"] < 0.05
    for key, case in phases["gemv"].items():
      if key != "phase_s":
        assert case["impls"]["mosaic"]["max_rel_err_vs_reference"] < 1e-5, key
  else:  # jax < 0.11: said, not silently missing
    assert "jax >= 0.11" in by["mosaic"]["skipped"]
    assert "jax >= 0.11" in phases["gemv"]["skipped"]


def test_trace_summary_per_step():
  """Two steps of a made-up GPU trace: 3 kernels and one device -> host copy each on a stream,
  and the XLA module spanning them on a line of its own (not counted)."""
  meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
          {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7(Compute)"}},
          {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "XLA Modules"}}]
  acts = []
  for step in range(2):
    t = 1000.0 * step
    acts += [{"ph": "X", "pid": 1, "tid": 1, "name": "jit__forward_step", "ts": t, "dur": 720.0},  # not a kernel
             {"ph": "X", "pid": 1, "tid": 7, "name": "gemm_fusion_dot.3", "ts": t, "dur": 300.0},
             {"ph": "X", "pid": 1, "tid": 7, "name": "gemm_fusion_dot.7", "ts": t + 310, "dur": 300.0},  # 10 us gap
             {"ph": "X", "pid": 1, "tid": 7, "name": "loop_add_fusion", "ts": t + 650, "dur": 50.0},  # 40 us gap
             {"ph": "X", "pid": 1, "tid": 7, "name": "MemcpyDtoH", "ts": t + 700, "dur": 20.0}]
  host = [{"ph": "X", "pid": 2, "name": "PjitFunction", "ts": 0.0, "dur": 5000.0}]  # not GPU activity
  s = gpu_diag.summarize_trace(meta + acts + host, steps=2, wall_s=2e-3)
  assert s["source"] == "gpu: /device:GPU:0"
  assert s["kernels_per_step"] == 3 and s["d2h_copies_per_step"] == 1 and s["d2h_ms_per_step"] == 0.02
  assert s["busy_ms_per_step"] == pytest.approx(0.67)  # 300 + 300 + 50 + 20 us
  assert s["wall_ms_per_step"] == pytest.approx(1.0) and s["busy_share_of_wall"] == pytest.approx(0.67)
  # Gaps over 20 us: 40 us inside each step and 280 us between them (720 -> 1000).
  assert s["gaps_over_20us_per_step"] == 1.5 and s["largest_gaps_us"] == [280.0, 40.0, 40.0]
  assert s["top_kernels_ms_per_step"] == [["gemm_fusion_dot", 0.6], ["loop_add_fusion", 0.05]]


def test_control_flow_ops_counts_instructions():
  hlo = ("%w = (s32[], f32[8]) while((s32[], f32[8]) %t), condition=%c, body=%b\n"
         "%c2 = f32[8] conditional(pred[] %p, f32[8] %a, f32[8] %a), true_computation=%x\n"
         "%f = f32[8] fusion(f32[8] %a), kind=kLoop, calls=%while_body_like\n")
  assert gpu_diag.control_flow_ops(hlo) == {"while": 1, "conditional": 1}


def test_unknown_phase_is_refused(capsys):
  with pytest.raises(SystemExit):
    gpu_diag.main(["--smoke", "--phases", "env,warp"])
  assert "unknown phases ['warp']" in capsys.readouterr().err
