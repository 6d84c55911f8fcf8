"""Per-request sampling controls and the on-device sampler.

`SamplingParams` is what a request asks for; `sample` turns a batch of
logits into token ids on device, each row with its own temperature, top-k,
top-p, min-p and seed. A row's random stream is `fold_in(key(seed), position)`:
it depends on the request's seed and the token's position only, never on
what else is in the batch, so seeded runs reproduce.

Legend: B batch rows, V vocab.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxinfer.errors import InvalidRequestError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to pick each new token of one request.

  temperature 0 is greedy. top_k 0 keeps every token; top_p 1.0 and
  min_p 0.0 are off. `seed` makes a sampled request reproducible.
  Generation ends at max_tokens, an EOS token (unless ignore_eos), one of
  `stop_token_ids`, or when the text contains one of `stop` (which is cut off).
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
    if self.seed is not None:
      self._check("seed", self.seed, lambda v: 0 <= v < 2**32, "in [0, 2**32)", integer=True)
    for s in self.stop:
      if not isinstance(s, str) or not s:
        raise InvalidRequestError(f"stop must hold non-empty strings, got {s!r}")
    for t in self.stop_token_ids:
      if not isinstance(t, int) or isinstance(t, bool) or t < 0:
        raise InvalidRequestError(f"stop_token_ids must hold non-negative ints, got {t!r}")

  @staticmethod
  def _check(name, value, ok, want, integer=False):
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (
        not integer and not math.isfinite(value)) or not ok(value):
      raise InvalidRequestError(f"{name} must be {'an int ' if integer else ''}{want}, got {value!r}")


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           min_p: jax.Array, seeds: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Picks one token per row of logits [B, V]; returns (ids [B] int32, logprobs [B] float32).

  The logprob is the token's log-probability under the model's unmodified
  distribution. All-greedy batches skip the sort entirely.
  """
  logits = logits.astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def sampled(_):
    V = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    desc = -jnp.sort(-scaled, axis=-1)  # [B, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)  # [B, 1]
    # top-p: the smallest prefix of the top-k tokens whose mass reaches top_p.
    in_k = jnp.arange(V)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum(in_k & (before < top_p[:, None]), axis=-1), 1)
    pth = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
    # min-p: keep tokens whose probability is >= min_p * the top token's.
    mth = desc[:, :1] + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]
    threshold = jnp.maximum(jnp.maximum(kth, pth), jnp.where(min_p[:, None] > 0, mth, -jnp.inf))
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
    drawn = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)

  ids = jax.lax.cond(jnp.any(temperature > 0), sampled, lambda _: greedy, None)
  return ids, jnp.take_along_axis(log_probs, ids[:, None], axis=-1)[:, 0]


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
