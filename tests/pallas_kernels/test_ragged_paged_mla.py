"""ragged_paged_mla (Pallas kernel, interpret mode on CPU) against its reference.

Poisoned as in test_ragged_paged_attention.py: the interpret-mode output starts
as NaN, pages nobody owns and slots past a sequence's kv_len hold NaN, and
page-table entries past a sequence's pages point outside the pool.

Legend: T packed tokens, S sequence slots, N pages, p page_size, H heads,
R kv_lora_rank, E qk_rope_head_dim.
"""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from conftest import PALLAS_INTERPRET
from pallas_kernels.ragged_paged_mla import BlockSizes, ragged_paged_mla, ragged_paged_mla_reference

TOLERANCES = {
    jnp.float32: {"atol": 2e-5, "rtol": 1e-4},
    jnp.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}
kernel = functools.partial(ragged_paged_mla, interpret=PALLAS_INTERPRET)  # compiled on a GPU


def make_batch(rng, seqs, *, page_size, H, R, E, dtype=jnp.float32, pad_seqs=2, pad_tokens=3):
  S = len(seqs) + pad_seqs
  need = [-(-kv // page_size) for _, kv in seqs]
  P = max(need + [1]) + 1
  N = sum(need) + 3
  perm = rng.permutation(N)
  page_indices = rng.choice(np.array([-1, N + 7], np.int32), size=(S, P)).astype(np.int32)
  latent = np.full((N, page_size, R + E), np.nan, np.float32)
  used = 0
  for s, ((_, kv), n) in enumerate(zip(seqs, need)):
    page_indices[s, :n] = perm[used:used + n]
    used += n
    flat = rng.normal(size=(n * page_size, R + E))
    flat[kv:] = np.nan
    latent[page_indices[s, :n]] = flat.reshape(n, page_size, R + E)
  kv_lens = np.zeros(S, np.int32)
  kv_lens[:len(seqs)] = [kv for _, kv in seqs]
  cu = np.zeros(S + 1, np.int32)
  cu[1:len(seqs) + 1] = np.cumsum([q for q, _ in seqs])
  cu[len(seqs) + 1:] = cu[len(seqs)]
  T = int(cu[-1]) + pad_tokens
  cast = lambda x: jnp.asarray(x, dtype)
  return {"q_latent": cast(rng.normal(size=(T, H, R))), "q_rope": cast(rng.normal(size=(T, H, E))),
          "latent_pages": cast(latent), "kv_lens": kv_lens, "page_indices": page_indices,
          "cu_q_lens": cu, "num_seqs": np.int32(len(seqs))}


def check(batch, dtype=jnp.float32, sm_scale=0.2, block_sizes=None):
  got = np.asarray(kernel(**batch, sm_scale=sm_scale, block_sizes=block_sizes).astype(jnp.float32))
  want = np.asarray(ragged_paged_mla_reference(**batch, sm_scale=sm_scale).astype(jnp.float32))
  real = int(batch["cu_q_lens"][int(batch["num_seqs"])])
  assert np.isfinite(got[:real]).all(), "a real row was not written (still NaN) or is not finite"
  np.testing.assert_allclose(got[:real], want[:real], **TOLERANCES[dtype])
  if PALLAS_INTERPRET:  # a compiled kernel's output starts as whatever the buffer held
    assert np.isnan(got[real:]).all(), "the kernel wrote rows of padding tokens"


MIXED = [(1, 1), (2, 40), (1, 130), (4, 77), (37, 37), (1, 200), (70, 90), (16, 81)]


@pytest.mark.parametrize("page_size,H,R,E,dtype", [
    (16, 8, 32, 16, jnp.float32),     # R + E = 48: no power of two, which the GQA kernel refuses
    (16, 16, 64, 16, jnp.bfloat16),
    (32, 6, 32, 16, jnp.float32),     # H = 6: a head block of 8, heads past H masked
    (16, 128, 64, 32, jnp.bfloat16),  # DeepSeek-V3's 128 heads over 8 head blocks
])
def test_mixed_decode_verify_prefill_batch(page_size, H, R, E, dtype):
  rng = np.random.default_rng(page_size + H + R)
  check(make_batch(rng, MIXED, page_size=page_size, H=H, R=R, E=E, dtype=dtype), dtype)


def test_deepseek_v3_widths_decode():
  """R = 512, E = 64 (L = 576), 16 heads: a decode batch and a short prefill."""
  rng = np.random.default_rng(0)
  check(make_batch(rng, [(1, 33), (1, 5), (3, 20)], page_size=16, H=16, R=512, E=64), sm_scale=0.07)


@pytest.mark.parametrize("block_sizes", [BlockSizes(block_q=1, block_h=16, pages_per_block=1),
                                         BlockSizes(block_q=4, block_h=4, pages_per_block=2),
                                         BlockSizes(block_q=16, block_h=2, pages_per_block=4)])
def test_block_sizes(block_sizes):
  rng = np.random.default_rng(1)
  check(make_batch(rng, MIXED[:5], page_size=16, H=8, R=32, E=16), block_sizes=block_sizes)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_ragged_layouts(data):
  seqs = data.draw(st.lists(st.tuples(st.sampled_from([1, 1, 2, 5, 17]), st.integers(0, 60)),
                            min_size=1, max_size=5), label="seqs")
  seqs = [(q, q + extra) for q, extra in seqs]
  H = data.draw(st.sampled_from([1, 3, 8, 16]), label="H")
  rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="seed"))
  check(make_batch(rng, seqs, page_size=16, H=H, R=32, E=16))


@pytest.mark.parametrize("change,match", [
    (lambda b: {"q_rope": b["q_rope"][..., :8], "latent_pages": b["latent_pages"][..., :40]}, "E"),
    (lambda b: {"q_latent": b["q_latent"][..., :24], "latent_pages": b["latent_pages"][..., :40]}, "R"),
    (lambda b: {"latent_pages": b["latent_pages"][..., :47]}, "R \\+ E"),
    (lambda b: {"q_rope": b["q_rope"][:, :4]}, "agree"),
    (lambda b: {"kv_lens": b["kv_lens"].astype(np.float32)}, "int32"),
])
def test_bad_operands_are_named(change, match):
  batch = make_batch(np.random.default_rng(2), [(2, 5)], page_size=16, H=8, R=32, E=16)
  batch.update(change(batch))
  with pytest.raises(ValueError, match=match):
    kernel(**batch, sm_scale=0.1)


def test_quantized_latent_in_groups():
  """An int8 latent with a float32 scale per 16 values (two c_KV groups, one rope group):
  kernel == reference, slots past kv_len carrying NaN scales."""
  from test_ragged_paged_attention import quantize_int8
  rng = np.random.default_rng(5)
  batch = make_batch(rng, MIXED, page_size=16, H=8, R=32, E=16)
  batch["latent_pages"], batch["latent_scale"] = quantize_int8(batch["latent_pages"], groups=3)
  check(batch)
