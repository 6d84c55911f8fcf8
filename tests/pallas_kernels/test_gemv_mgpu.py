"""gemv_mgpu (Pallas Mosaic GPU few-token GEMV) against its reference, and quant.linear's choice of it.

The kernel tests (marker `mosaic`) run it in Mosaic GPU interpret mode on a CPU
(jax >= 0.11; skipped with the reason under the Python 3.11 CI's jax 0.10: run
them with scripts/test_mosaic.sh or
  /work/venv312/bin/python -m pytest -ra tests/pallas_kernels/test_gemv_mgpu.py)
and lower it for CUDA (the Mosaic GPU lowering, layout inference included, runs
without a GPU; interpret mode forgives what it would refuse, e.g. an e4m3 ->
bf16 conversion Hopper has no instruction for). The dispatch table runs
everywhere: choose_gemv is a pure function.

Legend: M tokens, O outputs, I inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import ON_GPU
from jaxinfer import quant
from pallas_kernels import gemv_mgpu as gm
from pallas_kernels.gemv_mgpu import (MOSAIC_AVAILABLE, BlockSizes, choose_gemv, gemv_mgpu,
                                      gemv_reference)

def needs_mosaic(test):
  """The kernel's own tests: marked `mosaic`, skipped with the reason under jax < 0.11."""
  skip = pytest.mark.skipif(not MOSAIC_AVAILABLE,
                            reason="Mosaic GPU interpret mode needs jax >= 0.11 (Python 3.12 venv)")
  return pytest.mark.mosaic(skip(test))
INTERPRET = not ON_GPU


def weights(rng, O, I, fmt):
  """A per-channel QuantizedWeight of a random non-zero float weight [I, O], quant's own quantizer."""
  w = rng.normal(size=(I, O)).astype(np.float32) * rng.uniform(0.5, 2.0, size=O).astype(np.float32)
  qw = quant.quantize_fp8(w, 1) if fmt == "fp8" else quant.quantize_int8(w, 1)
  assert qw.scales.shape == (1, O) and qw.mins is None  # per channel: what the kernel takes
  return qw


def tokens(rng, M, I):
  return jnp.asarray(rng.normal(size=(M, I)).astype(np.float32)).astype(jnp.bfloat16)


# ---- the kernel in interpret mode -------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("M,O,I,block_sizes", [
    (1, 128, 256, None),                        # one token; C = 2 splits (auto: every step its own)
    (3, 192, 384, BlockSizes(k_splits=3)),      # three tokens padded to 8; three splits of one step
    (16, 64, 512, BlockSizes(num_stages=2, k_splits=1)),  # N = 16; one split of four steps
])
@needs_mosaic
def test_kernel_matches_reference(fmt, M, O, I, block_sizes):
  rng = np.random.default_rng(M * 1000 + O + I)
  qw = weights(rng, O, I, fmt)
  x = tokens(rng, M, I)
  q, s = jnp.asarray(qw.values), jnp.asarray(qw.scales)
  got = np.asarray(gemv_mgpu(x, q, s, block_sizes=block_sizes, interpret=INTERPRET))
  want = np.asarray(gemv_reference(x, q, s))
  assert got.shape == (M, O) and got.dtype == np.float32
  assert np.all(want != 0)
  # Both sum exact bf16 x bf16 products in float32, in different orders.
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_reference_is_the_dequantized_product(fmt):
  """gemv_reference = x @ (q * s)^T in float64 (quant.quantized_matmul_reference) up to float32
  summation: the bf16 conversions of x's values and q's are exact."""
  rng = np.random.default_rng(7)
  qw = weights(rng, 64, 256, fmt)
  x = tokens(rng, 5, 256)
  got = np.asarray(gemv_reference(x, jnp.asarray(qw.values), jnp.asarray(qw.scales)))
  want = quant.quantized_matmul_reference(np.asarray(x.astype(jnp.float32)), qw.values, qw.scales)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_mosaic
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_quant_linear_runs_the_kernel_where_chosen(fmt, monkeypatch):
  """quant.linear with the GEMV chosen (as on an sm_90 GPU) runs the kernel (its name is in the jaxpr) and gives
  quant.linear's own result for the weight ('TD,DF->TF', 2 tokens)."""
  rng = np.random.default_rng(3)
  qw = weights(rng, 128, 256, fmt)
  qw = quant.QuantizedWeight(jnp.asarray(qw.values), jnp.asarray(qw.scales))
  x = tokens(rng, 2, 256)
  def linear(x, w):  # a new function each time: jax caches traces per function
    return quant.linear("TD,DF->TF", x, w)
  want = np.asarray(jax.jit(linear)(x, qw), np.float32)
  assert "gemv_mgpu_" not in str(jax.make_jaxpr(lambda x, w: linear(x, w))(x, qw))
  monkeypatch.setattr(gm, "choose_gemv", lambda **_: "mosaic")
  assert "gemv_mgpu_" in str(jax.make_jaxpr(lambda x, w: linear(x, w))(x, qw))
  got = np.asarray(jax.jit(lambda x, w: linear(x, w))(x, qw), np.float32)
  # Both come back in bf16 (x's dtype); the XLA / CPU-kernel path rounds its activations
  # differently (int16 on the CPU for int8), hence a few bf16 ulps.
  np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


@needs_mosaic
def test_bad_operands_are_refused():
  rng = np.random.default_rng(1)
  qw = weights(rng, 128, 256, "int8")
  q, s = jnp.asarray(qw.values), jnp.asarray(qw.scales)
  with pytest.raises(ValueError, match="17 tokens"):
    gemv_mgpu(tokens(rng, 17, 256), q, s, interpret=True)
  with pytest.raises(ValueError, match="bfloat16 only"):
    gemv_mgpu(tokens(rng, 2, 256).astype(jnp.float32), q, s, interpret=True)
  with pytest.raises(ValueError, match="multiple of 64"):
    gemv_mgpu(tokens(rng, 2, 256), q[:100], s[:, :100], interpret=True)
  with pytest.raises(ValueError, match="multiple of block_k = 128"):
    gemv_mgpu(tokens(rng, 2, 192), q[:, :192], s, interpret=True)
  with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
    gemv_mgpu(tokens(rng, 2, 256), q.astype(jnp.bfloat16), s, interpret=True)
  with pytest.raises(ValueError, match="one per output channel"):
    gemv_mgpu(tokens(rng, 2, 256), q, jnp.ones((8, 128)), interpret=True)
  with pytest.raises(ValueError, match="k_splits=3 must divide"):
    gemv_mgpu(tokens(rng, 2, 256), q, s, block_sizes=BlockSizes(k_splits=3), interpret=True)


@needs_mosaic
@pytest.mark.parametrize("stage_in_smem", [False, True])
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("O,I", [
    (4096, 14336),   # w_down: C = 7 splits of 16 steps
    (1024, 4096),    # wk: C = 32, one step per program (fewer steps than pipeline stages)
    (128256, 4096),  # an int8-channel LM head: 2004 row tiles, no split
])
def test_lowers_for_cuda(O, I, M, dtype, stage_in_smem):
  """The compiled form (wgmma from registers, or from the staged bf16 tile) lowers for CUDA
  at the 8B's shapes: Mosaic GPU's layout inference and its dtype conversions accept it.
  Nothing is compiled or run."""
  x = jax.ShapeDtypeStruct((M, I), jnp.bfloat16)
  q = jax.ShapeDtypeStruct((O, I), dtype)
  s = jax.ShapeDtypeStruct((1, O), jnp.float32)
  fn = functools.partial(gemv_mgpu, block_sizes=BlockSizes(stage_in_smem=stage_in_smem))
  text = jax.jit(fn).trace(x, q, s).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_block_sizes_split_the_inputs_to_fill_the_gpu():
  """k_splits None: the smallest divisor of the step count giving >= 264 programs."""
  bs = BlockSizes()
  assert bs.splits(4096, 14336) == 7    # 64 row tiles x 7 of 112 steps = 448 programs
  assert bs.splits(14336, 4096) == 2    # 224 x 2 of 32
  assert bs.splits(128, 256) == 2       # too small to fill anything: one step per split
  assert BlockSizes(k_splits=4).splits(4096, 4096) == 4
  with pytest.raises(ValueError, match="num_stages=1 must be >= 2"):
    BlockSizes(num_stages=1)
  with pytest.raises(ValueError, match="block_k=96"):
    BlockSizes(block_k=96)


# ---- the dispatch decision (pure; runs under any jax) -----------------------------------------

HOPPER = dict(backend="gpu", capability="9.0", jax_version="0.11.2", tokens=1, weight_format="fp8",
              per_channel=True, x_dtype=jnp.bfloat16, shape=(4096, 14336))


@pytest.mark.parametrize("change,choice", [
    ({}, "mosaic"),
    ({"weight_format": "int8"}, "mosaic"),
    ({"tokens": 16}, "mosaic"),
    ({"capability": "10.0"}, "mosaic"),                # Blackwell has TMA and wgmma's successor path
    ({"jax_version": "0.12.0.dev20261201"}, "mosaic"),
    ({"tokens": 17}, "xla"),                           # XLA's GEMM from 17 tokens on
    ({"backend": "cpu", "capability": None}, "xla"),
    ({"backend": "tpu", "capability": None}, "xla"),
    ({"capability": "8.0"}, "xla"),                    # Ampere: no TMA / wgmma
    ({"capability": None}, "xla"),
    ({"jax_version": "0.10.2"}, "xla"),                # no Mosaic GPU interpret / this API
    ({"weight_format": "int4"}, "xla"),
    ({"per_channel": False}, "xla"),                   # int8's groups of 32 (mins)
    ({"x_dtype": jnp.float32}, "xla"),
    ({"one_device": False}, "xla"),                    # a partitioned program
    ({"shape": (4000, 14336)}, "xla"),                 # O not a multiple of 64
    ({"shape": (4096, 14300)}, "xla"),                 # I not a multiple of 128
])
def test_choose_gemv(change, choice):
  assert choose_gemv(**{**HOPPER, **change}) == choice


@pytest.mark.skipif(ON_GPU, reason="asserts the CPU's choice")
def test_quant_keeps_xla_off_the_gpu():
  """On a CPU quant.gemv_choice never picks the kernel, even for a weight it takes."""
  rng = np.random.default_rng(0)
  qw = weights(rng, 128, 256, "fp8")
  assert quant.gemv_choice(tokens(rng, 1, 256), jnp.asarray(qw.values), jnp.asarray(qw.scales)) == "xla"


def test_e4m3_values_are_exact_in_bfloat16():
  """Why the kernel may convert e4m3 weights to bf16 before the wgmma: every finite e4m3 value
  is a bf16 value (3-bit vs 7-bit significand, exponents within bf16's range)."""
  e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
  finite = e4m3[np.isfinite(e4m3.astype(np.float32))]
  f32 = finite.astype(np.float32)
  assert np.array_equal(f32.astype(ml_dtypes.bfloat16).astype(np.float32), f32)
