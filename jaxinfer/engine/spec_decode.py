"""Speculative decoding: drafters propose k tokens, the step verifies them.

A running request that has caught up with its tokens is scheduled with
1 + k new tokens: its newest token and k drafts. The step computes logits
at all k + 1 rows and samples the target token t_j of each row exactly as
it would without speculation (same processing, same key fold_in(seed,
position)). Draft d_j+1 is accepted while it equals t_j; the committed tokens
are t_0 .. t_a, where a is the number of accepted drafts (the last one is
the correction, or the bonus token when every draft was accepted).

Why "sample, then compare" is lossless: a drafter here is deterministic (its
q is a point mass on d), so rejection sampling accepts d with probability
min(1, p(d) / q(d)) = p(d), which is exactly P(t = d) for t ~ p; and after a
rejection, t ~ p conditioned on t != d, which is norm(max(0, p - q)). So the
committed tokens have the target's distribution, and, because t_j is drawn
with the key that the same position would use without speculation, a seeded
request produces the same tokens with or without it (and in any batch).

Structured output keeps this exact: a constrained request's drafts are cut
at the first one its grammar rejects (it could never be accepted), and
verify row j is masked by the grammar state after drafts 1..j, which is the
mask that position would get without speculation once d_1..d_j are
committed. So t_j is drawn from the same masked distribution either way.

Drafters: 'ngram' proposes on the host from the request's own tokens
(`NgramDrafter`); 'mtp' drafts on device inside the step itself (`MtpDrafter`,
jaxinfer.models.mtp): after the target's forward, the MTP module reads the
step's hidden states and committed tokens and returns k greedy drafts per
sequence with the step's results, so drafting costs no extra program and no
extra host round trip.

Legend: S sequences, k drafts per sequence (static), V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol, Sequence

import jax.numpy as jnp
import numpy as np

from jaxinfer.config import from_options
from jaxinfer.errors import InvalidRequestError

SPEC_METHODS = ("ngram", "mtp")
# How to get an MTP head for a model that ships none (quoted by the error that asks for one).
TRAIN_MTP_COMMAND = "python scripts/train_mtp.py --model {model}"
MAX_SPECULATIVE_TOKENS = 8
MAX_RELAXED_TOP_N = 64


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """How many tokens to draft per step, and with what.

  'ngram' (prompt lookup, no training): the continuation of the most recent
  earlier occurrence of the sequence's last n tokens (n from ngram_max down
  to ngram_min) in its own prompt and output.

  'mtp': the model's multi-token-prediction module (DeepSeek-V3's layer
  num_hidden_layers, or a head trained by scripts/train_mtp.py and saved
  beside the checkpoint) drafts greedily, k times in a chain. The engine
  refuses it for a model with no head, saying how to train one.

  Relaxed acceptance (TensorRT-LLM's, for reasoning phases; off by default,
  and lossy: greedy output is no longer the model's argmax): a greedy row
  also accepts a draft among the target's `relaxed_top_n` most likely tokens
  whose probability is at least the top token's minus `relaxed_delta`; the
  draft is then the committed token. Sampled rows always verify exactly.
  """

  method: str = "ngram"
  num_speculative_tokens: int = 3
  ngram_min: int = 1
  ngram_max: int = 4
  relaxed_top_n: int = 0  # 0: off (exact verification)
  relaxed_delta: float = 0.0

  def __post_init__(self):
    if self.method not in SPEC_METHODS:
      raise InvalidRequestError(f"speculative method must be one of {SPEC_METHODS}, got {self.method!r}")
    k = self.num_speculative_tokens
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
      raise InvalidRequestError(
          f"num_speculative_tokens must be an int in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
    for name in ("ngram_min", "ngram_max"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InvalidRequestError(f"{name} must be a positive int, got {v!r}")
    if self.ngram_min > self.ngram_max:
      raise InvalidRequestError(f"ngram_min={self.ngram_min} exceeds ngram_max={self.ngram_max}")
    n, delta = self.relaxed_top_n, self.relaxed_delta
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_RELAXED_TOP_N:
      raise InvalidRequestError(f"relaxed_top_n must be an int in [0, {MAX_RELAXED_TOP_N}] (0: off), got {n!r}")
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0.0 <= delta <= 1.0:
      raise InvalidRequestError(f"relaxed_delta must be a probability in [0, 1], got {delta!r}")
    if delta and not n:
      raise InvalidRequestError(f"relaxed_delta={delta!r} needs relaxed_top_n >= 1 (relaxed acceptance is off)")

  @property
  def relaxed(self) -> tuple[int, float] | None:
    """(top_n, delta) when relaxed acceptance is on."""
    return (self.relaxed_top_n, float(self.relaxed_delta)) if self.relaxed_top_n else None

  @classmethod
  def parse(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
    """None, a SpeculativeConfig, or a dict of its fields (what LLM(speculative=...) takes)."""
    if value is None or isinstance(value, SpeculativeConfig):
      return value
    if not isinstance(value, Mapping):
      raise InvalidRequestError(f"speculative must be a dict or SpeculativeConfig, got {type(value).__name__}")
    return from_options(cls, value, "speculative")


class Drafter(Protocol):
  def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
    """Up to k draft tokens to follow token_ids (fewer, or none, when it has no guess)."""


class NgramDrafter:
  """Prompt lookup: continue the latest earlier match of the trailing n-gram."""

  def __init__(self, ngram_min: int = 1, ngram_max: int = 4):
    self.ngram_min, self.ngram_max = ngram_min, ngram_max

  def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
    ids = np.asarray(token_ids, np.int64)
    L = len(ids)
    for n in range(min(self.ngram_max, L - 1), self.ngram_min - 1, -1):
      tail = ids[L - n:]
      # Windows starting at 0 .. L - n - 1: every earlier occurrence, not the tail itself.
      win = np.lib.stride_tricks.sliding_window_view(ids[:L - 1], n)
      hits = np.flatnonzero((win == tail).all(axis=1))
      if len(hits):
        start = int(hits[-1]) + n  # the most recent match: its continuation is the freshest
        return ids[start:start + k].tolist()
    return []


class MtpDrafter:
  """MTP drafts: made on device by the step (jaxinfer.models.mtp.propose) and handed over here
  per request; `propose` returns the ones the last step made for that request's tokens.

  The step drafts for the tokens it has just committed, so drafts are only good for the
  request's tokens as they stood after that step: they are keyed by the token count."""

  def __init__(self):
    self._drafts: dict[str, tuple[int, list[int]]] = {}  # request id -> (num tokens, drafts)

  def record(self, request_id: str, num_tokens: int, drafts: Sequence[int]) -> None:
    self._drafts[request_id] = (num_tokens, list(drafts))

  def forget(self, request_id: str) -> None:
    self._drafts.pop(request_id, None)

  def take(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
    """Up to k drafts to follow token_ids, if the last step made them for exactly these tokens."""
    n, drafts = self._drafts.pop(request_id, (-1, []))
    return drafts[:k] if n == len(token_ids) else []


def make_drafter(cfg: SpeculativeConfig) -> "Drafter | MtpDrafter":
  if cfg.method == "mtp":
    return MtpDrafter()
  return NgramDrafter(cfg.ngram_min, cfg.ngram_max)


def accept(targets: jnp.ndarray, drafts: jnp.ndarray, num_drafts: jnp.ndarray) -> jnp.ndarray:
  """Accepted drafts per sequence: the longest prefix with d_j+1 == t_j.

  targets [S, k + 1] (the sampled target tokens), drafts [S, k], num_drafts [S].
  Returns [S] int32 in 0 .. num_drafts.
  """
  k = drafts.shape[1]
  ok = (drafts == targets[:, :k]) & (jnp.arange(k) < num_drafts[:, None])
  return jnp.cumprod(ok.astype(jnp.int32), axis=1).sum(axis=1)


def relax(logits: jnp.ndarray, targets: jnp.ndarray, drafts: jnp.ndarray, num_drafts: jnp.ndarray,
          greedy: jnp.ndarray, top_n: int, delta: float) -> jnp.ndarray:
  """Targets [S, k + 1] with each greedy row's draft put in its place where relaxed
  acceptance takes it: the draft is among the row's top_n logits and its probability is
  at least the top one's minus delta. (accept() then takes the longest such prefix.)

  logits [S, k, V] float32 (the rows that verify drafts 1..k), drafts [S, k], num_drafts
  [S], greedy [S, k] bool (rows with temperature 0; sampled rows verify exactly).
  """
  k = drafts.shape[1]
  top = jnp.max(logits, axis=-1)  # [S, k]
  at = jnp.take_along_axis(logits, drafts[..., None], axis=-1)[..., 0]  # [S, k]
  rank = jnp.sum(logits > at[..., None], axis=-1)  # tokens strictly more likely than the draft
  z = jnp.sum(jnp.exp(logits - top[..., None]), axis=-1)  # p(x) = exp(x - top) / z
  close = jnp.exp(at - top) / z >= 1.0 / z - delta
  take = greedy & (rank < top_n) & close & (jnp.arange(k) < num_drafts[:, None])
  return targets.at[:, :k].set(jnp.where(take, drafts, targets[:, :k]))
