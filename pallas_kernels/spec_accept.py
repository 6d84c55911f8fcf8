"""Speculative decoding's accept step: one Pallas (Triton) kernel per verify batch.

Shapes (legend):
  S   sequences, k drafts per sequence (static), K1 = k + 1 verify rows,
  V   vocab (any size; the last vocab block is masked), K1p = next_pow2(K1)

  logits       [S, K1, V]  target logits of each sequence's k + 1 verify rows
                           (penalties and grammar masks already applied)
  draft_ids    [S, k]      int32 drafts d_1 .. d_k (row j verifies d_j+1)
  num_drafts   [S]         int32 in 0 .. k (0: a plain decode or no guess)
  temperature  [S, K1]     float32, 0 = greedy
  keys         [S, K1]     threefry2x32 keys (or their data, uint32 [S, K1, 2]): row j's
                           Gumbel noise is jax.random.gumbel(keys[s, j], (V,))
  threshold    [S, K1]     optional float32 truncation (top-k / top-p / min-p) as the
                           smallest kept scaled logit (jaxinfer.sampling.truncation_threshold)
  draft_probs  [S, k, V]   optional full draft distributions q_j (sampled drafts)
  uniforms     [S, k]      float32 in [0, 1), with draft_probs: u_j of the accept test
  ->
  num_accepted [S]         int32 in 0 .. num_drafts
  token_ids    [S, K1]     int32: row j < a holds d_j+1, row a the correction or bonus
                           token, rows past a the row's own draw t_j (committed: the
                           first a + 1)

Semantics (the reference `spec_accept_reference` spells them out naively).
Row j's scaled logits are s_j = logits_j / T_j (T_j = 1 on greedy rows), the
tokens below threshold_j at -inf on sampled rows; p_j = softmax(s_j). Row j's
own draw is t_j = first argmax(g_j + s_j), g_j its Gumbel noise (greedy rows:
first argmax(s_j)); by the Gumbel-max trick t_j ~ p_j.

- Point-mass drafts (no draft_probs: greedy, n-gram and MTP-argmax drafts,
  q_j = one-hot(d)): accept d_j+1 while it equals t_j, commit t_a. This is
  rejection sampling with the coupling u = [d != t]: P(accept) = p(d) =
  min(1, p(d) / q(d)), and a rejected row's t given t != d is distributed as
  norm(max(0, p - q)) (Leviathan et al. 2023, Section 2.3; Chen et al. 2023,
  Algorithm 2). It is jaxinfer's engine acceptance (engine/spec_decode.py)
  token for token: the runner samples every verify row with fold_in(seed,
  position) and compares, which is t_j with those keys. Only maxima are
  reduced, so the result does not depend on the order the vocab is walked.
- Full draft distributions (draft_probs): on a sampled row accept d while
  u_j * q_j(d) * Z_j < exp(s_j(d) - m_j) (that is u_j < p_j(d) / q_j(d), with
  m_j, Z_j the row's max and sum(exp(s_j - m_j))); at the first rejected row
  a the correction is first argmax over the vocab of log(r) + g_a with r =
  exp(s_a - m_a) - q_a * Z_a > 0, a Gumbel-max draw from norm(max(0, p_a - q_a))
  (no positive entry, which rounding alone can cause: t_a). Greedy rows
  accept while d == argmax whatever q says.
- All drafts accepted: the bonus token t_nd, drawn from p_nd.

Algorithm. One program per sequence (grid (S,)). It walks the vocab in
blocks of block_v columns, all K1 rows at once as a [K1p, block_v] tile
(each logit is read once), and keeps per row a running first-argmax of
g + s (value and index; a later block wins only if strictly larger, so ties
go to the lowest index, like jaxinfer.sampling.first_argmax), and with draft
distributions also the online softmax statistics (running max m and sum Z
rescaled by exp(m_old - m_new), as in FlashAttention-2, Dao 2023, Algorithm 1)
and s(d). The Gumbel noise is computed in the kernel from the keys
(threefry2x32 of (0, vocab index), then jax.random's uniform and Gumbel
transforms, op for op, as jaxinfer.sampling._gumbel_at): no [S, K1, V] noise
array is written or read. The accept test and a = the first failing row are
reductions over the K1p rows. Only with draft distributions, and only when a
sampled row was rejected, a second walk reads that one row's logits and q
once more for the residual draw: the residual needs Z, which is known only
after the first walk. So the kernel reads K1 logit rows per sequence (plus
one logit row and one q row after a sampled rejection) and writes K1 + 1
integers; q(d_j) is gathered by the wrapper ([S, k] values).

GPU exactness. The engine draws t_j with XLA ops; for the kernel to give the
same tokens on a GPU every float op on the way to g + s must round the same
way. The integer hash is exact; uniform * (1 - tiny) + tiny is exact whether
or not it is fused into an FMA (1 - tiny rounds to 1); Triton's f32 division
(arith.divf) is the approximate div.full.f32 while XLA divides with IEEE
div.rn.f32, so the kernel divides with inline PTX div.rn.f32 when compiled
for a GPU (x / t in interpret mode, which runs as XLA ops). The one op left
to chance is log: Triton calls libdevice's __nv_logf, and XLA:GPU is
believed to as well. Not yet run on a GPU: test_compiled_kernel_matches_xla_on_gpu
and `jaxinfer bench kernels` (integer_mismatches_vs_reference) check it there.

Limit: parallelism is S programs, and a sampled sequence hashes one Gumbel
value per logit (~120 integer ops each; greedy sequences skip the hash).
Batch 1 with k = 3 and a 49k vocab is ~200k hashes on one SM, by estimate
~0.2 ms on an H100, where XLA's sampler spreads the same work over the whole
GPU; splitting the vocab over programs with a final (max, first argmax,
logsumexp) merge is the remedy, not done here (unmeasured: no GPU was lent).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import is_pow2, next_pow2
from pallas_kernels._compat import triton_compiler_params

_TINY = float(np.finfo(np.float32).tiny)
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the accept kernel (None: chosen per call).

  block_v: vocab columns per iteration (a power of two); the tile is
    [next_pow2(k + 1), block_v]. None: 4096 elements per tile (1024 columns
    for k <= 3), at least 128 columns. Untuned: no GPU was lent when it was
    written.
  num_warps, num_stages: Triton launch parameters, ignored in interpret mode.
  """
  block_v: int | None = None
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    if self.block_v is not None and not is_pow2(self.block_v):
      raise ValueError(f"BlockSizes.block_v={self.block_v} must be a power of two")
    if self.num_warps < 1 or self.num_stages < 1:
      raise ValueError(f"{self.num_warps=} and {self.num_stages=} must be >= 1")

  def resolve(self, K1: int) -> int:
    return self.block_v or max(128, 4096 // next_pow2(K1))


def _rotl(x, d: int):
  return lax.shift_left(x, jnp.uint32(d)) | lax.shift_right_logical(x, jnp.uint32(32 - d))


def _threefry2x32(k0, k1, x0, x1):
  """jax's threefry2x32 hash (jax/_src/random/threefry2x32.py, unrolled), on uint32 arrays."""
  ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(0x1BD11BDA))
  x0, x1 = x0 + ks[0], x1 + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = x0 ^ _rotl(x1, r)
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
  return x0, x1


def gumbel_noise(k0, k1, idx):
  """jax.random.gumbel(key, (V,), float32)[idx] for the key with data (k0, k1); any broadcastable
  uint32 k0, k1 and int32 idx (partitionable threefry: bits i = xor of threefry((k0, k1), (0, i)))."""
  b0, b1 = _threefry2x32(k0, k1, jnp.zeros_like(idx, jnp.uint32), idx.astype(jnp.uint32))
  bits = b0 ^ b1
  one, tiny = jnp.float32(1), jnp.float32(_TINY)
  floats = lax.bitcast_convert_type(lax.shift_right_logical(bits, jnp.uint32(9)) | jnp.uint32(0x3F800000),
                                    jnp.float32) - one
  u = lax.max(tiny, floats * (one - tiny) + tiny)
  return -jnp.log(-jnp.log(u))


def _ieee_div(x, y):
  """x / y rounded to nearest (PTX div.rn.f32, as XLA divides): Triton's own f32 division is
  the approximate div.full.f32."""
  x, y = jnp.broadcast_arrays(x, y)
  return plgpu.elementwise_inline_asm(
      "div.rn.f32 $0, $1, $2;", args=[x, y], constraints="=f,f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])[0]


def _first_argmax_update(best, arg, val, col):
  """Running first-argmax over vocab blocks: best, arg [R]; val [R, C], col [C] (block columns)."""
  big = jnp.int32(np.iinfo(np.int32).max)
  bm = jnp.max(val, axis=1)
  bi = jnp.min(jnp.where(val == bm[:, None], col[None, :], big), axis=1)
  win = bm > best  # strictly: an equal value in a later block keeps the earlier index
  return jnp.where(win, bm, best), jnp.where(win, bi, arg)


def _pick(vec, row, fill):
  """vec[row] of a [R] vector at a traced row, as a reduction (no dynamic register indexing)."""
  hit = lax.iota(jnp.int32, vec.shape[0]) == row
  if jnp.issubdtype(vec.dtype, jnp.floating):
    return jnp.max(jnp.where(hit, vec, -jnp.inf))
  return jnp.sum(jnp.where(hit, vec, jnp.zeros_like(vec)))


def _accept_kernel(nd_ref, draft_ref, temp_ref, thr_ref, k0_ref, k1_ref, u_ref, qd_ref, logits_ref,
                   q_ref, num_ref, ids_ref, *, K1: int, block_v: int, full_q: bool, ieee_div):
  """One sequence: stats over its K1 rows, the accept test, the correction / bonus token.

  nd_ref [S]; draft_ref, temp_ref, thr_ref, k0_ref, k1_ref, u_ref, qd_ref [S, K1p] (row k
  and rows past it: no draft); logits_ref [S, K1, V]; q_ref [S, k, V] (full_q) or None.
  """
  V = logits_ref.shape[2]
  K1p = draft_ref.shape[1]
  s = pl.program_id(0)
  row = lax.iota(jnp.int32, K1p)
  row_ok = row < K1
  per_row = lambda ref: ref[s, :]  # [K1p]
  nd = nd_ref[s]
  d = per_row(draft_ref)
  temp = per_row(temp_ref)
  greedy = temp <= 0
  t = jnp.where(greedy, 1.0, temp).astype(jnp.float32)  # x / 1 is x: greedy rows keep their logits
  thr = jnp.where(greedy, -jnp.inf, per_row(thr_ref))
  k0, k1 = per_row(k0_ref), per_row(k1_ref)
  any_sampled = jnp.max(jnp.where(~greedy & row_ok, 1, 0)) > 0  # (Triton lowers no reduce_or)
  neg_inf = jnp.float32(-jnp.inf)

  def scaled(x, col_ok, t, thr):
    """Scaled, truncated logits; -inf past the vocab."""
    s_ = ieee_div(x.astype(jnp.float32), t)
    return jnp.where(col_ok & (s_ >= thr), s_, neg_inf)

  def block(b, carry):
    best, arg, m, z, s_d = carry
    col = b * block_v + lax.iota(jnp.int32, block_v)  # [C]
    col_ok = col < V
    x = plgpu.load(logits_ref.at[s, pl.ds(0, K1p), pl.ds(b * block_v, block_v)],
                   mask=row_ok[:, None] & col_ok[None, :], other=0.0)  # [K1p, C]
    sc = scaled(x, col_ok[None, :], t[:, None], thr[:, None])
    # Greedy sequences skip the hash (~120 integer ops per logit): they are memory-bound.
    noise = lax.cond(any_sampled, lambda c: gumbel_noise(k0[:, None], k1[:, None], c[None, :]),
                     lambda c: jnp.zeros((K1p, block_v), jnp.float32), col)
    val = jnp.where(greedy[:, None], sc, noise + sc)  # -inf + noise = -inf
    best, arg = _first_argmax_update(best, arg, val, col)
    if full_q:
      m_new = jnp.maximum(m, jnp.max(sc, axis=1))
      m_safe = jnp.where(m_new == neg_inf, 0.0, m_new)  # a row with nothing kept yet: no NaN
      z = z * jnp.exp(m - m_safe) + jnp.sum(jnp.exp(sc - m_safe[:, None]), axis=1)
      m = m_new
      s_d = jnp.maximum(s_d, jnp.max(jnp.where(col[None, :] == d[:, None], sc, neg_inf), axis=1))
    return best, arg, m, z, s_d

  ninf = jnp.full((K1p,), neg_inf)
  init = (ninf, jnp.zeros((K1p,), jnp.int32), ninf, jnp.zeros((K1p,), jnp.float32), ninf)
  _, arg, m, z, s_d = lax.fori_loop(0, pl.cdiv(V, block_v), block, init)

  if full_q:
    u, qd = per_row(u_ref), per_row(qd_ref)
    ok = jnp.where(greedy, d == arg, u * qd * z < jnp.exp(s_d - m))
  else:
    ok = d == arg
  ok &= row < nd
  a = jnp.min(jnp.where(ok, K1p, row))  # the first row whose draft is not accepted (<= nd)
  tok = _pick(arg, a, 0)
  if full_q:
    need = (a < nd) & (_pick(temp, a, 0.0) > 0)  # a sampled row rejected its draft
    t_a, thr_a, m_a, z_a = _pick(t, a, 0.0), _pick(thr, a, 0.0), _pick(m, a, 0.0), _pick(z, a, 0.0)
    k0_a, k1_a = _pick(k0, a, 0), _pick(k1, a, 0)
    a_q = jnp.minimum(a, K1 - 2)  # q has k rows; a < nd <= k whenever the walk runs

    def residual(b, carry):
      best, arg = carry
      col = b * block_v + lax.iota(jnp.int32, block_v)
      col_ok = col < V
      x = plgpu.load(logits_ref.at[s, a, pl.ds(b * block_v, block_v)], mask=col_ok, other=0.0)
      q = plgpu.load(q_ref.at[s, a_q, pl.ds(b * block_v, block_v)], mask=col_ok, other=0.0)
      r = jnp.exp(scaled(x, col_ok, t_a, thr_a) - m_a) - q.astype(jnp.float32) * z_a
      val = jnp.where(r > 0, jnp.log(jnp.where(r > 0, r, 1.0)) + gumbel_noise(k0_a, k1_a, col), neg_inf)
      return _first_argmax_update(best, arg, val[None, :], col)

    steps = need.astype(jnp.int32) * jnp.int32(pl.cdiv(V, block_v))  # 0: no walk
    r_best, r_arg = lax.fori_loop(0, steps, residual, (jnp.full((1,), neg_inf), jnp.zeros((1,), jnp.int32)))
    tok = jnp.where(need & (r_best[0] > neg_inf), r_arg[0], tok)
  out = jnp.where(row < a, d, jnp.where(row == a, tok, arg))
  plgpu.store(ids_ref.at[s, pl.ds(0, K1p)], out, mask=row_ok)
  num_ref[s] = a


def _check_inputs(logits, draft_ids, num_drafts, temperature, key_data, threshold, draft_probs, uniforms):
  if logits.ndim != 3:
    raise ValueError(f"logits must be [S, k + 1, V], got {logits.shape=}")
  S, K1, V = logits.shape
  k = K1 - 1
  if not jnp.issubdtype(logits.dtype, jnp.floating):
    raise ValueError(f"logits.dtype={logits.dtype} must be floating")
  want = {"draft_ids": (draft_ids, (S, k), jnp.int32), "num_drafts": (num_drafts, (S,), jnp.int32),
          "temperature": (temperature, (S, K1), jnp.float32), "keys": (key_data, (S, K1, 2), jnp.uint32)}
  if threshold is not None:
    want["threshold"] = (threshold, (S, K1), jnp.float32)
  if (draft_probs is None) != (uniforms is None):
    raise ValueError("draft_probs and uniforms come together (full draft distributions) or not at all")
  if draft_probs is not None:
    want["uniforms"] = (uniforms, (S, k), jnp.float32)
    if draft_probs.shape != (S, k, V) or not jnp.issubdtype(draft_probs.dtype, jnp.floating):
      raise ValueError(f"draft_probs must be float [S, k, V]=[{S}, {k}, {V}], got "
                       f"{draft_probs.shape=} {draft_probs.dtype=}")
    if k == 0:
      raise ValueError("draft_probs needs k >= 1 drafts (logits has a single row)")
  for name, (x, shape, dtype) in want.items():
    if x.shape != shape or x.dtype != dtype:
      raise ValueError(f"{name} must be {jnp.dtype(dtype).name} {list(shape)}, got {x.shape=} {x.dtype=}")


def _key_data(keys: jax.Array) -> jax.Array:
  """uint32 [..., 2] threefry2x32 key data from typed keys (or the data itself)."""
  if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
    impl = str(jax.random.key_impl(keys))
    if "threefry2x32" not in impl:
      raise ValueError(f"keys must be threefry2x32 keys, got {impl}")
    return jax.random.key_data(keys)
  return keys


def _check_random_config() -> None:
  """The kernel hashes (key, i) for noise value i, and uses jax.random's low-range Gumbel: what
  jax.random.gumbel does under these flags (jax's defaults)."""
  # A flag a later jax drops keeps its default behaviour for good.
  flag = lambda name, default: getattr(jax.config, name, default)
  if not flag("jax_threefry_partitionable", True) or flag("jax_high_dynamic_range_gumbel", False):
    raise ValueError("spec_accept draws jax.random.gumbel's noise only with jax_threefry_partitionable=True "
                     "and jax_high_dynamic_range_gumbel=False (jax's defaults)")


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def spec_accept(logits: jax.Array, draft_ids: jax.Array, num_drafts: jax.Array, temperature: jax.Array,
                keys: jax.Array, *, threshold: jax.Array | None = None,
                draft_probs: jax.Array | None = None, uniforms: jax.Array | None = None,
                block_sizes: BlockSizes | None = None,
                interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """(num_accepted [S], token_ids [S, k + 1]) of a verify batch (Pallas Triton kernel).

  See the module docstring for shapes and semantics. Raises ValueError
  naming the offending argument for inconsistent shapes or dtypes.
  """
  key_data = _key_data(jnp.asarray(keys))
  _check_inputs(logits, draft_ids, num_drafts, temperature, key_data, threshold, draft_probs, uniforms)
  _check_random_config()
  S, K1, V = logits.shape
  K1p = next_pow2(K1)
  bs = block_sizes or BlockSizes()
  block_v = bs.resolve(K1)
  full_q = draft_probs is not None

  def rows(x, fill):  # [S, n] -> [S, K1p]
    return jnp.pad(x, ((0, 0), (0, K1p - x.shape[1])), constant_values=fill)

  drafts = rows(draft_ids, -1)
  if full_q:
    qd = jnp.take_along_axis(draft_probs, jnp.clip(draft_ids, 0, V - 1)[..., None], axis=-1)[..., 0]
    qd, u = rows(qd.astype(jnp.float32), 1.0), rows(uniforms, 1.0)
  else:  # unused: scalars keep the kernel's signature
    qd = u = jnp.zeros((S, K1p), jnp.float32)
    draft_probs = jnp.zeros((1, 1, 1), jnp.float32)
  thr = jnp.full((S, K1), -jnp.inf, jnp.float32) if threshold is None else threshold
  kernel = functools.partial(_accept_kernel, K1=K1, block_v=block_v, full_q=full_q,
                             ieee_div=(lambda x, y: x / y) if interpret else _ieee_div)
  num, ids = pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((S,), jnp.int32), jax.ShapeDtypeStruct((S, K1), jnp.int32)),
      grid=(S,),
      compiler_params=triton_compiler_params(bs.num_warps, bs.num_stages),
      interpret=interpret,
      name=f"spec_accept_{block_v=}_{full_q=}",
  )(num_drafts, drafts, rows(temperature, 0.0), rows(thr, -jnp.inf), rows(key_data[..., 0], 0),
    rows(key_data[..., 1], 0), u, qd, logits, draft_probs)
  return num, ids


@jax.jit
def spec_accept_reference(logits: jax.Array, draft_ids: jax.Array, num_drafts: jax.Array,
                          temperature: jax.Array, keys: jax.Array, *, threshold: jax.Array | None = None,
                          draft_probs: jax.Array | None = None,
                          uniforms: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Plain-jnp reference: whole rows, jax.random.gumbel noise, jnp.argmax, cumprod acceptance.

  Shares no structure with the kernel (no blocking, no online softmax, no
  in-kernel hash), so equal integer outputs check the kernel's blocking,
  tail masking and noise. Same signature and semantics as `spec_accept`.
  """
  key_data = _key_data(jnp.asarray(keys))
  _check_inputs(logits, draft_ids, num_drafts, temperature, key_data, threshold, draft_probs, uniforms)
  _check_random_config()
  _, K1, V = logits.shape
  k = K1 - 1
  greedy = temperature <= 0  # [S, K1]
  t = jnp.where(greedy, 1.0, temperature)[..., None]
  s = logits.astype(jnp.float32) / t  # [S, K1, V]
  if threshold is not None:
    s = jnp.where(greedy[..., None] | (s >= threshold[..., None]), s, -jnp.inf)
  keys = jax.random.wrap_key_data(key_data, impl="threefry2x32")
  g = jax.vmap(jax.vmap(lambda key: jax.random.gumbel(key, (V,), jnp.float32)))(keys)  # [S, K1, V]
  own = jnp.argmax(jnp.where(greedy[..., None], s, g + s), axis=-1).astype(jnp.int32)  # t_j [S, K1]
  j = jnp.arange(K1)
  if draft_probs is None:
    ok = draft_ids == own[:, :k]
  else:
    m = jnp.max(s, axis=-1)  # [S, K1]
    z = jnp.sum(jnp.exp(s - m[..., None]), axis=-1)
    s_d = jnp.take_along_axis(s[:, :k], draft_ids[..., None], axis=-1)[..., 0]  # [S, k]
    q_d = jnp.take_along_axis(draft_probs, draft_ids[..., None], axis=-1)[..., 0].astype(jnp.float32)
    ok = jnp.where(greedy[:, :k], draft_ids == own[:, :k],
                   uniforms * q_d * z[:, :k] < jnp.exp(s_d - m[:, :k]))
  ok &= j[:k] < num_drafts[:, None]
  a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)  # [S]
  take = lambda x: jnp.take_along_axis(x, a[:, None], axis=1)[:, 0]
  tok = take(own)
  if draft_probs is not None:
    row = lambda x: jnp.take_along_axis(x, a[:, None, None], axis=1)[:, 0]  # [S, V] at row a
    q_a = row(jnp.pad(draft_probs.astype(jnp.float32), ((0, 0), (0, 1), (0, 0))))
    r = jnp.exp(row(s) - take(m)[:, None]) - q_a * take(z)[:, None]
    val = jnp.where(r > 0, jnp.log(jnp.where(r > 0, r, 1.0)) + row(g), -jnp.inf)
    residual = jnp.argmax(val, axis=-1).astype(jnp.int32)
    need = (a < num_drafts) & ~take(greedy) & jnp.any(r > 0, axis=-1)
    tok = jnp.where(need, residual, tok)
  d = jnp.pad(draft_ids, ((0, 0), (0, 1)))
  ids = jnp.where(j < a[:, None], d, jnp.where(j == a[:, None], tok[:, None], own))
  return a, ids.astype(jnp.int32)
