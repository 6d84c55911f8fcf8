"""The kernels lower to Triton IR for CUDA on a machine without a GPU.

Interpret mode (the other tests) runs the kernels as XLA ops and forgives
what the Pallas Triton lowering does not: tiles that are not powers of two,
primitives it has no rule for, 3-D dots, unsupported indexing. Lowering for
the "cuda" platform runs that lowering (jaxpr -> Triton MLIR) without
compiling or running anything, so those mistakes fail here, in CI.

jax 0.10 lowers for a default compute capability when no GPU is present;
jax 0.11 wants to see a GPU (or an abstract one) and says so: the tests are
marked `triton_lowering`, and tests/conftest.py skips them at collection with
that reason and counts them in the summary; scripts/gpu_check.sh runs them.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import (
  FlashBlockSizes,
  RaggedBlockSizes,
  flash_attention,
  ragged_paged_attention,
)
from pallas_kernels.ragged_paged_mla import BlockSizes as MlaBlockSizes
from pallas_kernels.ragged_paged_mla import ragged_paged_mla

from helpers import lower_for_cuda

pytestmark = pytest.mark.triton_lowering


def ragged_avals(T, S, P, N, page_size, Hq, Hkv, D, dtype):
  i32 = jnp.int32
  return (jax.ShapeDtypeStruct((T, Hq, D), dtype),
          jax.ShapeDtypeStruct((N, page_size, Hkv, D), dtype),
          jax.ShapeDtypeStruct((N, page_size, Hkv, D), dtype),
          jax.ShapeDtypeStruct((S,), i32), jax.ShapeDtypeStruct((S, P), i32),
          jax.ShapeDtypeStruct((S + 1,), i32), jax.ShapeDtypeStruct((), i32))


@pytest.mark.parametrize("T,S,page_size,Hq,Hkv,D,dtype,options", [
    (64, 64, 16, 32, 8, 128, jnp.bfloat16, {}),                       # decode batch
    (300, 8, 32, 32, 8, 128, jnp.bfloat16, {"sliding_window": 128, "soft_cap": 50.0}),
    (77, 5, 64, 14, 2, 64, jnp.float16, {}),                          # G = 7, padded to 8
    (40, 4, 16, 8, 8, 64, jnp.float32, {}),                           # G = 1, IEEE f32 dots
    (50, 6, 16, 16, 2, 128, jnp.bfloat16,
     {"block_sizes": RaggedBlockSizes(block_q=2, pages_per_block=1)}),
])
def test_ragged_paged_attention_lowers(T, S, page_size, Hq, Hkv, D, dtype, options):
  lower_for_cuda(functools.partial(ragged_paged_attention, **options),
                 *ragged_avals(T, S, 9, 80, page_size, Hq, Hkv, D, dtype))


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_ragged_paged_attention_lowers_over_a_quantized_cache(kv_dtype):
  """int8 / float8 pages with float32 scales per token and kv head (kv_cache_dtype int8 / fp8):
  the scale gathers [pages_per_block, p] and the tile conversions lower too."""
  T, S, N, page_size, Hq, Hkv, D = 64, 64, 80, 16, 32, 8, 128
  q, k, v, *rest = ragged_avals(T, S, 9, N, page_size, Hq, Hkv, D, jnp.bfloat16)
  pages = jax.ShapeDtypeStruct(k.shape, kv_dtype)
  scale = jax.ShapeDtypeStruct((N, page_size, Hkv), jnp.float32)
  def fn(q, k, v, kv_lens, page_indices, cu_q_lens, num_seqs, ks, vs):
    return ragged_paged_attention(q, k, v, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale=ks, v_scale=vs)
  text = lower_for_cuda(fn, q, pages, pages, *rest, scale, scale)
  assert "ragged_paged_attention" in text


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_ragged_paged_mla_lowers_over_a_quantized_cache(kv_dtype):
  """DeepSeek-V3's widths: an int8 / float8 latent with 9 float32 scales per token (groups of 64)."""
  T, S, N, page_size, H, R, E = 64, 64, 80, 16, 16, 512, 64
  i32 = jnp.int32
  avals = (jax.ShapeDtypeStruct((T, H, R), jnp.bfloat16), jax.ShapeDtypeStruct((T, H, E), jnp.bfloat16),
           jax.ShapeDtypeStruct((N, page_size, R + E), kv_dtype), jax.ShapeDtypeStruct((S,), i32),
           jax.ShapeDtypeStruct((S, 9), i32), jax.ShapeDtypeStruct((S + 1,), i32), jax.ShapeDtypeStruct((), i32),
           jax.ShapeDtypeStruct((N, page_size, (R + E) // 64), jnp.float32))

  def fn(q_latent, q_rope, latent, kv_lens, page_indices, cu_q_lens, num_seqs, scale):
    return ragged_paged_mla(q_latent, q_rope, latent, kv_lens, page_indices, cu_q_lens, num_seqs,
                            sm_scale=0.1, latent_scale=scale)
  lower_for_cuda(fn, *avals)


@pytest.mark.parametrize("B,T,S,Hq,Hkv,D,dtype,options", [
    (2, 2048, 2048, 32, 8, 128, jnp.bfloat16, {}),
    (1, 100, 300, 8, 1, 64, jnp.float16, {"causal": False}),
    (1, 5, 12, 4, 4, 64, jnp.float32, {}),                            # S shorter than a key tile
    (1, 333, 333, 4, 2, 128, jnp.bfloat16, {"block_sizes": FlashBlockSizes(64, 32)}),
])
def test_flash_attention_lowers(B, T, S, Hq, Hkv, D, dtype, options):
  avals = (jax.ShapeDtypeStruct((B, T, Hq, D), dtype), jax.ShapeDtypeStruct((B, S, Hkv, D), dtype),
           jax.ShapeDtypeStruct((B, S, Hkv, D), dtype))
  lower_for_cuda(functools.partial(flash_attention, **options), *avals)


@pytest.mark.parametrize("T,S,page_size,H,R,E,dtype,options", [
    (64, 64, 16, 128, 512, 64, jnp.bfloat16, {}),  # DeepSeek-V3 decode batch: L = 576
    (300, 4, 16, 16, 512, 64, jnp.bfloat16, {}),   # prefill chunks
    (40, 4, 16, 6, 32, 16, jnp.float32, {}),       # H = 6 in a head block of 8, IEEE f32 dots
    (50, 6, 16, 16, 64, 16, jnp.float16,
     {"block_sizes": MlaBlockSizes(block_q=2, block_h=8, pages_per_block=1)}),
])
def test_ragged_paged_mla_lowers(T, S, page_size, H, R, E, dtype, options):
  i32 = jnp.int32
  avals = (jax.ShapeDtypeStruct((T, H, R), dtype), jax.ShapeDtypeStruct((T, H, E), dtype),
           jax.ShapeDtypeStruct((80, page_size, R + E), dtype), jax.ShapeDtypeStruct((S,), i32),
           jax.ShapeDtypeStruct((S, 9), i32), jax.ShapeDtypeStruct((S + 1,), i32),
           jax.ShapeDtypeStruct((), i32))
  lower_for_cuda(functools.partial(ragged_paged_mla, sm_scale=0.1, **options), *avals)
