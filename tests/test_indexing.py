"""jaxinfer.indexing: bfloat16 gathers and scatters without a float32 copy of the operand on the CPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import USER_XLA
from jaxinfer.indexing import BITS, set_at, storage_dtype, take, values
from jaxinfer.models.cache import CacheSpec, gqa_layer

N, P, K, D = 257, 16, 3, 64  # pages, page size, kv heads, head dim: a small layer cache


def _arrays_of_size(hlo: str, n: int) -> list[str]:
  """Instructions of the optimized HLO (parameters aside) whose result has n elements."""
  out = []
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?%\S+ = (\w+)\[([\d,]*)\]", line)
    if m and "parameter(" not in line and np.prod([int(d) for d in m.group(2).split(",") if d]) == n:
      out.append(f"{m.group(1)}: {line.strip()[:120]}")
  return out


def _bf16(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape).astype(np.float32)).astype(jnp.bfloat16)


pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the storage is CPU-only")


def test_xla_cpu_converts_a_whole_bfloat16_operand_to_gather_or_scatter_it():
  # Why jaxinfer.indexing exists: if this stops holding (a newer XLA), the uint16 storage can go.
  cache, ids, new = _bf16((N, P, K, D)), jnp.array([[3, 7]]), _bf16((4, K, D), 1)
  slots = jnp.array([5, 6, 40, 41])
  gather = jax.jit(lambda c, i: c[i]).lower(cache, ids).compile(compiler_options=USER_XLA).as_text()
  scatter = jax.jit(lambda c, s, n: c.at[s // P, s % P].set(n)).lower(cache, slots, new).compile(compiler_options=USER_XLA).as_text()
  for hlo in (gather, scatter):
    assert any(a.startswith("f32:") and "convert" in a for a in _arrays_of_size(hlo, N * P * K * D))


def test_take_and_set_at_on_stored_bits_make_no_copy_of_the_operand():
  stored = jax.lax.bitcast_convert_type(_bf16((N, P, K, D)), BITS)
  ids, slots, new = jnp.array([[3, 7]]), jnp.array([5, 6, 40, 41]), _bf16((4, K, D), 1)
  gather = jax.jit(take).lower(stored, ids).compile(compiler_options=USER_XLA).as_text()
  assert not [a for a in _arrays_of_size(gather, N * P * K * D) if "gather" not in a and "bitcast-convert" not in a]
  assert not [a for a in _arrays_of_size(gather, N * P * K * D) if a.startswith("f32")]
  scatter = jax.jit(lambda c, s, n: set_at(c, (s // P, s % P), n), donate_argnums=0).lower(
      stored, slots, new).compile(compiler_options=USER_XLA).as_text()
  # The one whole-size array left is the update itself (in place when donated), in uint16.
  whole = _arrays_of_size(scatter, N * P * K * D)
  assert whole and all(a.startswith("u16:") and "convert" not in a.split("=", 1)[1].split("(")[0] for a in whole)


def test_take_and_set_at_move_the_same_bits_as_plain_indexing():
  cache = _bf16((N, P, K, D))
  stored = jax.lax.bitcast_convert_type(cache, BITS)
  ids = jnp.array([[3, 7], [256, 0]])
  np.testing.assert_array_equal(np.asarray(take(stored, ids)), np.asarray(cache[ids]))
  np.testing.assert_array_equal(np.asarray(take(cache, ids)), np.asarray(cache[ids]))
  slots, new = jnp.array([5, 6, 40, 41]), _bf16((4, K, D), 1)
  want = cache.at[slots // P, slots % P].set(new)
  got = set_at(stored, (slots // P, slots % P), new)
  assert got.dtype == BITS
  np.testing.assert_array_equal(np.asarray(values(got)), np.asarray(want))
  # float32 values are rounded to bfloat16 as plain indexing would (x.at[].set casts too).
  got32 = set_at(stored, (slots // P, slots % P), new.astype(jnp.float32) + 1e-3)
  np.testing.assert_array_equal(np.asarray(values(got32)),
                                np.asarray(cache.at[slots // P, slots % P].set((new.astype(jnp.float32) + 1e-3).astype(jnp.bfloat16))))


def test_a_bfloat16_cache_is_stored_as_its_bits_on_the_cpu_only():
  spec = CacheSpec((gqa_layer(K, D),), "bfloat16")
  assert spec.zeros(4, P)[0]["k"].dtype == BITS and spec.abstract(4, P)[0]["v"].dtype == BITS
  assert CacheSpec((gqa_layer(K, D),), "float32").zeros(4, P)[0]["k"].dtype == jnp.float32
  assert storage_dtype(jnp.bfloat16, "gpu") == jnp.bfloat16 and storage_dtype(jnp.float32, "cpu") == jnp.float32


def test_a_float8_cache_is_stored_as_its_bits_too_and_int8_as_it_is():
  """kv_cache_dtype 'fp8': XLA CPU converts a whole float8 operand to gather or scatter it, as it
  does bfloat16, so the pages hold uint8 bits; int8 needs nothing. Scales stay float32."""
  f8 = _bf16((N, P, K, D)).astype(jnp.float8_e4m3fn)
  ids, slots, new = jnp.array([[3, 7]]), jnp.array([5, 6, 40, 41]), _bf16((4, K, D), 1)
  plain = jax.jit(lambda c, i: c[i]).lower(f8, ids).compile(compiler_options=USER_XLA).as_text()
  assert any(a.startswith(("f32:", "f16:", "bf16:")) and "convert" in a for a in _arrays_of_size(plain, N * P * K * D))
  stored = jax.lax.bitcast_convert_type(f8, jnp.uint8)
  gather = jax.jit(take).lower(stored, ids).compile(compiler_options=USER_XLA).as_text()
  assert not [a for a in _arrays_of_size(gather, N * P * K * D) if "convert(" in a]
  scatter = jax.jit(lambda c, s, n: set_at(c, (s // P, s % P), n), donate_argnums=0).lower(
      stored, slots, new).compile(compiler_options=USER_XLA).as_text()
  whole = _arrays_of_size(scatter, N * P * K * D)
  assert whole and all(a.startswith("u8:") for a in whole)
  got = set_at(stored, (slots // P, slots % P), new)
  np.testing.assert_array_equal(np.asarray(values(got)).astype(np.float32),
                                np.asarray(f8.at[slots // P, slots % P].set(new.astype(jnp.float8_e4m3fn))).astype(np.float32))
  np.testing.assert_array_equal(np.asarray(take(got, ids)).astype(np.float32),
                                np.asarray(values(got)[ids]).astype(np.float32))
  fp8 = CacheSpec((gqa_layer(K, D),), "float8_e4m3fn").zeros(4, P)[0]
  assert {n: str(a.dtype) for n, a in fp8.items()} == {"k": "uint8", "v": "uint8", "k_scale": "float32",
                                                       "v_scale": "float32"}
  assert CacheSpec((gqa_layer(K, D),), "int8").zeros(4, P)[0]["k"].dtype == jnp.int8
  assert storage_dtype(jnp.float8_e4m3fn, "gpu") == jnp.float8_e4m3fn
