"""cpu_kernels.int8_matmul, int8_group_matmul and int4_matmul (XLA FFI kernels) against their int64 / float64 references."""

import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from cpu_kernels import int8_matmul, int8_matmul_reference, int16_rows_reference


def _x86_with_avx2() -> bool:
  if platform.machine().lower() not in ("x86_64", "amd64"):
    return False
  try:
    flags = next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split()
  except (OSError, StopIteration):
    return False
  return "avx2" in flags and "fma" in flags


# Where the kernel cannot be written for the CPU the suite runs on, its tests are reported
# as skipped with this reason; where it can, not building it is a failure.
needs_kernel = pytest.mark.skipif(not _x86_with_avx2(), reason="the int8 CPU kernel is x86-64 AVX2 only")


@needs_kernel
def test_the_kernel_builds_and_registers_here():
  assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
  assert cpu_kernels.unavailable_reason() is None


def _ints(rng, R, I, O):
  # Rows of different magnitudes: each row's own scale a.
  x = (rng.standard_normal((R, I)) * rng.uniform(0.01, 30, (R, 1))).astype(np.float32)
  q = rng.integers(-127, 128, (O, I)).astype(np.int8)
  return x, q


@needs_kernel
@pytest.mark.parametrize("R,I,O", [
    (1, 576, 1536),   # one token (the one-stream path)
    (1, 100, 7),      # inputs past the last multiple of 64 and of 16
    (6, 584, 33),     # tiles of 2 x 4 plus leftover rows and columns
    (64, 1536, 576),  # SmolLM2's down projection at 64 tokens (VNNI build: panels from 16 tokens on)
    (37, 576, 43),    # panels: two 16-row blocks and 11 rows, 6-token tiles and one token at a time
    (3, 8, 3),        # fewer inputs than one vector
    (2, 0, 4),        # nothing to sum: zeros
])
def test_random_sums_equal_the_int64_reference_exactly(R, I, O):
  x, q = _ints(np.random.default_rng(R * 1000 + I + O), R, I, O)
  got = np.asarray(jax.jit(int8_matmul)(jnp.asarray(x), jnp.asarray(q)))
  assert got.dtype == np.float32 and got.shape == (R, O)
  np.testing.assert_array_equal(got, int8_matmul_reference(x, q))


@needs_kernel
@pytest.mark.parametrize("R", [1, 5, 19])  # 19: the VNNI build's panels (groups of 256 inputs)
def test_extreme_values_over_many_inputs_do_not_overflow(R):
  # Every product at 32767 * 127 (and -) over 20000 inputs: 8.3e10, far past int32; the
  # kernel flushes its int32 lanes to int64 every 4096 inputs (panels: every 256). (x = 32767:
  # a = 1, x16 = x.)
  I = 20000
  x = np.full((R, I), 32767, np.float32)
  x[-1] = -32767
  q = np.full((4, I), 127, np.int8)
  q[1] = -127
  q[2, ::3] = -127
  got = np.asarray(int8_matmul(jnp.asarray(x), jnp.asarray(q)))
  ref = int8_matmul_reference(x, q)
  assert abs(ref[0, 0]) > 2**36
  np.testing.assert_array_equal(got, ref)


@needs_kernel
def test_calls_from_two_threads_at_once_give_the_reference_numbers():
  # The kernels' helper threads serve one call at a time; a call made while another thread's
  # call holds them goes to XLA's pool. Both threads, over many overlapping calls of several
  # chunks each (a 576 x 1536 weight at one and at 7 tokens), must get exact results.
  import threading
  cases = [_ints(np.random.default_rng(seed), R, 576, 1536) for seed, R in ((1, 1), (2, 7))]
  fn = jax.jit(int8_matmul)
  wrong, errors = [], []

  def run(x, q):
    try:
      want = int8_matmul_reference(x, q)
      xj, qj = jnp.asarray(x), jnp.asarray(q)
      for _ in range(60):
        if not np.array_equal(np.asarray(fn(xj, qj)), want):
          wrong.append(x.shape)
    except Exception as e:  # noqa: BLE001 - reported below, not swallowed
      errors.append(e)

  threads = [threading.Thread(target=run, args=case) for case in cases]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors and not wrong, (errors, wrong)


@needs_kernel
def test_each_row_is_the_same_number_at_any_row_count():
  # Greedy batch invariance: a row's result does not depend on the rows beside it (the
  # one-row stream, the 2 x 4 tiles and their leftovers all sum the same integers).
  x, q = _ints(np.random.default_rng(7), 13, 1536, 96)
  f = jax.jit(int8_matmul)
  together = np.asarray(f(x, q))
  for rows in (1, 2, 3, 4, 5, 8):
    parts = [np.asarray(f(x[i:i + rows], q)) for i in range(0, 13, rows)]
    np.testing.assert_array_equal(np.concatenate(parts), together)


@needs_kernel
def test_int8_panel_rows_are_the_same_numbers_as_the_cells():
  # In the VNNI build int8 takes repacked panels from INT4_PANEL_ROWS tokens on (and inputs a
  # multiple of 32), cells below: a row must come out the same number either way.
  R = cpu_kernels.INT4_PANEL_ROWS * 2 + 9
  x, q = _ints(np.random.default_rng(41), R, 1536, 43)
  f = jax.jit(int8_matmul)
  together = np.asarray(f(x, q))
  np.testing.assert_array_equal(together, int8_matmul_reference(x, q))
  one_at_a_time = np.concatenate([np.asarray(f(x[i:i + 1], q)) for i in range(R)])
  np.testing.assert_array_equal(one_at_a_time, together)
  below = cpu_kernels.INT4_PANEL_ROWS - 1
  np.testing.assert_array_equal(np.asarray(f(x[:below], q)), together[:below])


@needs_kernel
@pytest.mark.parametrize("kernel", ["int8", "int4"])
def test_each_row_is_quantized_on_its_own_scale(kernel):
  # The kernel forms x16 and a itself: a row of zeros gives zeros, a row with a NaN gives
  # NaNs and leaves the other rows alone, a row of tiny values keeps its precision.
  rng = np.random.default_rng(3)
  x = rng.standard_normal((4, 64)).astype(np.float32)
  x[1] = 0
  x[2, 5] = np.nan
  x[3] *= 1e-30
  x16, a = int16_rows_reference(x)
  assert np.all(np.abs(x[[0, 3]] - a[[0, 3]] * x16[[0, 3]]) <= a[[0, 3]] / 2)
  assert a[1, 0] == 1 and np.isnan(a[2, 0]) and np.abs(x16).max() == 32767
  if kernel == "int8":
    q = rng.integers(-127, 128, (9, 64)).astype(np.int8)
    got = np.asarray(int8_matmul(jnp.asarray(x), jnp.asarray(q)))
    ref = int8_matmul_reference(x, q)
  else:
    q = rng.integers(-8, 8, (9, 64)).astype(np.int8)
    s = rng.uniform(0.001, 0.02, (2, 9)).astype(np.float16)
    got = _int4(x, q, s, None)
    ref = cpu_kernels.int4_matmul_reference(x, q, s)
  assert np.all(got[1] == 0) and np.all(np.isnan(got[2]))
  np.testing.assert_allclose(got[[0, 3]], ref[[0, 3]], rtol=1e-6)
  assert np.abs(got[3]).max() > 0  # 1e-30 is not flushed to zero


def test_wrong_shapes_and_dtypes_are_value_errors():
  with pytest.raises(ValueError, match=r"x float32 \[R, I\] and q int8 \[O, I\], got x float32\[2, 8\], q int8\[3, 9\]"):
    int8_matmul(jnp.ones((2, 8), jnp.float32), jnp.ones((3, 9), jnp.int8))
  with pytest.raises(ValueError, match=r"want x float32 .* got x int16"):
    int8_matmul(jnp.ones((2, 8), jnp.int16), jnp.ones((3, 8), jnp.int8))


def test_switched_off_it_says_why_once_and_int8_runs_through_xla():
  # JAXINFER_CPU_KERNELS=0 (as where it cannot be built): available() is False with the
  # reason, one warning names it, and int8 linears take XLA's split dot, still correct.
  code = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(name)s: %(message)s")
import jax, jax.numpy as jnp, numpy as np
import cpu_kernels
from jaxinfer.quant import linear, quantize, dequantize
rng = np.random.default_rng(0)
w = quantize(rng.standard_normal((96, 40)).astype(np.float32), 1, "int8")
x = rng.standard_normal((3, 96)).astype(np.float32)
y = np.asarray(jax.jit(lambda x, w: linear("TD,DF->TF", x, w))(x, jax.tree.map(jnp.asarray, w)))
ref = x.astype(np.float64) @ np.asarray(dequantize(w, 1), np.float64)
print("available", cpu_kernels.available(), cpu_kernels.unavailable_reason())
print("close", bool(np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max()))  # x to 2^-16 of its row max
"""
  env = {**os.environ, "JAXINFER_CPU_KERNELS": "0", "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  warnings = [l for l in lines if l.startswith("cpu_kernels.int8_matmul:")]
  assert warnings == ["cpu_kernels.int8_matmul: int8, int4 and fp8 weights and decode attention on CPU "
                      "run through XLA (slower): JAXINFER_CPU_KERNELS=0"], lines
  assert "available False JAXINFER_CPU_KERNELS=0" in lines and "close True" in lines, lines


# ---- int4 groups -----------------------------------------------------------------------------

def _int4_case(rng, R, I, O, G, with_mins=True):
  x = (rng.standard_normal((R, I)) * rng.uniform(0.01, 30, (R, 1))).astype(np.float32)
  q = rng.integers(-8, 8, (O, I)).astype(np.int8)
  s = rng.uniform(0.001, 0.02, (G, O)).astype(np.float16)  # as GGUF stores d and m
  m = rng.uniform(-0.1, 0.1, (G, O)).astype(np.float16) if with_mins else None
  return x, q, s, m


def _int4(x, q, s, m):
  m = None if m is None else jnp.asarray(m)
  return np.asarray(jax.jit(cpu_kernels.int4_matmul)(jnp.asarray(x), jnp.asarray(q).astype(jnp.int4),
                                                     jnp.asarray(s), m))


@needs_kernel
@pytest.mark.parametrize("R,I,O,G,with_mins", [
    (1, 576, 1536, 18, True),   # one token, GGUF Q4_1's groups of 32
    (6, 576, 33, 18, True),     # 2 x 4 tiles plus leftovers
    (64, 1536, 576, 48, False),  # Q4_0: no mins
    (5, 128, 7, 2, True),       # groups of 64: two 32-input chunks per group
    (3, 4096, 9, 1, True),      # one group over all inputs
])
def test_int4_groups_equal_the_float64_reference(R, I, O, G, with_mins):
  # Exact integer group sums, scaled and summed in float32: within float32 rounding of the
  # float64 value x @ ((q + 8) scale + min)^T (x @ (q scale)^T without mins).
  x, q, s, m = _int4_case(np.random.default_rng(R + I + O + G), R, I, O, G, with_mins)
  got = _int4(x, q, s, m)
  ref = cpu_kernels.int4_matmul_reference(x, q, s, m)
  assert got.dtype == np.float32 and got.shape == (R, O)
  assert np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max()


@needs_kernel
def test_int4_extreme_values_in_the_largest_group_do_not_overflow():
  # 4096 inputs of 32767 x (7 + 8): a group sum of 2013204480, just inside int32.
  x = np.full((2, 4096), 32767, np.float32)
  x[1] = -32767
  q = np.full((3, 4096), 7, np.int8)
  s = np.full((1, 3), 1e-3, np.float16)
  got = _int4(x, q, s, None)
  np.testing.assert_allclose(got, cpu_kernels.int4_matmul_reference(x, q, s), rtol=1e-6)


@needs_kernel
def test_int4_rows_are_the_same_number_at_any_row_count():
  # 43 outputs: one token runs 8-row tiles and three single cells, several 2 x 4 tiles
  # and single cells; every cell must come out the same number.
  x, q, s, m = _int4_case(np.random.default_rng(11), 13, 576, 43, 18)
  together = _int4(x, q, s, m)
  for rows in (1, 2, 3, 4, 5, 8):
    parts = [_int4(x[i:i + rows], q, s, m) for i in range(0, 13, rows)]
    np.testing.assert_array_equal(np.concatenate(parts), together)


@needs_kernel
@pytest.mark.parametrize("O,G,with_mins", [
    (43, 18, True),   # groups of 32: 16-row panels, one of 8 rows and 3 rows past the last 8
    (21, 9, False),   # groups of 64 (two 32-input chunks a group), Q4_0
])
def test_int4_panel_rows_are_the_same_numbers_as_the_cells(O, G, with_mins):
  # From cpu_kernels.INT4_PANEL_ROWS tokens on the kernel takes another path (a repacked
  # panel of eight output rows a vector); below it, tiles of cells. Each element must be the
  # same number either way: a request's logits cannot depend on how many share its step.
  R = cpu_kernels.INT4_PANEL_ROWS * 2 + 9  # panel tiles of 6 (the VNNI build) and 3 tokens, and 2 left over
  x, q, s, m = _int4_case(np.random.default_rng(O + G), R, 576, O, G, with_mins)
  together = _int4(x, q, s, m)
  ref = cpu_kernels.int4_matmul_reference(x, q, s, m)
  assert np.abs(together - ref).max() <= 1e-6 * np.abs(ref).max()
  one_at_a_time = np.concatenate([_int4(x[i:i + 1], q, s, m) for i in range(R)])
  np.testing.assert_array_equal(one_at_a_time, together)
  below = cpu_kernels.INT4_PANEL_ROWS - 1
  np.testing.assert_array_equal(_int4(x[:below], q, s, m), together[:below])


def test_int4_groups_the_kernel_cannot_take_are_value_errors():
  x = jnp.ones((2, 96), jnp.float32)
  q = jnp.ones((3, 96), jnp.int4)
  with pytest.raises(ValueError, match="I / G a multiple of 32"):
    cpu_kernels.int4_matmul(x, q, jnp.ones((2, 3), jnp.float16))  # groups of 48
  with pytest.raises(ValueError, match="I / G a multiple of 32"):
    cpu_kernels.int4_matmul(x, q, jnp.ones((3, 3), jnp.float16), jnp.ones((3, 4), jnp.float16))
  with pytest.raises(ValueError, match="multiple of 32 up to 4096"):  # past it the int32 group sums could overflow
    cpu_kernels.int4_matmul(jnp.ones((1, 8192), jnp.float32), jnp.ones((3, 8192), jnp.int4), jnp.ones((1, 3), jnp.float16))
  with pytest.raises(ValueError, match="got x int16"):
    cpu_kernels.int4_matmul(x.astype(jnp.int16), q, jnp.ones((3, 3), jnp.float16))
  # float32 scales (checkpoint format version 1) would be read as float16 pairs: refused.
  with pytest.raises(ValueError, match=r"float16 scales and mins .* scales float32\[3, 3\]"):
    cpu_kernels.int4_matmul(x, q, jnp.ones((3, 3), jnp.float32))
  with pytest.raises(ValueError, match=r"mins float32\[3, 3\]"):
    cpu_kernels.int4_matmul(x, q, jnp.ones((3, 3), jnp.float16), jnp.ones((3, 3), jnp.float32))


# ---- int8 groups -----------------------------------------------------------------------------

def _int8g_case(rng, R, I, O, G, with_mins=True):
  x = (rng.standard_normal((R, I)) * rng.uniform(0.01, 30, (R, 1))).astype(np.float32)
  q = rng.integers(-128, 128, (O, I)).astype(np.int8)
  s = rng.uniform(0.001, 0.02, (G, O)).astype(np.float32)
  m = rng.uniform(-0.1, 0.1, (G, O)).astype(np.float32) if with_mins else None
  return x, q, s, m


def _int8g(x, q, s, m):
  m = None if m is None else jnp.asarray(m)
  return np.asarray(jax.jit(cpu_kernels.int8_group_matmul)(jnp.asarray(x), jnp.asarray(q), jnp.asarray(s), m))


@needs_kernel
@pytest.mark.parametrize("R,I,O,G,with_mins", [
    (1, 576, 1536, 18, True),    # one token, groups of 32 with mins (jaxinfer's int8)
    (6, 576, 33, 18, True),      # 2 x 4 tiles plus leftovers
    (64, 1536, 576, 48, False),  # Q8_0: no mins
    (5, 128, 7, 2, True),        # groups of 64: two 32-input chunks per group
    (3, 1024, 9, 2, True),       # groups of 512, the largest
])
def test_int8_groups_equal_the_float64_reference(R, I, O, G, with_mins):
  # Exact integer group sums, scaled and summed in float32: within float32 rounding of the
  # float64 value x16 @ (q scale + min)^T.
  x, q, s, m = _int8g_case(np.random.default_rng(R + I + O + G), R, I, O, G, with_mins)
  got = _int8g(x, q, s, m)
  ref = cpu_kernels.int8_group_matmul_reference(x, q, s, m)
  assert got.dtype == np.float32 and got.shape == (R, O)
  assert np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max()


@needs_kernel
def test_int8_extreme_values_in_the_largest_group_do_not_overflow():
  # 512 inputs of 32767 x -128: a group sum of -2147418112, just inside int32.
  x = np.full((2, 512), 32767, np.float32)
  x[1] = -32767
  q = np.full((3, 512), -128, np.int8)
  s = np.full((1, 3), 1e-3, np.float32)
  got = _int8g(x, q, s, None)
  np.testing.assert_allclose(got, cpu_kernels.int8_group_matmul_reference(x, q, s), rtol=1e-6)


@needs_kernel
def test_int8_group_rows_are_the_same_number_at_any_row_count():
  # 43 outputs: one token runs 8-row tiles and three single cells, more tokens 2 x 4 tiles
  # and single cells; every cell must come out the same number (greedy batch invariance).
  for with_mins in (True, False):
    x, q, s, m = _int8g_case(np.random.default_rng(12), 13, 576, 43, 18, with_mins)
    together = _int8g(x, q, s, m)
    for rows in (1, 2, 3, 4, 5, 8):
      parts = [_int8g(x[i:i + rows], q, s, m) for i in range(0, 13, rows)]
      np.testing.assert_array_equal(np.concatenate(parts), together)


def test_int8_groups_the_kernel_cannot_take_are_value_errors():
  x = jnp.ones((2, 96), jnp.float32)
  q = jnp.ones((3, 96), jnp.int8)
  with pytest.raises(ValueError, match="I / G a multiple of 32"):
    cpu_kernels.int8_group_matmul(x, q, jnp.ones((2, 3), jnp.float32))  # groups of 48
  with pytest.raises(ValueError, match="multiple of 32 up to 512"):  # past it the int32 group sums could overflow
    cpu_kernels.int8_group_matmul(jnp.ones((1, 1024), jnp.float32), jnp.ones((3, 1024), jnp.int8),
                                  jnp.ones((1, 3), jnp.float32))
  with pytest.raises(ValueError, match=r"scales float16\[3, 3\]"):
    cpu_kernels.int8_group_matmul(x, q, jnp.ones((3, 3), jnp.float16))
  with pytest.raises(ValueError, match=r"mins float32\[3, 4\]"):
    cpu_kernels.int8_group_matmul(x, q, jnp.ones((3, 3), jnp.float32), jnp.ones((3, 4), jnp.float32))
  with pytest.raises(ValueError, match=r"q int4"):
    cpu_kernels.int8_group_matmul(x, q.astype(jnp.int4), jnp.ones((3, 3), jnp.float32))


# ---- fp8 (e4m3fn) -----------------------------------------------------------------------------

def _fp8_case(rng, R, I, O):
  import ml_dtypes
  x = (rng.standard_normal((R, I)) * rng.uniform(0.01, 30, (R, 1))).astype(np.float32)
  q = (rng.standard_normal((O, I)) * 60).astype(ml_dtypes.float8_e4m3fn)  # normals, subnormals, +-448
  s = rng.uniform(0.001, 0.02, O).astype(np.float32)
  return x, q, s


def _fp8(x, q, s):
  return np.asarray(jax.jit(cpu_kernels.fp8_matmul)(jnp.asarray(x), jnp.asarray(q), jnp.asarray(s)))


@needs_kernel
@pytest.mark.parametrize("R,I,O", [
    (1, 576, 1536),   # one token: 8-row tiles (float32 activations), 4 x 1 blocks of 16 rows (bfloat16)
    (6, 100, 13),     # 4 x 3 / 4 x 6 tiles, inputs past the last multiple of 8 / 16 (32: bfloat16), 5 rows past the last 8
    (64, 1536, 576),  # SmolLM2's down projection at 64 tokens
    (100, 580, 43),   # token blocks of 48, 48 and 4; a 32-row panel, then 8 rows and 3 (bfloat16: 64 rows, 3-token tiles)
    (2, 3, 2),        # fewer inputs than one vector; an odd count (bfloat16: half a last pair)
])
def test_fp8_equals_the_float64_reference(R, I, O):
  x, q, s = _fp8_case(np.random.default_rng(R + I + O), R, I, O)
  got = _fp8(x, q, s)
  ref = cpu_kernels.fp8_matmul_reference(x, q, s, cpu_kernels.fp8_activations())
  assert got.dtype == np.float32 and got.shape == (R, O)
  assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max()


@needs_kernel
def test_fp8_rounds_activations_to_bfloat16_exactly_where_the_cpu_has_avx512_bf16():
  # The build follows the CPU: vdpbf16ps where /proc/cpuinfo has avx512_bf16 (and VNNI), else
  # float32 activations. The other reference misses by far more than the tolerance above.
  flags = next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split()
  want = "bfloat16" if {"avx512_bf16", "avx512_vnni"} <= set(flags) else "float32"
  assert cpu_kernels.fp8_activations() == want
  x, q, s = _fp8_case(np.random.default_rng(5), 7, 576, 40)
  got = _fp8(x, q, s)
  other = "float32" if want == "bfloat16" else "bfloat16"
  ref, miss = (cpu_kernels.fp8_matmul_reference(x, q, s, a) for a in (want, other))
  assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max()
  assert np.abs(got - miss).max() > 1e-4 * np.abs(ref).max()


@needs_kernel
@pytest.mark.parametrize("column", [0, 8])  # the eight-at-a-time conversion, and the one past them
def test_fp8_converts_every_e4m3_value_exactly(column):
  # Weight row b holds byte b at `column` and zeros elsewhere; x is 1 there: y[0, b] is that
  # byte's e4m3fn value (NaN for 0x7f / 0xff), times a scale of 1.
  import ml_dtypes
  codes = np.arange(256, dtype=np.uint8)
  q = np.zeros((256, 9), np.uint8)
  q[:, column] = codes
  x = np.zeros((1, 9), np.float32)
  x[0, column] = 1
  got = _fp8(x, q.view(ml_dtypes.float8_e4m3fn), np.ones(256, np.float32))[0]
  want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  assert np.isnan(want).sum() == 2
  np.testing.assert_array_equal(got, want)  # NaN where want is NaN; -0 == 0


@needs_kernel
def test_fp8_rows_are_the_same_numbers_at_any_row_count():
  # 100 tokens: two token blocks of 48 and a rest; every tile shape (4 x 3 or 4 x 6, 4 x 1,
  # 8 x 1 at one row, 1 x 1 past the last 8 weight rows; bfloat16: 3 or 1 tokens x 3 blocks
  # of 16 rows, the last one partial) meets each row somewhere.
  x, q, s = _fp8_case(np.random.default_rng(12), 100, 580, 43)
  together = _fp8(x, q, s)
  for rows in (1, 2, 5, 6, 7, 49):
    parts = [_fp8(x[i:i + rows], q, s) for i in range(0, 100, rows)]
    np.testing.assert_array_equal(np.concatenate(parts), together)


def test_fp8_wrong_shapes_and_dtypes_are_value_errors():
  q = jnp.ones((3, 8), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match=r"q float8_e4m3fn \[O, I\], scale \[O\], got x float32\[2, 8\], q float8_e4m3fn\[3, 8\], scale \[4\]"):
    cpu_kernels.fp8_matmul(jnp.ones((2, 8), jnp.float32), q, jnp.ones(4, jnp.float32))
  with pytest.raises(ValueError, match=r"got x float32\[2, 8\], q int8\[3, 8\]"):
    cpu_kernels.fp8_matmul(jnp.ones((2, 8), jnp.float32), jnp.ones((3, 8), jnp.int8), jnp.ones(3, jnp.float32))


# ---- the AVX2 and AVX512-VNNI builds ------------------------------------------------------------

def _has_vnni() -> bool:
  try:
    flags = next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split()
  except (OSError, StopIteration):
    return False
  return {"avx512f", "avx512vl", "avx512bw", "avx512_vnni"} <= set(flags)


@pytest.mark.skipif(not _has_vnni(), reason="this CPU has no AVX512-VNNI: only the AVX2 build runs here")
def test_the_vnni_build_runs_here_and_gives_the_avx2_builds_numbers(tmp_path):
  # Where the CPU has AVX512-VNNI the kernels' int16 multiply-adds are vpdpwssd; forced to
  # the AVX2 build (JAXINFER_CPU_KERNELS_ISA=avx2) every element must be the same number.
  code = """
import sys, numpy as np, jax, jax.numpy as jnp, cpu_kernels
rng = np.random.default_rng(0)
x = (rng.standard_normal((37, 576)) * rng.uniform(0.01, 30, (37, 1))).astype(np.float32)
q8 = rng.integers(-127, 128, (43, 576)).astype(np.int8)
q4 = jnp.asarray(rng.integers(-8, 8, (43, 576)).astype(np.int8)).astype(jnp.int4)
s, m = rng.uniform(0.001, 0.02, (18, 43)).astype(np.float16), rng.uniform(-0.1, 0.1, (18, 43)).astype(np.float16)
outs = [cpu_kernels.int8_matmul(jnp.asarray(x[:r]), jnp.asarray(q8)) for r in (1, 37)]
outs += [cpu_kernels.int4_matmul(jnp.asarray(x[:r]), q4, jnp.asarray(s), jnp.asarray(m)) for r in (1, 37)]
np.savez(sys.argv[1], isa=cpu_kernels.isa(), *[np.asarray(o) for o in outs])
"""
  got = {}
  for isa in ("avx512vnni", "avx2"):
    env = {**os.environ, "JAXINFER_CPU_KERNELS_ISA": isa, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"{isa}.npz")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got[isa] = np.load(tmp_path / f"{isa}.npz")
    assert str(got[isa]["isa"]) == isa
  for k in range(4):
    np.testing.assert_array_equal(got["avx512vnni"][f"arr_{k}"], got["avx2"][f"arr_{k}"])
