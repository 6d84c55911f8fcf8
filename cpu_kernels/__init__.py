"""Hand-written XLA CPU kernels (each: C++ source + build / load / jitted wrapper + numpy
reference), reached through XLA's FFI as custom calls in the jitted step.

- `int8_matmul`: float32 activations (quantized per row to int16 inside the kernel) x int8
  weights -> exact integer sums, the int8 weight read once at any row count
  (`int8_matmul.py`, `int8_matmul.cc`). jaxinfer.quant runs every per-channel int8 matmul
  on the CPU through it when `available()`.
- `int4_matmul`: the same for group-wise int4 weights (scales and mins per group of a
  multiple of 32 inputs up to 4096, as GGUF Q4_0 / Q4_1), read packed as XLA CPU holds them;
  from INT4_PANEL_ROWS rows of x on, through repacked panels (the same numbers).
- `int8_group_matmul`: the same for group-wise int8 weights (float32 scales, and mins or
  none, per group of a multiple of 32 inputs up to 512): jaxinfer.quant's default int8 and
  GGUF Q8_0 blocks. Cells only (no repacked panel at many tokens).
- `fp8_matmul`: float32 activations x per-channel e4m3fn weights (weight-only), converted a
  few rows at a time into a small float32 panel instead of a float32 copy of the weight.
- `decode_attention`: the decode rows of paged attention (a float32, bfloat16, int8 or fp8
  cache, the last two with their per-token scales), one call per layer instead of XLA's
  chunk loop (`attention.py`, `attention.cc`); jaxinfer.ops uses it.

All of them are one library; parallel.h splits their output rows over the calling thread and
helper threads, convert.h holds the float8 conversion they share.

The library is built for AVX2, or where the CPU has AVX512-VNNI with its int16 multiply-adds as
vpdpwssd (`isa()` says which runs; the same numbers either way); where the CPU also has
AVX512-BF16, fp8 rounds its activations to bfloat16 (`fp8_activations()`) for vdpbf16ps.
"""

from cpu_kernels.attention import (DECODE_ATTENTION_TARGET, decode_attention, decode_attention_reference,
                                   pages_as_float)
from cpu_kernels.int8_matmul import (INT4_MAX_GROUP, INT4_PANEL_ROWS, INT8_MAX_GROUP, available, fp8_activations,
                                     fp8_matmul, fp8_matmul_reference, int4_groups_fit, int4_matmul,
                                     int4_matmul_reference, int8_group_matmul, int8_group_matmul_reference,
                                     int8_groups_fit, int8_matmul, int8_matmul_reference, int16_rows_reference,
                                     isa, unavailable_reason)

__all__ = ["DECODE_ATTENTION_TARGET", "INT4_MAX_GROUP", "INT4_PANEL_ROWS", "INT8_MAX_GROUP", "available", "decode_attention", "decode_attention_reference", "pages_as_float", "fp8_activations", "fp8_matmul", "fp8_matmul_reference", "int4_groups_fit",
           "int4_matmul", "int4_matmul_reference", "int8_group_matmul", "int8_group_matmul_reference",
           "int8_groups_fit", "int8_matmul", "int8_matmul_reference", "int16_rows_reference",
           "isa", "unavailable_reason"]
