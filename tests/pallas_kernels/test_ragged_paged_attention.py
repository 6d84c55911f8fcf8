"""ragged_paged_attention (Pallas kernel, interpret mode on CPU) against its reference.

Poison: in interpret mode the kernel's output buffer starts as NaN
(`test_interpret_mode_output_starts_as_nan` pins that premise), so a row the
kernel should write but does not fails `assert_allclose`, and rows it must
not write (padding tokens, padding sequences) are asserted to still be NaN.
The KV pool is poisoned too: pages no sequence owns, and the slots of a
sequence's last page past its kv_len, hold NaN, so reading them unmasked
shows up in the result.

Legend: T packed tokens, S sequence slots, N pages, p page_size, P pages per
slot, Hq / Hkv query / kv heads, D head dim.
"""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from conftest import PALLAS_INTERPRET
from pallas_kernels import RaggedBlockSizes as BlockSizes
from pallas_kernels import ragged_paged_attention, ragged_paged_attention_reference

# Kernel vs reference, per input dtype. The kernel feeds the dots the input
# dtype (softmax weights rounded to it before the PV dot) and rounds the
# output to it; the reference computes in float32 throughout.
TOLERANCES = {
    jnp.float32: {"atol": 2e-5, "rtol": 1e-4},
    jnp.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
    jnp.float16: {"atol": 4e-3, "rtol": 4e-3},
}

kernel = functools.partial(ragged_paged_attention, interpret=PALLAS_INTERPRET)  # compiled on a GPU


def make_batch(rng, seqs, *, page_size, Hq, Hkv, D, dtype=jnp.float32, pad_seqs=2, pad_tokens=3,
               pages_per_seq=None):
  """A ragged batch over a shuffled, NaN-poisoned page pool.

  seqs: [(q_len, kv_len)] of the real sequences; pad_seqs padding slots
  follow (kv_len 0, q_len 0), and pad_tokens rows follow the real tokens.
  Pages are drawn in random order from the pool; every page no sequence
  owns, and every slot past a sequence's kv_len, is NaN. page_indices entries
  past a sequence's pages hold ids the kernel must never follow (-1, N + 7).
  """
  S = len(seqs) + pad_seqs
  need = [-(-kv // page_size) for _, kv in seqs]
  P = pages_per_seq or max(need + [1]) + 1
  N = sum(need) + 3  # three pages nobody owns
  perm = rng.permutation(N)
  page_indices = rng.choice(np.array([-1, N + 7], np.int32), size=(S, P)).astype(np.int32)
  k_pages = np.full((N, page_size, Hkv, D), np.nan, np.float32)
  v_pages = np.full((N, page_size, Hkv, D), np.nan, np.float32)
  used = 0
  for s, ((_, kv), n) in enumerate(zip(seqs, need)):
    page_indices[s, :n] = perm[used:used + n]
    used += n
    flat_k = rng.normal(size=(n * page_size, Hkv, D))
    flat_v = rng.normal(size=(n * page_size, Hkv, D))
    flat_k[kv:] = np.nan
    flat_v[kv:] = np.nan
    k_pages[page_indices[s, :n]] = flat_k.reshape(n, page_size, Hkv, D)
    v_pages[page_indices[s, :n]] = flat_v.reshape(n, page_size, Hkv, D)
  kv_lens = np.zeros(S, np.int32)
  kv_lens[:len(seqs)] = [kv for _, kv in seqs]
  cu_q_lens = np.zeros(S + 1, np.int32)
  cu_q_lens[1:len(seqs) + 1] = np.cumsum([q for q, _ in seqs])
  cu_q_lens[len(seqs) + 1:] = cu_q_lens[len(seqs)]
  T = int(cu_q_lens[-1]) + pad_tokens
  q = rng.normal(size=(T, Hq, D))
  cast = lambda x: jnp.asarray(x, dtype)
  return {"q": cast(q), "k_pages": cast(k_pages), "v_pages": cast(v_pages), "kv_lens": kv_lens,
          "page_indices": page_indices, "cu_q_lens": cu_q_lens, "num_seqs": np.int32(len(seqs))}


def check(batch, dtype=jnp.float32, **options):
  """Kernel == reference on the real rows; the rest of the output never written."""
  block_sizes = options.pop("block_sizes", None)
  got = np.asarray(kernel(**batch, block_sizes=block_sizes, **options).astype(jnp.float32))
  want = np.asarray(ragged_paged_attention_reference(**batch, **options).astype(jnp.float32))
  real = int(batch["cu_q_lens"][int(batch["num_seqs"])])
  assert np.isfinite(got[:real]).all(), "a real row was not written (still NaN) or is not finite"
  np.testing.assert_allclose(got[:real], want[:real], **TOLERANCES[dtype])
  if PALLAS_INTERPRET:  # a compiled kernel's output starts as whatever the buffer held
    assert np.isnan(got[real:]).all(), "the kernel wrote rows of padding tokens"
  return got


# decode (1), MTP verification (1 + k: 2, 4), prefill chunks up to 256, with
# kv_len rarely a multiple of the page size.
MIXED = [(1, 1), (2, 40), (1, 130), (4, 77), (37, 37), (1, 200), (256, 300), (16, 81)]


@pytest.mark.parametrize("page_size,D,Hq,Hkv,dtype", [
    (16, 64, 2, 2, jnp.float32),     # G = 1
    (32, 128, 8, 2, jnp.bfloat16),   # G = 4
    (64, 64, 8, 1, jnp.float16),     # G = 8
    (16, 128, 8, 1, jnp.bfloat16),   # G = 8, D = 128
    (32, 64, 4, 1, jnp.float32),     # G = 4
    (16, 64, 6, 2, jnp.float32),     # G = 3, padded to 4 rows per token: heads past G are masked
])
def test_mixed_decode_verify_prefill_batch(page_size, D, Hq, Hkv, dtype):
  rng = np.random.default_rng(page_size * D + Hq)
  batch = make_batch(rng, MIXED, page_size=page_size, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
  check(batch, dtype)


@pytest.mark.parametrize("q_len", [1, 2, 4])
@pytest.mark.parametrize("page_size", [16, 64])
def test_decode_and_verify_only_batches(q_len, page_size):
  """Small-q batches take the 16-row q tiles (block_q * G = 16)."""
  rng = np.random.default_rng(q_len + page_size)
  seqs = [(q_len, kv) for kv in (q_len, 17, 64, 65, 100, 129)]
  check(make_batch(rng, seqs, page_size=page_size, Hq=8, Hkv=2, D=64))


@pytest.mark.parametrize("block_sizes,Hq,Hkv", [
    (BlockSizes(block_q=1, pages_per_block=1), 16, 1),    # many q blocks per sequence, one page per step
    (BlockSizes(block_q=8, pages_per_block=2), 16, 1),
    # Blocks wider than most sequences; G = 4, so a 32-token q block is 128 rows (with G = 16
    # and 8 pages per block it asked an H200 for 482 KiB of shared memory, over its 227).
    (BlockSizes(block_q=32, pages_per_block=4), 8, 2),
])
def test_explicit_block_sizes(block_sizes, Hq, Hkv):
  rng = np.random.default_rng(7)
  seqs = [(1, 33), (4, 40), (19, 19), (45, 90)]
  check(make_batch(rng, seqs, page_size=16, Hq=Hq, Hkv=Hkv, D=64), block_sizes=block_sizes)


@pytest.mark.parametrize("sliding_window,soft_cap,block_sizes", [
    (7, None, None), (None, 5.0, None), (40, 20.0, None), (1, None, None),
    # One page per KV step and a window shorter than a q block: some rows of a
    # tile see no key at all in the tile's first KV blocks (m stays -inf).
    (7, None, BlockSizes(block_q=16, pages_per_block=1)),
])
def test_sliding_window_and_soft_cap(sliding_window, soft_cap, block_sizes):
  rng = np.random.default_rng(11)
  seqs = [(1, 90), (3, 50), (60, 60), (20, 100)]
  batch = make_batch(rng, seqs, page_size=16, Hq=4, Hkv=2, D=64)
  batch["q"] = batch["q"] * 4  # larger logits, so the cap bends them
  check(batch, sliding_window=sliding_window, soft_cap=soft_cap, sm_scale=0.2,
        block_sizes=block_sizes)


@pytest.mark.parametrize("Hq,Hkv,sliding_window,block_sizes,dtype", [
    (2, 2, None, None, jnp.float32),   # G = 1
    (6, 2, None, None, jnp.float32),   # G = 3: the padded fourth head's sink is masked
    (8, 2, 7, None, jnp.bfloat16),     # G = 4, GPT-OSS's sliding layers
    # One page per KV step and a short window: rows start at the sink, then see no key for a while.
    (4, 2, 5, BlockSizes(block_q=16, pages_per_block=1), jnp.float32),
])
def test_attention_sinks(Hq, Hkv, sliding_window, block_sizes, dtype):
  """GPT-OSS's sinks: each head's extra softmax logit, from well below to well above the scores."""
  rng = np.random.default_rng(Hq * 10 + Hkv)
  batch = make_batch(rng, MIXED, page_size=16, Hq=Hq, Hkv=Hkv, D=64, dtype=dtype)
  sinks = np.linspace(-4.0, 6.0, Hq).astype(np.float32)
  got = check(batch, dtype, sliding_window=sliding_window, sinks=sinks, block_sizes=block_sizes)
  plain = check(batch, dtype, sliding_window=sliding_window, block_sizes=block_sizes)
  real = int(batch["cu_q_lens"][int(batch["num_seqs"])])
  # The largest sinks take most of the weight: those heads' outputs shrink towards 0.
  assert np.abs(got[:real, -1]).mean() < 0.5 * np.abs(plain[:real, -1]).mean()
  # A sink of -inf is no sink at all.
  none = np.asarray(kernel(**batch, sliding_window=sliding_window, block_sizes=block_sizes,
                           sinks=np.full(Hq, -np.inf, np.float32)).astype(jnp.float32))
  np.testing.assert_array_equal(none[:real], plain[:real])


@pytest.mark.skipif(not PALLAS_INTERPRET, reason="needs interpret mode's NaN-filled output buffer")
def test_padding_sequences_and_blocks_write_nothing():
  """num_seqs = 0: every grid program is padding, the output stays untouched (NaN)."""
  rng = np.random.default_rng(3)
  batch = make_batch(rng, [(5, 20), (1, 9)], page_size=16, Hq=4, Hkv=2, D=64)
  batch["num_seqs"] = np.int32(0)
  assert np.isnan(np.asarray(kernel(**batch))).all()


def test_inside_outer_jit_with_traced_lengths():
  """The engine's use: traced num_seqs / cu_q_lens / kv_lens, one compile for many layouts.

  T = 43 is not a multiple of any block_q, and the layouts differ in how the
  same T splits into sequences.
  """
  traces = []

  @jax.jit
  def step(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
    traces.append(1)
    return kernel(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                  block_sizes=BlockSizes(block_q=8))

  rng = np.random.default_rng(5)
  T, S, P, N, page_size, Hkv, D = 43, 4, 6, 30, 16, 2, 64
  q = jnp.asarray(rng.normal(size=(T, 4, D)), jnp.float32)
  for q_lens, kv_lens, num_seqs in [([40, 1, 2], [60, 30, 2], 3), ([1, 2, 40], [9, 70, 41], 3),
                                    ([20, 20, 0], [20, 25, 0], 2)]:
    batch = {
        "q": q, "k_pages": jnp.asarray(rng.normal(size=(N, page_size, Hkv, D)), jnp.float32),
        "v_pages": jnp.asarray(rng.normal(size=(N, page_size, Hkv, D)), jnp.float32),
        "kv_lens": np.array([*kv_lens, 0], np.int32),
        "page_indices": rng.permutation(N)[:S * P].reshape(S, P).astype(np.int32),
        "cu_q_lens": np.concatenate([[0], np.cumsum([*q_lens, 0])]).astype(np.int32),
        "num_seqs": np.int32(num_seqs)}
    got = np.asarray(step(**batch))
    want = np.asarray(ragged_paged_attention_reference(**batch))
    real = int(batch["cu_q_lens"][num_seqs])
    np.testing.assert_allclose(got[:real], want[:real], **TOLERANCES[jnp.float32])
  assert len(traces) == 1


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), page_size=st.sampled_from([16, 32]))
def test_random_ragged_layouts(data, page_size):
  """Random ragged layouts at fixed static shapes (so hypothesis does not recompile)."""
  T, S, P, Hq, Hkv, D = 48, 5, 8, 4, 1, 32 if page_size == 16 else 64
  num_seqs = data.draw(st.integers(1, S), label="num_seqs")
  q_lens = data.draw(st.lists(st.integers(0, 20), min_size=num_seqs, max_size=num_seqs), label="q_lens")
  if sum(q_lens) > T:
    q_lens = [min(q, T // num_seqs) for q in q_lens]
  kv_lens = [q + data.draw(st.integers(0, P * page_size - q), label="past") for q in q_lens]
  seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
  rng = np.random.default_rng(seed)
  batch = make_batch(rng, list(zip(q_lens, kv_lens)), page_size=page_size, Hq=Hq, Hkv=Hkv, D=D,
                     pad_seqs=S - num_seqs, pad_tokens=T - sum(q_lens), pages_per_seq=P)
  # Pad the pool to a fixed size too (extra pages are NaN, owned by nobody).
  N = S * P + 3
  for name in ("k_pages", "v_pages"):
    x = batch[name]
    batch[name] = jnp.concatenate([x, jnp.full((N - x.shape[0], *x.shape[1:]), jnp.nan, x.dtype)])
  check(batch)


def test_interpret_mode_output_starts_as_nan():
  """The premise of the poison checks above: unwritten interpret-mode outputs are NaN."""
  from jax.experimental import pallas as pl

  def writes_nothing(x_ref, o_ref):
    del x_ref, o_ref

  out = pl.pallas_call(writes_nothing, out_shape=jax.ShapeDtypeStruct((4, 8), jnp.float32),
                       interpret=True)(jnp.zeros((4, 8)))
  assert np.isnan(np.asarray(out)).all()


def naive_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                    sliding_window=None, soft_cap=None, sinks=None):
  """Dense per-sequence attention in float64 numpy, one query and head at a time; a sink is
  one more exp term in the denominator."""
  q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
  T, Hq, D = q.shape
  _, p, Hkv, _ = k_pages.shape
  out = np.zeros((T, Hq, D))
  for s in range(num_seqs):
    lo, hi, L = cu_q_lens[s], cu_q_lens[s + 1], kv_lens[s]
    k = k_pages[page_indices[s, :-(-L // p)]].reshape(-1, Hkv, D)[:L]
    v = v_pages[page_indices[s, :-(-L // p)]].reshape(-1, Hkv, D)[:L]
    for i, t in enumerate(range(lo, hi)):
      pos = L - (hi - lo) + i
      j = np.arange(L)
      ok = (j <= pos) if sliding_window is None else (j <= pos) & (j > pos - sliding_window)
      for h in range(Hq):
        scores = k[:, h // (Hq // Hkv)] @ q[t, h] / np.sqrt(D)
        if soft_cap is not None:
          scores = soft_cap * np.tanh(scores / soft_cap)
        top = scores[ok].max() if sinks is None else max(scores[ok].max(), sinks[h])
        w = np.exp(np.where(ok, scores, -np.inf) - top)
        denominator = w.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
        out[t, h] = (w / denominator) @ v[:, h // (Hq // Hkv)]
  return out


@pytest.mark.parametrize("sliding_window,soft_cap,sinks", [
    (None, None, None), (6, 3.0, None), (6, None, [0.5, -1.0, 2.0, 3.5])])
def test_reference_matches_naive_numpy(sliding_window, soft_cap, sinks):
  """The reference is checked against an independent float64 loop, not only against itself."""
  rng = np.random.default_rng(13)
  batch = make_batch(rng, [(1, 20), (3, 3), (9, 40)], page_size=16, Hq=4, Hkv=2, D=16)
  sinks = None if sinks is None else np.array(sinks, np.float32)
  got = np.asarray(ragged_paged_attention_reference(**batch, sliding_window=sliding_window,
                                                    soft_cap=soft_cap, sinks=sinks))
  args = {k: np.asarray(v) for k, v in batch.items()}
  want = naive_attention(**{**args, "num_seqs": int(args["num_seqs"])},
                         sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
  real = int(args["cu_q_lens"][3])
  np.testing.assert_allclose(got[:real], want[:real], atol=1e-5, rtol=1e-5)
  assert (got[real:] == 0).all()


def _valid_args(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  return make_batch(rng, [(2, 5), (1, 20)], page_size=16, Hq=4, Hkv=2, D=32, dtype=dtype)


@pytest.mark.parametrize("change,names", [
    (lambda a: {"q": a["q"][:, :3]}, ["Hq=3", "Hkv=2"]),
    (lambda a: {"q": a["q"][..., :16]}, ["D=16", "Dk=32"]),
    (lambda a: {"v_pages": a["v_pages"][:-1]}, ["k_pages.shape", "v_pages.shape"]),
    (lambda a: {"v_pages": a["v_pages"].astype(jnp.bfloat16)}, ["k_pages.dtype", "v_pages.dtype"]),
    (lambda a: {"page_indices": a["page_indices"][:-1]}, ["page_indices", "len(kv_lens)=4"]),
    (lambda a: {"cu_q_lens": a["cu_q_lens"][:-1]}, ["len(cu_q_lens)=4", "5"]),
    (lambda a: {"kv_lens": a["kv_lens"].astype(np.int16)}, ["kv_lens.dtype"]),  # int64 would become int32 under jit
    (lambda a: {"page_indices": a["page_indices"].astype(np.uint32)}, ["page_indices.dtype"]),
    (lambda a: {"cu_q_lens": a["cu_q_lens"].astype(np.float32)}, ["cu_q_lens.dtype"]),
    (lambda a: {"q": a["q"].astype(jnp.int32)}, ["q.dtype"]),
    (lambda a: {"k_pages": a["k_pages"].astype(jnp.int8), "v_pages": a["v_pages"].astype(jnp.int8)},
     ["k_pages.dtype"]),
    (lambda a: {"num_seqs": np.array([2], np.int32)}, ["num_seqs"]),
    (lambda a: {"k_pages": a["k_pages"][:, :12], "v_pages": a["v_pages"][:, :12]}, ["page_size=12"]),
])
def test_wrapper_rejects_inconsistent_inputs(change, names):
  args = _valid_args()
  args.update(change(args))
  with pytest.raises(ValueError) as e:
    kernel(**args)
  for name in names:
    assert name in str(e.value)


@pytest.mark.parametrize("options,names", [
    ({"sliding_window": 0}, ["sliding_window=0"]),
    ({"soft_cap": -1.0}, ["soft_cap=-1.0"]),
    ({"sinks": np.zeros(3, np.float32)}, ["sinks", "Hq", "4"]),
    ({"sinks": np.zeros(4, np.int32)}, ["sinks", "int32"]),
    ({"block_sizes": BlockSizes(block_q=1)}, ["block_q=1", "16"]),
    ({"block_sizes": BlockSizes(pages_per_block=None, block_q=8)}, None),  # valid: 8 x 2 rows
])
def test_wrapper_rejects_bad_options(options, names):
  args = _valid_args()
  if names is None:
    kernel(**args, **options)
    return
  with pytest.raises(ValueError) as e:
    kernel(**args, **options)
  for name in names:
    assert name in str(e.value)


def test_block_sizes_must_be_powers_of_two():
  with pytest.raises(ValueError, match="block_q=3"):
    BlockSizes(block_q=3)
  with pytest.raises(ValueError, match="pages_per_block=6"):
    BlockSizes(pages_per_block=6)


def quantize_int8(x, groups=None):
  """x [..., F] (NaN-poisoned slots allowed) -> int8 values and float32 scales [...] (or
  [..., groups]): max|x| / 127 per vector or group; a poisoned vector keeps a NaN scale."""
  x = np.asarray(x, np.float32)
  g = x.reshape(x.shape[:-1] + ((groups or 1), -1))
  scale = np.abs(g).max(-1) / 127
  vals = np.nan_to_num(np.round(g / scale[..., None])).astype(np.int8).reshape(x.shape)
  return jnp.asarray(vals), jnp.asarray(scale if groups else scale[..., 0])


@pytest.mark.parametrize("Hq,Hkv,sliding_window", [(8, 2, None), (4, 4, 40)])
def test_quantized_cache_with_scales(Hq, Hkv, sliding_window):
  """int8 pages with float32 scales per token and kv head: kernel == reference (which
  dequantizes the whole cache first), slots past kv_len carrying NaN scales."""
  rng = np.random.default_rng(Hq + Hkv)
  batch = make_batch(rng, MIXED, page_size=16, Hq=Hq, Hkv=Hkv, D=32)
  batch["k_pages"], batch["k_scale"] = quantize_int8(batch["k_pages"])
  batch["v_pages"], batch["v_scale"] = quantize_int8(batch["v_pages"])
  check(batch, sliding_window=sliding_window)
