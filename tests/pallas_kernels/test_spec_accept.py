"""spec_accept (Pallas kernel, interpret mode on CPU) against its reference, the engine's sampler,
and the target distribution.

- The kernel equals the reference on the integer outputs over a sweep: vocab
  sizes that are not a multiple of the block, k = 1..4, greedy, sampled and
  truncated rows, point-mass and full-q drafts, sequences with 0 and k drafts.
- Point-mass acceptance equals the engine's (jaxinfer.sampling.sample on every
  verify row with fold_in(seed, position) keys, then engine.spec_decode.accept),
  truncation included.
- The reference is lossless: the first committed token follows p, for a poor
  and a good draft distribution (chi-square, fixed seed), and the same test
  rejects a sampler that draws the correction from p instead of
  norm(max(0, p - q)).

Legend: S sequences, k drafts, K1 = k + 1 rows, V vocab, N trials.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.spec_decode import accept
from jaxinfer.sampling import (
  SamplingBatch,
  sample,
  sort_descending,
  truncation_threshold,
)
from conftest import PALLAS_INTERPRET
from pallas_kernels.spec_accept import (
  BlockSizes,
  gumbel_noise,
  spec_accept,
  spec_accept_reference,
)

from helpers import lower_for_cuda

kernel = functools.partial(spec_accept, interpret=PALLAS_INTERPRET)  # compiled on a GPU


@jax.jit
def _row_keys(seeds, positions):
  return jax.vmap(jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p)))(seeds, positions)


def row_keys(seeds, positions):
  """[S, K1] keys fold_in(key(seed), position), the sampler's per-row stream."""
  return _row_keys(jnp.asarray(seeds, jnp.uint32), jnp.asarray(positions, jnp.int32))


@jax.jit
def thresholds(logits, temperature, top_k, top_p, min_p):
  """[S, K1] smallest kept scaled logit, computed as the sampler's exact path does (full sort)."""
  S, K1, V = logits.shape
  x = logits.astype(jnp.float32).reshape(S * K1, V)
  scaled = x / jnp.where(temperature > 0, temperature, 1.0).reshape(-1, 1)
  desc = jax.vmap(sort_descending)(scaled)
  z = jnp.sum(jnp.exp(scaled - desc[:, :1]), axis=-1)
  thr = truncation_threshold(desc, top_k.reshape(-1), top_p.reshape(-1), min_p.reshape(-1), z)
  return thr.reshape(S, K1)


def make_case(rng, k, V, dtype, S=5):
  """Random logits and per-row controls of 5 sequences: greedy, sampled, truncated to its 12 and
  its 40 best tokens, greedy; 0 and k drafts."""
  K1 = k + 1
  logits = jnp.asarray(rng.normal(size=(S, K1, V)) * 2.5, dtype)
  temps = np.array([0.0, 1.0, 0.7, 1.3, 0.0])
  temperature = np.repeat(temps[:, None], K1, 1).astype(np.float32)
  scaled = np.asarray(logits, np.float32) / np.where(temperature > 0, temperature, 1)[..., None]
  desc = -np.sort(-scaled, axis=-1)
  thr = np.full((S, K1), -np.inf, np.float32)
  thr[2], thr[3] = desc[2, :, 11], desc[3, :, 39]
  keys = row_keys(rng.integers(0, 2**32, (S, K1)), rng.integers(0, 4096, (S, K1)))
  num_drafts = jnp.asarray([k, 0, k, max(k - 1, 0), k], jnp.int32)
  return logits, jnp.asarray(temperature), jnp.asarray(thr), keys, num_drafts


# (V, block_v, k, full_q, dtype): V not a multiple of block_v, every k, both draft kinds. Few
# cases: each compiles the kernel in interpret mode (~3 s).
CASES = [
    (1000, 256, 1, False, jnp.float32),
    (1000, 256, 2, True, jnp.bfloat16),
    (130, 128, 3, False, jnp.float32),  # the engine test's shapes: its kernel compile is shared
    (130, 128, 4, True, jnp.float32),
]


@pytest.mark.parametrize("V,block_v,k,full_q,dtype", CASES)
def test_kernel_matches_reference(V, block_v, k, full_q, dtype):
  rng = np.random.default_rng(V * 10 + k)
  S = 5
  logits, temperature, thr, keys, num_drafts = make_case(rng, k, V, dtype)
  extra = {}
  if full_q:
    # q sharper than p on p's favourites: drafts drawn from q are often rejected, and the
    # residual max(0, p - q) then leaves p's favourites out (the correction is not p's draw).
    q_logits = 3.0 * np.asarray(logits[:, :k], np.float32) + rng.normal(size=(S, k, V))
    q = np.exp(q_logits - q_logits.max(-1, keepdims=True))
    q = (q / q.sum(-1, keepdims=True)).astype(np.float32)
    drafts = np.array([[rng.choice(V, p=q[i, j] / q[i, j].sum()) for j in range(k)] for i in range(S)])
    argmax = np.argmax(np.asarray(logits[:, :k], np.float32), axis=-1)
    greedy = np.asarray(temperature[:, :k]) == 0
    drafts = jnp.asarray(np.where(greedy, argmax, drafts), jnp.int32)  # greedy sequences accept all
    extra = {"draft_probs": jnp.asarray(q), "uniforms": jnp.asarray(rng.uniform(size=(S, k)), jnp.float32)}
  else:
    # Every row's own draw t_j (a sequence with no drafts commits row 0's and shows the rest);
    # the first c drafts of each sequence are those, then a wrong one.
    own = np.asarray(spec_accept_reference(logits, jnp.zeros((S, k), jnp.int32), jnp.zeros(S, jnp.int32),
                                           temperature, keys, threshold=thr)[1])
    c = np.minimum(np.array([k, 0, 1, 2, k - 1]), np.asarray(num_drafts))
    drafts = own[:, :k].copy()
    for i in range(S):
      drafts[i, c[i]:] = (drafts[i, c[i]:] + 1 + i) % V
    drafts = jnp.asarray(drafts)
  want_a, want_ids = spec_accept_reference(logits, drafts, num_drafts, temperature, keys, threshold=thr,
                                           **extra)
  got_a, got_ids = kernel(logits, drafts, num_drafts, temperature, keys, threshold=thr,
                          block_sizes=BlockSizes(block_v=block_v), **extra)
  np.testing.assert_array_equal(got_a, want_a)
  np.testing.assert_array_equal(got_ids, want_ids)
  a, nd = np.asarray(want_a), np.asarray(num_drafts)
  if full_q:  # the case exercises acceptance, a sampled rejection (the residual draw) and the bonus
    sampled = np.asarray(temperature[:, 0]) > 0
    assert (a > 0).any() and (sampled & (a < nd)).any() and (a == nd).any(), (a, nd)
    # A correction is drawn from max(0, p - q): p(token) > q(token). Here q is sharp on p's
    # favourites, so a kernel that committed the row's own draw t_a instead would break this.
    x = np.asarray(logits, np.float32) / np.where(temperature > 0, temperature, 1)[..., None]
    x = np.where(x >= np.asarray(thr)[..., None], x, -np.inf)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    for i in np.flatnonzero(sampled & (a < nd)):
      tok = int(want_ids[i, a[i]])
      assert p[i, a[i], tok] > float(extra["draft_probs"][i, a[i], tok]), (i, tok)
  else:
    np.testing.assert_array_equal(a, c)
    np.testing.assert_array_equal(want_ids, own)  # point-mass: every row holds its own draw


def engine_and_kernel(rng, S, k, V, accept_fn):
  """(engine's accepted [S], ids [S, K1]), (accept_fn's) for S sequences cycling through greedy,
  plain sampled, top-k, top-p + min-p and min-p controls; drafts: each sequence's own draws, the
  first sequence's last one replaced by a wrong token."""
  K1 = k + 1
  logits = jnp.asarray(rng.normal(size=(S, K1, V)) * 2.0, jnp.float32)
  per_seq = lambda vals, dtype: jnp.asarray(np.repeat(np.resize(vals, S)[:, None], K1, 1), dtype)
  temperature = per_seq([0.0, 0.9, 0.7, 1.2, 1.0], jnp.float32)
  top_k = per_seq([0, 0, 20, 0, 0], jnp.int32)
  top_p = per_seq([1, 1, 1, 0.8, 1], jnp.float32)
  min_p = per_seq([0, 0, 0, 0.05, 0.1], jnp.float32)
  seeds = per_seq(rng.integers(0, 2**32, S), jnp.uint32)
  positions = jnp.asarray(rng.integers(5, 500, (S, 1)) + np.arange(K1), jnp.int32)
  num_drafts = jnp.asarray(np.resize([3, 0, 2, 3, 1], S).clip(0, k), jnp.int32)
  flat = lambda a: a.reshape(-1)
  L = S * K1
  sp = SamplingBatch(flat(temperature), flat(top_k), flat(top_p), flat(min_p), jnp.ones(L),
                     jnp.zeros(L), jnp.zeros(L), flat(seeds), flat(positions), jnp.zeros(L, bool))
  history = (jnp.zeros((1, V), jnp.int32), jnp.zeros((1, V), bool), jnp.zeros(L, jnp.int32))
  engine_ids = np.asarray(jax.jit(sample)(logits.reshape(L, V), sp, *history)[0]).reshape(S, K1)
  drafts = engine_ids[:, :k].copy()
  drafts[0, k - 1] = (drafts[0, k - 1] + 1) % V
  drafts, engine_ids = jnp.asarray(drafts), jnp.asarray(engine_ids)
  thr = thresholds(logits, temperature, top_k, top_p, min_p)
  got = accept_fn(logits, drafts, num_drafts, temperature, row_keys(seeds, positions), threshold=thr)
  return (accept(engine_ids, drafts, num_drafts), engine_ids), got


def test_point_mass_acceptance_is_the_engines():
  """The engine samples every verify row (sample(), fold_in(seed, position) keys, top-k / top-p /
  min-p) and accepts matching drafts; the kernel, given the same keys and the sampler's
  thresholds, commits the same tokens."""
  (engine_a, engine_ids), (got_a, got_ids) = engine_and_kernel(
      np.random.default_rng(7), 5, 3, 130, functools.partial(kernel, block_sizes=BlockSizes(block_v=128)))
  np.testing.assert_array_equal(engine_a, [2, 0, 2, 3, 1])  # sequence 0: 2 of its 3 drafts
  np.testing.assert_array_equal(got_a, engine_a)
  np.testing.assert_array_equal(got_ids, engine_ids)


def test_kernel_noise_is_jax_randoms():
  keys = row_keys(np.arange(6).reshape(2, 3) * 7919, np.arange(6).reshape(2, 3))
  data = jax.random.key_data(keys)
  V = 300
  got = jax.jit(gumbel_noise)(data[..., 0:1], data[..., 1:2], jnp.arange(V)[None, None, :])  # [2, 3, V]
  want = jax.vmap(jax.vmap(lambda key: jax.random.gumbel(key, (V,), jnp.float32)))(keys)
  np.testing.assert_array_equal(got, want)


# Chi-square critical value for 5 degrees of freedom at significance 1e-4
# (scipy.stats.chi2.ppf(1 - 1e-4, 5)).
CHI2_CRIT_DF5 = 25.74
P_LOGITS = np.log(np.array([0.35, 0.25, 0.15, 0.12, 0.08, 0.05]))


def first_token_counts(draw, q, N, seed):
  """Counts over V of the first committed token of N k=1 verifications at temperature 0.8, drafts
  drawn from q [V] (a point mass: drafts given as is); draw(logits, drafts, temperature, keys,
  draft_probs, uniforms) -> token ids [N, 2]."""
  V = len(P_LOGITS)
  rng = np.random.default_rng(seed)
  logits = np.broadcast_to(P_LOGITS * 0.8, (N, 2, V)).astype(np.float32)
  drafts = rng.choice(V, p=q, size=(N, 1)).astype(np.int32)
  probs = np.broadcast_to(q, (N, 1, V)).astype(np.float32)
  keys = rng.integers(0, 2**32, (N, 2, 2), dtype=np.uint32)  # key data: any 64 random bits
  ids = draw(jnp.asarray(logits), jnp.asarray(drafts), jnp.full((N, 2), 0.8, jnp.float32),
             jnp.asarray(keys), jnp.asarray(probs), jnp.asarray(rng.uniform(size=(N, 1)), jnp.float32))
  return np.bincount(np.asarray(ids[:, 0]), minlength=V)


def chi_square(counts):
  p = np.exp(P_LOGITS)  # logits * 0.8 at temperature 0.8: p itself
  expected = p / p.sum() * counts.sum()
  return float(((counts - expected) ** 2 / expected).sum())


def reference_draw(logits, drafts, temperature, keys, probs, uniforms, point_mass=False):
  nd = jnp.ones(logits.shape[0], jnp.int32)
  extra = {} if point_mass else {"draft_probs": probs, "uniforms": uniforms}
  return spec_accept_reference(logits, drafts, nd, temperature, keys, **extra)[1]


def correction_from_p(logits, drafts, temperature, keys, probs, uniforms):
  """The classic mistake: accept with min(1, p/q), but draw the correction from p itself."""
  ids = reference_draw(logits, drafts, temperature, keys, probs, uniforms)
  own = reference_draw(logits, jnp.zeros_like(drafts), temperature, keys, probs, uniforms, True)
  accepted = ids[:, 0] == drafts[:, 0]  # p has no point mass here: a rejection never redraws d
  return jnp.where(accepted[:, None], ids, own)


Q_POOR = np.array([0.02, 0.03, 0.05, 0.1, 0.3, 0.5])  # mass where p has little
Q_GOOD = np.array([0.3, 0.28, 0.15, 0.12, 0.1, 0.05])


@pytest.mark.parametrize("q", [Q_POOR, Q_GOOD], ids=["poor_q", "good_q"])
def test_reference_is_lossless(q):
  N = 20000
  stat = chi_square(first_token_counts(reference_draw, q, N, seed=0))
  assert stat < CHI2_CRIT_DF5, stat
  # Point-mass drafts (the engine's): the least and the most likely token.
  for d in (5, 0):
    point = np.eye(len(q))[d]
    draw = functools.partial(reference_draw, point_mass=True)
    stat = chi_square(first_token_counts(draw, point, N, seed=1))
    assert stat < CHI2_CRIT_DF5, (d, stat)


def test_lossless_check_rejects_a_wrong_residual():
  """The test above has the power to see a correction drawn from p instead of the residual."""
  stat = chi_square(first_token_counts(correction_from_p, Q_POOR, 20000, seed=0))
  assert stat > 10 * CHI2_CRIT_DF5, stat


def test_bad_inputs_name_the_argument():
  S, k, V = 2, 2, 50
  logits = jnp.zeros((S, k + 1, V))
  ok = {"draft_ids": jnp.zeros((S, k), jnp.int32), "num_drafts": jnp.zeros(S, jnp.int32),
        "temperature": jnp.zeros((S, k + 1)), "keys": row_keys(np.zeros((S, k + 1)), np.zeros((S, k + 1)))}
  with pytest.raises(ValueError, match="draft_ids"):
    kernel(logits, **{**ok, "draft_ids": jnp.zeros((S, k + 1), jnp.int32)})
  with pytest.raises(ValueError, match="temperature"):
    kernel(logits, **{**ok, "temperature": jnp.zeros((S,))})
  with pytest.raises(ValueError, match="draft_probs and uniforms"):
    kernel(logits, **ok, draft_probs=jnp.zeros((S, k, V)))
  with pytest.raises(ValueError, match="draft_probs must be"):
    kernel(logits, **ok, draft_probs=jnp.zeros((S, k, V + 1)), uniforms=jnp.zeros((S, k)))
  with pytest.raises(ValueError, match="block_v"):
    BlockSizes(block_v=100)


@pytest.mark.triton_lowering
@pytest.mark.parametrize("full_q", [False, True])
def test_kernel_lowers_to_triton(full_q):
  """The Pallas Triton lowering accepts the kernel (interpret mode forgives what it would not)."""
  S, k, V = 8, 3, 49152
  A = jax.ShapeDtypeStruct
  avals = [A((S, k + 1, V), jnp.bfloat16), A((S, k), jnp.int32), A((S,), jnp.int32),
           A((S, k + 1), jnp.float32), A((S, k + 1, 2), jnp.uint32), A((S, k + 1), jnp.float32)]
  if full_q:
    avals += [A((S, k, V), jnp.float32), A((S, k), jnp.float32)]

  def fn(logits, drafts, nd, temperature, key_data, thr, *q):
    extra = {"draft_probs": q[0], "uniforms": q[1]} if q else {}
    return spec_accept(logits, drafts, nd, temperature, key_data, threshold=thr, **extra)

  lower_for_cuda(fn, *avals)


@pytest.mark.gpu  # compiled kernel vs XLA's sampler
@pytest.mark.parametrize("V", [1000, 49152])
def test_compiled_kernel_matches_xla_on_gpu(V):
  """On a GPU the kernel's float ops (div.rn.f32, libdevice log) must round as XLA's do for the
  engine's seeded outputs to stay the same: the compiled kernel commits the engine's tokens, and
  its full-q outputs equal the reference's."""
  rng = np.random.default_rng(V)
  S, k = 64, 3
  (engine_a, engine_ids), (got_a, got_ids) = engine_and_kernel(rng, S, k, V, spec_accept)
  np.testing.assert_array_equal(got_a, engine_a)
  np.testing.assert_array_equal(got_ids, engine_ids)
  logits = jnp.asarray(rng.normal(size=(S, k + 1, V)), jnp.float32)
  q = jax.nn.softmax(3.0 * logits[:, :k] + jnp.asarray(rng.normal(size=(S, k, V)), jnp.float32), axis=-1)
  args = (logits, jnp.asarray(rng.integers(0, V, (S, k)), jnp.int32), jnp.full((S,), k, jnp.int32),
          jnp.full((S, k + 1), 0.8, jnp.float32), row_keys(rng.integers(0, 2**32, (S, k + 1)),
                                                           np.zeros((S, k + 1))))
  extra = {"draft_probs": q, "uniforms": jnp.asarray(rng.random((S, k)), jnp.float32)}
  want, got = spec_accept_reference(*args, **extra), spec_accept(*args, **extra)
  # Z is summed in another order than XLA's: a flip needs u within an ulp of p / q, or a
  # near-tie of the residual's Gumbel maxima.
  assert int(jnp.sum(got[1] != want[1])) <= 1
