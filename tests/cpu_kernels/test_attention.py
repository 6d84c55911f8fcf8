"""cpu_kernels.decode_attention (XLA FFI kernel) against its float64 reference, and where
jaxinfer.ops uses it."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import cpu_kernels
from conftest import USER_XLA
from cpu_kernels import decode_attention, decode_attention_reference, pages_as_float
from jaxinfer import ops, quant

from tests.cpu_kernels.test_int8_matmul import needs_kernel


def _case(rng, S=3, R=2, K=3, G=3, d=64, N=20, p=16, P=6, dvp=None):
  q = (rng.standard_normal((S, R, K, G, d)) * 0.3).astype(np.float32)
  k = rng.standard_normal((N, p, K, d)).astype(np.float32)
  v = rng.standard_normal((N, p, K, dvp or d)).astype(np.float32)
  pages = rng.integers(0, N, (S, P)).astype(np.int32)
  return q, k, v, pages


@needs_kernel
@pytest.mark.parametrize("kw", [{}, {"window": 7}, {"soft_cap": 5.0}, {"dv": 32}, {"window": 1, "soft_cap": 1.5}])
def test_random_rows_equal_the_float64_reference(kw):
  rng = np.random.default_rng(len(kw) + kw.get("window", 0))
  q, k, v, pages = _case(rng)
  # a first key only, a page boundary, a padding row (-1), past the table's last key (clamped)
  q_pos = np.array([[0, 15], [70, -1], [40, 200]], np.int32)
  got = np.asarray(jax.jit(lambda *a: decode_attention(*a, **kw))(*map(jnp.asarray, (q, k, v, q_pos, pages))))
  want = decode_attention_reference(q, k, v, q_pos, pages, **kw)
  assert got.shape == want.shape and got.dtype == np.float32
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
  assert not got[1, 1].any()  # the padding row is zeros


def _stored(x, kind):
  """Float32 pages as a cache of `kind` stores them: (pages, scale or None)."""
  if kind == "bfloat16-bits":
    return x.astype(ml_dtypes.bfloat16).view(np.uint16), None
  if kind == "bfloat16":
    return x.astype(ml_dtypes.bfloat16), None
  top = {"int8": 127.0, "fp8": 448.0, "fp8-bits": 448.0}[kind]
  scale = np.abs(x).max(-1) / top  # per token and kv head, as jaxinfer.models.cache quantizes
  v = x / scale[..., None]
  if kind == "int8":
    return np.round(v).astype(np.int8), scale.astype(np.float32)
  f8 = v.astype(ml_dtypes.float8_e4m3fn)
  return (f8.view(np.uint8) if kind == "fp8-bits" else f8), scale.astype(np.float32)


@needs_kernel
@pytest.mark.parametrize("kind", ["bfloat16-bits", "bfloat16", "int8", "fp8-bits", "fp8"])
def test_bfloat16_and_quantized_pages_equal_the_reference_on_their_values(kind):
  # The kernel reads the pages as stored; the reference dequantizes them in float64.
  rng = np.random.default_rng(6)
  q, k, v, pages = _case(rng)
  (ks, k_scale), (vs, v_scale) = _stored(k, kind), _stored(v, kind)
  scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
  q_pos = np.array([[0, 15], [70, -1], [40, 95]], np.int32)
  got = np.asarray(jax.jit(lambda q, k, v, qp, pg, **sc: decode_attention(q, k, v, qp, pg, window=50, **sc))(
      *map(jnp.asarray, (q, ks, vs, q_pos, pages)), **{n: jnp.asarray(a) for n, a in scales.items()}))
  want = decode_attention_reference(q, ks, vs, q_pos, pages, window=50, **scales)
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
  # and the values are what was stored: within the format's rounding of the float32 pages
  exact = decode_attention_reference(q, k, v, q_pos, pages, window=50)
  tol = {"bfloat16-bits": 3e-2, "bfloat16": 3e-2, "int8": 6e-2, "fp8-bits": 2e-1, "fp8": 2e-1}[kind]
  np.testing.assert_allclose(got, exact, atol=tol)
  assert not np.allclose(pages_as_float(ks, k_scale), k)  # (the stored pages really are rounded)


@needs_kernel
def test_a_quantized_row_is_the_same_number_whatever_else_is_in_the_batch():
  rng = np.random.default_rng(7)
  q, k, v, pages = _case(rng, S=16, R=1)
  (ks, k_scale), (vs, v_scale) = _stored(k, "int8"), _stored(v, "int8")
  q_pos = rng.integers(0, 90, (16, 1)).astype(np.int32)
  fn = jax.jit(lambda q, qp, pg: decode_attention(q, jnp.asarray(ks), jnp.asarray(vs), qp, pg,
                                                  k_scale=jnp.asarray(k_scale), v_scale=jnp.asarray(v_scale)))
  many = np.asarray(fn(q, q_pos, pages))
  one = np.asarray(fn(q[:1], q_pos[:1], pages[:1]))
  np.testing.assert_array_equal(one[0], many[0])


@needs_kernel
def test_out_of_range_page_ids_are_clamped_into_the_pool_like_xla_gathers():
  rng = np.random.default_rng(3)
  q, k, v, pages = _case(rng, S=1, R=1)
  pages[0, :2] = [-5, 999]
  q_pos = np.array([[20]], np.int32)
  got = np.asarray(decode_attention(*map(jnp.asarray, (q, k, v, q_pos, pages))))
  np.testing.assert_allclose(got, decode_attention_reference(q, k, v, q_pos, pages), atol=2e-6, rtol=1e-5)


@needs_kernel
def test_a_row_is_the_same_number_whatever_else_is_in_the_batch():
  # Greedy batch invariance: row (0, 0) alone and beside 15 other rows, bit for bit.
  rng = np.random.default_rng(4)
  q, k, v, pages = _case(rng, S=16, R=1)
  q_pos = rng.integers(0, 90, (16, 1)).astype(np.int32)
  fn = jax.jit(decode_attention)
  many = np.asarray(fn(*map(jnp.asarray, (q, k, v, q_pos, pages))))
  one = np.asarray(fn(*map(jnp.asarray, (q[:1], k, v, q_pos[:1], pages[:1]))))
  np.testing.assert_array_equal(one[0], many[0])


@needs_kernel
def test_shapes_and_options_it_cannot_take_are_value_errors():
  q, k, v, pages = _case(np.random.default_rng(5), d=60, N=4, p=4, P=2)
  q_pos = np.zeros((3, 2), np.int32)
  with pytest.raises(ValueError, match="multiples of 8"):
    decode_attention(q, k, v, q_pos, pages)
  q, k, v, pages = _case(np.random.default_rng(5), N=4, p=4, P=2)
  with pytest.raises(ValueError, match="float32"):
    decode_attention(q.astype(jnp.bfloat16), k, v, q_pos, pages)
  k8, s8 = _stored(k, "int8")
  with pytest.raises(ValueError, match="k_scale None"):  # int8 pages need their scales
    decode_attention(q, k8, k8, q_pos, pages)
  with pytest.raises(ValueError, match=r"v_scale float32\[4, 4\]"):  # per token and kv head, not per token
    decode_attention(q, k8, k8, q_pos, pages, k_scale=s8, v_scale=s8[..., 0])
  with pytest.raises(ValueError, match="k_scale float32"):  # float pages take none
    decode_attention(q, k, v, q_pos, pages, k_scale=s8, v_scale=s8)
  with pytest.raises(ValueError, match="of one dtype"):
    decode_attention(q, k8, v, q_pos, pages, k_scale=s8, v_scale=s8)
  with pytest.raises(ValueError, match="window"):
    decode_attention(q, k, v, q_pos, pages, window=0)
  with pytest.raises(ValueError, match="soft_cap"):
    decode_attention(q, k, v, q_pos, pages, soft_cap=-1.0)


def _decode_hlo(dtype, pages_dtype=None, same_kv=False, **kw):
  """The compiled HLO of one batch-1 decode through ops.ragged_paged_attention (XLA path);
  same_kv: one cache is both keys and values (MLA's latent)."""
  H, K, d, p = 6, 2, 64, 16
  q = jnp.ones((1, H, d), dtype)
  pages = jnp.ones((8, p, K, d), pages_dtype or dtype)
  fn = jax.jit(lambda q, k, v: ops.ragged_paged_attention(
      q, k, k if same_kv else v, jnp.array([5], jnp.int32), jnp.zeros((1, 4), jnp.int32), jnp.array([0, 1], jnp.int32),
      jnp.int32(1), impl="xla", **kw))
  return fn.lower(q, pages, pages).compile(compiler_options=USER_XLA).as_text()


@needs_kernel
def test_ops_runs_decode_rows_through_the_kernel_and_the_rest_through_xla():
  assert cpu_kernels.DECODE_ATTENTION_TARGET in _decode_hlo(jnp.float32)
  assert cpu_kernels.DECODE_ATTENTION_TARGET in _decode_hlo(jnp.float32, sliding_window=4, soft_cap=3.0)
  assert cpu_kernels.DECODE_ATTENTION_TARGET in _decode_hlo(jnp.bfloat16)
  scales = jnp.ones((8, 16, 2), jnp.float32)
  for stored in (jnp.int8, jnp.uint8):  # int8, and float8's bits as the CPU cache holds them
    assert cpu_kernels.DECODE_ATTENTION_TARGET in _decode_hlo(jnp.float32, pages_dtype=stored, k_scale=scales,
                                                              v_scale=scales)
  # sinks are not in it, nor scales per group of values (MLA's latent)
  assert cpu_kernels.DECODE_ATTENTION_TARGET not in _decode_hlo(jnp.float32, sinks=jnp.zeros(6))
  grouped = jnp.ones((8, 16, 2, 2), jnp.float32)
  assert cpu_kernels.DECODE_ATTENTION_TARGET not in _decode_hlo(jnp.float32, pages_dtype=jnp.int8, same_kv=True,
                                                                k_scale=grouped, v_scale=grouped)
  # nor in a program traced for several devices (XLA's partitioner cannot split a custom call)
  two = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
  assert cpu_kernels.DECODE_ATTENTION_TARGET not in quant.tracing_on(two, _decode_hlo)(jnp.float32)
