"""Multi-head latent attention (MLA, DeepSeek-V2 sec. 2.1 / DeepSeek-V3 sec. 2.1.1) over the paged cache.

Every head's keys and values are up-projections of one per-token latent
c_KV = RMSNorm(x W_DKV) of width r (kv_lora_rank); position enters through a
separate rope key k_R (width E, shared by all heads). The cache keeps only
[c_KV, k_R]: r + E values per token and layer, no head axis.

Decode and prefill both use the *absorbed* form (DeepSeek-V2 sec. 2.1.2):
  q_C . k_C = q_C . (c W_UK) = (q_C W_UK^T) . c
so each head's no-rope query is mapped into latent space once, and
attention is MQA with one KV head of width r + E over the cache itself; the
values are the latent c, and W_UV (then o_proj) is applied to the attended
latent. Nothing per head is ever expanded from the cache. (A long prefill
could instead expand c into per-head K/V, which costs fewer FLOPs when the
chunk's queries outnumber r / C; not done here.)

Rope: DeepSeek's checkpoints rotate the rope dims as interleaved pairs
(x0, x1), (x2, x3), ... (HF `rope_interleave`, on for DeepSeek-V3). Taking
the even dims then the odd dims turns that into our half-split layout, after
which `apply_rope` is the same rotation; q and k go through the same
permutation, so their dot product, the only thing attention sees, is that of
HF's layout (HF's rotated output is in the half-split order too).

Legend: T tokens (packed, of many sequences), D hidden, H heads,
Q q_lora_rank, R kv_lora_rank, E qk_rope_head_dim, C qk_nope_head_dim,
V v_head_dim, F = C + E (a query head), L = R + E (a cached token), N pages,
p page size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer import ops
from jaxinfer.config import ModelConfig
from jaxinfer.errors import UnsupportedModelError
from jaxinfer.models.cache import write
from jaxinfer.models.layers import apply_rope, rms_norm, rope_attention_factor, rope_inv_freq, yarn_mscale
from jaxinfer.models.transformer import PagedBatch
from jaxinfer.params import WeightSpec
from jaxinfer.quant import dequantize_jnp, is_quantized, linear

# The q and kv latent norms use DeepSeek's fixed epsilon, not the config's
# rms_norm_eps (DeepSeek's reference code and transformers build them with the
# RMSNorm default); the config's value is for the layer norms only.
LATENT_NORM_EPS = 1e-6


def mla_specs(cfg: ModelConfig, i: int) -> dict[str, WeightSpec]:
  """Layer i's attention weights (and its input norm) for MLA, in our [in, out] layout.

  Keys: attn_norm [D]; with q LoRA (q_lora_rank > 0) wq_a [D, Q], q_a_norm [Q],
  wq_b [Q, H, F], else wq [D, H, F]; wkv_a [D, R + E] (the latent and the rope
  key in one matmul); kv_a_norm [R]; wkv_b [R, H, C + V] (per head, W_UK then
  W_UV); wo [H, V, D]. Heads are split over 'heads'; the latent dims
  ('q_lora', 'kv_lora') are replicated: every head reads all of them.
  """
  if cfg.attention_bias:
    raise UnsupportedModelError(f"{cfg.name or cfg.architecture}: MLA with attention_bias is not supported")
  D, H, Q, R, E, C, V = (cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
                         cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim)
  if min(R, E, C, V) <= 0 or E % 2:
    raise UnsupportedModelError(
        f"MLA needs kv_lora_rank, qk_nope_head_dim, v_head_dim > 0 and an even qk_rope_head_dim > 0, "
        f"got {R=}, {C=}, {V=}, {E=}")
  hf, gg = f"model.layers.{i}.", f"blk.{i}."
  att = hf + "self_attn."
  spec = {
      "attn_norm": WeightSpec((D,), ("embed",), "ones", hf + "input_layernorm.weight",
                              gg + "attn_norm.weight"),
      "wkv_a": WeightSpec((D, R + E), ("embed", "kv_lora"), "normal", att + "kv_a_proj_with_mqa.weight",
                          gg + "attn_kv_a_mqa.weight", linear=True),
      "kv_a_norm": WeightSpec((R,), ("kv_lora",), "ones", att + "kv_a_layernorm.weight",
                              gg + "attn_kv_a_norm.weight"),
      "wkv_b": WeightSpec((R, H, C + V), ("kv_lora", "heads", "head_dim"), "normal",
                          att + "kv_b_proj.weight", gg + "attn_kv_b.weight", linear=True),
      "wo": WeightSpec((H, V, D), ("heads", "head_dim", "embed"), "normal", att + "o_proj.weight",
                       gg + "attn_output.weight", linear=True),
  }
  if Q:
    spec["wq_a"] = WeightSpec((D, Q), ("embed", "q_lora"), "normal", att + "q_a_proj.weight",
                              gg + "attn_q_a.weight", linear=True)
    spec["q_a_norm"] = WeightSpec((Q,), ("q_lora",), "ones", att + "q_a_layernorm.weight",
                                  gg + "attn_q_a_norm.weight")
    spec["wq_b"] = WeightSpec((Q, H, C + E), ("q_lora", "heads", "head_dim"), "normal",
                              att + "q_b_proj.weight", gg + "attn_q_b.weight", linear=True)
  else:
    spec["wq"] = WeightSpec((D, H, C + E), ("embed", "heads", "head_dim"), "normal",
                            att + "q_proj.weight", gg + "attn_q.weight", linear=True)
  return spec


def softmax_scale(cfg: ModelConfig) -> float:
  """1 / sqrt(C + E), times yarn's mscale(factor, mscale_all_dim) ** 2 (DeepSeek-V2 sec. 4.3:
  the length-extension temperature applies to the whole logit, not just the rope dims)."""
  scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
  s = cfg.rope_scaling
  if s is not None and s.mscale_all_dim:
    scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
  return scale


def _rope(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
  """x [T, N, E] in DeepSeek's interleaved-pair layout -> rotated, in the half-split layout,
  times yarn's attention factor (HF scales cos and sin by it)."""
  x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
  out = apply_rope(x, positions, rope_inv_freq(cfg))
  factor = rope_attention_factor(cfg)
  return out if factor == 1.0 else out * jnp.asarray(factor, out.dtype)


def _dense(w) -> jax.Array:
  """A float view of wkv_b [R, H, C + V]: the absorbed form contracts it over its output dims,
  which the int8 `linear` cannot do, so a quantized one is dequantized (scales per output
  channel, or per group of input rows)."""
  return dequantize_jnp(w, 1) if is_quantized(w) else w


def mla_attention_block(p: dict[str, jax.Array], cfg: ModelConfig, x: jax.Array, positions: jax.Array,
                        layer_cache: dict[str, jax.Array], batch: PagedBatch, *,
                        attention_impl: str = "auto", decode_q_len: int = 1
                        ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """MLA of the ragged tokens x [T, D] (already normed) at positions [T].

  Same contract as transformer.attention_block: writes each token's
  [c_KV, k_R] into layer_cache['latent'] [N, p, R + E] at batch.slot_mapping,
  attends over the cache, returns ([T, D], the new layer cache).
  """
  R, C = cfg.kv_lora_rank, cfg.qk_nope_head_dim
  if "wq_a" in p:  # q LoRA (DeepSeek-V2 eq. 12): a low-rank bottleneck with its own norm
    q = linear("TQ,QHF->THF", rms_norm(linear("TD,DQ->TQ", x, p["wq_a"]), p["q_a_norm"], LATENT_NORM_EPS),
               p["wq_b"])
  else:
    q = linear("TD,DHF->THF", x, p["wq"])
  q_nope, q_rope = q[..., :C], _rope(q[..., C:], positions, cfg)  # [T, H, C], [T, H, E]

  kv = linear("TD,DL->TL", x, p["wkv_a"])
  c_kv = rms_norm(kv[:, :R], p["kv_a_norm"], LATENT_NORM_EPS)  # [T, R]
  k_rope = _rope(kv[:, None, R:], positions, cfg)[:, 0]  # [T, E]: one rope key for all heads
  # Write first, then attend: a query sees its own token through the cache.
  # latent [N, p, L], and in a quantized cache its scales [N, p, G]
  latent = jnp.concatenate([c_kv, k_rope.astype(c_kv.dtype)], -1)
  new_cache = {**layer_cache, **write(layer_cache, "latent", latent, batch.slot_mapping)}

  wkv_b = _dense(p["wkv_b"])
  w_uk, w_uv = wkv_b[..., :C], wkv_b[..., C:]  # [R, H, C], [R, H, V]
  # Absorption (DeepSeek-V2 sec. 2.1.2): q_C . (c W_UK) = (q_C W_UK^T) . c, per head.
  q_latent = jnp.einsum("THC,RHC->THR", q_nope, w_uk.astype(q_nope.dtype))
  # MQA over the latent cache: one KV head of width L = R + E, the same pages as keys and as
  # values, of which only the first R columns (the latent) are wanted. The XLA path runs it
  # as the GQA op with K = 1 and v_head_dim = R: each page is gathered once and only R
  # columns meet the probabilities (the E rope columns ride along in the gather alone). The
  # Pallas GQA kernel would need L a power of two (DeepSeek-V3's 576 is not) and would carry
  # the rope columns through V; the MLA kernel scores with two dots, latent and rope.
  o_latent = ops.ragged_paged_mla(
      q_latent, q_rope.astype(q_latent.dtype), new_cache["latent"], batch.kv_lens, batch.page_indices,
      batch.cu_q_lens, batch.num_seqs, sm_scale=softmax_scale(cfg), impl=attention_impl,
      decode_q_len=decode_q_len,
      latent_scale=new_cache.get("latent_scale"))  # [T, H, R]: each head's softmax-weighted sum of latents
  o = jnp.einsum("THR,RHV->THV", o_latent, w_uv.astype(o_latent.dtype))
  return linear("THV,HVD->TD", o, p["wo"]), new_cache
