"""Per-request sampling controls and the on-device sampler.

`SamplingParams` is what a request asks for; `sample` turns a batch of
logits into token ids on device, each row with its own penalties,
temperature, top-k, top-p, min-p and seed. A row's random stream is
`fold_in(key(seed), position)`: it depends on the request's seed and the
token's position only, never on what else is in the batch, so seeded runs
reproduce. Only token ids and (top-n) logprobs leave the device.

Legend: B batch rows, V vocab, N top logprobs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jaxinfer.errors import InvalidRequestError

MAX_LOGPROBS = 20  # top-n logprobs are computed at this fixed width on device


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
  temperature and truncation.
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
           rows: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Picks one token per row of logits [B, V].

  Row b's history (for penalties) is row rows[b] of counts_table [R, V] and
  prompt_table [R, V]; it is gathered only when some row has a penalty.

  Returns (ids [B] int32, their logprobs [B], top-n ids [B, N], top-n
  logprobs [B, N]). Logprobs are of the unmodified distribution. Batches
  with no penalties, no sampled rows or no logprob requests skip that work
  (lax.cond), so a greedy batch costs one argmax.
  """
  logits = logits.astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  penalized = (sp.repetition_penalty != 1) | (sp.presence_penalty != 0) | (sp.frequency_penalty != 0)
  logits = jax.lax.cond(jnp.any(penalized),
                        lambda x: apply_penalties(x, sp, counts_table[rows], prompt_table[rows]),
                        lambda x: x, logits)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def sampled(_):
    V = logits.shape[-1]
    scaled = logits / jnp.where(sp.temperature > 0, sp.temperature, 1.0)[:, None]
    desc = -jnp.sort(-scaled, axis=-1)  # [B, V]
    k = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, V), V)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)  # [B, 1]
    # top-p: the smallest prefix of the top-k tokens whose mass reaches top_p.
    in_k = jnp.arange(V)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum(in_k & (before < sp.top_p[:, None]), axis=-1), 1)
    pth = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
    # min-p: keep tokens whose probability is >= min_p * the top token's.
    mth = desc[:, :1] + jnp.log(jnp.maximum(sp.min_p, 1e-30))[:, None]
    threshold = jnp.maximum(jnp.maximum(kth, pth), jnp.where(sp.min_p[:, None] > 0, mth, -jnp.inf))
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(sp.seed, sp.position)
    drawn = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
    return jnp.where(sp.temperature > 0, drawn, greedy)

  ids = jax.lax.cond(jnp.any(sp.temperature > 0), sampled, lambda _: greedy, None)
  top_lp, top_ids = top_logprobs(log_probs, sp.want_logprobs)
  return ids, jnp.take_along_axis(log_probs, ids[:, None], axis=-1)[:, 0], top_ids, top_lp


def top_logprobs(log_probs: jax.Array, want: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The MAX_LOGPROBS best (logprobs, ids) per row of [B, V] (fewer if V is smaller),
  or zeros when no row wants them."""
  B, V = log_probs.shape
  n = min(MAX_LOGPROBS, V)
  none = (jnp.zeros((B, n), jnp.float32), jnp.zeros((B, n), jnp.int32))
  return jax.lax.cond(jnp.any(want), lambda x: tuple(jax.lax.top_k(x, n)), lambda x: none, log_probs)


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
