"""ops.ragged_paged_attention (XLA reference) against a naive per-sequence numpy attention."""

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from conftest import PALLAS_IMPL
from jaxinfer import ops, quant


def naive(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, window=None, soft_cap=None,
          sinks=None):
  """Dense causal softmax attention, one sequence at a time, float64. A sink (GPT-OSS) is one
  more logit of the head's softmax whose weight is dropped: it only grows the denominator."""
  T, H, d = q.shape
  _, p, K, _ = k_pages.shape
  out = np.full((T, H, d), np.nan)
  for s in range(num_seqs):
    lo, hi, L = cu_q_lens[s], cu_q_lens[s + 1], kv_lens[s]
    pages = page_indices[s, :-(-L // p)]
    k = k_pages[pages].reshape(-1, K, d)[:L].astype(np.float64)
    v = v_pages[pages].reshape(-1, K, d)[:L].astype(np.float64)
    for i, t in enumerate(range(lo, hi)):
      pos = L - (hi - lo) + i
      for h in range(H):
        kh = h // (H // K)
        scores = k[:, kh] @ q[t, h].astype(np.float64) / np.sqrt(d)
        if soft_cap is not None:
          scores = soft_cap * np.tanh(scores / soft_cap)
        j = np.arange(L)
        ok = j <= pos if window is None else (j <= pos) & (j > pos - window)
        scores = np.where(ok, scores, -np.inf)
        if sinks is not None:
          scores = np.append(scores, sinks[h])
        w = np.exp(scores - scores.max())
        w = w / w.sum()
        out[t, h] = w[:L] @ v[:, kh]
  return out


def layout(rng, q_lens, kv_extra, page_size, num_pages, pages_per_seq):
  """Random ragged batch: pages drawn shuffled from the pool, never page 0."""
  S = len(q_lens)
  kv_lens = np.array([q + e for q, e in zip(q_lens, kv_extra)], np.int32)
  perm = rng.permutation(np.arange(1, num_pages))
  page_indices = np.zeros((S + 2, pages_per_seq), np.int32)  # 2 padding sequences
  used = 0
  for s, L in enumerate(kv_lens):
    n = -(-L // page_size)
    page_indices[s, :n] = perm[used:used + n]
    used += n
  cu = np.zeros(S + 3, np.int32)
  cu[1:S + 1] = np.cumsum(q_lens)
  cu[S + 1:] = cu[S]
  return kv_lens, page_indices, cu


def mixed_batch(rng, page_size):
  """Five sequences (decode, verify, decode over 150 keys, prefill chunks) over 20-page slots,
  3 padding tokens: (q_lens, num_pages, kv_lens, page_indices, cu_q_lens, T)."""
  q_lens, kv_extra = [1, 3, 1, 37, 70], [20, 9, 150, 0, 61]
  num_pages = len(q_lens) * 20 + 1
  kv_lens, page_indices, cu = layout(rng, q_lens, kv_extra, page_size, num_pages, 20)
  return q_lens, num_pages, kv_lens, page_indices, cu, int(cu[-1]) + 3


CASES = [(16, 4, 4, 32, None, None), (16, 8, 2, 64, None, None), (4, 6, 2, 16, 5, None),
         (32, 8, 1, 64, None, None), (16, 4, 2, 32, 40, 2.0)]


def attention(*args, impl, **kwargs):
  """ops.ragged_paged_attention; impl 'xla-loop' is the XLA path with the CPU kernels off (its
  decode rows through its own chunk loop, as on several devices or where the kernels cannot
  build) rather than through cpu_kernels.decode_attention."""
  if impl != "xla-loop":
    return ops.ragged_paged_attention(*args, impl=impl, **kwargs)
  two = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
  return quant.tracing_on(two, ops.ragged_paged_attention)(*args, impl="xla", **kwargs)


@pytest.mark.parametrize("impl", ["xla", "xla-loop", PALLAS_IMPL])  # all behind the one signature
@pytest.mark.parametrize("page_size,H,K,d,window,soft_cap", CASES)
def test_matches_naive_on_mixed_decode_verify_prefill(page_size, H, K, d, window, soft_cap, impl):
  rng = np.random.default_rng(page_size + H + K)
  q_lens = [1, 3, 1, 37, 5, 130, 1]  # decode, verify (1 + 2), decode, prefill chunks, ...
  kv_extra = [0, 20, 150, 0, 61, 7, 255]
  P = 20 if page_size >= 16 else 80
  num_pages = 7 * P + 1
  kv_lens, page_indices, cu = layout(rng, q_lens, kv_extra, page_size, num_pages, P)
  T = int(cu[-1]) + 5  # padding tokens at the end
  q = rng.normal(size=(T, H, d)).astype(np.float32)
  k_pages = rng.normal(size=(num_pages, page_size, K, d)).astype(np.float32)
  v_pages = rng.normal(size=(num_pages, page_size, K, d)).astype(np.float32)
  kv_full = np.concatenate([kv_lens, [0, 0]]).astype(np.int32)
  got = np.asarray(attention(q, k_pages, v_pages, kv_full, page_indices, cu, np.int32(len(q_lens)),
                             sliding_window=window, soft_cap=soft_cap, impl=impl))
  want = naive(q, k_pages, v_pages, kv_full, page_indices, cu, len(q_lens), window, soft_cap)
  real = int(cu[len(q_lens)])
  np.testing.assert_allclose(got[:real], want[:real], atol=2e-5, rtol=1e-4)
  if impl != PALLAS_IMPL:  # the kernel leaves padding rows as the buffer held them
    assert np.isfinite(got).all()  # padding rows are unspecified but never NaN


@pytest.mark.parametrize("impl", ["xla", PALLAS_IMPL])
@pytest.mark.parametrize("H,K,window,decode_q_len", [(8, 4, None, 1), (8, 2, 8, 1), (4, 4, 5, 3)])
def test_attention_sinks_match_naive(H, K, window, decode_q_len, impl):
  """GPT-OSS's sinks on mixed decode / verify / prefill rows, with and without a window; sinks
  from far below to far above the scores (the last heads' rows keep little weight)."""
  rng = np.random.default_rng(H + K + (window or 0))
  q_lens = [1, 3, 1, 70, 2, 9, 1]
  kv_extra = [0, 20, 150, 0, 61, 7, 40]
  page_size, P = 16, 20
  num_pages = 7 * P + 1
  kv_lens, page_indices, cu = layout(rng, q_lens, kv_extra, page_size, num_pages, P)
  T = int(cu[-1]) + 5
  q = rng.normal(size=(T, H, 16)).astype(np.float32)
  k_pages = rng.normal(size=(num_pages, page_size, K, 16)).astype(np.float32)
  v_pages = rng.normal(size=(num_pages, page_size, K, 16)).astype(np.float32)
  kv_full = np.concatenate([kv_lens, [0, 0]]).astype(np.int32)
  sinks = np.linspace(-5.0, 8.0, H).astype(np.float32)
  got = np.asarray(ops.ragged_paged_attention(q, k_pages, v_pages, kv_full, page_indices, cu,
                                              np.int32(len(q_lens)), sliding_window=window, sinks=sinks,
                                              impl=impl, decode_q_len=decode_q_len))
  want = naive(q, k_pages, v_pages, kv_full, page_indices, cu, len(q_lens), window, sinks=sinks)
  real = int(cu[len(q_lens)])
  np.testing.assert_allclose(got[:real], want[:real], atol=2e-5, rtol=1e-4)
  without = naive(q, k_pages, v_pages, kv_full, page_indices, cu, len(q_lens), window)
  assert np.abs(want[:real] - without[:real]).max() > 0.1  # the sinks matter here


def test_attention_sinks_of_the_wrong_shape_are_refused():
  rng = np.random.default_rng(0)
  kv_lens, page_indices, cu = layout(rng, [1], [3], 16, 3, 2)
  q = rng.normal(size=(1, 4, 16)).astype(np.float32)
  pages = rng.normal(size=(3, 16, 2, 16)).astype(np.float32)
  with pytest.raises(ValueError, match=r"sinks must be \[H\]=4"):
    ops.ragged_paged_attention(q, pages, pages, kv_lens, page_indices[:1], cu[:2], np.int32(1),
                               sinks=np.zeros(2, np.float32))


def test_auto_is_xla_on_cpu_and_pallas_on_gpu():
  assert ops.resolve_attention_impl("auto", "cpu") == "xla"
  assert ops.resolve_attention_impl("auto", "gpu") == "pallas"
  assert ops.resolve_attention_impl("pallas_interpret", "cpu") == "pallas_interpret"
  with pytest.raises(ValueError, match="compiles for GPU only"):
    ops.resolve_attention_impl("pallas", "cpu")
  with pytest.raises(ValueError, match="must be one of"):
    ops.resolve_attention_impl("triton", "gpu")


@pytest.mark.parametrize("backend,cc,mosaic,want", [
    ("gpu", "9.0", True, "mosaic"),    # H100 / H200 under jax >= 0.11
    ("gpu", "10.0", True, "pallas"),   # Blackwell: wgmma is sm_90a only (sm_100 has tcgen05)
    ("gpu", "8.9", True, "pallas"),    # Ada: no TMA / wgmma, the Triton kernel
    ("gpu", "9.0", False, "pallas"),   # jax 0.10: no Mosaic GPU
    ("gpu", None, True, "pallas"),     # no GPU in this process to ask: not assumed to be Hopper
    ("cpu", None, True, "xla"),
    ("tpu", None, False, "xla"),
])
def test_auto_picks_mosaic_on_hopper_with_jax_0_11(backend, cc, mosaic, want):
  assert ops.choose_attention_impl("auto", backend=backend, compute_capability=cc,
                                   mosaic_available=mosaic) == want
  # An MLA model stays on Triton under 'auto' (its Mosaic kernel has not run on a GPU).
  assert ops.choose_attention_impl("auto", backend=backend, compute_capability=cc, mosaic_available=mosaic,
                                   mla=True) == ("pallas" if want == "mosaic" else want)


def test_explicit_impls_are_checked_against_the_machine():
  choose = ops.choose_attention_impl
  assert choose("mosaic", backend="gpu", compute_capability="9.0", mosaic_available=True) == "mosaic"
  assert choose("pallas", backend="gpu", compute_capability="9.0", mosaic_available=True) == "pallas"
  assert choose("mosaic_interpret", backend="cpu", compute_capability=None,
                mosaic_available=True) == "mosaic_interpret"
  for cc in ("8.0", "10.0"):
    with pytest.raises(ValueError, match=f"needs a Hopper .sm_90. GPU for wgmma .this one is sm_{cc}"):
      choose("mosaic", backend="gpu", compute_capability=cc, mosaic_available=True)
  with pytest.raises(ValueError, match="needs jax >= 0.11"):
    choose("mosaic", backend="gpu", compute_capability="9.0", mosaic_available=False)
  with pytest.raises(ValueError, match="compiles for GPU only"):
    choose("mosaic", backend="cpu", compute_capability=None, mosaic_available=True)


def test_mosaic_is_asked_for_explicitly_and_needs_jax_0_11():
  from pallas_kernels.ragged_paged_attention_mgpu import MOSAIC_AVAILABLE
  with pytest.raises(ValueError, match="'mosaic' compiles for GPU only"):
    ops.resolve_attention_impl("mosaic", "cpu")
  if MOSAIC_AVAILABLE:
    assert ops.resolve_attention_impl("mosaic_interpret", "cpu") == "mosaic_interpret"
  else:
    with pytest.raises(ValueError, match="needs jax >= 0.11"):
      ops.resolve_attention_impl("mosaic_interpret", "cpu")


def test_bfloat16_inputs_accumulate_in_float32():
  import jax.numpy as jnp
  rng = np.random.default_rng(0)
  kv_lens, page_indices, cu = layout(rng, [1, 9], [40, 3], 16, 9, 4)
  q = rng.normal(size=(10, 4, 32)).astype(np.float32)
  kp = rng.normal(size=(9, 16, 2, 32)).astype(np.float32)
  vp = rng.normal(size=(9, 16, 2, 32)).astype(np.float32)
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  got = ops.ragged_paged_attention(bf(q), bf(kp), bf(vp), kv_lens, page_indices[:2], cu[:3], np.int32(2))
  assert got.dtype == jnp.bfloat16
  want = naive(np.asarray(bf(q), np.float32), np.asarray(bf(kp), np.float32), np.asarray(bf(vp), np.float32),
               kv_lens, page_indices[:2], cu[:3], 2)
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window,decode_q_len", [(None, 1), (40, 1), (None, 4)])
def test_xla_query_blocks_at_their_edges(window, decode_q_len):
  """Multi-query sequences are cut into blocks of ops._BLOCK_Q queries: lengths at,
  around and past a block edge, blocks that overhang into the next sequence's rows,
  decodes in between, KV far past one chunk, and a window that skips leading chunks;
  with decode_q_len 4, the 2-query sequences join the vectorized decode path."""
  B = ops._BLOCK_Q
  rng = np.random.default_rng(B)
  q_lens = [B, 1, B + 1, 2, B - 1, 1, 2 * B + 3]
  kv_extra = [0, 700, 3, 0, 2 * ops._PREFILL_KEYS + 5, 31, 260]
  P = 64
  num_pages = len(q_lens) * P + 1
  kv_lens, page_indices, cu = layout(rng, q_lens, kv_extra, 16, num_pages, P)
  T = int(cu[-1]) + 7
  q = rng.normal(size=(T, 4, 32)).astype(np.float32)
  k_pages = rng.normal(size=(num_pages, 16, 2, 32)).astype(np.float32)
  v_pages = rng.normal(size=(num_pages, 16, 2, 32)).astype(np.float32)
  kv_full = np.concatenate([kv_lens, [0, 0]]).astype(np.int32)
  got = np.asarray(ops.ragged_paged_attention(q, k_pages, v_pages, kv_full, page_indices, cu,
                                              np.int32(len(q_lens)), sliding_window=window, impl="xla",
                                              decode_q_len=decode_q_len))
  want = naive(q, k_pages, v_pages, kv_full, page_indices, cu, len(q_lens), window)
  real = int(cu[len(q_lens)])
  np.testing.assert_allclose(got[:real], want[:real], atol=2e-5, rtol=1e-4)


def _gathered_shapes(jaxpr):
  """Output shapes of every gather in a jaxpr, nested loops and calls included."""
  from jax.extend.core import jaxprs_in_params
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "gather":
      out.append(tuple(eqn.outvars[0].aval.shape))
    for sub in jaxprs_in_params(eqn.params):
      out += _gathered_shapes(sub)
  return out


def test_xla_path_reads_each_sequences_kv_once_per_block_not_per_token():
  """The KV gathered per loop iteration is one chunk per sequence (decode) or per query
  block, never one per query token: a 512-token prefill chunk must not copy its KV 512 times."""
  import jax
  T, S, P, p, K, d = 512, 64, 256, 16, 3, 64
  args = (np.zeros((T, 9, d), np.float32), np.zeros((P * 2, p, K, d), np.float32),
          np.zeros((P * 2, p, K, d), np.float32), np.zeros(S, np.int32), np.zeros((S, P), np.int32),
          np.zeros(S + 1, np.int32), np.int32(1))
  jaxpr = jax.make_jaxpr(ops.ragged_paged_attention_xla)(*args).jaxpr
  kv_gathers = [s for s in _gathered_shapes(jaxpr) if s[-2:] == (K, d)]
  assert kv_gathers, "no K/V gather found: the test no longer sees the XLA path"
  decode_keys = max(ops._DECODE_KEYS, p)
  for shape in kv_gathers:
    keys = int(np.prod(shape[:-2]))
    assert keys <= max(S * decode_keys, ops._PREFILL_KEYS), shape


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_xla_random_ragged_layouts(data):
  """Random layouts at fixed static shapes (no recompiles): the XLA path equals naive attention."""
  T, S, P, p = 160, 6, 12, 16
  num_seqs = data.draw(st.integers(1, S), label="num_seqs")
  q_lens = data.draw(st.lists(st.sampled_from([1, 2, 3, 4, 5, 9, 30, 64, 65, 100]), min_size=num_seqs,
                              max_size=num_seqs), label="q_lens")
  while sum(q_lens) > T - 3:
    q_lens[q_lens.index(max(q_lens))] //= 2
  kv_extra = [data.draw(st.integers(0, P * p - q), label="past") for q in q_lens]
  window = data.draw(st.sampled_from([None, 17]), label="window")
  decode_q_len = data.draw(st.sampled_from([1, 4]), label="decode_q_len")
  rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="seed"))
  num_pages = S * P + 1
  kv_lens, page_indices, cu = layout(rng, q_lens, kv_extra, p, num_pages, P)
  pad = S - num_seqs  # layout() adds 2 padding sequences; fill up to S + 2 rows in all
  page_indices = np.concatenate([page_indices, np.zeros((pad, P), np.int32)])
  cu = np.concatenate([cu, np.full(pad, cu[-1], np.int32)])
  kv_full = np.concatenate([kv_lens, np.zeros(pad + 2, np.int32)]).astype(np.int32)
  q = rng.normal(size=(T, 4, 16)).astype(np.float32)
  k_pages = rng.normal(size=(num_pages, p, 2, 16)).astype(np.float32)
  v_pages = rng.normal(size=(num_pages, p, 2, 16)).astype(np.float32)
  got = np.asarray(_jit_xla(q, k_pages, v_pages, kv_full, page_indices, cu, np.int32(num_seqs),
                            sliding_window=window, decode_q_len=decode_q_len))
  want = naive(q, k_pages, v_pages, kv_full, page_indices, cu, num_seqs, window)
  real = int(cu[num_seqs])
  np.testing.assert_allclose(got[:real], want[:real], atol=2e-5, rtol=1e-4)


def _jit_xla(*args, **static):
  import jax
  key = tuple(sorted(static.items()))
  if key not in _JITTED:
    _JITTED[key] = jax.jit(lambda *a: ops.ragged_paged_attention_xla(*a, **static))
  return _JITTED[key](*args)


_JITTED: dict = {}


@pytest.mark.parametrize("impl", ["xla", PALLAS_IMPL])
@pytest.mark.parametrize("decode_q_len", [1, 3])
def test_v_head_dim_mla_latent_cache(impl, decode_q_len):
  """MLA's use: one cache [N, p, 1, r + rope] is keys and values, the values are its first r
  columns, an explicit scale; equal to naive attention on the full pages, first r columns kept."""
  rng = np.random.default_rng(7)
  page_size, H, r, rope = 16, 8, 24, 8
  q_lens, num_pages, kv_lens, page_indices, cu, T = mixed_batch(rng, page_size)
  q = rng.normal(size=(T, H, r + rope)).astype(np.float32)
  latent = rng.normal(size=(num_pages, page_size, 1, r + rope)).astype(np.float32)
  kv_full = np.concatenate([kv_lens, [0, 0]]).astype(np.int32)
  scale = 0.3
  got = np.asarray(ops.ragged_paged_attention(q, latent, latent, kv_full, page_indices, cu,
                                              np.int32(len(q_lens)), sm_scale=scale, impl=impl,
                                              decode_q_len=decode_q_len, v_head_dim=r))
  # naive() scales by d ** -0.5: fold the wanted scale into q instead.
  want = naive(q * scale * np.sqrt(r + rope), latent, latent, kv_full, page_indices, cu, len(q_lens))
  real = int(cu[len(q_lens)])
  assert got.shape == (T, H, r)
  np.testing.assert_allclose(got[:real], want[:real, :, :r], atol=2e-5, rtol=1e-4)


def test_v_head_dim_distinct_values_and_bad_width():
  rng = np.random.default_rng(8)
  kv_lens, page_indices, cu = layout(rng, [1, 9], [5, 30], 16, 9, 4)
  kv_full = np.concatenate([kv_lens, [0, 0]]).astype(np.int32)
  q = rng.normal(size=(12, 4, 16)).astype(np.float32)
  k_pages, v_pages = (rng.normal(size=(9, 16, 2, 16)).astype(np.float32) for _ in range(2))
  args = (q, k_pages, v_pages, kv_full, page_indices, cu, np.int32(2))
  got = np.asarray(ops.ragged_paged_attention(*args, impl="xla", v_head_dim=5))
  full = np.asarray(ops.ragged_paged_attention(*args, impl="xla"))
  np.testing.assert_allclose(got[:10], full[:10, :, :5], atol=1e-6)
  for bad in (0, 17):
    with pytest.raises(ValueError, match="v_head_dim"):
      ops.ragged_paged_attention(*args, impl="xla", v_head_dim=bad)


@pytest.mark.parametrize("impl", ["xla", PALLAS_IMPL])
def test_ragged_paged_mla_is_mqa_over_the_latent(impl):
  """ops.ragged_paged_mla == naive MQA with q = [q_latent, q_rope] over the latent pages,
  values their first R columns; R + E = 48 is no power of two."""
  rng = np.random.default_rng(9)
  page_size, H, R, E = 16, 8, 32, 16
  q_lens, num_pages, kv_lens, page_indices, cu, T = mixed_batch(rng, page_size)
  q_latent = rng.normal(size=(T, H, R)).astype(np.float32)
  q_rope = rng.normal(size=(T, H, E)).astype(np.float32)
  latent = rng.normal(size=(num_pages, page_size, R + E)).astype(np.float32)
  kv_full = np.concatenate([kv_lens, [0, 0]]).astype(np.int32)
  scale = 0.15
  got = np.asarray(ops.ragged_paged_mla(q_latent, q_rope, latent, kv_full, page_indices, cu,
                                        np.int32(len(q_lens)), sm_scale=scale, impl=impl))
  q = np.concatenate([q_latent, q_rope], -1) * scale * np.sqrt(R + E)  # naive() divides by sqrt(d)
  want = naive(q, latent[:, :, None], latent[:, :, None], kv_full, page_indices, cu, len(q_lens))
  real = int(cu[len(q_lens)])
  assert got.shape == (T, H, R)
  np.testing.assert_allclose(got[:real], want[:real, :, :R], atol=2e-5, rtol=1e-4)


# ---- a quantized KV cache (kv_cache_dtype int8 / fp8) ------------------------------------------

def _quantized(pages, dtype, groups=None):
  """pages [..., F] as the cache stores them: (values, float32 scales [...] or [..., groups]),
  and the float64 numbers they stand for (what the naive attention reads)."""
  from jaxinfer.models.cache import dequantize_tokens, quantize_tokens
  vals, scale = quantize_tokens(pages, dtype, groups)
  return vals, scale, np.asarray(dequantize_tokens(vals, scale), np.float64)


@pytest.mark.parametrize("impl", ["xla", PALLAS_IMPL])
@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("page_size,H,K,d,window,soft_cap", [CASES[1], CASES[4]])
def test_quantized_cache_equals_naive_on_the_values_it_stands_for(page_size, H, K, d, window, soft_cap,
                                                                   dtype, impl):
  """Both paths read int8 / float8 pages with per-token, per-head scales and give the attention
  of the dequantized cache (the scales folded into scores and probabilities change nothing
  but rounding), mixed decode / verify / prefill."""
  rng = np.random.default_rng(K + d)
  q_lens, num_pages, kv_lens, page_indices, cu, T = mixed_batch(rng, page_size)
  q = rng.normal(size=(T, H, d)).astype(np.float32)
  # Per-head magnitudes that differ by 100x: one scale per page or per tensor would lose the small heads.
  mag = np.geomspace(0.05, 5.0, K)[:, None].astype(np.float32)
  k_vals, k_scale, k_ref = _quantized(rng.normal(size=(num_pages, page_size, K, d)).astype(np.float32) * mag, dtype)
  v_vals, v_scale, v_ref = _quantized(rng.normal(size=(num_pages, page_size, K, d)).astype(np.float32) * mag, dtype)
  assert k_vals.dtype == np.dtype(dtype) and k_scale.shape == (num_pages, page_size, K)
  kv_full = np.concatenate([kv_lens, [0, 0]]).astype(np.int32)
  got = np.asarray(ops.ragged_paged_attention(q, k_vals, v_vals, kv_full, page_indices, cu, np.int32(len(q_lens)),
                                              sliding_window=window, soft_cap=soft_cap, impl=impl,
                                              k_scale=k_scale, v_scale=v_scale, decode_q_len=3))
  want = naive(q, k_ref, v_ref, kv_full, page_indices, cu, len(q_lens), window, soft_cap)
  real = int(cu[len(q_lens)])
  np.testing.assert_allclose(got[:real], want[:real], atol=2e-5, rtol=1e-4)


def test_quantized_cache_error_is_the_formats_rounding():
  """quantize_tokens: int8 is off by at most half a step (max|x| / 254) per vector; float8 e4m3
  by at most 2^-4 relative (3 mantissa bits) above its subnormals; zeros stay exact."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 4, 32)).astype(np.float32) * np.geomspace(1e-3, 1e2, 4)[:, None]
  x[0, 0] = 0.0
  for dtype, bound in (("int8", lambda x: np.abs(x).max(-1, keepdims=True) / 254 * (1 + 1e-6)),
                       ("float8_e4m3fn", lambda x: np.maximum(np.abs(x) * 2.0 ** -4,
                                                              np.abs(x).max(-1, keepdims=True) / 448 * 2.0 ** -9))):
    _, scale, back = _quantized(x, dtype)
    assert np.all(np.abs(back - x) <= bound(x)), dtype
    assert np.all(back[0, 0] == 0) and scale[0, 0] == 1.0


@pytest.mark.parametrize("impl", ["xla", PALLAS_IMPL])
@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_quantized_mla_latent_in_groups_on_both_paths(impl, dtype):
  """MLA's latent scaled per group of E values (c_KV's groups and the rope key's own): both
  paths equal naive MQA over the dequantized latent, with a rope key 30x c_KV's size."""
  rng = np.random.default_rng(3)
  page_size, H, R, E = 16, 4, 32, 16
  q_lens, kv_extra = [1, 2, 40], [30, 5, 17]
  P = 8
  num_pages = len(q_lens) * P + 1
  kv_lens, page_indices, cu = layout(rng, q_lens, kv_extra, page_size, num_pages, P)
  T = int(cu[-1])
  q_latent = rng.normal(size=(T, H, R)).astype(np.float32)
  q_rope = rng.normal(size=(T, H, E)).astype(np.float32)
  latent = rng.normal(size=(num_pages, page_size, R + E)).astype(np.float32)
  latent[..., R:] *= 30
  vals, scale, ref = _quantized(latent, dtype, groups=(R + E) // E)
  assert scale.shape == (num_pages, page_size, 3)
  kv_full = np.concatenate([kv_lens, [0, 0]]).astype(np.int32)
  got = np.asarray(ops.ragged_paged_mla(q_latent, q_rope, vals, kv_full, page_indices, cu, np.int32(3),
                                        sm_scale=0.15, impl=impl, latent_scale=scale))
  q = np.concatenate([q_latent, q_rope], -1) * 0.15 * np.sqrt(R + E)
  want = naive(q, ref[:, :, None], ref[:, :, None], kv_full, page_indices, cu, 3)
  np.testing.assert_allclose(got[:T], want[:T, :, :R], atol=2e-5, rtol=1e-4)
