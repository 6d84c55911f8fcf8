"""Hand-written XLA CPU kernels (each: C++ source + build / load / jitted wrapper + numpy
reference), reached through XLA's FFI as custom calls in the jitted step.

- `int8_matmul`: int16 activations x int8 weights -> exact integer sums, the int8 weight
  read once at any row count (`int8_matmul.py`, `int8_matmul.cc`). jaxinfer.quant runs
  every per-channel int8 matmul on the CPU through it when `available()`.
"""

from cpu_kernels.int8_matmul import available, int8_matmul, int8_matmul_reference, unavailable_reason

__all__ = ["available", "int8_matmul", "int8_matmul_reference", "unavailable_reason"]
