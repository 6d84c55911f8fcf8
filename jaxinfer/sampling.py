"""Per-request sampling controls and the on-device sampler.

`SamplingParams` is what a request asks for; `sample` turns a batch of
logits into token ids on device, each row with its own penalties,
temperature, top-k, top-p, min-p and seed. A row's random stream is
`fold_in(key(seed), position)`: it depends on the request's seed and the
token's position only, never on what else is in the batch, so seeded runs
reproduce. Only token ids and (top-n) logprobs leave the device.

The sampler pays for what a batch asks: greedy rows need one argmax, the
truncations a lax.top_k pre-selection, and only rows whose truncation
reaches past the candidates sort their row. Its draws are exactly those of
sorting every row and calling jax.random.categorical on the masked logits
(the reference in tests/test_sampling.py).

Legend: B batch rows, V vocab, N top logprobs, W candidates (top-k / top-p / min-p),
L a prefix of the sorted row.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

from jaxinfer.errors import InvalidRequestError
from jaxinfer.structured import StructuredOutput

MAX_LOGPROBS = 20  # top-n logprobs are computed at this fixed width on device
# top-k / top-p / min-p look for their threshold among this many best tokens
# (lax.top_k) before sorting the row; see `sample`. lax.top_k over [64, 49152]
# costs ~8 / 11 / 18 / 41 ms at 128 / 256 / 512 / 1024 on a 2-core CPU, and a
# row that falls back ~4 ms; SmolLM2's top-p 0.9 nucleus exceeds 256 tokens
# in ~3% of rows at temperature 0.8, ~8% at 1.0 (sampling-2026-11-22.json, by
# scripts/bench_sampling.py, a one-off: `git show 4d584e8:scripts/bench_sampling.py`).
CANDIDATES = 256


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to pick each new token of one request.

  temperature 0 is greedy. top_k 0 keeps every token; top_p 1.0 and
  min_p 0.0 are off. `seed` makes a sampled request reproducible.
  Penalties (as in vLLM / the OpenAI API): `repetition_penalty` > 1 divides
  positive (multiplies negative) logits of every token already in the prompt
  or output; `presence_penalty` is subtracted once from tokens present in the
  output, `frequency_penalty` once per occurrence there.
  Generation ends at max_tokens, an EOS token (unless ignore_eos), one of
  `stop_token_ids`, or when the text contains one of `stop` (which is cut off).
  `logprobs=n` returns the n most likely tokens at each step besides the
  sampled one; `prompt_logprobs=n` does the same for every prompt token
  (such a request skips the prefix cache: its prompt must be computed).
  Logprobs are those of the model's own distribution, before penalties,
  temperature, truncation and the grammar mask. `structured` constrains the
  output to a JSON schema, a regex or a list of choices (jaxinfer.structured);
  the request ends with 'stop' once its grammar is complete.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  seed: int | None = None
  max_tokens: int = 256
  stop: tuple[str, ...] = ()
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False
  repetition_penalty: float = 1.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logprobs: int | None = None
  prompt_logprobs: int | None = None
  structured: StructuredOutput | None = None

  def __post_init__(self):
    # Lists are accepted for convenience and stored as tuples (hashable, frozen).
    if isinstance(self.stop, str):
      object.__setattr__(self, "stop", (self.stop,))
    object.__setattr__(self, "stop", tuple(self.stop))
    object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
    self._check("temperature", self.temperature, lambda v: v >= 0, ">= 0")
    self._check("top_k", self.top_k, lambda v: v >= 0, ">= 0 (0 disables it)", integer=True)
    self._check("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
    self._check("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
    self._check("max_tokens", self.max_tokens, lambda v: v >= 1, ">= 1", integer=True)
    self._check("repetition_penalty", self.repetition_penalty, lambda v: v > 0, "> 0")
    self._check("presence_penalty", self.presence_penalty, lambda v: -2 <= v <= 2, "in [-2, 2]")
    self._check("frequency_penalty", self.frequency_penalty, lambda v: -2 <= v <= 2, "in [-2, 2]")
    for name in ("logprobs", "prompt_logprobs"):
      if getattr(self, name) is not None:
        self._check(name, getattr(self, name), lambda v: 0 <= v <= MAX_LOGPROBS,
                    f"in [0, {MAX_LOGPROBS}] or None", integer=True)
    if self.seed is not None:
      self._check("seed", self.seed, lambda v: 0 <= v < 2**32, "in [0, 2**32)", integer=True)
    for s in self.stop:
      if not isinstance(s, str) or not s:
        raise InvalidRequestError(f"stop must hold non-empty strings, got {s!r}")
    for t in self.stop_token_ids:
      if not isinstance(t, int) or isinstance(t, bool) or t < 0:
        raise InvalidRequestError(f"stop_token_ids must hold non-negative ints, got {t!r}")
    if self.structured is not None and not isinstance(self.structured, StructuredOutput):
      raise InvalidRequestError(
          f"structured must be a StructuredOutput, got {type(self.structured).__name__}")

  @property
  def uses_penalties(self) -> bool:
    return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0)

  @staticmethod
  def _check(name, value, ok, want, integer=False):
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (
        not integer and not math.isfinite(value)) or not ok(value):
      raise InvalidRequestError(f"{name} must be {'an int ' if integer else ''}{want}, got {value!r}")


class SamplingBatch(NamedTuple):
  """Per-row sampling controls of one step, [B] each (padding rows are greedy)."""

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  min_p: jax.Array
  repetition_penalty: jax.Array
  presence_penalty: jax.Array
  frequency_penalty: jax.Array
  seed: jax.Array  # uint32
  position: jax.Array  # int32: the position of the token being sampled
  want_logprobs: jax.Array  # bool: compute the top-n logprobs for this row

  def penalized(self) -> jax.Array:
    """[B] bool: the row has a repetition, presence or frequency penalty."""
    return (self.repetition_penalty != 1) | (self.presence_penalty != 0) | (self.frequency_penalty != 0)

  def truncated(self, vocab_size: int) -> jax.Array:
    """[B] bool: the row samples from a truncated distribution (top-k below the vocab,
    top-p or min-p)."""
    top_k = jnp.where(self.top_k < vocab_size, self.top_k, 0)  # keeping >= V tokens is keeping all
    return (self.temperature > 0) & ((top_k > 0) | (self.top_p < 1) | (self.min_p > 0))

  @classmethod
  def from_params(cls, params: "Sequence[SamplingParams | None]", seeds: Sequence[int],
                  positions: Sequence[int]) -> "SamplingBatch":
    """Host (numpy) rows from each row's SamplingParams; a None row (padding) is
    greedy, unpenalized and wants no logprobs."""
    B = len(params)
    sp = cls(np.zeros(B, np.float32), np.zeros(B, np.int32), np.ones(B, np.float32),
             np.zeros(B, np.float32), np.ones(B, np.float32), np.zeros(B, np.float32),
             np.zeros(B, np.float32), np.asarray(seeds, np.uint32), np.asarray(positions, np.int32),
             np.zeros(B, bool))
    for i, p in enumerate(params):
      if p is not None:
        sp.set_row(i, p)
    return sp

  def set_row(self, i: int, p: "SamplingParams") -> None:
    """Writes row i of host (numpy) rows from p (its seed and position are the caller's)."""
    self.temperature[i], self.top_k[i], self.top_p[i], self.min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
    self.repetition_penalty[i] = p.repetition_penalty
    self.presence_penalty[i], self.frequency_penalty[i] = p.presence_penalty, p.frequency_penalty
    self.want_logprobs[i] = bool(p.logprobs)


class SamplerMode(NamedTuple):
  """Which kinds of sampling work a batch needs, read off its rows on the host.

  The sampler's program is specialised on it (a static argument): a flag that
  is off leaves its work out, one that is on does it for every row, branch-free,
  leaving rows without that need bit-exact (x / 1, x - 0 * n, an all-ones mask,
  a greedy row's argmax). The device never branches on the batch: on XLA:GPU a
  conditional copies its predicate to the host and waits for it, which stops
  the host from launching the next step while this one runs.
  """

  draw: bool = False  # some row samples from its whole (untruncated) distribution
  truncate: bool = False  # some row samples under top-k / top-p / min-p
  process: bool = False  # some row has a penalty or an allowed-token mask
  logprobs: bool = False  # some row wants its top-n logprobs
  # False (XLA:CPU): loops over rows where that is cheaper there and costs no host round
  # trip: truncated rows whose threshold lies beyond their candidates sort one at a time
  # (a sort costs ~5 ms a row), whole-row draws go a few rows at a time (their noise stays
  # in cache). True (GPU, where a loop with a data-dependent trip count makes the host
  # wait): every row at once, every truncated row sorted.
  rows_at_once: bool = False

  @classmethod
  def of(cls, sp: SamplingBatch, vocab_size: int, masked: bool = False, rows_at_once: bool = False
         ) -> "SamplerMode":
    """The mode of host (numpy) rows sp; `masked`: some row has an allowed-token mask."""
    sampling = np.asarray(sp.temperature) > 0
    top_k = np.asarray(sp.top_k)
    truncated = sampling & (((top_k > 0) & (top_k < vocab_size)) | (np.asarray(sp.top_p) < 1)
                            | (np.asarray(sp.min_p) > 0))
    penalized = ((np.asarray(sp.repetition_penalty) != 1) | (np.asarray(sp.presence_penalty) != 0)
                 | (np.asarray(sp.frequency_penalty) != 0))
    return cls(draw=bool(np.any(sampling & ~truncated)), truncate=bool(np.any(truncated)),
               process=bool(masked or np.any(penalized)), logprobs=bool(np.any(sp.want_logprobs)),
               rows_at_once=rows_at_once and bool(np.any(sampling)))

  def covers(self, other: "SamplerMode") -> bool:
    """Whether this mode does all the work `other` does (and so draws the same tokens)."""
    return (all(a or not b for a, b in zip(self[:4], other[:4]))
            and (self.rows_at_once == other.rows_at_once or not (other.draw or other.truncate)))


# Every kind of work on: right for any batch (what `sample` does when given no mode).
ALL_WORK = SamplerMode(draw=True, truncate=True, process=True, logprobs=True)
# The modes a runner compiles at warm-up (with rows_at_once set for its backend); a batch runs
# the first that covers it. Fewer modes than flag sets: each costs a compile per row bucket
# (the truncating ones ~2-3 s on a 2-core CPU), and work a batch does not need changes none
# of its tokens.
WARM_MODES = (SamplerMode(), SamplerMode(process=True, logprobs=True),
              SamplerMode(draw=True, process=True, logprobs=True), ALL_WORK)


def apply_penalties(logits: jax.Array, sp: SamplingBatch, output_counts: jax.Array,
                    prompt_mask: jax.Array) -> jax.Array:
  """logits [B, V] with the rows' penalties applied.

  output_counts [B, V] int32 counts each token in the request's output so
  far; prompt_mask [B, V] bool marks tokens of its prompt.
  """
  seen = (output_counts > 0) | prompt_mask
  r = sp.repetition_penalty[:, None]
  logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
  logits = logits - sp.frequency_penalty[:, None] * output_counts
  return logits - sp.presence_penalty[:, None] * (output_counts > 0)


def sample(logits: jax.Array, sp: SamplingBatch, counts_table: jax.Array, prompt_table: jax.Array,
           rows: jax.Array, allowed: jax.Array | None = None, *, candidates: int = CANDIDATES,
           mode: SamplerMode = ALL_WORK) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Picks one token per row of logits [B, V].

  Row b's history (for penalties) is row rows[b] of counts_table [R, V] and
  prompt_table [R, V]; it is gathered only when mode.process. allowed [B, W]
  int32 (W = ceil(V / 32), bit i % 32 of word i // 32 allows token i;
  structured output) restricts each row's choice; all-ones rows are untouched.

  Returns (ids [B] int32, their logprobs [B], top-n ids [B, N], top-n
  logprobs [B, N]). Logprobs are of the unmodified distribution; the top n
  are zeros unless mode.logprobs.

  `mode` (static) says which kinds of work the batch needs (SamplerMode.of
  reads it off the host rows; the default does all of them, right for any
  batch): a greedy batch costs an argmax and a logsumexp; top-k / top-p /
  min-p read their threshold off the `candidates` best tokens (lax.top_k) and
  draw among those, sorting the whole row only for rows whose threshold lies
  beyond them (or every truncated row, mode.rows_at_once); rows that sample from
  the whole vocabulary draw V Gumbel values. Ids are those of the
  straightforward full-sort sampler (tests/test_sampling.py keeps one as the
  reference), whatever the mode, as long as it covers the batch.
  """
  logits = logits.astype(jnp.float32)
  scores = logits
  if mode.process:
    # Both at once: each leaves a row without it bit-exact (x / 1, x - 0 * n, an all-ones mask).
    scores = apply_penalties(scores, sp, counts_table[rows], prompt_table[rows])
    if allowed is not None:
      scores = apply_token_bitmask(scores, allowed)
  ids = first_argmax(scores)
  if mode.draw or mode.truncate:
    ids = _draw(scores, sp, ids, candidates, mode)
  return (ids, *chosen_logprobs(logits, ids, mode.logprobs))


def chosen_logprobs(logits: jax.Array, ids: jax.Array, top_n: bool
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(logprob of ids [B], top-n ids [B, N], top-n logprobs [B, N]) under the raw logits [B, V]
  (float32); the top n only when top_n (static), else zeros."""
  # log_softmax = (x - top) - log_z; only the picked entries are ever formed.
  top = jnp.max(logits, axis=-1, keepdims=True)  # [B, 1]
  log_z = jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1, keepdims=True))  # [B, 1]
  lp = (jnp.take_along_axis(logits, ids[:, None], axis=-1) - top) - log_z
  top_lp, top_ids = top_logprobs(logits, top, log_z, top_n)
  return lp[:, 0], top_ids, top_lp


def apply_token_bitmask(logits: jax.Array, allowed: jax.Array) -> jax.Array:
  """logits [B, V] with the tokens that allowed [B, W] int32 does not allow at -inf.

  Unpacked in-register (a [B, W, 32] shift feeding one select, fused by XLA),
  not gathered per token: it reads the [B, V] logits once.
  """
  B, V = logits.shape
  W = allowed.shape[1]
  bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
  ok = bits.reshape(B, W * 32)[:, :V] != 0
  return jnp.where(ok, logits, -jnp.inf)


def _draw(scores: jax.Array, sp: SamplingBatch, greedy: jax.Array, candidates: int,
          mode: SamplerMode) -> jax.Array:
  """Token ids [B] of a batch where some row samples: greedy rows keep `greedy`.

  A sampled row draws jax.random.categorical(fold_in(key(seed), position),
  its scaled logits scores / temperature with everything below its
  truncation threshold at -inf).
  """
  B, V = scores.shape
  sampling = sp.temperature > 0
  t = jnp.where(sampling, sp.temperature, 1.0)[:, None]  # [B, 1]
  top_k = jnp.where(sp.top_k < V, sp.top_k, 0)  # keeping >= V tokens is keeping all
  truncated = sp.truncated(V)
  whole_row = sampling & ~truncated
  keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(sp.seed, sp.position)
  ids = greedy
  if mode.truncate:
    ids = jnp.where(truncated, _draw_truncated(scores, t, top_k, sp, keys, greedy, truncated, candidates,
                                               mode.rows_at_once), ids)
  if mode.draw:
    ids = jnp.where(whole_row, _draw_rows(scores, t, keys, mode.rows_at_once), ids)
  return ids


def _draw_rows(scores: jax.Array, t: jax.Array, keys: jax.Array, at_once: bool) -> jax.Array:
  """jax.random.categorical(keys[b], scores[b] / t[b]) for every row b of scores [B, V]."""
  B, V = scores.shape

  def draw(args):
    scores, t, keys = args  # [G, V], [G, 1], [G]
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)  # [G, V]
    return first_argmax(noise + scores / t)  # = jax.random.categorical(key, scaled), row by row

  if at_once:
    return draw((scores, t, keys))
  # G rows at a time (a loop of known trip count), so the noise and its temporaries stay in
  # cache (and under malloc's mmap threshold, so no fresh pages per call): 3x faster than all
  # B rows at once on [64, 49152] on a 2-core CPU.
  G = next(g for g in (4, 2, 1) if B % g == 0)
  groups = lambda a: a.reshape(B // G, G, *a.shape[1:])
  return jax.lax.map(draw, (groups(scores), groups(t), groups(keys))).reshape(B)


def _draw_truncated(scores, t, top_k, sp, keys, greedy, truncated, candidates, at_once):
  """The draws [B] of the truncated rows (other rows: whatever; the caller keeps theirs)."""
  B, V = scores.shape

  def exact(b_scores, b_t, b_top_k, b_top_p, b_min_p, b_z, b_key):  # one row, by a full sort
    scaled = b_scores / b_t
    thr = truncation_threshold(sort_descending(scaled)[None], b_top_k[None], b_top_p[None],
                               b_min_p[None], b_z[None])
    return jax.random.categorical(b_key, jnp.where(scaled >= thr, scaled, -jnp.inf)).astype(jnp.int32)

  if at_once:
    # Every row sorts (no loop: a GPU sorts [B, V] in well under a step).
    scaled = scores / t
    z = jnp.sum(jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), axis=-1)
    return jax.vmap(exact)(scores, t[:, 0], top_k, sp.top_p, sp.min_p, z, keys)

  cand, idx, z, thr, decided = candidate_thresholds(scores, t, top_k, sp.top_p, sp.min_p, candidates)
  if _bits_are_per_index():
    # All tokens a decided row can draw are candidates, and the Gumbel noise
    # of token i depends on (key, i) only: the argmax over the candidates is
    # the argmax over the row, for W noise values instead of V.
    picked = jnp.where(cand >= thr[:, None], cand, -jnp.inf) + _gumbel_at(keys, idx)  # [B, W]
    best = jnp.max(picked, axis=-1, keepdims=True)
    # Ties go to the lowest token id, as in argmax over the row.
    ids = jnp.where(decided, jnp.min(jnp.where(picked == best, idx, V), axis=-1), greedy)
  else:
    decided, ids = jnp.zeros_like(decided), greedy

  # A row whose threshold lies beyond its candidates sorts its whole row and
  # draws over it, one row at a time (~5 ms per 49152-token row on CPU): the
  # cost follows the number of such rows, and a row's draw never depends on
  # its neighbours. (A loop with a data-dependent trip count: the CPU's way only.)
  undecided = truncated & ~decided
  order = jnp.argsort(~undecided)  # [B], undecided rows first

  def one(i, ids):
    b = order[i]
    return ids.at[b].set(exact(scores[b], t[b, 0], top_k[b], sp.top_p[b], sp.min_p[b], z[b], keys[b]))

  return jax.lax.fori_loop(0, jnp.sum(undecided), one, ids)


def candidate_thresholds(scores: jax.Array, t: jax.Array, top_k: jax.Array, top_p: jax.Array,
                         min_p: jax.Array, width: int) -> tuple[jax.Array, ...]:
  """Truncation thresholds read off the W = min(width, V) best of each row's
  scaled logits scores [B, V] / t [B, 1].

  Returns (cand [B, W] descending, their ids [B, W], z [B], thr [B], decided
  [B]); thr is exact where decided, i.e. where every token at or above it is
  a candidate: it beats the last candidate, and top-p's normalizer is known
  (a top-k wider than W hides it).
  """
  V = scores.shape[-1]
  W = min(width, V)
  # Dividing by t > 0 keeps the order (ties aside), so top_k runs on scores,
  # which need no [B, V] copy. The barriers keep XLA:CPU's TopK kernel: once
  # its users look through to the sort it is lowered to, it compiles as a
  # full sort (50x slower). One barrier per output, not one over the pair:
  # after SPMD partitioning (any mesh) a pair barrier becomes the TopK's
  # direct user, which XLA:CPU's TopkDecomposer aborts on.
  best, idx = jax.lax.top_k(scores, W)  # [B, W]
  best, idx = jax.lax.optimization_barrier(best), jax.lax.optimization_barrier(idx)
  cand = best / t  # the scaled logits of the candidates, bit for bit
  # top-p's mass when top-k is off is the whole row's (top-k on: the top-k's).
  scaled = scores / t
  z = jnp.sum(jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), axis=-1)
  thr = truncation_threshold(cand, top_k, top_p, min_p, z)
  decided = ((thr > cand[:, -1]) | (W == V)) & ~((top_k > W) & (top_p < 1))
  return cand, idx, z, thr, decided


def truncation_threshold(desc: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                         z: jax.Array) -> jax.Array:
  """The smallest scaled logit each row keeps [B], from its L best, desc [B, L] (descending).

  top_k [B] (0: off), top_p [B] (1: off), min_p [B] (0: off); z [B] is the
  row's sum(exp(x - max)), top-p's normalizer when top-k is off. With L < V,
  a row whose truncation reaches past its L best gets desc[:, -1] (or less),
  a lower bound: the caller tells those apart.
  """
  L = desc.shape[-1]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, L), L)  # [B]
  kth = jnp.where(top_k > 0, jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)[:, 0], -jnp.inf)
  # top-p: the smallest prefix of the top-k tokens whose mass reaches top_p.
  in_k = jnp.arange(L)[None, :] < k[:, None]  # [B, L]
  unnorm = jnp.exp(jnp.where(in_k, desc, -jnp.inf) - desc[:, :1])
  probs = unnorm / jnp.where(top_k > 0, jnp.sum(unnorm, axis=-1), z)[:, None]
  before = jnp.cumsum(probs, axis=-1) - probs
  n_keep = jnp.maximum(jnp.sum(in_k & (before < top_p[:, None]), axis=-1), 1)
  # top_p 1 is off: a float32 cumsum can reach 1.0 before the tail and would
  # drop its last tokens (each of mass < 1e-7).
  pth = jnp.where(top_p < 1, jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)[:, 0], -jnp.inf)
  # min-p: keep tokens whose probability is >= min_p * the top token's.
  mth = jnp.where(min_p > 0, desc[:, 0] + jnp.log(jnp.maximum(min_p, 1e-30)), -jnp.inf)
  return jnp.maximum(jnp.maximum(kth, pth), mth)


def sort_descending(x: jax.Array) -> jax.Array:
  """-jnp.sort(-x) of float32 x [V] (up to the sign of zeros).

  Sorts the order-preserving int32 image of the floats: XLA:CPU sorts int32
  ~4x faster than float32, whose comparator also has to order NaNs.
  """
  bits = jax.lax.bitcast_convert_type(x, jnp.int32)
  flip = lambda k: jnp.where(k < 0, k ^ 0x7FFFFFFF, k)  # an involution, monotone in x
  keys = ~jax.lax.sort(~flip(bits), is_stable=False)  # ~ reverses the order: descending
  return jax.lax.bitcast_convert_type(flip(keys), jnp.float32)


def first_argmax(x: jax.Array) -> jax.Array:
  """jnp.argmax(x, -1) of x [B, V] as int32 [B]: the first maximum (for NaN
  rows some index in range).

  XLA:CPU's (value, index) argmax reduce takes ~10 ms on [64, 49152]; a plain
  max per block of C tokens, then a search of the first block holding the
  row's max, reads x once and makes no [B, V] temporary (~0.5 ms).
  """
  B, V = x.shape
  C = next((c for c in (512, 256, 128, 64, 32) if V % c == 0), None)
  if C is None:
    return jnp.argmax(x, axis=-1).astype(jnp.int32)
  blocks = x.reshape(B, V // C, C)
  block_max = jnp.max(blocks, axis=-1)  # [B, V / C]
  top = jnp.max(block_max, axis=-1, keepdims=True)  # [B, 1]
  first = lambda hit: jnp.argmax(hit, axis=-1).astype(jnp.int32)  # first True (0 if none)
  block = first(block_max == top)  # [B]
  within = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [B, C]
  return block * C + first(within == top)


def _bits_are_per_index() -> bool:
  """Whether random bit i of a [V] draw depends on (key, i) only (JAX's default,
  partitionable threefry) and Gumbel noise uses one uniform per value. If not
  (or a flag is renamed), truncated rows draw over the whole row instead."""
  flag = lambda name, default: getattr(jax.config, name, default)
  return (flag("jax_threefry_partitionable", False) is True
          and flag("jax_default_prng_impl", "") == "threefry2x32"
          and flag("jax_high_dynamic_range_gumbel", True) is False)


def _gumbel_at(keys: jax.Array, idx: jax.Array) -> jax.Array:
  """jax.random.gumbel(keys[b], (V,), float32)[idx[b]] for each row b of idx [B, W], for any V.

  Partitionable threefry gives element i of a bits array as the xor of
  threefry2x32(key, (hi(i), lo(i))); the uniform and Gumbel transforms below
  are jax.random's ("low" mode), op for op. A test checks both against jax.random.
  """
  data = jax.random.key_data(keys)  # [B, 2] uint32
  k1, k2 = (jnp.broadcast_to(data[:, j:j + 1], idx.shape) for j in range(2))
  b1, b2 = threefry2x32_p.bind(k1, k2, jnp.zeros(idx.shape, jnp.uint32), idx.astype(jnp.uint32))
  bits = b1 ^ b2
  one, tiny = jnp.float32(1), jnp.float32(jnp.finfo(jnp.float32).tiny)
  floats = jax.lax.bitcast_convert_type((bits >> 9) | np.uint32(0x3F800000), jnp.float32) - one
  u = jax.lax.max(tiny, floats * (one - tiny) + tiny)
  return -jnp.log(-jnp.log(u))


def top_logprobs(logits: jax.Array, top: jax.Array, log_z: jax.Array,
                 top_n: bool) -> tuple[jax.Array, jax.Array]:
  """The MAX_LOGPROBS best (logprobs, ids) per row of logits [B, V] (fewer if V is smaller),
  or zeros unless top_n (static). top, log_z [B, 1]: the rows' max and log-normalizer."""
  B, V = logits.shape
  n = min(MAX_LOGPROBS, V)
  if not top_n:
    return jnp.zeros((B, n), jnp.float32), jnp.zeros((B, n), jnp.int32)
  vals, ids = jax.lax.top_k(logits, n)
  return (vals - top) - log_z, ids


def validate_per_request(params: Sequence[SamplingParams] | SamplingParams | None,
                         n: int) -> list[SamplingParams]:
  """One SamplingParams per prompt: None -> defaults, one -> shared, a list -> as given."""
  if params is None:
    return [SamplingParams()] * n
  if isinstance(params, SamplingParams):
    return [params] * n
  params = list(params)
  if len(params) != n:
    raise InvalidRequestError(f"sampling_params has {len(params)} entries for {n} prompts")
  for i, p in enumerate(params):
    if not isinstance(p, SamplingParams):
      raise InvalidRequestError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
  return params
