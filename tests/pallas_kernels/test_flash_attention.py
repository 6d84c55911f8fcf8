"""flash_attention (Pallas kernel, interpret mode on CPU) against its reference.

In interpret mode the kernel's output starts as NaN (pinned by
test_ragged_paged_attention.test_interpret_mode_output_starts_as_nan), so a
row or head the kernel fails to write fails the comparison. K and V rows past
S are never there to read: the tests pass exact-size arrays, and T and S are
mostly not multiples of the tile sizes.

Legend: B batch, T queries, S keys, Hq / Hkv query / kv heads, D head dim.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import PALLAS_INTERPRET
from pallas_kernels import FlashBlockSizes as BlockSizes
from pallas_kernels import flash_attention, flash_attention_reference

# Kernel vs reference, per input dtype (the kernel rounds the softmax weights
# to the input dtype before the PV dot, and the output to it).
TOLERANCES = {
    jnp.float32: {"atol": 2e-5, "rtol": 1e-4},
    jnp.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
    jnp.float16: {"atol": 4e-3, "rtol": 4e-3},
}

kernel = functools.partial(flash_attention, interpret=PALLAS_INTERPRET)  # compiled on a GPU
SMALL = BlockSizes(block_q=32, block_k=16)  # several tiles even at test sizes


def inputs(rng, B, T, S, Hq, Hkv, D, dtype=jnp.float32):
  cast = lambda x: jnp.asarray(x, dtype)
  return (cast(rng.normal(size=(B, T, Hq, D))), cast(rng.normal(size=(B, S, Hkv, D))),
          cast(rng.normal(size=(B, S, Hkv, D))))


def check(q, k, v, dtype=jnp.float32, **options):
  block_sizes = options.pop("block_sizes", None)
  got = np.asarray(kernel(q, k, v, block_sizes=block_sizes, **options).astype(jnp.float32))
  want = np.asarray(flash_attention_reference(q, k, v, **options).astype(jnp.float32))
  assert np.isfinite(got).all(), "an output element was not written (still NaN)"
  np.testing.assert_allclose(got, want, **TOLERANCES[dtype])


@pytest.mark.parametrize("B,T,S,Hq,Hkv,D,dtype", [
    (2, 100, 100, 2, 2, 64, jnp.float32),     # G = 1, square, ragged tiles
    (1, 77, 77, 8, 2, 128, jnp.bfloat16),     # G = 4, D = 128
    (2, 64, 64, 8, 1, 64, jnp.float16),       # G = 8, tile-aligned
    (1, 37, 150, 4, 1, 64, jnp.float32),      # T < S: a chunk after 113 cached keys
    (1, 150, 37, 2, 1, 64, jnp.float32),      # T > S: the first 113 queries see nothing
    (1, 1, 90, 4, 4, 64, jnp.bfloat16),       # one query
    (1, 5, 12, 2, 1, 64, jnp.float32),        # S shorter than one key tile
])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_reference_small_tiles(B, T, S, Hq, Hkv, D, dtype, causal):
  rng = np.random.default_rng(T * S + Hq)
  check(*inputs(rng, B, T, S, Hq, Hkv, D, dtype), dtype, causal=causal, block_sizes=SMALL)


@pytest.mark.parametrize("T,S", [(200, 200), (130, 300)])
def test_default_tiles(T, S):
  """Default tiles (64 x 32 in float32): a partial last q tile, diagonal and ragged key blocks."""
  rng = np.random.default_rng(T + S)
  check(*inputs(rng, 1, T, S, 4, 1, 64), causal=True)


def test_sm_scale():
  rng = np.random.default_rng(1)
  check(*inputs(rng, 1, 50, 50, 2, 1, 32), causal=True, sm_scale=0.3, block_sizes=SMALL)


def test_causal_rows_without_keys_are_zero():
  """T > S: query i sees keys <= i - (T - S); the first T - S queries see none."""
  rng = np.random.default_rng(2)
  q, k, v = inputs(rng, 1, 40, 24, 2, 2, 16)
  got = np.asarray(kernel(q, k, v, causal=True, block_sizes=SMALL))
  assert (got[:, :16] == 0).all()
  assert (np.abs(got[:, 16:]) > 0).any(axis=-1).all()


def naive(q, k, v, causal, sm_scale=None):
  """Float64 numpy, one (batch, head, query) at a time."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  scale = D ** -0.5 if sm_scale is None else sm_scale
  out = np.zeros_like(q)
  for b in range(B):
    for h in range(Hq):
      kh = h // (Hq // Hkv)
      for i in range(T):
        n = min(S, max(0, i + S - T + 1)) if causal else S
        if n == 0:
          continue
        s = k[b, :n, kh] @ q[b, i, h] * scale
        w = np.exp(s - s.max())
        out[b, i, h] = (w / w.sum()) @ v[b, :n, kh]
  return out


@pytest.mark.parametrize("T,S,causal", [(9, 9, True), (5, 12, True), (12, 5, True), (6, 11, False)])
def test_reference_matches_naive_numpy(T, S, causal):
  rng = np.random.default_rng(T * S)
  q, k, v = inputs(rng, 2, T, S, 4, 2, 16)
  got = np.asarray(flash_attention_reference(q, k, v, causal=causal))
  np.testing.assert_allclose(got, naive(q, k, v, causal), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shapes,dtypes,names", [
    (((1, 8, 3, 32), (1, 8, 2, 32), (1, 8, 2, 32)), None, ["Hq=3", "Hkv=2"]),
    (((1, 8, 4, 32), (1, 8, 2, 16), (1, 8, 2, 16)), None, ["D=32", "Dk=16"]),
    (((2, 8, 4, 32), (1, 8, 2, 32), (1, 8, 2, 32)), None, ["B=2", "Bk=1"]),
    (((1, 8, 4, 32), (1, 8, 2, 32), (1, 9, 2, 32)), None, ["k.shape", "v.shape"]),
    (((1, 8, 4, 24), (1, 8, 2, 24), (1, 8, 2, 24)), None, ["D=24"]),
    (((8, 4, 32), (1, 8, 2, 32), (1, 8, 2, 32)), None, ["q.shape"]),
    (((1, 8, 4, 32),) * 3, (jnp.float32, jnp.float32, jnp.bfloat16), ["k.dtype", "v.dtype"]),
    (((1, 8, 4, 32),) * 3, (jnp.int32, jnp.float32, jnp.float32), ["q.dtype"]),
])
def test_wrapper_rejects_inconsistent_inputs(shapes, dtypes, names):
  dtypes = dtypes or (jnp.float32,) * 3
  args = [jnp.ones(shape, dtype) for shape, dtype in zip(shapes, dtypes, strict=True)]
  with pytest.raises(ValueError) as e:
    kernel(*args)
  for name in names:
    assert name in str(e.value)


def test_block_sizes_must_be_powers_of_two_at_least_16():
  with pytest.raises(ValueError, match="block_q=48"):
    BlockSizes(block_q=48)
  with pytest.raises(ValueError, match="block_k=8"):
    BlockSizes(block_k=8)
