"""The decoder as pure functions: Llama 2/3, Mistral, Qwen2/3, SmolLM2, Mixtral, Qwen3-MoE, DeepSeek-V3,
GPT-OSS.

Families differ only in config flags: q/k/v biases (Qwen2), q/k RMSNorm
(Qwen3), a sliding window (Mistral), tied embeddings (SmolLM2), RoPE scaling
(Llama 3.1), mixture-of-experts FFNs (Mixtral, Qwen3-MoE; see
jaxinfer.models.moe). The layer takes its FFN as a function of (params, x),
so MoE layers reuse everything else, and `cfg.is_moe_layer(i)` picks it per
layer (Qwen3-MoE's mlp_only_layers and DeepSeek's first dense layers mix both
in one stack). DeepSeek-V3 swaps the attention for MLA (jaxinfer.models.mla).
GPT-OSS adds attention sinks, an output bias and per-layer windows
(`cfg.layer_sliding_window(i)`: sliding and full layers alternate).
The engine runs dense layers on fused q/k/v and gate/up weights (one matmul
each, jaxinfer.params.FUSED); a layer in checkpoint layout runs as well.

Legend: T new tokens (of many sequences, packed), S sequences, N pages,
p page size, D hidden, H query heads, K kv heads, G = H / K query heads per kv
head, d head_dim, V vocab.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxinfer import ops
from jaxinfer.config import ModelConfig
from jaxinfer.models.cache import Cache, write
from jaxinfer.models.layers import (apply_rope, fused_swiglu_mlp, rms_norm, rope_attention_factor, rope_inv_freq,
                                    swiglu_mlp)
from jaxinfer.models.moe import RouterStats, moe_ffn
from jaxinfer.params import model_dtype
from jaxinfer.quant import embed_lookup, head_logits, linear

class PagedBatch(NamedTuple):
  """Where a step's ragged tokens live in the paged cache (see ops.ragged_paged_attention)."""

  slot_mapping: jax.Array  # [T] page * page_size + offset where each token's KV goes
  kv_lens: jax.Array  # [S]
  page_indices: jax.Array  # [S, P]
  cu_q_lens: jax.Array  # [S + 1]
  num_seqs: jax.Array  # [] int32


def attention_block(p: dict[str, jax.Array], cfg: ModelConfig, x: jax.Array, positions: jax.Array,
                    layer_cache: dict[str, jax.Array], batch: PagedBatch, *,
                    attention_impl: str = "auto", decode_q_len: int = 1, layer: int = 0
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """GQA attention of decoder layer number `layer` (which picks its window, see cfg.layer_types)."""
  window = cfg.layer_sliding_window(layer)
  q, k, v = qkv_projection(p, cfg, x)
  if cfg.qk_norm:
    q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
  inv_freq = rope_inv_freq(cfg)
  # yarn scales cos and sin by its attention factor (1 otherwise), so q . k by its square.
  q = apply_rope(q, positions, inv_freq, rope_attention_factor(cfg))
  k = apply_rope(k, positions, inv_freq, rope_attention_factor(cfg))
  # Write first, then attend: a query sees its own token through the cache.
  new_cache = {**layer_cache, **write(layer_cache, "k", k, batch.slot_mapping),
               **write(layer_cache, "v", v, batch.slot_mapping)}
  out = ops.ragged_paged_attention(q, new_cache["k"], new_cache["v"], batch.kv_lens,
                                   batch.page_indices, batch.cu_q_lens, batch.num_seqs,
                                   sliding_window=window, sinks=p["sinks"] if cfg.attention_sinks else None,
                                   impl=attention_impl, decode_q_len=decode_q_len,
                                   k_scale=new_cache.get("k_scale"), v_scale=new_cache.get("v_scale"))
  out = linear("THd,HdD->TD", out, p["wo"])
  if cfg.attention_out_bias:
    out = out + p["bo"]
  return out, new_cache


def qkv_projection(p: dict[str, jax.Array], cfg: ModelConfig, x: jax.Array
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """x [T, D] -> q [T, H, d], k and v [T, K, d] (with Qwen2's biases): one matmul over the fused
  wqkv [D, K, G + 2, d] (jaxinfer.params.FUSED), or three over a checkpoint-layout layer."""
  if "wqkv" not in p:
    q = linear("TD,DHd->THd", x, p["wq"])
    k = linear("TD,DKd->TKd", x, p["wk"])
    v = linear("TD,DKd->TKd", x, p["wv"])
    if cfg.attention_bias:
      q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    return q, k, v
  qkv = linear("TD,DKGd->TKGd", x, p["wqkv"])
  if cfg.attention_bias:
    qkv = qkv + p["bqkv"]
  G = cfg.num_heads // cfg.num_kv_heads
  # Slots G and G + 1 of kv group k are its key and value; the G before them its query heads,
  # k G .. k G + G - 1 in HF's order. Sliced along an axis no mesh splits: local under TP.
  q = qkv[:, :, :G].reshape(x.shape[0], cfg.num_heads, cfg.head_dim)
  return q, qkv[:, :, G], qkv[:, :, G + 1]


def dense_ffn(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  if "w_gate_up" in p:
    return fused_swiglu_mlp(x, p["w_gate_up"], p["w_down"])
  return swiglu_mlp(x, p["w_gate"], p["w_up"], p["w_down"])


def decoder_layer(p, cfg: ModelConfig, x, positions, layer_cache, batch: PagedBatch, ffn=dense_ffn, *,
                  attention_impl: str = "auto", decode_q_len: int = 1, layer: int = 0):
  """Decoder layer number `layer` (which picks its attention window, see cfg.layer_types)."""
  if cfg.kv_lora_rank:  # DeepSeek's multi-head latent attention over the latent cache
    from jaxinfer.models.mla import mla_attention_block as attend  # mla imports this module
  else:
    attend = attention_block
  kw = {} if cfg.kv_lora_rank else {"layer": layer}
  h, layer_cache = attend(p, cfg, rms_norm(x, p["attn_norm"], cfg.rms_norm_eps),
                          positions, layer_cache, batch, attention_impl=attention_impl,
                          decode_q_len=decode_q_len, **kw)
  x = x + h
  x = x + ffn(p, rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps))
  return x, layer_cache


def forward(params: Any, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            cache: Cache, batch: PagedBatch, *, attention_impl: str = "auto",
            decode_q_len: int = 1, return_router_stats: bool = False):
  """Runs the ragged tokens [T] at positions [T] through the decoder.

  Writes their K/V into the paged `cache` at `batch.slot_mapping` and
  returns the final normed hidden states [T, D] and the updated cache.
  `attention_impl` picks the attention kernel and `decode_q_len` says which
  sequences the XLA path treats as decodes (see jaxinfer.ops).
  With `return_router_stats`, also a RouterStats whose tokens_per_expert is
  [MoE layers, E] (the step's real tokens only, not its padding).
  """
  x = embed_lookup(params["embed"], tokens, model_dtype(params))
  # The step's real tokens are the first cu_q_lens[num_seqs]; the rest is bucket padding.
  valid = jnp.arange(tokens.shape[0]) < batch.cu_q_lens[batch.num_seqs]
  stats: list[RouterStats] = []

  def sparse_ffn(p, h):
    out, layer_stats = moe_ffn(p["moe"], cfg, h, valid)
    stats.append(layer_stats)
    return out

  def layer(i, p, x, layer_cache, batch):
    return decoder_layer(p, cfg, x, positions, layer_cache, batch,
                         ffn=sparse_ffn if cfg.is_moe_layer(i) else dense_ffn,
                         attention_impl=attention_impl, decode_q_len=decode_q_len, layer=i)

  if is_stacked(params["layers"]):
    x, new_cache = _scan(layer, params["layers"], cfg, x, cache, batch)
  else:
    new_cache = []
    for i, (layer_params, layer_cache) in enumerate(zip(params["layers"], cache)):
      x, layer_cache = layer(i, layer_params, x, layer_cache, batch)
      new_cache.append(layer_cache)
  hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
  if not return_router_stats:
    return hidden, new_cache
  per_expert = (jnp.stack([s.tokens_per_expert for s in stats]) if stats
                else jnp.zeros((0, max(cfg.num_experts, 1)), jnp.int32))
  return hidden, new_cache, RouterStats(per_expert)


# ---- scanned layers ------------------------------------------------------------------------------
#
# With stacked layers (`stack_layers`: one tree whose leaves lead with a layer axis L) the step runs
# the same decoder_layer once, under lax.scan, so its program (and its compile time) does not grow
# with depth. The cache is then one pool of L * N pages (`stack_cache`): layer i's page j is page
# i N + j, so each layer attends and writes through the whole pool with its page ids and slots
# moved by i N: no layer's cache is sliced out (which would copy it) and the writes stay in place
# in the scan's carry. The weights are sliced per layer (lax.scan's xs).


def is_stacked(layers: Any) -> bool:
  """Whether params["layers"] is stack_layers' one stacked tree (not a list of layers)."""
  return isinstance(layers, dict)


def scannable(cfg: ModelConfig) -> str | None:
  """None if every layer runs the same program (stackable), else why not."""
  if any(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
    return "it has MoE layers (their router statistics are gathered per layer in Python)"
  if len({cfg.layer_sliding_window(i) for i in range(cfg.num_layers)}) > 1:
    return "its layers have different attention windows"
  return None


def stack_layers(cfg: ModelConfig, params: Any) -> Any:
  """params with its list of layers as one tree [L, ...] (what forward scans over)."""
  why = scannable(cfg)
  if why:
    raise ValueError(f"{cfg.architecture}: layers cannot be scanned: {why}")
  return {**params, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *params["layers"])}


def stack_cache(cache: Cache) -> Cache:
  """The per-layer pools [N, p, ...] as one pool [L * N, p, ...] (layer i's pages at i N)."""
  return [jax.tree.map(lambda *xs: jnp.concatenate(xs), *cache)]


def _scan(layer, stacked: Any, cfg: ModelConfig, x: jax.Array, cache: Cache, batch: PagedBatch):
  L = jax.tree.leaves(stacked)[0].shape[0]
  # A per-layer cache (a scratch pool, e.g. the runner's logits pass) is stacked here: a copy,
  # which the step's own pool, stacked once when allocated, never pays.
  pool = (cache if len(cache) == 1 else stack_cache(cache))[0]
  N = jax.tree.leaves(pool)[0].shape[0] // L
  p = jax.tree.leaves(pool)[0].shape[1]

  def body(carry, xs):
    x, pool = carry
    i, layer_params = xs
    slots = batch.slot_mapping
    inside = (slots >= 0) & (slots < N * p)  # an out-of-range slot (dropped) stays out of the pool
    moved = batch._replace(slot_mapping=jnp.where(inside, slots + i * N * p, L * N * p),
                           page_indices=batch.page_indices + i * N)
    x, pool = layer(0, layer_params, x, pool, moved)  # every layer alike (scannable): layer 0's window
    return (x, pool), None

  (x, pool), _ = jax.lax.scan(body, (x, pool), (jnp.arange(L, dtype=jnp.int32), stacked))
  return x, [pool]


def compute_logits(params: Any, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
  """hidden [..., D] -> float32 logits [..., V] (tied embeddings reuse `embed`)."""
  if cfg.tie_word_embeddings:
    return head_logits(hidden, params["embed"], tied=True)
  return head_logits(hidden, params["lm_head"], tied=False)
