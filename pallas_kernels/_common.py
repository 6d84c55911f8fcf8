"""What both attention kernels check and compute the same way: operand rules and tile arithmetic."""

from __future__ import annotations

import jax
import jax.numpy as jnp

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# A quantized KV cache's values (with float32 scales per token and kv head beside them).
QUANTIZED_DTYPES = (jnp.int8, jnp.float8_e4m3fn)


def is_pow2(n: int) -> bool:
  return n >= 1 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


def check_quantized_values(x: jax.Array, name: str) -> None:
  """ValueError unless x holds a quantized cache's values (int8 or float8_e4m3fn)."""
  if x.dtype not in QUANTIZED_DTYPES:
    raise ValueError(f"{name}.dtype={x.dtype}: scales come with int8 or float8_e4m3fn values only")


def check_attention_operands(q: jax.Array, k: jax.Array, v: jax.Array, k_name: str, v_name: str,
                             quantized: bool = False) -> None:
  """q [..., Hq, D] against k, v [..., Hkv, D]: ValueError naming what disagrees.

  The leading dims are each kernel's own business; this checks what the
  Triton tiles need of every attention kernel: matching K/V, supported
  dtypes, equal head dims, GQA (Hq a multiple of Hkv) and a power-of-two
  head dim >= 16 (the smallest Triton dot).
  """
  if k.shape != v.shape:
    raise ValueError(f"{k_name}.shape={k.shape} must equal {v_name}.shape={v.shape}")
  if k.dtype != v.dtype:
    raise ValueError(f"{k_name}.dtype={k.dtype} must equal {v_name}.dtype={v.dtype}")
  if q.dtype not in SUPPORTED_DTYPES:
    raise ValueError(f"q.dtype={q.dtype} is not one of float32, bfloat16, float16")
  if quantized:
    check_quantized_values(k, k_name)
  if not quantized and k.dtype not in SUPPORTED_DTYPES:
    raise ValueError(f"{k_name}.dtype={k.dtype} is not one of float32, bfloat16, float16"
                     + (" (int8 / float8 values need their scales)" if k.dtype in QUANTIZED_DTYPES else ""))
  Hq, D = q.shape[-2:]
  Hkv, Dk = k.shape[-2:]
  if D != Dk:
    raise ValueError(f"q head dim {D=} must equal the {k_name}/{v_name} head dim {Dk=}")
  if Hq % Hkv:
    raise ValueError(f"{Hq=} must be a multiple of {Hkv=}")
  if not is_pow2(D) or D < 16:
    raise ValueError(f"head dim {D=} must be a power of two >= 16 (Triton tiles)")
