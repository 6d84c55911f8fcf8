"""Quantized weights (int8, fp8, int4): quantization, the matmul against references, compiled HLO,
specs, the model."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import cpu_kernels
from conftest import USER_XLA, golden, tiny_dir
from jaxinfer import LLM, SamplingParams
from jaxinfer.checkpoint.hf import read_config
from jaxinfer.config import ModelConfig
from jaxinfer.errors import InvalidRequestError, UnsupportedModelError
from jaxinfer import quant
from jaxinfer.params import abstract_params, init_params, is_spec, param_specs
from jaxinfer.quant import (FP8_MAX, LeafLayout, QuantizedWeight, check_fp8, dequantize, dequantize_weight, embed_lookup,
                            head_logits, is_quantized, leaf_layout, linear, quantize, quantize_fp8, quantize_int4,
                            quantize_int8, quantize_int8_groups, quantize_leaf, quantized_matmul,
                            quantized_matmul_reference)
from jaxinfer.sharding import make_mesh, make_rules, param_shardings

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def test_quantize_int8_is_symmetric_per_output_channel():
  rng = np.random.default_rng(0)
  w = rng.standard_normal((6, 3, 8)).astype(np.float32)  # wo-like: inputs (H, Dh), outputs D
  w[..., 5] = 0  # an all-zero output channel
  q = quantize_int8(w, 2)
  assert q.values.dtype == np.int8 and q.scales.dtype == np.float32
  assert q.values.shape == (8, 6, 3) and q.scales.shape == (1, 8)  # output axes first
  expected = np.abs(w).max(axis=(0, 1)) / 127
  expected[5] = 1.0
  np.testing.assert_array_equal(q.scales[0], expected.astype(np.float32))
  assert np.abs(q.values).max() == 127 and not q.values[5].any()
  # Rounding to the nearest step: off by at most half a step per element.
  assert np.all(np.abs(dequantize(q, 2) - w) <= q.scales[0] / 2 + 1e-7)


def test_quantize_int8_groups_asymmetric_spans_each_groups_range_in_255_steps():
  rng = np.random.default_rng(5)
  w = rng.standard_normal((64, 3)).astype(np.float32)  # [in, out]: two groups of 32 per output
  w[32:, 1] = 0.25  # a constant group: scale 1, every value on its min
  q = quantize_int8_groups(w, 1, 32)
  assert q.values.dtype == np.int8 and q.values.shape == (3, 64)
  assert q.scales.shape == q.mins.shape == (2, 3) and q.scales.dtype == q.mins.dtype == np.float32
  g = w.reshape(2, 32, 3)
  lo, hi = g.min(1), g.max(1)
  want = np.where(hi > lo, (hi - lo) / np.float32(255), 1).astype(np.float32)
  np.testing.assert_array_equal(q.scales, want)
  assert q.values.min() == -128 and q.values.max() == 127  # each group's min and max are its ends
  back = dequantize(q, 1)
  assert np.all(np.abs(back - w) <= np.repeat(q.scales, 32, axis=0) / 2 + 1e-6)
  np.testing.assert_allclose(back[32:, 1], 0.25, rtol=1e-6)


def test_int8_groups_hold_4_bit_blocks_and_q8_0_blocks_exactly():
  # Why the default int8 agrees with float32 at every position of the default model: its
  # weights are GGUF Q4_1 blocks (w = m + k d, k in 0..15, per 32 inputs), 17 of int8's 255
  # asymmetric steps per 4-bit step, and its table Q8_0 blocks (w = d q, max |q| = 127),
  # which symmetric groups give back exactly.
  rng = np.random.default_rng(6)
  d = rng.uniform(0.001, 0.01, (4, 1, 5)).astype(np.float16).astype(np.float32)
  m = rng.uniform(-0.05, 0.0, (4, 1, 5)).astype(np.float16).astype(np.float32)
  k = rng.integers(0, 16, (4, 32, 5))
  k[:, 0], k[:, 1] = 0, 15  # each block spans its range, as Q4_1's quantizer makes it
  w = (m + k * d).reshape(128, 5)
  np.testing.assert_allclose(dequantize(quantize_int8_groups(w, 1), 1), w, rtol=0, atol=2e-8)
  q8 = rng.integers(-127, 128, (4, 32, 5)).astype(np.float32)
  q8[:, 0] = 127
  table = (q8 * d).reshape(128, 5)
  sym = quantize_int8_groups(table, 1, asymmetric=False)
  assert sym.mins is None
  np.testing.assert_array_equal(dequantize(sym, 1), table)


def test_quantize_fp8_is_per_output_channel_e4m3():
  rng = np.random.default_rng(0)
  w = rng.standard_normal((6, 3, 8)).astype(np.float32)
  w[..., 5] = 0
  q = quantize_fp8(w, 2)
  assert q.values.dtype == jnp.float8_e4m3fn and q.scales.shape == (1, 8) and q.mins is None
  v = q.values.astype(np.float32)
  assert np.all(np.abs(v).max(axis=(1, 2))[[0, 1, 2, 3, 4, 6, 7]] == FP8_MAX) and not v[5].any()
  assert np.isfinite(v).all()
  # e4m3 keeps 3 mantissa bits: off by at most 1/16 of |w|, or half a subnormal step (2^-10 * scale).
  assert np.all(np.abs(dequantize(q, 2) - w) <= np.abs(w) / 16 + q.scales[0] * 2.0 ** -10)


def test_quantize_int4_is_asymmetric_per_group_of_32():
  rng = np.random.default_rng(0)
  w = rng.standard_normal((64, 5)).astype(np.float32) + 0.3
  w[32:, 4] = 0.25  # a constant group
  q = quantize_int4(w, 1)
  assert q.values.dtype == jnp.int4 and q.scales.shape == q.mins.shape == (2, 5)
  assert q.scales.dtype == q.mins.dtype == np.float16  # GGUF Q4_1's d and m
  np.testing.assert_array_equal(q.mins, w.reshape(2, 32, 5).min(axis=1).astype(np.float16))
  v = q.values.astype(np.int8)
  assert v.min() == -8 and v.max() == 7
  err = np.abs(dequantize(q, 1) - w).reshape(2, 32, 5)
  # Half a step, plus what rounding the min and scale to float16 moves the grid (2^-11 of each).
  assert np.all(err <= q.scales[:, None, :] / 2 + 2.0 ** -11 * (np.abs(w).max() + 15 * q.scales[:, None, :]))
  assert np.all(err[1, :, 4] == 0)


def test_int4_refuses_weights_past_float16s_range_by_name():
  w = np.ones((64, 3), np.float32)
  w[5, 1] = -7e4
  with pytest.raises(ValueError, match=r"wq \(64, 3\) has weights past float16's range .*use int8 or fp8"):
    quantize(w, 1, "int4", name="wq")


def test_int4_group_size_must_divide_the_inputs():
  with pytest.raises(ValueError, match=r"int4 group size 32 does not divide the 48 inputs of wq"):
    quantize(np.ones((48, 8), np.float32), 1, "int4", name="wq")
  with pytest.raises(ValueError, match="group size 5 does not divide the 32 inputs"):
    quantize_int4(np.ones((4, 8, 6), np.float32), 2, group_size=5)


@pytest.mark.parametrize("quantization", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("eq,x_shape,w_shape,n_in", [
    ("TD,DHd->THd", (5, 64), (64, 4, 8), 1),
    ("THd,HdD->TD", (5, 4, 16), (4, 16, 16), 2),
    ("...D,DF->...F", (2, 3, 64), (64, 24), 1),
])
def test_linear_matches_the_dequantized_reference(eq, x_shape, w_shape, n_in, quantization):
  rng = np.random.default_rng(1)
  x = rng.standard_normal(x_shape).astype(np.float32)
  w = rng.standard_normal(w_shape).astype(np.float32)
  q = quantize(w, n_in, quantization)
  y = np.asarray(linear(eq, jnp.asarray(x), jax.tree.map(jnp.asarray, q)))
  in_size = int(np.prod(w_shape[:n_in]))
  x2 = x.reshape(-1, in_size)
  # Weight-only: x @ the dequantized weight up to float32 rounding (per channel with the scales
  # after the contraction, group-wise int4 dequantized first); a wrong scale, min or group
  # layout would be off by whole units.
  w2 = dequantize(q, n_in).reshape(in_size, -1).astype(np.float64)
  ref = x2.astype(np.float64) @ w2
  if quantization in ("int8", "int4"):
    # On the CPU each token's x goes in as integers: int16 for the kernels (within max|x| /
    # 65534), two int8 limbs for XLA's split dot (max|x| / 64516); each output is off by at
    # most that times sum_i |w_io| (plus float32 rounding).
    bound = np.abs(x2).max(-1, keepdims=True) / 64516 * np.abs(w2).sum(0) + 1e-5
    assert np.all(np.abs(y.reshape(ref.shape) - ref) <= bound)
  else:
    if cpu_kernels.fp8_activations() == "bfloat16":  # the CPU kernel's x, rounded as it rounds it
      ref = x2.astype(ml_dtypes.bfloat16).astype(np.float64) @ w2
    np.testing.assert_allclose(y.reshape(ref.shape), ref, rtol=1e-5, atol=1e-5)
    ref = x2.astype(np.float64) @ w2
  G = q.scales.shape[0]
  mins = None if q.mins is None else q.mins.reshape(G, -1)
  np.testing.assert_allclose(ref, quantized_matmul_reference(x2, q.values.reshape(-1, in_size),
                                                             q.scales.reshape(G, -1), mins), rtol=1e-5, atol=1e-5)
  assert y.shape == jnp.einsum(eq, x, w).shape


@pytest.mark.parametrize("with_mins", [False, True])
def test_int8_group_scales_run_the_group_kernel_or_the_dequantized_weight(monkeypatch, with_mins):
  # Q8_0's scales (and the default int8's, with mins) vary along the contraction. On the CPU
  # the group kernel sums x16 q per group exactly (its reference, to float32 rounding); without
  # the kernels (a program over several devices, no compiler) the weight is dequantized and
  # the activations stay float: x @ w to float32 rounding.
  rng = np.random.default_rng(2)
  x = rng.standard_normal((4, 64)).astype(np.float32)
  q = rng.integers(-127, 128, (12, 64)).astype(np.int8)  # [out, in]
  groups = rng.uniform(0.001, 0.01, (2, 12)).astype(np.float32)  # groups of 32 inputs
  mins = rng.uniform(-0.1, 0.1, (2, 12)).astype(np.float32) if with_mins else None
  w = (q.reshape(12, 2, 32) * groups.T[:, :, None]).reshape(12, 64)
  if with_mins:
    w = w + np.repeat(mins.T, 32, axis=1)
  w = w.T.astype(np.float64)
  assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
  got = np.asarray(quantized_matmul(x, q, groups, mins))
  ref = cpu_kernels.int8_group_matmul_reference(x, q, groups, mins)
  assert np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max()
  np.testing.assert_allclose(got, x.astype(np.float64) @ w, rtol=0, atol=1e-3)  # int16 activations
  monkeypatch.setattr(quant, "use_cpu_kernels", lambda: False)
  got = np.asarray(quantized_matmul(x, q, groups, mins))
  np.testing.assert_allclose(got, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got, quantized_matmul_reference(x, q, groups, mins), rtol=1e-5, atol=1e-5)


def test_linear_refuses_an_equation_it_cannot_flatten():
  q = jax.tree.map(jnp.asarray, quantize_int8(np.ones((4, 6), np.float32), 1))
  with pytest.raises(ValueError, match="contracted axes"):
    linear("DT,DF->TF", jnp.ones((4, 3)), q)


# ---- the compiled HLO at a SmolLM2-135M decode shape (D=576 -> F=1536, one token) -------------

def _hlo(f, *args) -> str:
  return jax.jit(f).lower(*args).compile(compiler_options=USER_XLA).as_text()


def test_bfloat16_activations_dot_the_per_channel_values_in_bfloat16_with_a_float32_sum():
  # fp8 traced for several devices (no CPU kernel): the path a GPU takes. A bf16 model's dot
  # runs bf16 x bf16 -> f32 over the converted e4m3 values (exact), which XLA GPU can fuse
  # into one GEMM, rather than upcasting both sides to a float32 dot.
  mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
  rng = np.random.default_rng(0)
  w = jax.tree.map(jnp.asarray, quantize(rng.standard_normal((576, 1536)).astype(np.float32), 1, "fp8"))
  x = jnp.asarray(rng.standard_normal((3, 576)), jnp.bfloat16)
  f = quant.tracing_on(mesh, lambda x, w: linear("TD,DF->TF", x, w, jnp.float32))
  dots = [l for l in jax.jit(f).lower(x, w).as_text().splitlines() if "dot_general" in l]
  assert len(dots) == 1 and "(tensor<3x576xbf16>, tensor<1536x576xbf16>) -> tensor<3x1536xf32>" in dots[0], dots
  want = quantized_matmul_reference(np.asarray(x, np.float64), np.asarray(w.values, np.float64), w.scales)
  np.testing.assert_allclose(np.asarray(jax.jit(f)(x, w)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantization", ["int8", "fp8", "int4"])
def test_quantizing_a_jax_array_matches_numpy_to_the_rounding_of_a_division(quantization):
  # init_params quantizes random weights where they live (an 8B model on the GPU); the
  # checkpoint converter quantizes numpy arrays on the host. XLA CPU's float32 division is
  # not correctly rounded (1 ulp off for ~4% of quotients), so scales may differ by an ulp
  # and a value sitting on a rounding boundary by one step; nothing more.
  rng = np.random.default_rng(1)
  for shape, n_in in (((64, 96), 1), ((4, 16, 32), 2)):
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 3, shape[n_in:])).astype(np.float32)
    w[..., 0] = 0  # an all-zero channel: scale 1
    on_host, on_device = quantize(w, n_in, quantization), quantize(jnp.asarray(w), n_in, quantization)
    assert isinstance(on_device.values, jax.Array)
    assert jax.tree.structure(on_host) == jax.tree.structure(on_device)
    for a, b in zip(jax.tree.leaves(on_host), jax.tree.leaves(on_device)):
      assert (a.dtype, a.shape) == (b.dtype, b.shape)
    np.testing.assert_allclose(np.asarray(on_device.scales), on_host.scales, rtol=3e-7, atol=0)
    host_v, dev_v = np.asarray(on_host.values, np.float32), np.asarray(on_device.values, np.float32)
    assert np.mean(host_v != dev_v) < 0.005
    # Where they differ, by one step of the format (int: 1; e4m3: its spacing at that value).
    step = 1.0 if quantization != "fp8" else np.maximum(2.0 ** (np.floor(np.log2(np.abs(host_v) + 1e-30)) - 3), 2.0 ** -9)
    assert np.all(np.abs(host_v - dev_v) <= step)


def _widened_copies(lines):
  """Fusions whose result is a [576, 1536] (or [1536, 576]) array: a copy of the weight written per call."""
  return [l for l in lines if "fusion(" in l and any(s in l.split("=")[1].split("(")[0]
                                                     for s in ("[576,1536]", "[1536,576]"))]


@pytest.mark.parametrize("quantization,target,values,layout", [
    ("int8", "jaxinfer_int8_matmul", "s8[1536,576]", "{1,0}"),
    ("int4", "jaxinfer_int4_matmul", "s4[1536,576]", "{1,0:E(4)}"),  # packed: 4-bit elements
    ("fp8", "jaxinfer_fp8_matmul", "f8e4m3fn[1536,576]", "{1,0}"),
])
def test_int8_int4_and_fp8_on_one_device_are_a_cpu_kernel_over_the_quantized_parameter(quantization, target, values,
                                                                                       layout):
  # One token's linear on the CPU: a custom call to cpu_kernels' kernel reading the
  # [1536, 576] values parameter itself (output first; for int4 also the group scales and
  # mins of Q4_0 / Q4_1-style groups of 32, for fp8 its per-channel scales) and the float32
  # token parameter itself (the int8 / int4 kernels quantize it; no XLA operation before the
  # call); no dot, no copy of the weight.
  # Fails if the kernels cannot be built here.
  import cpu_kernels
  assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
  x = jnp.ones((1, 576), jnp.float32)
  w = jax.tree.map(jnp.asarray, quantize(np.ones((576, 1536), np.float32), 1, quantization))
  lines = _hlo(lambda x, w: linear("TD,DF->TF", x, w), x, w).splitlines()
  assert not _widened_copies(lines) and not [l for l in lines if " dot(" in l], lines
  calls = [l for l in lines if "custom-call(" in l]
  assert len(calls) == 1 and f'custom_call_target="{target}"' in calls[0], calls
  assert "= f32[1,1536]" in calls[0] and f"{{f32[1,576]{{1,0}}, {values}{{1,0}}" in calls[0], calls
  token = [l.split("=")[0].strip() for l in lines if "= f32[1,576]{1,0} parameter(0)" in l]
  param = [l.split("=")[0].strip() for l in lines if f"= {values}{layout} parameter(1)" in l]
  operands = calls[0].split("custom-call(")[1].split(")")[0].split(", ")
  assert len(token) == 1 and operands[0] == token[0], (token, calls)
  assert len(param) == 1 and operands[1] == param[0], (param, calls)


def test_int8_traced_for_several_devices_is_the_split_dot_of_two_activation_limbs():
  # A program split over a mesh cannot partition a custom call, so it traces XLA's split
  # dot: [2, 576] s8 limbs (hi, lo) x the [1536, 576] s8 parameter -> s32, no weight copy.
  mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
  x = jnp.ones((1, 576), jnp.float32)
  w = jax.tree.map(jnp.asarray, quantize(np.ones((576, 1536), np.float32), 1, "int8"))
  lines = _hlo(quant.tracing_on(mesh, lambda x, w: linear("TD,DF->TF", x, w)), x, w).splitlines()
  assert not _widened_copies(lines) and not [l for l in lines if "custom-call(" in l], lines
  dots = [l for l in lines if " dot(" in l]
  assert len(dots) == 1 and "= s32[2,1536]" in dots[0], dots
  assert any(l.strip().startswith("%param_1 = s8[1536,576]") for l in lines), lines
  # The same numbers as the kernel to float32 rounding of differently rounded activations.
  rng = np.random.default_rng(5)
  xr = rng.standard_normal((3, 576)).astype(np.float32)
  wr = jax.tree.map(jnp.asarray, quantize(rng.standard_normal((576, 64)).astype(np.float32), 1, "int8"))
  split = np.asarray(jax.jit(quant.tracing_on(mesh, lambda x, w: linear("TD,DF->TF", x, w)))(xr, wr))
  kernel = np.asarray(jax.jit(lambda x, w: linear("TD,DF->TF", x, w))(xr, wr))
  np.testing.assert_allclose(split, kernel, rtol=2e-4, atol=2e-4 * np.abs(kernel).max())


@pytest.mark.parametrize("quantization,devices", [("int8", 1), ("int8", 2), ("int4", 1), ("fp8", 1)])
def test_one_token_linear_allocates_no_copy_of_the_weight(quantization, devices):
  # What the CPU kernels and the split dot are for, as bytes: one token's linear at the
  # D=576 -> F=1536 shape keeps its temporaries under the 884736 bytes of even a one-byte
  # copy of the weight (XLA's widened copies are float32 / s32: 3538944 bytes). On one
  # device the kernels read the quantized parameter; traced for several devices int8 runs
  # the dot of two activation limbs (~12 KB of temporaries). (fp8 and int4 traced for
  # several devices are weight-only and do write a float32 copy: quant.py's docstring.)
  x = jnp.ones((1, 576), jnp.float32)
  w = jax.tree.map(jnp.asarray, quantize(np.ones((576, 1536), np.float32), 1, quantization))
  f = lambda x, w: linear("TD,DF->TF", x, w)
  if devices > 1:
    f = quant.tracing_on(jax.make_mesh((devices,), ("model",), devices=jax.devices()[:devices]), f)
  temp = jax.jit(f).lower(x, w).compile(compiler_options=USER_XLA).memory_analysis().temp_size_in_bytes
  assert temp < 576 * 1536, temp
  np.testing.assert_allclose(np.asarray(jax.jit(f)(x, w)), np.full((1, 1536), 576.0), rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 4])
def test_bfloat16_linear_reads_the_bfloat16_weight(rows):
  # quant.float_linear: a float32-accumulating dot (one row run as two) over the bf16 weight
  # itself; a bf16-result or one-row bf16 dot would write a float32 [576, 1536] copy per call.
  x = jnp.ones((rows, 576), jnp.bfloat16)
  w = jnp.ones((576, 1536), jnp.bfloat16)
  lines = _hlo(lambda x, w: linear("TD,DF->TF", x, w), x, w).splitlines()
  assert not _widened_copies(lines), lines
  plain = _hlo(lambda x, w: jnp.einsum("TD,DF->TF", x, w), x, w).splitlines()
  assert [l.split("=")[1].split()[0] for l in _widened_copies(plain)] == ["f32[576,1536]{1,0}"], plain
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((rows, 3, 64)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((3, 64, 40)), jnp.bfloat16)
  y = linear("THd,HdD->TD", x, w)
  ref = np.einsum("THd,HdD->TD", np.asarray(x, np.float64), np.asarray(w, np.float64))
  assert y.dtype == jnp.bfloat16 and y.shape == ref.shape
  # float32 sums rounded once to bfloat16 (8 bits of mantissa): within 2^-8 of each value.
  assert np.all(np.abs(np.asarray(y, np.float64) - ref) <= np.abs(ref) * 2.0 ** -8 + 1e-4)


def test_split_int8_matmul_is_exact_at_the_limits_and_batch_invariant():
  # Every limb and value at +-127 over the widest input SmolLM2 has: the int32 sums are exact.
  from jaxinfer.quant import split_activations, split_int8_matmul
  x = np.full((3, 1536), 127.0, np.float32)
  x[1] = -127.0
  x[2, ::2] = -127.0
  limbs, a = split_activations(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(limbs)[:3], x.astype(np.int8))
  assert not np.asarray(limbs)[3:].any() and np.all(np.asarray(a) == 1.0)
  q = np.full((8, 1536), -127, np.int8)  # [out, in]
  y = np.asarray(split_int8_matmul(jnp.asarray(x), jnp.asarray(q), jnp.ones((8,), jnp.float32)))
  np.testing.assert_array_equal(y, x.astype(np.float64) @ q.T.astype(np.float64))
  # A row's result does not depend on the rows beside it (integer sums in any order).
  rng = np.random.default_rng(3)
  x = rng.standard_normal((16, 576)).astype(np.float32)
  w = quantize_int8(rng.standard_normal((576, 96)).astype(np.float32), 1)
  f = jax.jit(quantized_matmul)
  together = np.asarray(f(x, w.values, w.scales))
  alone = np.concatenate([np.asarray(f(x[i:i + 1], w.values, w.scales)) for i in range(16)])
  np.testing.assert_array_equal(together, alone)


# ---- specs, abstract params, shardings, init -----------------------------------------------------

def _cfg() -> ModelConfig:
  return read_config(tiny_dir("llama3"))  # untied: has an LM head


def test_quantized_specs_abstract_and_init_agree():
  cfg = _cfg()
  abstract = abstract_params(cfg, jnp.bfloat16, quantization="int8")
  params = init_params(cfg, jax.random.key(0), jnp.bfloat16, quantization="int8")
  assert jax.tree.structure(abstract) == jax.tree.structure(params)
  for a, p in zip(jax.tree.leaves(abstract), jax.tree.leaves(params)):
    assert (a.shape, a.dtype) == (p.shape, p.dtype)
  wo = abstract["layers"][0]["wo"]
  H, Dh, D = cfg.num_heads, cfg.head_dim, cfg.hidden_size
  assert isinstance(wo, QuantizedWeight)
  assert (wo.values.shape, wo.values.dtype) == ((D, H, Dh), jnp.int8)  # output axes first
  # Groups of 32 of its H * Dh inputs, a scale and a min each (quant.leaf_layout).
  assert (wo.scales.shape, wo.scales.dtype, wo.mins.shape) == ((H * Dh // 32, D), jnp.float32, (H * Dh // 32, D))
  # int8 quantizes the LM head too (groups of 32 of its D inputs, no mins); the untied
  # embedding is only gathered.
  head = abstract["lm_head"]
  assert (head.values.shape, head.values.dtype, head.scales.shape, head.mins) == (
      (cfg.vocab_size, D), jnp.int8, (D // 32, cfg.vocab_size), None)
  assert abstract["embed"].dtype == jnp.bfloat16
  assert abstract["layers"][0]["attn_norm"].dtype == jnp.bfloat16


@pytest.mark.parametrize("quantization", ["int8", "fp8", "int4", "int8-channel"])
def test_each_format_reaches_specs_random_init_and_the_hf_importer(quantization):
  from jaxinfer.checkpoint import import_model
  dtype = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.int4, "int8-channel": jnp.int8}[quantization]
  D = _cfg().hidden_size
  cfg = _cfg()
  trees = (abstract_params(cfg, jnp.float32, quantization=quantization),
           init_params(cfg, jax.random.key(0), jnp.float32, quantization=quantization),
           import_model(tiny_dir("llama3"), quantization).weights)
  for tree in trees:
    w = tree["layers"][0]["w_gate"]
    assert is_quantized(w) and w.values.dtype == dtype
    assert (w.mins is not None) == (quantization in ("int4", "int8"))
    assert w.scales.shape[0] == (1 if quantization in ("fp8", "int8-channel") else D // 32)
    # The abstract tree (a restore's target), random init and an import agree on the scales' dtype.
    want = jnp.float16 if quantization == "int4" else jnp.float32
    assert w.scales.dtype == want and (w.mins is None or w.mins.dtype == want)
    # int8 and int4 hold the LM head in int8 (groups of 32 along D; int8-channel one scale per
    # vocab column); fp8 keeps it float.
    head = tree["lm_head"]
    assert is_quantized(head) == (quantization != "fp8")
    if quantization != "fp8":
      groups = 1 if quantization == "int8-channel" else D // 32
      assert head.values.dtype == jnp.int8 and head.scales.shape == (groups, cfg.vocab_size) and head.mins is None


def test_quantized_shardings_follow_the_logical_axes():
  cfg = _cfg()
  mesh = make_mesh(model=2)
  rules = make_rules({"kv_heads": None})  # tiny llama3 has 1 KV head
  sh = param_shardings(cfg, mesh, "int8", rules)["layers"][0]
  P = jax.sharding.PartitionSpec
  # Values [out..., in...]: w_gate [F, D] splits its first axis, w_down [D, F] its last.
  assert sh["w_gate"].values.spec == P("model", None) and sh["w_gate"].scales.spec == P(None, "model")
  assert sh["w_down"].values.spec == P(None, "model") and sh["w_down"].scales.spec == P(None, None)
  assert sh["wq"].values.spec == P("model", None, None) and sh["wq"].scales.spec == P(None, "model", None)
  # Every quantized leaf of the spec tree got a sharding.
  n_specs = len(jax.tree.leaves(param_specs(cfg, "int8"), is_leaf=is_spec))
  assert len(jax.tree.leaves(param_shardings(cfg, mesh, "int8", rules))) == n_specs


def test_fp8_check_passes_here_and_names_a_jax_without_float8(monkeypatch):
  check_fp8()  # this CPU backend converts e4m3 exactly
  monkeypatch.delattr(jnp, "float8_e4m3fn")
  with pytest.raises(UnsupportedModelError, match=r"fp8' needs jax with float8_e4m3fn \(this is jax"):
    check_fp8.__wrapped__()


def test_int4_is_refused_for_mla_by_name():
  # models/mla.py reads wkv_b as values x scales (no mins): refused rather than wrong.
  cfg = read_config(tiny_dir("deepseek_v3"))
  with pytest.raises(UnsupportedModelError, match=r"int4' is not supported for MLA .*kv_b_proj"):
    param_specs(cfg, "int4")


def test_unknown_quantization_is_a_clear_error():
  with pytest.raises(InvalidRequestError, match="quantization must be one of int8, fp8, int4, int8-channel.*'int3'"):
    LLM(tiny_dir("llama3"), max_model_len=64, warmup=False, quantization="int3")
  with pytest.raises(InvalidRequestError, match="'fp4'"):
    param_specs(_cfg(), "fp4")
  with pytest.raises(InvalidRequestError, match="got True"):
    param_specs(_cfg(), True)
  with pytest.raises(InvalidRequestError, match="got 'INT8-channel'"):
    param_specs(_cfg(), "INT8-channel")


def test_each_quantization_lays_out_linears_and_the_head():
  cfg = read_config(tiny_dir("smollm2"))  # tied: the head is the embedding table [V, D]
  specs = param_specs(cfg)
  table, w_up = specs["embed"], specs["layers"][0]["w_up"]
  assert table.head and w_up.linear
  assert leaf_layout(w_up, "int8") == LeafLayout("int8", 32, True)
  assert leaf_layout(table, "int8") == LeafLayout("int8", 32, False)
  assert leaf_layout(w_up, "int8-channel") == leaf_layout(table, "int8-channel") == LeafLayout("int8")
  assert leaf_layout(w_up, "int4") == LeafLayout("int4", 32, True)
  assert leaf_layout(table, "int4") == LeafLayout("int8", 32, False)
  assert leaf_layout(w_up, "fp8") == LeafLayout("fp8") and leaf_layout(table, "fp8") is None
  assert leaf_layout(w_up, None) is None
  # Inputs that are not a multiple of 32: per channel.
  odd = dataclasses.replace(w_up, shape=(48, w_up.shape[1]))
  assert leaf_layout(odd, "int8") == LeafLayout("int8")
  # Stacked experts stay per channel (models/moe.py's grouped matmul takes per-channel scales).
  moe = param_specs(read_config(tiny_dir("qwen3_moe")))
  experts = next(s for s in jax.tree.leaves(moe, is_leaf=is_spec) if s.num_experts)
  assert leaf_layout(experts, "int8") == LeafLayout("int8")


@pytest.mark.parametrize("quantization", ["int8", "int8-channel"])
def test_a_tied_int8_table_reads_back_its_dequantized_rows_and_logits(quantization):
  # The table in groups along D per vocab row (int8) or per D column (int8-channel): the
  # lookup gives the dequantized rows, the head x @ the dequantized table^T.
  cfg = read_config(tiny_dir("smollm2"))
  spec = param_specs(cfg)["embed"]
  rng = np.random.default_rng(7)
  table = (rng.standard_normal(spec.shape) * rng.uniform(0.1, 2, (spec.shape[0], 1))).astype(np.float32)
  q = quantize_leaf(spec, table, quantization)
  back = dequantize_weight(spec, q)
  assert back.shape == table.shape
  assert np.abs(back - table).max() <= np.abs(table).max() / 127
  qj = jax.tree.map(jnp.asarray, q)
  tokens = jnp.asarray([[3, 0, spec.shape[0] - 1]])
  np.testing.assert_allclose(np.asarray(embed_lookup(qj, tokens, jnp.float32)), back[np.asarray(tokens)], rtol=1e-6,
                             atol=1e-7)
  x = rng.standard_normal((2, spec.shape[1])).astype(np.float32)
  got = np.asarray(head_logits(jnp.asarray(x), qj, tied=True))
  np.testing.assert_allclose(got, x.astype(np.float64) @ back.T.astype(np.float64), rtol=0, atol=1e-3)


# ---- the model -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def int8_llms():
  return {f: LLM(tiny_dir(f), max_model_len=256, max_num_seqs=8, warmup=False, quantization="int8")
          for f in ("smollm2", "qwen3", "llama2")}


@pytest.mark.parametrize("family", ["smollm2", "qwen3", "llama2"])
def test_int8_logits_close_to_float32(int8_llms, family):
  # The goldens are transformers' float32 logits (|logit| up to ~4 on these random tiny models).
  # Tolerance: per-channel int8 weights move them by < 0.2 here (measured 0.07-0.11);
  # a wrong scale or layout moves them by whole units.
  g = golden(family)
  llm = int8_llms[family]
  assert isinstance(llm.runner.params["layers"][0]["w_gate_up"], QuantizedWeight)  # gate/up fused (params.FUSED)
  logits = llm.logits(g["token_ids"].tolist())
  np.testing.assert_allclose(logits, g["logits"], atol=0.2, rtol=0)
  assert np.mean(logits.argmax(-1) == g["logits"].argmax(-1)) >= 0.9


def test_int8_greedy_batch_invariance(int8_llms):
  """Slow (over 30 s on two cores): each of the eight prompts also runs alone, in its own
  step bucket, compiled for the int8 model."""
  llm = int8_llms["qwen3"]
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 320, n).tolist() for n in (3, 40, 9, 1, 70, 16, 5, 33)]
  together = llm.generate(prompts, GREEDY)
  for p, out in zip(prompts, together):
    assert out.token_ids == llm.generate([p], GREEDY)[0].token_ids


def test_int8_sharded_over_a_mesh_matches_one_device(int8_llms):
  # Shardings of the quantized tree come from the logical axes (values like the weight, scales
  # like its outputs); a tensor-parallel int8 model computes the same int32 sums (a row-parallel
  # weight's partial sums are all-reduced as s32), and only the float epilogue that scales them
  # rounds in another order (~1e-5 relative per layer).
  mesh = make_mesh(model=2)
  sharded = LLM(tiny_dir("smollm2"), max_model_len=256, max_num_seqs=8, warmup=False, quantization="int8",
                mesh=mesh, sharding_rules={"kv_heads": None})  # 1 KV head: replicated on purpose
  w = sharded.runner.params["layers"][0]["w_gate_up"]  # values [2, F, D]: gate and up, F split
  assert w.values.sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
  ids = golden("smollm2")["token_ids"].tolist()
  np.testing.assert_allclose(sharded.logits(ids), int8_llms["smollm2"].logits(ids), atol=1e-3, rtol=0)
