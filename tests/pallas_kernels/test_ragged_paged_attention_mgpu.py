"""ragged_paged_attention_mgpu (Pallas Mosaic GPU) against the jnp reference.

On a CPU the kernel runs in Mosaic GPU interpret mode (jax >= 0.11: simulated
shared memory, TMA copies, barriers; a barrier phase nobody waited for is an
error there); on an sm_90 GPU it is compiled (scripts/gpu_mosaic_check.sh).
Under jax < 0.11 (the Python 3.11 CI environment) every test here is skipped
with the reason printed by `pytest -ra`: run them under Python 3.12,
  /work/venv312/bin/python -m pytest -ra tests/pallas_kernels/test_ragged_paged_attention_mgpu.py

The batches are the Triton kernel's test batches (make_batch): pages shuffled
over a pool whose unowned pages and slots past each kv_len are NaN, page table
entries past a sequence's pages pointing outside the pool, padding sequences
and padding tokens. In interpret mode the output starts as NaN, so a real row
left unwritten fails and padding rows are asserted never written.

Legend: T packed tokens, S sequence slots, p page_size, Hq / Hkv query / kv
heads, G = Hq / Hkv, D head dim.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from conftest import ON_GPU
from pallas_kernels import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention_mgpu import (
    MOSAIC_AVAILABLE,
    BlockSizes,
    ragged_paged_attention_mgpu,
    unsupported_reason,
)
from test_ragged_paged_attention import TOLERANCES, make_batch, quantize_int8

pytestmark = [
    pytest.mark.mosaic,
    pytest.mark.skipif(not MOSAIC_AVAILABLE,
                       reason="Mosaic GPU interpret mode needs jax >= 0.11 (Python 3.12 venv)"),
]

INTERPRET = not ON_GPU


def kernel(**kwargs):
  return ragged_paged_attention_mgpu(**kwargs, interpret=INTERPRET)


def check(batch, dtype=jnp.bfloat16, **options):
  """Kernel == reference on the real rows; padding rows never written (interpret mode)."""
  block_sizes = options.pop("block_sizes", None)
  got = np.asarray(kernel(**batch, block_sizes=block_sizes, **options).astype(jnp.float32))
  want = np.asarray(ragged_paged_attention_reference(**batch, **options).astype(jnp.float32))
  real = int(batch["cu_q_lens"][int(batch["num_seqs"])])
  assert np.isfinite(got[:real]).all(), "a real row was not written (still NaN) or is not finite"
  np.testing.assert_allclose(got[:real], want[:real], **TOLERANCES[dtype])
  if INTERPRET:
    assert np.isnan(got[real:]).all(), "the kernel wrote rows of padding tokens"
  return got


# kv_len 1, one short of / exactly / one past a page, several pages, not a page multiple.
DECODE_KV_LENS = (1, 15, 16, 17, 64, 100, 129)


@pytest.mark.parametrize("page_size,Hq,Hkv,D", [
    (16, 4, 4, 64),     # G = 1: 64 tokens per q block, one per decode sequence
    (16, 32, 8, 128),   # G = 4: the Llama-3-8B heads
    (32, 16, 2, 64),    # G = 8, two pages per 64-key step
    (32, 8, 1, 128),    # G = 8, one kv head
])
def test_decode_batches(page_size, Hq, Hkv, D):
  rng = np.random.default_rng(page_size + Hq + D)
  seqs = [(1, kv) for kv in DECODE_KV_LENS]
  check(make_batch(rng, seqs, page_size=page_size, Hq=Hq, Hkv=Hkv, D=D, dtype=jnp.bfloat16))


# decode, MTP verify (2, 4 queries), prefill chunks; q blocks of one sequence split at 16 tokens (G = 4).
MIXED = [(1, 1), (2, 40), (4, 77), (37, 37), (1, 200), (20, 81)]


@pytest.mark.parametrize("page_size,Hq,Hkv,dtype,block_sizes", [
    (16, 8, 2, jnp.bfloat16, None),   # G = 4: 16 tokens per q block
    (32, 2, 2, jnp.float16, None),    # G = 1: 64 tokens per q block
    (16, 8, 2, jnp.bfloat16, BlockSizes(warp_specialized=True)),
])
def test_mixed_decode_verify_prefill_batch(page_size, Hq, Hkv, dtype, block_sizes):
  rng = np.random.default_rng(page_size * Hq)
  check(make_batch(rng, MIXED, page_size=page_size, Hq=Hq, Hkv=Hkv, D=64, dtype=dtype), dtype,
        block_sizes=block_sizes)


@pytest.mark.parametrize("page_size,block_sizes", [
    (16, BlockSizes(pages_per_block=8, num_stages=3)),   # 128 keys per step, 8 TMA copies per barrier
    (64, BlockSizes(num_stages=4)),                      # one page per step, more slots than steps
    (8, BlockSizes(pages_per_block=32)),                 # 256 keys (the largest step), tiny pages
    # A producer warpgroup issues the copies; a sequence of 1 key and one of 300 (5 steps, 2 slots).
    (16, BlockSizes(warp_specialized=True)),
    (64, BlockSizes(num_stages=3, warp_specialized=True)),
])
def test_block_sizes(page_size, block_sizes):
  rng = np.random.default_rng(page_size)
  seqs = [(1, 1), (1, 300), (3, 129), (1, 257), (9, 64)]
  check(make_batch(rng, seqs, page_size=page_size, Hq=8, Hkv=2, D=64, dtype=jnp.bfloat16),
        block_sizes=block_sizes)


@pytest.mark.parametrize("sliding_window,soft_cap,block_sizes", [
    (7, None, None), (None, 5.0, None), (40, 20.0, BlockSizes(warp_specialized=True)),
    # The window's first step starts past step 0 (kb0 > 0), with the producer counting from it.
    (1, None, BlockSizes(warp_specialized=True)),
])
def test_sliding_window_and_soft_cap(sliding_window, soft_cap, block_sizes):
  rng = np.random.default_rng(11)
  batch = make_batch(rng, [(1, 90), (3, 50), (30, 60), (1, 200)], page_size=16, Hq=8, Hkv=2, D=64,
                     dtype=jnp.bfloat16)
  batch["q"] = batch["q"] * 4  # larger logits, so the cap bends them
  check(batch, sliding_window=sliding_window, soft_cap=soft_cap, sm_scale=0.2,
        block_sizes=block_sizes)


def test_attention_sinks():
  """GPT-OSS's sinks, from well below to well above the scores; G = 4 heads per kv head."""
  rng = np.random.default_rng(5)
  Hq = 8
  batch = make_batch(rng, [(1, 70), (2, 33), (1, 1), (12, 40)], page_size=16, Hq=Hq, Hkv=2, D=64,
                     dtype=jnp.bfloat16)
  sinks = np.linspace(-4.0, 6.0, Hq).astype(np.float32)
  got = check(batch, sinks=sinks, sliding_window=20)
  plain = check(batch, sliding_window=20)
  real = int(batch["cu_q_lens"][int(batch["num_seqs"])])
  # The largest sink takes most of the weight: its head's outputs shrink towards 0.
  assert np.abs(got[:real, -1]).mean() < 0.5 * np.abs(plain[:real, -1]).mean()


@pytest.mark.parametrize("block_sizes,Hq,options", [
    (BlockSizes(kv_splits=2), 8, {}),
    (BlockSizes(kv_splits=8), 16, {}),  # G = 8; short sequences leave most splits empty
    (BlockSizes(kv_splits=3, warp_specialized=True), 8, {"sliding_window": 200}),
    # Sinks belong to one split only: counted in every split they would shrink every row.
    (BlockSizes(kv_splits=4), 8, {"sinks": np.linspace(-3.0, 5.0, 8).astype(np.float32)}),
])
def test_kv_splits(block_sizes, Hq, options):
  """Split-KV (flash-decoding): each q block's KV range in parts, merged by log-sum-exp."""
  rng = np.random.default_rng(block_sizes.kv_splits)
  seqs = [(1, 700), (1, 1), (1, 65), (3, 300), (12, 40)]
  check(make_batch(rng, seqs, page_size=16, Hq=Hq, Hkv=2, D=64, dtype=jnp.bfloat16),
        block_sizes=block_sizes, **options)


def test_null_page_padding_rows():
  """The engine's padding: page 0 (NULL_PAGE) fills page tables, padding slots have kv_len 0.

  Page 0 holds NaN: a kernel that followed a padding entry (or read a padding
  slot's page) would turn real rows NaN.
  """
  rng = np.random.default_rng(9)
  p, Hq, Hkv, D = 16, 8, 2, 64
  seqs = [(1, 33), (1, 1), (2, 47)]
  S, P, N = 6, 5, 12
  k_pages = rng.normal(size=(N, p, Hkv, D)).astype(np.float32)
  v_pages = rng.normal(size=(N, p, Hkv, D)).astype(np.float32)
  k_pages[0] = v_pages[0] = np.nan  # NULL_PAGE
  page_indices = np.zeros((S, P), np.int32)
  free = iter(rng.permutation(np.arange(1, N)))
  for s, (_, kv) in enumerate(seqs):
    page_indices[s, :-(-kv // p)] = [next(free) for _ in range(-(-kv // p))]
  kv_lens = np.zeros(S, np.int32)
  kv_lens[:3] = [kv for _, kv in seqs]
  cu_q_lens = np.array([0, 1, 2, 4, 4, 4, 4], np.int32)
  T = 8  # 4 real tokens, 4 padding tokens
  batch = {"q": jnp.asarray(rng.normal(size=(T, Hq, D)), jnp.bfloat16),
           "k_pages": jnp.asarray(k_pages, jnp.bfloat16), "v_pages": jnp.asarray(v_pages, jnp.bfloat16),
           "kv_lens": kv_lens, "page_indices": page_indices, "cu_q_lens": cu_q_lens,
           "num_seqs": np.int32(3)}
  check(batch)


def quantize_fp8(x):
  """x [..., D] (NaN-poisoned slots allowed) -> float8_e4m3fn values and float32 scales [...]:
  max|x| / 448 per token and head. A poisoned vector keeps NaN in its values too (e4m3fn
  has NaN; int8 has none, so quantize_int8 poisons the scales only)."""
  x = np.asarray(x, np.float32)
  scale = np.abs(x).max(-1) / 448
  return jnp.asarray(x / scale[..., None], jnp.float8_e4m3fn), jnp.asarray(scale)


QUANTIZE = {"int8": quantize_int8, "fp8": quantize_fp8}


# Each case once: both 8-bit dtypes, pages of 16 / 32 / 64 (4 / 2 / 1 pages and their scales
# per step), G 1 / 4 / 8, D 64 / 128 (64- and 128-byte swizzles of the 8-bit tiles), q in bf16
# and f16 (fp8 -> bf16 goes through f16 on sm_90), a producer warpgroup, and split-KV with a
# window, sinks and a soft cap on the scaled scores.
@pytest.mark.parametrize("kv,page_size,Hq,Hkv,D,q_dtype,seqs,block_sizes,options", [
    ("fp8", 16, 8, 2, 128, jnp.bfloat16, [(1, kv) for kv in DECODE_KV_LENS], None, {}),
    ("int8", 32, 16, 2, 64, jnp.bfloat16, MIXED, None, {}),
    ("fp8", 64, 2, 2, 64, jnp.float16, [(1, 1), (4, 77), (37, 37), (1, 200)],
     BlockSizes(warp_specialized=True), {}),
    ("int8", 16, 8, 2, 64, jnp.bfloat16, [(1, 400), (1, 1), (3, 150), (12, 40)],
     BlockSizes(kv_splits=3, warp_specialized=True),
     {"sliding_window": 200, "soft_cap": 5.0, "sm_scale": 0.2,
      "sinks": np.linspace(-3.0, 5.0, 8).astype(np.float32)}),
])
def test_quantized_cache(kv, page_size, Hq, Hkv, D, q_dtype, seqs, block_sizes, options):
  """int8 / fp8 pages with float32 scales per token and kv head == the reference, which
  dequantizes the whole cache in float32 first. Slots past kv_len carry NaN scales (and NaN
  fp8 values): a V row or a value scale read unmasked there turns the row NaN."""
  rng = np.random.default_rng(page_size + Hq + D)
  batch = make_batch(rng, seqs, page_size=page_size, Hq=Hq, Hkv=Hkv, D=D, dtype=q_dtype)
  batch["k_pages"], batch["k_scale"] = QUANTIZE[kv](batch["k_pages"])
  batch["v_pages"], batch["v_scale"] = QUANTIZE[kv](batch["v_pages"])
  if "soft_cap" in options:
    batch["q"] = batch["q"] * 4  # larger logits, so the cap bends them
  check(batch, q_dtype, block_sizes=block_sizes, **options)


def test_unsupported_operands_raise():
  rng = np.random.default_rng(1)
  batch = make_batch(rng, [(1, 20)], page_size=16, Hq=6, Hkv=2, D=64, dtype=jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="must divide 64"):
    kernel(**batch)  # G = 3
  batch = make_batch(rng, [(1, 20)], page_size=16, Hq=4, Hkv=2, D=64, dtype=jnp.float32)
  with pytest.raises(NotImplementedError, match="bfloat16 / float16 only"):
    kernel(**batch)
  scale = np.ones(batch["k_pages"].shape[:3], np.float32)
  batch.update(k_pages=batch["k_pages"].astype(jnp.int8), v_pages=batch["v_pages"].astype(jnp.int8))
  with pytest.raises(NotImplementedError, match="q dtype float32 with a quantized cache"):
    kernel(**batch, k_scale=scale, v_scale=scale)  # the tiles would convert to float32 q
  assert unsupported_reason((1, 4, 64), (9, 16, 2, 64), jnp.int8, quantized=True,
                            q_dtype=jnp.bfloat16) is None
  assert "int8 / float8_e4m3fn only" in unsupported_reason((1, 4, 64), (9, 16, 2, 64), jnp.bfloat16,
                                                           quantized=True)
  with pytest.raises(NotImplementedError, match="multiple of 64"):
    kernel(**make_batch(rng, [(1, 20)], page_size=16, Hq=4, Hkv=2, D=64, dtype=jnp.bfloat16),
           block_sizes=BlockSizes(pages_per_block=1))
  with pytest.raises(NotImplementedError, match="needs G = Hq / Hkv >= 4"):
    kernel(**make_batch(rng, [(1, 20)], page_size=16, Hq=4, Hkv=2, D=64, dtype=jnp.bfloat16),
           block_sizes=BlockSizes(kv_splits=2))
  assert unsupported_reason((1, 32, 128), (9, 16, 8, 128), jnp.bfloat16) is None


@pytest.mark.skipif(ON_GPU, reason="on a GPU the tests above compile the kernel for real")
@pytest.mark.parametrize("page_size,Hq,Hkv,D,block_sizes,options", [
    (16, 32, 8, 128, BlockSizes(), {}),                       # the 8B decode benchmark's shapes
    (64, 32, 8, 128, BlockSizes(num_stages=3), {}),
    (16, 32, 8, 128, BlockSizes(pages_per_block=8, num_stages=2), {}),
    (32, 8, 8, 64, BlockSizes(), {"sliding_window": 128, "soft_cap": 30.0}),
    (16, 64, 8, 64, BlockSizes(), {"sinks": True}),
    (16, 32, 8, 128, BlockSizes(warp_specialized=True), {}),
    (64, 32, 8, 128, BlockSizes(num_stages=4, warp_specialized=True), {"sliding_window": 512}),
    (16, 32, 8, 128, BlockSizes(kv_splits=8, warp_specialized=True), {"sinks": True}),
    # Quantized: 8-bit smem tiles, their upcast to the WGMMA layout, the scales' column layout.
    (16, 32, 8, 128, BlockSizes(), {"kv": jnp.int8}),
    (16, 32, 8, 128, BlockSizes(warp_specialized=True), {"kv": jnp.float8_e4m3fn}),
    (64, 16, 2, 64, BlockSizes(kv_splits=4), {"kv": jnp.float8_e4m3fn, "q": jnp.float16}),
])
def test_lowers_for_sm90_without_a_gpu(page_size, Hq, Hkv, D, block_sizes, options):
  """Pallas -> Mosaic GPU lowering for CUDA (sm_90, what Mosaic GPU assumes with no GPU present).

  Interpret mode never builds the Mosaic GPU IR: layout and lowering errors
  (a register layout wgmma cannot take, an op with no lowering) surface only
  here or on a GPU. What follows the lowering (Mosaic GPU's passes, ptxas)
  runs only on a GPU (scripts/gpu_mosaic_check.sh).
  """
  import jax
  T, S, P, N = 256, 128, 64, 2048
  sds = jax.ShapeDtypeStruct
  options = dict(options)
  kv_dtype = options.pop("kv", jnp.bfloat16)
  q_dtype = options.pop("q", jnp.bfloat16)
  args = (sds((T, Hq, D), q_dtype), sds((N, page_size, Hkv, D), kv_dtype),
          sds((N, page_size, Hkv, D), kv_dtype), sds((S,), jnp.int32), sds((S, P), jnp.int32),
          sds((S + 1,), jnp.int32), sds((), jnp.int32))
  sinks = sds((Hq,), jnp.float32) if options.pop("sinks", False) else None
  scale = sds((N, page_size, Hkv), jnp.float32) if kv_dtype != jnp.bfloat16 else None
  fn = jax.jit(lambda *a, sinks, scale: ragged_paged_attention_mgpu(
      *a, sinks=sinks, k_scale=scale, v_scale=scale, block_sizes=block_sizes, **options))
  text = fn.trace(*args, sinks=sinks, scale=scale).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_ops_dispatch_takes_the_mosaic_kernel_where_it_covers_the_operands():
  """jaxinfer.ops with impl 'mosaic(_interpret)': this kernel for a bf16 cache, the Triton one for the rest."""
  import jax
  from jaxinfer import ops
  from pallas_kernels import ragged_paged_attention
  impl = "mosaic" if ON_GPU else "mosaic_interpret"
  rng = np.random.default_rng(2)
  seqs = [(1, 20), (2, 40)]
  batch = make_batch(rng, seqs, page_size=16, Hq=8, Hkv=2, D=64, dtype=jnp.bfloat16)
  got = ops.ragged_paged_attention(**batch, impl=impl)
  real = int(batch["cu_q_lens"][int(batch["num_seqs"])])
  np.testing.assert_array_equal(np.asarray(got[:real], np.float32),
                                np.asarray(kernel(**batch)[:real], np.float32))
  batch = make_batch(rng, seqs, page_size=16, Hq=8, Hkv=2, D=64, dtype=jnp.float32)  # not covered
  got = ops.ragged_paged_attention(**batch, impl=impl)
  np.testing.assert_array_equal(np.asarray(got[:real]), np.asarray(
      ragged_paged_attention(**batch, interpret=INTERPRET)[:real]))

  # The choice per operands (shapes and dtypes only): quantized caches under a 16-bit q too.
  sds = jax.ShapeDtypeStruct
  q, pages = sds((4, 8, 64), jnp.bfloat16), sds((9, 16, 2, 64), jnp.bfloat16)
  pages8, scale = sds((9, 16, 2, 64), jnp.float8_e4m3fn), sds((9, 16, 2), jnp.float32)
  assert ops.ragged_attention_kernel(impl, q, pages) == "mosaic"
  assert ops.ragged_attention_kernel(impl, q, pages8, scale) == "mosaic"
  assert ops.ragged_attention_kernel(impl, sds(q.shape, jnp.float32), pages8, scale) == "pallas"
  assert ops.ragged_attention_kernel(impl, q, sds(pages.shape, jnp.float32)) == "pallas"
  assert ops.ragged_attention_kernel(impl, sds((4, 6, 64), jnp.bfloat16), pages) == "pallas"  # G = 3
  assert ops.ragged_attention_kernel(impl.replace("mosaic", "pallas"), q, pages) == "pallas"
