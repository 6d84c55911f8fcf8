"""Building blocks shared by every decoder: RMSNorm, RoPE, SwiGLU.

Legend: T tokens, N heads (query or kv), Dh head_dim, D hidden, F mlp.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.quant import linear


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm computed in float32 (bf16 variance loses digits), returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight * x32.astype(x.dtype)


@functools.lru_cache(maxsize=32)
def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """Per-pair rotation frequencies [Dh/2], float32, with the config's scaling applied.

  A host-side constant that folds into the jitted step; cached because every
  layer asks for it while tracing. Read-only, since callers share it.
  """
  dim = cfg.head_dim
  inv_freq = (1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
              ).astype(np.float32)
  s = cfg.rope_scaling
  if s is None:
    return _frozen(inv_freq)
  if s.kind == "linear":
    return _frozen((inv_freq / s.factor).astype(np.float32))
  # llama3 (Llama 3.1 report, sec. 3.1 / Meta's reference code): long wavelengths are
  # slowed by `factor`, short ones kept, the band between interpolated smoothly.
  old = s.original_max_position_embeddings
  low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
  smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return _frozen(np.where(medium, smoothed, scaled).astype(np.float32))


def _frozen(a: np.ndarray) -> np.ndarray:
  a.flags.writeable = False
  return a


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotates x [..., T, N, Dh] by positions [..., T], in the half-split (GPT-NeoX/HF) layout."""
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., T, Dh/2]
  cos = jnp.cos(freqs)[..., None, :]
  sin = jnp.sin(freqs)[..., None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def swiglu_mlp(x: jax.Array, w_gate, w_up, w_down) -> jax.Array:
  """down(silu(gate(x)) * up(x)) for x [..., D]; weights float or quant.QuantizedWeight."""
  gate = linear("...D,DF->...F", x, w_gate)
  up = linear("...D,DF->...F", x, w_up)
  return linear("...F,FD->...D", jax.nn.silu(gate) * up, w_down)
