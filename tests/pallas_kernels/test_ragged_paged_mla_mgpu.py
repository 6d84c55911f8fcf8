"""ragged_paged_mla_mgpu (Pallas Mosaic GPU) against the jnp reference of ragged_paged_mla.

On a CPU the kernel runs in Mosaic GPU interpret mode (jax >= 0.11); under jax
< 0.11 (the Python 3.11 CI environment) every test here is skipped with the
reason printed by `pytest -ra`; scripts/test_mosaic.sh runs them under Python 3.12.

The batches are the Triton MLA kernel's (make_batch): pages shuffled over a
pool whose unowned pages and slots past each kv_len are NaN, page-table entries
past a sequence's pages pointing outside the pool, padding sequences and
padding tokens. In interpret mode the output starts as NaN, so a real row left
unwritten fails and padding rows are asserted never written.

Legend: T packed tokens, S sequence slots, p page_size, H heads, R kv_lora_rank,
E qk_rope_head_dim, L = R + E, g a quantized cache's scale group.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from conftest import ON_GPU
from pallas_kernels.ragged_paged_mla import ragged_paged_mla_reference
from pallas_kernels.ragged_paged_mla_mgpu import (
    MOSAIC_AVAILABLE,
    BlockSizes,
    ragged_paged_mla_mgpu,
    unsupported_reason,
)
from test_ragged_paged_attention import quantize_int8
from test_ragged_paged_mla import make_batch

pytestmark = [
    pytest.mark.mosaic,
    pytest.mark.skipif(not MOSAIC_AVAILABLE,
                       reason="Mosaic GPU interpret mode needs jax >= 0.11 (Python 3.12 venv)"),
]

INTERPRET = not ON_GPU
TOLERANCES = {jnp.bfloat16: {"atol": 3e-2, "rtol": 3e-2}, jnp.float16: {"atol": 5e-3, "rtol": 5e-3}}


def kernel(**kwargs):
  return ragged_paged_mla_mgpu(**kwargs, interpret=INTERPRET)


def check(batch, dtype=jnp.bfloat16, sm_scale=0.1, block_sizes=None):
  """Kernel == reference on the real rows; padding rows never written (interpret mode)."""
  got = np.asarray(kernel(**batch, sm_scale=sm_scale, block_sizes=block_sizes).astype(jnp.float32))
  want = np.asarray(ragged_paged_mla_reference(**batch, sm_scale=sm_scale).astype(jnp.float32))
  real = int(batch["cu_q_lens"][int(batch["num_seqs"])])
  assert np.isfinite(got[:real]).all(), "a real row was not written (still NaN) or is not finite"
  np.testing.assert_allclose(got[:real], want[:real], **TOLERANCES[dtype])
  if INTERPRET:
    assert np.isnan(got[real:]).all(), "the kernel wrote rows of padding tokens"
  return got


# kv_len 1, one short of / exactly / one past a page, several pages, not a page multiple.
DECODE_KV_LENS = (1, 15, 16, 17, 64, 100, 129)
# decode, MTP verify (2, 4 queries: k + 1 for k = 1, 3), prefill chunks; with 8 heads a q tile
# holds 8 tokens, so the 37- and 20-token chunks span several tiles, the last one partial.
MIXED = [(1, 1), (2, 40), (4, 77), (37, 37), (1, 200), (20, 81)]


@pytest.mark.parametrize("page_size,H,R,E,seqs", [
    (16, 8, 64, 64, [(1, kv) for kv in DECODE_KV_LENS]),    # 8 tokens x 8 heads per q tile
    (32, 16, 128, 32, [(1, kv) for kv in DECODE_KV_LENS]),  # two pages per step; L = 160: 64 B swizzles
    (64, 64, 64, 16, [(1, kv) for kv in DECODE_KV_LENS]),   # one token per tile; L = 80: 32 B swizzles
    (16, 8, 128, 64, MIXED),
    (32, 128, 64, 64, [(1, 1), (2, 40), (5, 70)]),          # two head blocks of 64 per q tile
])
def test_decode_verify_prefill_batches(page_size, H, R, E, seqs):
  rng = np.random.default_rng(page_size + H + R)
  check(make_batch(rng, seqs, page_size=page_size, H=H, R=R, E=E, dtype=jnp.bfloat16))


def test_deepseek_v3_widths():
  """R = 512, E = 64 (L = 576): the latent's output columns in two programs of 256 per q tile
  (the PV wgmma's N), each scoring the whole row; 16 heads (128 over TP 8); decode, verify
  and a prefill chunk."""
  rng = np.random.default_rng(0)
  check(make_batch(rng, [(1, 33), (1, 5), (3, 20), (6, 70)], page_size=16, H=16, R=512, E=64,
                   dtype=jnp.bfloat16), sm_scale=0.05)


@pytest.mark.parametrize("page_size,block_sizes", [
    (16, BlockSizes(pages_per_block=8, num_stages=3)),  # 128 keys per step, 8 x 2 copies per barrier
    (64, BlockSizes(num_stages=4)),                     # more slots than most sequences have steps
    (8, BlockSizes(pages_per_block=32)),                # 256 keys (the largest step), tiny pages
    # A producer warpgroup issues the copies: a sequence of 1 key, one of 300 (5 steps, 2 slots).
    (16, BlockSizes(warp_specialized=True)),
    (64, BlockSizes(num_stages=3, warp_specialized=True)),
])
def test_block_sizes(page_size, block_sizes):
  rng = np.random.default_rng(page_size)
  seqs = [(1, 1), (1, 300), (9, 129)]
  check(make_batch(rng, seqs, page_size=page_size, H=8, R=64, E=64, dtype=jnp.float16), jnp.float16,
        block_sizes=block_sizes)


@pytest.mark.parametrize("block_sizes,R", [
    (BlockSizes(kv_splits=2), 64),
    (BlockSizes(kv_splits=3, warp_specialized=True), 128),
    (BlockSizes(kv_splits=8), 64),
])
def test_kv_splits(block_sizes, R):
  """Split-KV: each q block's KV range in C parts (split boundaries inside a sequence of 700
  keys; empty splits for the short ones), merged by log-sum-exp."""
  rng = np.random.default_rng(block_sizes.kv_splits)
  seqs = [(1, 700), (1, 1), (3, 300), (12, 40)]
  check(make_batch(rng, seqs, page_size=16, H=8, R=R, E=64, dtype=jnp.bfloat16),
        block_sizes=block_sizes)


def quantize_fp8(x, groups):
  """x [..., L] (NaN-poisoned slots allowed) -> float8_e4m3fn values and float32 scales
  [..., groups]: max|x| / 448 per group. A poisoned row keeps NaN in its values too."""
  x = np.asarray(x, np.float32)
  g = x.reshape(x.shape[:-1] + (groups, -1))
  scale = np.abs(g).max(-1) / 448
  return jnp.asarray((g / scale[..., None]).reshape(x.shape), jnp.float8_e4m3fn), jnp.asarray(scale)


QUANTIZE = {"int8": quantize_int8, "fp8": quantize_fp8}


@pytest.mark.parametrize("kv,page_size,H,R,q_dtype,seqs,block_sizes", [
    ("int8", 16, 8, 128, jnp.bfloat16, [(1, 1), (2, 40), (4, 77), (20, 81)], None),  # 3 groups of 64
    ("fp8", 32, 16, 64, jnp.float16, [(1, kv) for kv in DECODE_KV_LENS], None),  # fp8 -> f16
    ("fp8", 16, 8, 64, jnp.bfloat16, [(1, 400), (1, 1), (3, 150), (12, 40)],
     BlockSizes(kv_splits=3, warp_specialized=True)),
    # DeepSeek-V3's fp8 latent: 9 groups of 64, 4 of them a program's PV columns.
    ("fp8", 64, 16, 512, jnp.bfloat16, [(1, 70), (2, 9), (5, 30)], None),
])
def test_quantized_cache(kv, page_size, H, R, q_dtype, seqs, block_sizes):
  """int8 / fp8 latents with a float32 scale per token and group of 64 == the reference, which
  dequantizes the whole cache first. Slots past kv_len carry NaN scales (and NaN fp8 values):
  a value or a scale read unmasked there turns the row NaN."""
  rng = np.random.default_rng(page_size + H + R)
  E = 64
  batch = make_batch(rng, seqs, page_size=page_size, H=H, R=R, E=E, dtype=q_dtype)
  batch["latent_pages"], batch["latent_scale"] = QUANTIZE[kv](batch["latent_pages"], (R + E) // 64)
  check(batch, q_dtype, block_sizes=block_sizes)


def test_unsupported_operands_raise():
  rng = np.random.default_rng(1)
  with pytest.raises(NotImplementedError, match="H = 4 heads"):
    kernel(**make_batch(rng, [(1, 20)], page_size=16, H=4, R=64, E=64, dtype=jnp.bfloat16), sm_scale=0.1)
  batch = make_batch(rng, [(1, 20)], page_size=16, H=8, R=64, E=64, dtype=jnp.float32)
  with pytest.raises(NotImplementedError, match="bfloat16 / float16 only"):
    kernel(**batch, sm_scale=0.1)
  with pytest.raises(ValueError, match="R \\+ E"):  # the Triton kernel's operand checks
    kernel(**dict(batch, latent_pages=batch["latent_pages"][..., :100]), sm_scale=0.1)
  q, rope = (4, 16, 512), (4, 16, 64)
  assert unsupported_reason(q, rope, (9, 16, 576), jnp.bfloat16) is None
  assert unsupported_reason(q, rope, (9, 16, 576), jnp.float8_e4m3fn, scale_groups=9) is None
  assert "g = 32" in unsupported_reason(q, rope, (9, 16, 576), jnp.int8, scale_groups=18)
  assert "shared memory" in unsupported_reason(q, rope, (9, 16, 576), jnp.bfloat16,
                                               block_sizes=BlockSizes(num_stages=3))
  assert "multiple of 64" in unsupported_reason((4, 16, 96), rope, (9, 16, 160), jnp.bfloat16)
  assert "E = 512" in unsupported_reason(q, (4, 16, 512), (9, 16, 1024), jnp.bfloat16)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the tests above compile the kernel for real")
@pytest.mark.parametrize("page_size,H,R,E,block_sizes,options", [
    (16, 16, 512, 64, BlockSizes(), {}),                 # DeepSeek-V3 at TP 8: 224 KiB of tiles
    (64, 128, 512, 64, BlockSizes(), {}),                # all 128 heads: two head blocks
    (16, 16, 512, 64, BlockSizes(kv_splits=4), {}),
    (16, 16, 512, 64, BlockSizes(warp_specialized=True), {}),
    (32, 8, 128, 64, BlockSizes(pages_per_block=4, num_stages=3), {}),
    (16, 16, 256, 32, BlockSizes(), {}),                 # MiniCPM3's widths: 64-byte swizzles
    (16, 8, 64, 16, BlockSizes(kv_splits=2), {}),        # 32-byte swizzles
    (16, 16, 512, 64, BlockSizes(warp_specialized=True), {"kv": jnp.float8_e4m3fn}),
    (16, 32, 256, 64, BlockSizes(kv_splits=2), {"kv": jnp.int8, "q": jnp.float16}),
])
def test_lowers_for_sm90_without_a_gpu(page_size, H, R, E, block_sizes, options):
  """Pallas -> Mosaic GPU lowering for CUDA (sm_90). Interpret mode never builds the Mosaic GPU
  IR: layout-inference errors (a wgmma whose operands swizzle differently fails here) and
  shared memory past 227 KiB (Mosaic counts it while lowering) surface only here or on a GPU."""
  import jax
  T, S, P, N = 256, 128, 64, 2048
  sds = jax.ShapeDtypeStruct
  kv_dtype = options.get("kv", jnp.bfloat16)
  q_dtype = options.get("q", jnp.bfloat16)
  args = (sds((T, H, R), q_dtype), sds((T, H, E), q_dtype), sds((N, page_size, R + E), kv_dtype),
          sds((S,), jnp.int32), sds((S, P), jnp.int32), sds((S + 1,), jnp.int32), sds((), jnp.int32))
  scale = sds((N, page_size, (R + E) // E), jnp.float32) if "kv" in options else None
  fn = jax.jit(lambda *a, scale: ragged_paged_mla_mgpu(*a, sm_scale=0.1, latent_scale=scale,
                                                       block_sizes=block_sizes))
  text = fn.trace(*args, scale=scale).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_ops_dispatch_takes_the_mosaic_kernel_where_it_covers_the_operands():
  """jaxinfer.ops.ragged_paged_mla with impl 'mosaic(_interpret)': this kernel where it covers
  the operands, the Triton one for the rest."""
  import jax
  from jaxinfer import ops
  from pallas_kernels import ragged_paged_mla
  impl = "mosaic" if ON_GPU else "mosaic_interpret"
  rng = np.random.default_rng(2)
  seqs = [(1, 20), (2, 40)]
  batch = make_batch(rng, seqs, page_size=16, H=8, R=64, E=64, dtype=jnp.bfloat16)
  real = int(batch["cu_q_lens"][int(batch["num_seqs"])])
  got = ops.ragged_paged_mla(**batch, sm_scale=0.1, impl=impl)
  np.testing.assert_array_equal(np.asarray(got[:real], np.float32),
                                np.asarray(kernel(**batch, sm_scale=0.1)[:real], np.float32))
  batch = make_batch(rng, seqs, page_size=16, H=4, R=64, E=32, dtype=jnp.bfloat16)  # H not covered
  got = ops.ragged_paged_mla(**batch, sm_scale=0.1, impl=impl)
  np.testing.assert_array_equal(np.asarray(got[:real], np.float32), np.asarray(
      ragged_paged_mla(**batch, sm_scale=0.1, interpret=INTERPRET)[:real], np.float32))

  sds = jax.ShapeDtypeStruct
  q, rope = sds((4, 16, 512), jnp.bfloat16), sds((4, 16, 64), jnp.bfloat16)
  pages, pages8 = sds((9, 16, 576), jnp.bfloat16), sds((9, 16, 576), jnp.float8_e4m3fn)
  assert ops.mla_attention_kernel(impl, q, rope, pages) == "mosaic"
  assert ops.mla_attention_kernel(impl, q, rope, pages8, sds((9, 16, 9), jnp.float32)) == "mosaic"
  assert ops.mla_attention_kernel(impl, sds(q.shape, jnp.float32), rope, pages8,
                                  sds((9, 16, 9), jnp.float32)) == "pallas"
  assert ops.mla_attention_kernel(impl, q, rope, sds(pages.shape, jnp.float32)) == "pallas"
  assert ops.mla_attention_kernel(impl.replace("mosaic", "pallas"), q, rope, pages) == "pallas"
