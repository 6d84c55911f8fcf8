"""Mixture-of-experts FFN: routers and the grouped expert matmul, as pure functions.

Legend: T tokens, E experts, A active (routed) experts per token, D hidden,
F expert width, G router groups (DeepSeek-V3), R = T * A token copies.

One MoE FFN (`moe_ffn`):
  1. route: router logits [T, E] (float32) -> per token the ids [T, A] of its
     experts and their weights [T, A] (`route_softmax_topk`, `route_deepseek_v3`);
  2. dispatch: the R token copies sorted by expert id, so each expert's rows
     are contiguous, with `group_sizes` [E] rows per expert;
  3. grouped SwiGLU: `jax.lax.ragged_dot` multiplies each expert's rows by
     that expert's weights only, never all E experts for every token;
  4. combine: unsort back to [T, A, D] and sum the copies with their weights;
  5. shared experts (DeepSeek-V3, Qwen2-MoE): a dense SwiGLU on every token, added.

The routers follow the published models: Mixtral (softmax over all experts,
top-k, renormalized), Qwen3-MoE (the same, renormalized iff norm_topk_prob),
GPT-OSS (logits + bias, top-k, softmax over the k; experts with biases and a
clamped SwiGLU, `layers.clamped_swiglu`)
and DeepSeek-V3 (Liu et al. 2024, "DeepSeek-V3 Technical Report", sec.
2.1.2: sigmoid affinities; the auxiliary-loss-free bias shifts which experts
are chosen but not their weights; node-limited routing, here the
`n_group` / `topk_group` group limit, where a group scores the sum of its best
2 experts' biased affinities; weights normalized over the chosen experts and
scaled by `routed_scaling_factor`).

On XLA CPU `ragged_dot` is lowered to a dense masked product over all
groups (jax's fallback: as costly as running every expert on every copy,
slower than all-experts einsums when measured); on GPU/TPU it is a grouped matmul. Steps with fewer copies than
experts (decode) gather each copy's expert weights instead
(`_per_copy_swiglu`). The sorted layout is also what an expert-parallel
all-to-all dispatches.

Quantized experts (int8 / fp8, jaxinfer/quant.py): values [E, out, in] with scales
[E, 1, out], one per (expert, output channel). Those factor out of each row's dot
(sum_i x_i q_eio s_eo = s_eo sum_i x_i q_eio), so `expert_dot` runs the grouped dot over
the converted values and multiplies each row by its own expert's scales after it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.indexing import take
from jaxinfer.models import eplb
from jaxinfer.models.layers import clamped_swiglu, swiglu_mlp
from jaxinfer.quant import is_quantized


class RouterStats(NamedTuple):
  """What one MoE layer's router did in a step (for load monitoring)."""

  tokens_per_expert: jax.Array  # [E] int32: valid token copies routed to each expert


def router_logits(x: jax.Array, w_router: jax.Array) -> jax.Array:
  """x [T, D] . router [D, E] -> float32 [T, E].

  Always in float32: a bf16 logit rounds near-tied experts to the same value
  and the top-k would then pick by index (DeepSeek-V3 routes in float32 too).
  """
  return jnp.einsum("TD,DE->TE", x.astype(jnp.float32), w_router.astype(jnp.float32))


def route_softmax_topk(logits: jax.Array, k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
  """Mixtral / Qwen3-MoE: softmax over all E experts, the top k; weights summing to 1 if `renormalize`.

  logits [T, E] float32 -> (weights [T, A] float32, ids [T, A] int32).
  """
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  weights, ids = jax.lax.top_k(probs, k)
  if renormalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, ids.astype(jnp.int32)


def route_deepseek_v3(logits: jax.Array, bias: jax.Array | None, k: int, n_group: int, topk_group: int,
                      scaling: float, renormalize: bool) -> tuple[jax.Array, jax.Array]:
  """DeepSeek-V3 (noaux_tc): sigmoid scores, group-limited top-k on scores + bias.

  logits [T, E] float32, bias [E] (None: zeros) -> (weights [T, A] float32, ids [T, A] int32).
  The bias only steers the choice; the weights are the chosen experts' plain
  sigmoid scores (renormalized if asked), times `scaling`.
  """
  T, E = logits.shape
  scores = jax.nn.sigmoid(logits.astype(jnp.float32))  # [T, E]
  choice = scores if bias is None else scores + bias.astype(jnp.float32)
  if n_group > 1:
    grouped = choice.reshape(T, n_group, E // n_group)  # [T, G, E/G]
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]: best 2 of each group
    _, top_groups = jax.lax.top_k(group_scores, topk_group)  # [T, topk_group]
    keep = jnp.any(top_groups[:, :, None] == jnp.arange(n_group), axis=1)  # [T, G]
    choice = jnp.where(jnp.repeat(keep, E // n_group, axis=1), choice, -jnp.inf)
  _, ids = jax.lax.top_k(choice, k)
  weights = jnp.take_along_axis(scores, ids, axis=-1)
  if renormalize:
    # transformers adds 1e-20: sigmoid weights can all be tiny, never all zero in float32.
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  return weights * scaling, ids.astype(jnp.int32)


def route_topk_softmax(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """GPT-OSS: the top k logits, softmaxed among themselves.

  logits [T, E] float32 (the router bias already added) -> (weights [T, A] float32, ids [T, A] int32).
  """
  top, ids = jax.lax.top_k(logits.astype(jnp.float32), k)
  return jax.nn.softmax(top, axis=-1), ids.astype(jnp.int32)


def route(p: dict[str, Any], cfg: ModelConfig, x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The config's router on x [T, D] -> (weights [T, A] float32, ids [T, A] int32)."""
  logits = router_logits(x, p["router"])
  if cfg.router_logit_bias:
    logits = logits + p["router_logit_bias"].astype(jnp.float32)
  if cfg.scoring_func == "topk_softmax":
    return route_topk_softmax(logits, cfg.num_experts_per_token)
  if cfg.scoring_func == "sigmoid":
    return route_deepseek_v3(logits, p.get("router_bias"), cfg.num_experts_per_token, cfg.n_group,
                             cfg.topk_group, cfg.routed_scaling_factor, cfg.norm_topk_prob)
  return route_softmax_topk(logits, cfg.num_experts_per_token, cfg.norm_topk_prob)


def silu_glu(gate: jax.Array, up: jax.Array) -> jax.Array:
  return jax.nn.silu(gate) * up


def expert_activation(cfg: ModelConfig) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """act(gate, up) of the config's experts: SwiGLU, or GPT-OSS's clamped form."""
  if cfg.swiglu_limit is None:
    return silu_glu
  return functools.partial(clamped_swiglu, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha)


def grouped_swiglu(x: jax.Array, ids: jax.Array, weights: jax.Array, w_gate: jax.Array,
                   w_up: jax.Array, w_down: jax.Array, biases: tuple | None = None,
                   act: Callable[[jax.Array, jax.Array], jax.Array] = silu_glu) -> jax.Array:
  """sum_a weights[t, a] * expert_{ids[t, a]}(x[t]) for x [T, D], ids / weights [T, A].

  w_gate, w_up [E, D, F], w_down [E, F, D]; `biases` (b_gate, b_up [E, F],
  b_down [E, D]) are added to each expert's projections (GPT-OSS); `act(gate,
  up)` is the gated activation. The R = T * A token copies are
  sorted by expert so `ragged_dot` computes each copy with its own expert
  only; the result is unsorted and combined in float32, then cast to x's dtype.
  Fewer copies than experts (R < E, decode) take `_per_copy_swiglu` instead.
  """
  T, A = ids.shape
  E = w_gate.shape[0]
  if T * A < E:  # static: small decode buckets
    return _per_copy_swiglu(x, ids, weights, w_gate, w_up, w_down, biases, act)
  return _ragged_swiglu(x, ids, weights, w_gate, w_up, w_down, biases, act)


def expert_dot(xs: jax.Array, w: Any, group_sizes: jax.Array, expert: jax.Array) -> jax.Array:
  """ragged_dot(xs [R, I], w [E, I, O], group_sizes [E]) -> [R, O] in xs's dtype, for float or
  per-channel quantized experts; expert [R]: each row's expert (rows past the groups, which
  ragged_dot leaves zero, may name any)."""
  if not is_quantized(w):
    return jax.lax.ragged_dot(xs, w, group_sizes)
  values = jnp.swapaxes(w.values, 1, 2).astype(xs.dtype)  # [E, O, I] -> [E, I, O]
  y = jax.lax.ragged_dot(xs, values, group_sizes, preferred_element_type=jnp.float32)
  return (y * take(w.scales[:, 0], expert)).astype(xs.dtype)


def per_copy_dot(eq: str, x: jax.Array, w: Any, ids: jax.Array) -> jax.Array:
  """einsum(eq, x, w[ids]) -> [T, A, O] for ids [T, A]: each token copy against its own expert's
  weight [I, O] (float, or quantized: the A gathered experts converted, their scales after)."""
  if not is_quantized(w):
    return jnp.einsum(eq, x, take(w, ids))
  values = jnp.swapaxes(take(w.values, ids), -1, -2).astype(x.dtype)  # [T, A, O, I] -> [T, A, I, O]
  y = jnp.einsum(eq, x, values, preferred_element_type=jnp.float32)
  return (y * take(w.scales, ids)[:, :, 0]).astype(x.dtype)


def _ragged_swiglu(x, ids, weights, w_gate, w_up, w_down, biases=None, act=silu_glu) -> jax.Array:
  T, A = ids.shape
  E = w_gate.shape[0]
  flat = ids.reshape(-1)  # [R]: copy r = t * A + a
  order = jnp.argsort(flat, stable=True)  # [R] copies grouped by expert
  group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)  # [E]
  expert = flat[order]  # [R] each sorted copy's expert
  xs = jnp.take(x, order // A, axis=0)  # [R, D]
  gate = expert_dot(xs, w_gate, group_sizes, expert)  # [R, F]
  up = expert_dot(xs, w_up, group_sizes, expert)
  if biases is not None:
    b_gate, b_up, b_down = biases
    gate, up = gate + b_gate[expert], up + b_up[expert]
  ys = expert_dot(act(gate, up).astype(x.dtype), w_down, group_sizes, expert)  # [R, D]
  if biases is not None:
    ys = ys + b_down[expert]
  y = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True).reshape(T, A, -1)  # [T, A, D]
  out = jnp.einsum("TAD,TA->TD", y.astype(jnp.float32), weights.astype(jnp.float32))
  return out.astype(x.dtype)


def _per_copy_swiglu(x, ids, weights, w_gate, w_up, w_down, biases=None, act=silu_glu) -> jax.Array:
  """grouped_swiglu for fewer token copies than experts (small decode steps): each copy reads
  its own expert's weights, R < E expert weights in all.

  XLA CPU lowers ragged_dot to a masked product over every group (as much work as running all
  E experts on every copy); here a decode step of one token reads 2 of 8 experts. The gather
  wins by most at one token and less with each token added; from R = E on, ragged_dot is
  ahead.
  """
  g = per_copy_dot("TD,TADF->TAF", x, w_gate, ids)  # [T, A, F]
  u = per_copy_dot("TD,TADF->TAF", x, w_up, ids)
  if biases is not None:
    b_gate, b_up, b_down = biases
    g, u = g + b_gate[ids], u + b_up[ids]
  y = per_copy_dot("TAF,TAFD->TAD", act(g, u).astype(x.dtype), w_down, ids)
  if biases is not None:
    y = y + b_down[ids]
  out = jnp.einsum("TAD,TA->TD", y.astype(jnp.float32), weights.astype(jnp.float32))
  return out.astype(x.dtype)


def moe_ffn(p: dict[str, Any], cfg: ModelConfig, x: jax.Array, valid: jax.Array | None = None
            ) -> tuple[jax.Array, RouterStats]:
  """The MoE FFN of one layer on x [T, D] -> ([T, D], RouterStats).

  `valid` [T] bool marks real tokens (padding is routed like any token, since
  shapes are static, but not counted in the stats). The stats count logical experts, also
  when the weights are laid out by slot (an EPLB placement, models/eplb.py). With experts split over a mesh (set by
  the runner while tracing), the expert-parallel all-to-all FFN runs instead
  (models/expert_parallel.py).
  """
  from jaxinfer.models import expert_parallel  # imports this module
  ep = expert_parallel.active()
  if ep is not None:
    return ep(p, cfg, x, valid)
  weights, ids = route(p, cfg, x)
  slots = ids
  if eplb.SLOTS_KEY in p:  # experts laid out by slot (models/eplb.py): replicas share the rows
    slots = eplb.assign_slots(ids, p[eplb.SLOTS_KEY], p[eplb.REPLICAS_KEY], 0)
  biases = (p["b_gate"], p["b_up"], p["b_down"]) if cfg.expert_bias else None
  out = grouped_swiglu(x, slots, weights, p["w_gate"], p["w_up"], p["w_down"], biases,
                       expert_activation(cfg))
  if "shared" in p:
    s = p["shared"]
    shared = swiglu_mlp(x, s["w_gate"], s["w_up"], s["w_down"])
    if "gate" in s:  # Qwen2-MoE: sigmoid(x . w) scales the shared expert per token
      shared = shared * jax.nn.sigmoid(router_logits(x, s["gate"])).astype(x.dtype)
    out = out + shared
  count = None if valid is None else jnp.repeat(valid.astype(jnp.int32), ids.shape[1])
  stats = RouterStats(jnp.bincount(ids.reshape(-1), weights=count, length=cfg.num_experts).astype(jnp.int32))
  return out, stats


def reference_moe_ffn(p: dict[str, Any], cfg: ModelConfig, x: jax.Array) -> np.ndarray:
  """Token by token, expert by expert in float64 numpy, no sorting and no ragged_dot: the tests'
  reference (the routing itself comes from `route`, which the router tests check)."""
  weights, ids = (np.asarray(a) for a in route(p, cfg, x))
  w = {k: np.asarray(v, np.float64) for k, v in p.items() if k != "shared"}
  x = np.asarray(x, np.float64)

  def swiglu(h, gate, up, down):
    g = h @ gate
    return (g / (1 + np.exp(-g)) * (h @ up)) @ down

  def expert(h, e):
    if not cfg.expert_bias and cfg.swiglu_limit is None:
      return swiglu(h, w["w_gate"][e], w["w_up"][e], w["w_down"][e])
    g = h @ w["w_gate"][e] + (w["b_gate"][e] if cfg.expert_bias else 0)
    u = h @ w["w_up"][e] + (w["b_up"][e] if cfg.expert_bias else 0)
    if cfg.swiglu_limit is None:
      act = g / (1 + np.exp(-g)) * u
    else:
      lim, alpha = cfg.swiglu_limit, cfg.swiglu_alpha
      g, u = np.minimum(g, lim), np.clip(u, -lim, lim)
      act = (u + 1) * g / (1 + np.exp(-alpha * g))
    return act @ w["w_down"][e] + (w["b_down"][e] if cfg.expert_bias else 0)

  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    for a in range(ids.shape[1]):
      out[t] += weights[t, a] * expert(x[t], ids[t, a])
  if "shared" in p:
    s = {k: np.asarray(v, np.float64) for k, v in p["shared"].items()}
    shared = swiglu(x, s["w_gate"], s["w_up"], s["w_down"])
    if "gate" in s:
      shared = shared / (1 + np.exp(-(x @ s["gate"])))
    out += shared
  return out
