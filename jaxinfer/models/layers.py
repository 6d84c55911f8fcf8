"""Building blocks shared by every decoder: RMSNorm, RoPE, SwiGLU.

Legend: T tokens, N heads (query or kv), Dh head_dim, D hidden, F mlp, C gate / up.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.quant import linear


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm computed in float32 (bf16 variance loses digits), returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight * x32.astype(x.dtype)


@functools.lru_cache(maxsize=32)
def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """Per-pair rotation frequencies [Dh/2], float32, with the config's scaling applied.

  Dh is head_dim, or for MLA (kv_lora_rank > 0) qk_rope_head_dim: only the
  decoupled rope dims rotate (DeepSeek-V2 sec. 2.1.3). A host-side constant
  that folds into the jitted step; cached because every layer asks for it
  while tracing. Read-only, since callers share it.
  """
  dim = cfg.qk_rope_head_dim if cfg.kv_lora_rank else cfg.head_dim
  inv_freq = (1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
              ).astype(np.float32)
  s = cfg.rope_scaling
  if s is None:
    return _frozen(inv_freq)
  if s.kind == "linear":
    return _frozen((inv_freq / s.factor).astype(np.float32))
  if s.kind == "yarn":
    return _frozen(_yarn_inv_freq(inv_freq, dim, cfg.rope_theta, s))
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


def _yarn_inv_freq(inv_freq: np.ndarray, dim: int, base: float, s: RopeScaling) -> np.ndarray:
  """YaRN "NTK-by-parts" (Peng et al. 2023, sec. 3.2): a pair that turns more than
  beta_fast times over the original context keeps its frequency, one that turns
  fewer than beta_slow times is interpolated (divided by factor), linear in between.
  """
  def pair_dim(turns: float) -> float:  # the dim whose pair turns `turns` times over the context
    return dim * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(base))

  low, high = pair_dim(s.beta_fast), pair_dim(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # a step instead of a ramp, without dividing by zero
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  return (inv_freq / s.factor * ramp + inv_freq * (1 - ramp)).astype(np.float32)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's attention temperature sqrt(1/t) = 0.1 ln(factor) + 1 (Peng et al. 2023, sec. 3.4),
  with DeepSeek's `mscale` multiplier on the log term; 1 when not extending."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
  """The factor yarn multiplies the rotated dims by (cos and sin scaled alike); 1 otherwise.

  DeepSeek configs give mscale and mscale_all_dim: the ratio of the two
  temperatures (1 for DeepSeek-V3, whose two are equal: its whole correction
  then sits in the softmax scale, see mla.softmax_scale).
  """
  s = cfg.rope_scaling
  if s is None or s.kind != "yarn":
    return 1.0
  if s.attention_factor is not None:
    return float(s.attention_factor)
  if s.mscale and s.mscale_all_dim:
    return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
  return yarn_mscale(s.factor)


def _frozen(a: np.ndarray) -> np.ndarray:
  a.flags.writeable = False
  return a


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> jax.Array:
  """Rotates x [..., T, N, Dh] by positions [..., T], in the half-split (GPT-NeoX/HF) layout.

  `scale` multiplies cos and sin alike (yarn's attention factor, `rope_attention_factor`).
  """
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., T, Dh/2]
  cos = jnp.cos(freqs)[..., None, :]
  sin = jnp.sin(freqs)[..., None, :]
  if scale != 1.0:
    cos, sin = cos * scale, sin * scale
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float, alpha: float) -> jax.Array:
  """GPT-OSS's expert activation: gate clamped above at `limit`, up to [-limit, limit], then
  (up + 1) * gate * sigmoid(alpha * gate) (alpha = 1.702: the sigmoid approximation of GELU)."""
  gate = jnp.minimum(gate, limit)
  up = jnp.clip(up, -limit, limit)
  return (up + 1) * (gate * jax.nn.sigmoid(alpha * gate))


def swiglu_mlp(x: jax.Array, w_gate, w_up, w_down) -> jax.Array:
  """down(silu(gate(x)) * up(x)) for x [..., D]; weights float or quant.QuantizedWeight."""
  gate = linear("...D,DF->...F", x, w_gate)
  up = linear("...D,DF->...F", x, w_up)
  return linear("...F,FD->...D", jax.nn.silu(gate) * up, w_down)


def fused_swiglu_mlp(x: jax.Array, w_gate_up, w_down) -> jax.Array:
  """swiglu_mlp over the fused w_gate_up [D, 2, F] (jaxinfer.params.FUSED): gate and up in one
  matmul, split along an axis no mesh splits."""
  gate_up = linear("...D,DCF->...CF", x, w_gate_up)
  return linear("...F,FD->...D", jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :], w_down)
