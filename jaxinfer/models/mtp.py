"""Multi-token prediction (DeepSeek-V3 §2.2) as a drafter: one extra decoder block.

The MTP module at position i reads the target's hidden state h_i and the
embedding of the next token t_{i+1}, and predicts t_{i+2}:

    x  = W_proj [RMSNorm_e(Emb(t_{i+1})); RMSNorm_h(h_i)]     eh_proj: [2D, D]
    g  = Block(x)                                              one decoder layer
    p  = softmax(Head(RMSNorm_s(g)))                           shared_head.norm, shared LM head

The embedding and the output head are the target's (shared, §2.2). The block
is one decoder layer of the model's own kind: the dense Llama block for Llama-
family models, MLA + MoE for DeepSeek-V3 (whose checkpoints ship it as layer
`num_hidden_layers`). The concatenation puts the embedding first, as the
checkpoints' eh_proj expects (DeepSeek's and vLLM's `torch.cat([e, h])`,
although the paper writes h first), and the embedding of position 0 is zeroed
as they do.

Drafting k tokens reuses the one module k times (MTP-Eagle): draft j + 1 reads
draft j's embedding and the module's own output g of the previous position in
place of the target's hidden state. Drafts are greedy (argmax): a point-mass q,
so "sample, then compare" verification stays lossless (engine/spec_decode.py).

The block attends like any layer: its K/V for every earlier position live in
the page pool as one extra cache layer after the model's (CacheSpec with
`draft_layers=1`), written by the step for every position it computes (input:
the target's h_i and t_{i+1}); draft positions' K/V is overwritten when those
positions are computed for real.

Legend: T tokens of the step (packed), S sequences, L = S * (k + 1) logits rows,
k drafts per sequence, D hidden, V vocab, P pages per sequence, p page size.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.models.layers import rms_norm
from jaxinfer.models.transformer import PagedBatch, compute_logits, decoder_layer, dense_ffn
from jaxinfer.params import WeightSpec, layer_specs
from jaxinfer.quant import embed_lookup

NULL_PAGE = 0  # engine/kv_manager.NULL_PAGE: the padding page (not imported: models stay engine-free)


def mtp_layer_index(cfg: ModelConfig) -> int:
  """DeepSeek-V3 numbers its MTP module as the layer after the last decoder layer."""
  return cfg.num_layers


def mtp_specs(cfg: ModelConfig, own_head: bool = False) -> dict[str, Any]:
  """The MTP module's parameter tree, a WeightSpec at every leaf, under DeepSeek-V3's
  Hugging Face names (`model.layers.{num_hidden_layers}.*`):

    enorm     [D]       RMSNorm of the next token's embedding
    hnorm     [D]       RMSNorm of the previous hidden state
    eh_proj   [2D, D]   W_proj over [e; h] (stored [out, in] = [D, 2D])
    norm      [D]       shared_head.norm, before the (shared) LM head
    block     {...}     decoder layer `num_hidden_layers` (params.layer_specs)
    head      [D, V]    only with `own_head`: shared_head.head, when a checkpoint's head
                        is its own (DeepSeek's is a copy of lm_head)
  """
  D, V = cfg.hidden_size, cfg.vocab_size
  i = mtp_layer_index(cfg)
  hf = f"model.layers.{i}."
  spec: dict[str, Any] = {
      "enorm": WeightSpec((D,), ("embed",), "ones", hf + "enorm.weight", ""),
      "hnorm": WeightSpec((D,), ("embed",), "ones", hf + "hnorm.weight", ""),
      "eh_proj": WeightSpec((2 * D, D), (None, "embed"), "normal", hf + "eh_proj.weight", "", linear=True),
      "norm": WeightSpec((D,), ("embed",), "ones", hf + "shared_head.norm.weight", ""),
      "block": layer_specs(cfg, i),
  }
  if own_head:
    spec["head"] = WeightSpec((D, V), ("embed", "vocab"), "normal", hf + "shared_head.head.weight", "",
                              linear=True)
  return spec


def block_forward(p: dict[str, Any], cfg: ModelConfig, x: jax.Array, positions: jax.Array,
                  layer_cache: dict[str, jax.Array], batch: PagedBatch, *, attention_impl: str,
                  decode_q_len: int) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The module's decoder layer over x [T, D] (its K/V written at batch.slot_mapping)."""
  i = mtp_layer_index(cfg)
  if cfg.is_moe_layer(i):
    from jaxinfer.models.moe import moe_ffn
    valid = jnp.arange(x.shape[0]) < batch.cu_q_lens[batch.num_seqs]

    def ffn(lp, h):
      return moe_ffn(lp["moe"], cfg, h, valid)[0]
  else:
    ffn = dense_ffn
  # A GQA window comes from cfg.layer_types, which has no entry past the last layer:
  # the module attends like the last decoder layer.
  return decoder_layer(p["block"], cfg, x, positions, layer_cache, batch, ffn=ffn,
                       attention_impl=attention_impl, decode_q_len=decode_q_len,
                       layer=min(i, cfg.num_layers - 1))


def mtp_hidden(p: dict[str, Any], embed: jax.Array, cfg: ModelConfig, h: jax.Array, next_tokens: jax.Array,
               positions: jax.Array, layer_cache: dict[str, jax.Array], batch: PagedBatch, *,
               attention_impl: str = "auto", decode_q_len: int = 1
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """g [T, D] from h [T, D] (the target's hidden, or the module's own g for a chained draft)
  and next_tokens [T] (t_{i+1} for the token at positions [T]); writes the block's K/V."""
  e = embed_lookup(embed, next_tokens, p["enorm"].dtype)  # [T, D]
  e = jnp.where((positions == 0)[:, None], 0, e)
  eh = jnp.concatenate([rms_norm(e, p["enorm"], cfg.rms_norm_eps),
                        rms_norm(h.astype(e.dtype), p["hnorm"], cfg.rms_norm_eps)], axis=-1)  # [T, 2D]
  x = jnp.einsum("TE,ED->TD", eh, p["eh_proj"])
  return block_forward(p, cfg, x, positions, layer_cache, batch, attention_impl=attention_impl,
                       decode_q_len=decode_q_len)


def mtp_logits(p: dict[str, Any], params: Any, cfg: ModelConfig, g: jax.Array) -> jax.Array:
  """g [..., D] -> float32 logits [..., V] through shared_head.norm and the LM head
  (the module's own head if it has one, else the target's)."""
  x = rms_norm(g, p["norm"], cfg.rms_norm_eps)
  if "head" in p:
    return jnp.einsum("...D,DV->...V", x, p["head"], preferred_element_type=jnp.float32)
  return compute_logits(params, cfg, x)


def propose(p: dict[str, Any], params: Any, cfg: ModelConfig, hidden: jax.Array, tokens_next: jax.Array,
            positions: jax.Array, paged: PagedBatch, logits_indices: jax.Array, samples: jax.Array,
            num_drafts: jax.Array, ids: jax.Array, committed: jax.Array, layer_cache: dict[str, jax.Array],
            k: int, page_size: int, *, attention_impl: str = "auto"
            ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The step's MTP pass: writes the module's K/V for every token of the step and returns
  k greedy drafts per sequence [S, k] (meaningful where the sequence committed tokens).

  hidden [T, D] the target's final hidden states; tokens_next [T] t_{i+1} of each row where
  the host knows it (a prefill chunk's prompt); logits_indices [L]; samples [S]; num_drafts [S];
  ids [S, k + 1] the sampled targets; committed [S] how many of them each sequence commits.
  The rows that sampled read their t_{i+1} from ids: accepted drafts equal their targets, so
  row j's next token is t_j up to the last committed row.
  """
  T = hidden.shape[0]
  S, K1 = ids.shape
  embed = params["embed"]
  sampled = samples[:, None] & (jnp.arange(K1) <= num_drafts[:, None])  # [S, k + 1]
  rows = jnp.where(sampled.reshape(-1), logits_indices, T)  # [L]; T: dropped
  nxt = tokens_next.at[rows].set(ids.reshape(-1), mode="drop")  # [T]
  g, layer_cache = mtp_hidden(p, embed, cfg, hidden, nxt, positions, layer_cache, paged,
                              attention_impl=attention_impl, decode_q_len=K1)
  # The last committed row of each sequence (position start + accepted) drafts the token
  # two past it; its successor (the bonus / correction token) is computed next step.
  last = logits_indices.reshape(S, K1)[jnp.arange(S), jnp.maximum(committed - 1, 0)]  # [S]
  g_s, pos = g[last], positions[last]  # [S, D], [S]
  d = jnp.argmax(mtp_logits(p, params, cfg, g_s), axis=-1).astype(jnp.int32)  # [S]
  drafts = [d]
  P = paged.page_indices.shape[1]
  live = committed > 0
  for _ in range(k - 1):
    # MTP-Eagle: the module's own g stands in for the target's hidden one position on.
    pos = pos + 1
    inside = live & (pos < P * page_size)
    page = paged.page_indices[jnp.arange(S), jnp.minimum(pos // page_size, P - 1)]
    # Past the sequence's pages (or for a sequence that drafts nothing) the K/V goes to the
    # padding page; a draft's K/V is overwritten when its position is computed for real.
    slot = jnp.where(inside, page * page_size + pos % page_size, NULL_PAGE * page_size)
    dec = PagedBatch(slot, jnp.minimum(pos + 1, P * page_size), paged.page_indices,
                     jnp.arange(S + 1, dtype=jnp.int32), paged.num_seqs)
    g_s, layer_cache = mtp_hidden(p, embed, cfg, g_s, d, pos, layer_cache, dec,
                                  attention_impl=attention_impl, decode_q_len=1)
    d = jnp.argmax(mtp_logits(p, params, cfg, g_s), axis=-1).astype(jnp.int32)
    drafts.append(d)
  return jnp.stack(drafts, axis=1), layer_cache
