"""`jaxinfer bench offline` (jaxinfer/bench/offline.py): the GPU mode on the CPU (the
weight-copy detector its matmul probe reports, against a real H200 HLO and XLA CPU's dequantized
copy, and one --smoke row end to end), the table, and the interleaved mode's round order."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DATA, USER_XLA
from jaxinfer import quant
from jaxinfer.config import ModelConfig
from jaxinfer import bench
from jaxinfer.bench import offline as bench_offline
from jaxinfer.params import abstract_params


def test_a_convert_inside_the_gemm_fusion_is_not_a_weight_copy():
  # Compiled on an H200 (jax 0.11.2): an fp8 w_gate at one token. The e4m3 -> f32 convert of the
  # whole [14336, 4096] weight sits inside XLA's Triton GEMM fusion, so nothing weight-sized
  # is written to memory; the entry computation holds only parameters, a bitcast and the fusion.
  hlo = (DATA / "hlo" / "h200-fp8-linear-1-token.hlo.txt").read_text()
  assert "convert" in hlo.split("ENTRY")[0] and "[14336,4096]" in hlo.split("ENTRY")[0]
  assert bench_offline.materialized_weight_copies(hlo, ("[14336,4096]", "[4096,14336]")) == []
  assert bench_offline.gemm_kinds(hlo) == ["__triton_nested_gemm_fusion"]


def test_xla_cpus_dequantized_copy_is_a_weight_copy():
  # fp8 traced for two devices (no CPU kernel): XLA CPU writes the float32 weight per call.
  mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
  w = jax.tree.map(jnp.asarray, quant.quantize(np.ones((576, 1536), np.float32), 1, "fp8"))
  x = jnp.ones((1, 576), jnp.float32)
  f = quant.tracing_on(mesh, lambda x, w: quant.linear("TD,DF->TF", x, w))
  copies = bench_offline.materialized_weight_copies(jax.jit(f).lower(x, w).compile(compiler_options=USER_XLA).as_text(),
                                                    ("[1536,576]", "[576,1536]"))
  assert len(copies) == 1 and "f32[1536,576]" in copies[0], copies


def test_gpu_smoke_row_runs_the_quantized_model(tmp_path, capsys):
  out = tmp_path / "gpu.json"
  # The row itself runs in its own process (`python -m jaxinfer bench offline --gpu-worker`).
  assert bench.main(["offline", "--gpu", "--smoke", "--gpu-formats", "fp8", "--attention-impls", "xla",
                             "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert result["failures"] == [] and len(result["rows"]) == 1
  row = result["rows"][0]
  assert (row["quantization"], row["kv_cache_dtype"], row["resolved_kv_cache_dtype"]) == ("fp8", "auto", "bfloat16")
  # The bytes it measured are the fp8 model's: values, float32 scales, and the bf16 rest.
  cfg = ModelConfig.from_hf(bench_offline.SMOKE)
  want = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize
             for a in jax.tree.leaves(abstract_params(cfg, jnp.bfloat16, quantization="fp8")))
  assert row["weight_bytes"] == want
  assert len(row["batch1_token_ids"]) == 8  # --smoke: 8 new tokens
  assert row["matmul_probe"]["T1"]["full_precision_weight_copies"] == []  # the CPU kernel reads e4m3 as is
  assert "| xla | fp8 | auto |" in capsys.readouterr().out


def test_table_puts_each_row_against_jaxinfer_at_its_precision_and_against_float32():
  row = lambda system, precision, tps, **kw: dict(workload="64 prompts x 128", system=system, dtype="float32",
                                                   precision=precision, tokens_per_s=tps, ttft_s=1.0,
                                                   peak_rss_mb=100.0, **kw)
  rows = [row("jaxinfer", "float32", 200.0, ratio_to_jaxinfer=1.0, ratio_to_float32=1.0),
          row("jaxinfer", "int4", 250.0, ratio_to_jaxinfer=1.0, ratio_to_float32=1.25),
          row("llama.cpp", "int4", 300.0, ratio_to_jaxinfer=1.2, ratio_to_float32=1.5),
          row("jaxinfer", "int8", 150.0, ratio_to_jaxinfer=1.0)]  # a run without a float32 row
  lines = bench_offline.table(rows).splitlines()
  assert lines[0].split("|")[5:7] == [" vs jaxinfer ", " vs float32 "]
  cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[2:]]
  assert [(c[1], c[2], c[4], c[5]) for c in cells] == [
      ("jaxinfer", "float32 (float32)", "1.00x", "1.00x"), ("jaxinfer", "float32 (int4)", "1.00x", "1.25x"),
      ("llama.cpp", "float32 (int4)", "1.20x", "1.50x"), ("jaxinfer", "float32 (int8)", "1.00x", "-")]


def test_interleaved_rounds_alternate_the_order():
  systems = [("jaxinfer", "float32"), ("jaxinfer", "int4"), ("llama.cpp", "int4")]
  assert [bench_offline.abba_order(systems, r) for r in range(3)] == [systems, systems[::-1], systems]


def test_cli_dispatches_bench_subcommands_and_reports_bad_flags(capsys):
  from jaxinfer import cli
  with pytest.raises(SystemExit) as e:
    cli.main(["bench", "offline", "--interleaved", "0"])
  assert e.value.code == 2 and "--interleaved: ROUNDS must be >= 1" in capsys.readouterr().err
  assert cli.main(["bench"]) == 0  # the list of subcommands
  listed = capsys.readouterr().out
  assert all(f"\n  {name} " in listed for name in bench.SUBCOMMANDS)
  with pytest.raises(SystemExit) as e:
    cli.main(["bench", "nope"])
  assert e.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err
