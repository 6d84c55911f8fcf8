"""The device side of generation: bucketed, jitted prefill and decode steps.

This is the foundation's generator: static batches over a contiguous KV
cache. The paged, continuously batched engine replaces it behind the same
`LLM` API. What it already fixes is the compile discipline: every shape is
rounded up to a bucket, so the number of compiled programs is bounded by
(batch buckets) x (length buckets) per step kind, whatever the requests.

Legend: B batch, T prompt tokens, S cache slots, V vocab.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.models import compute_logits, forward, init_cache
from jaxinfer.sampling import sample


def power_of_two_buckets(lo: int, hi: int) -> tuple[int, ...]:
  """lo, 2lo, 4lo, ... and finally hi itself."""
  out, b = [], lo
  while b < hi:
    out.append(b)
    b *= 2
  out.append(hi)
  return tuple(out)


def bucket(n: int, buckets: tuple[int, ...]) -> int:
  for b in buckets:
    if n <= b:
      return b
  raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class Runner:
  """Owns params and the compiled steps for one model."""

  def __init__(self, cfg: ModelConfig, params: Any, max_batch_size: int, max_model_len: int):
    self.cfg = cfg
    self.params = params
    self.dtype = jax.tree.leaves(params)[0].dtype
    self.batch_buckets = power_of_two_buckets(1, max_batch_size)
    self.len_buckets = power_of_two_buckets(min(64, max_model_len), max_model_len)
    self.max_model_len = max_model_len
    self._prefill = jax.jit(functools.partial(_prefill, cfg))
    self._decode = jax.jit(functools.partial(_decode, cfg), donate_argnums=(1,))
    self._logits = jax.jit(functools.partial(_all_logits, cfg))
    self._grow = jax.jit(_grow, static_argnums=(1,))
    self._programs: set[tuple] = set()  # (step kind, padded shape): one compiled program each

  def compiled_programs(self) -> int:
    """How many distinct programs have been compiled so far (bounded by max_programs)."""
    return len(self._programs)

  def max_programs(self) -> int:
    nb, nl = len(self.batch_buckets), len(self.len_buckets)
    return nb * nl * 2 + nl + nb * nl * nl  # prefill, decode, logits, cache growth

  def logits(self, token_ids: list[int]) -> np.ndarray:
    T = bucket(len(token_ids), self.len_buckets)
    tokens = np.zeros((1, T), np.int32)
    tokens[0, :len(token_ids)] = token_ids
    self._programs.add(("logits", T))
    out = self._logits(self.params, jnp.asarray(tokens))
    # Slice on the host: a device-side slice would compile once per prompt length.
    return np.asarray(out)[0, :len(token_ids)]

  def prefill(self, prompts: list[list[int]], sampling: dict[str, np.ndarray], slots: int):
    """Runs the prompts, returns (cache with `slots` slots, first ids, their logprobs)."""
    B = bucket(len(prompts), self.batch_buckets)
    T = bucket(max(len(p) for p in prompts), self.len_buckets)
    tokens = np.zeros((B, T), np.int32)
    lengths = np.ones((B,), np.int32)
    for i, p in enumerate(prompts):
      tokens[i, :len(p)] = p
      lengths[i] = len(p)
    self._programs.add(("prefill", B, T))
    cache, ids, logprobs = self._prefill(self.params, jnp.asarray(tokens), jnp.asarray(lengths),
                                         *_pad_rows(sampling, B, lengths - 1))
    if slots > T:
      self._programs.add(("grow", B, T, slots))
      cache = self._grow(cache, slots)
    return cache, ids, logprobs

  def decode(self, cache, last_ids: np.ndarray, positions: np.ndarray, sampling: dict[str, np.ndarray]):
    B, S = cache[0]["k"].shape[:2]
    self._programs.add(("decode", B, S))
    tokens = np.zeros((B, 1), np.int32)
    pos = np.zeros((B,), np.int32)
    tokens[:len(last_ids), 0] = last_ids
    pos[:len(positions)] = positions
    return self._decode(self.params, cache, jnp.asarray(tokens), jnp.asarray(pos),
                        *_pad_rows(sampling, B, pos))


def _pad_rows(sampling: dict[str, np.ndarray], B: int, positions: np.ndarray):
  """Sampling arrays padded to B rows (padding rows are greedy), plus positions."""
  out = []
  for name in ("temperature", "top_k", "top_p", "min_p", "seed"):
    a = sampling[name]
    padded = np.zeros((B,), a.dtype)
    if name == "top_p":
      padded[:] = 1.0
    padded[:len(a)] = a
    out.append(jnp.asarray(padded))
  return (*out, jnp.asarray(positions, jnp.int32))


def _prefill(cfg, params, tokens, lengths, temperature, top_k, top_p, min_p, seeds, sample_pos):
  B, T = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  cache = init_cache(cfg, B, T, jax.tree.leaves(params)[0].dtype)
  hidden, cache = forward(params, cfg, tokens, positions, cache)
  last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, D]
  ids, logprobs = sample(compute_logits(params, cfg, last), temperature, top_k, top_p, min_p,
                         seeds, sample_pos + 1)
  return cache, ids, logprobs


def _decode(cfg, params, cache, tokens, positions, temperature, top_k, top_p, min_p, seeds, sample_pos):
  hidden, cache = forward(params, cfg, tokens, positions[:, None], cache)
  ids, logprobs = sample(compute_logits(params, cfg, hidden[:, 0]), temperature, top_k, top_p,
                         min_p, seeds, sample_pos + 1)
  return cache, ids, logprobs


def _all_logits(cfg, params, tokens):
  B, T = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  cache = init_cache(cfg, B, T, jax.tree.leaves(params)[0].dtype)
  hidden, _ = forward(params, cfg, tokens, positions, cache)
  return compute_logits(params, cfg, hidden)


def _grow(cache, slots: int):
  pad = lambda a: jnp.pad(a, ((0, 0), (0, slots - a.shape[1]), (0, 0), (0, 0)))
  return jax.tree.map(pad, cache)
