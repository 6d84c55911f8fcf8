"""One spec per weight; everything else about parameters derives from it.

`param_specs(cfg)` returns the parameter pytree with a `WeightSpec` at every
leaf: shape, logical axis names, initializer and the weight's name in Hugging
Face and GGUF checkpoints. From that one tree come random init
(`init_params`), allocation-free shapes (`abstract_params`, for
`jax.eval_shape`-style checks and orbax restore targets), shardings
(`jaxinfer.sharding.param_shardings`) and checkpoint import
(`jaxinfer.checkpoint`). That tree is the checkpoints' layout; the engine runs
on one with q/k/v and gate/up joined per dense layer (`fuse_params`,
`runtime_specs`: "fused projections" below).

Layout legend: V vocab, D hidden (embed), H query heads, K kv heads,
Dh head_dim, F mlp (intermediate) width, E experts. Linear weights are stored
[in, out] so layers are plain einsums ('BTD,DHK->BTHK').

Each layer's specs come from `layer_specs(cfg, i)`, which picks the FFN: the
dense SwiGLU (w_gate, w_up, w_down) or, in an MoE layer, a `moe` subtree:

  router     [D, E]     logical ('embed', None): every device needs all E
                        logits of a token to pick its top-k, so it is not split
  router_bias [E]       DeepSeek-V3's e_score_correction_bias
  router_logit_bias [E] GPT-OSS's router bias
  w_gate/w_up [E, D, F] ('experts', 'embed', 'mlp')
  w_down     [E, F, D]  ('experts', 'mlp', 'embed')
  b_gate/b_up [E, F], b_down [E, D]  GPT-OSS's expert biases
  shared     {w_gate, w_up, w_down[, gate]}  a dense SwiGLU every token takes

Experts are stacked along a leading 'experts' axis (what `ragged_dot` and an
expert-parallel split want). Hugging Face checkpoints, Hub ones and what
transformers 5.23 `save_pretrained` writes alike, hold one [out, in] tensor
per expert (`...experts.{e}.gate_proj.weight`): a spec whose `hf` name has
'{e}' is stacked from those; GGUF's `ffn_*_exps` tensors are already stacked.
GPT-OSS keeps all experts in one tensor, [in, out] and with gate and up
fused: `gate_up_proj` [E, D, 2F] holds gate in the even columns and up in the
odd ones (`WeightSpec.interleave`), its bias [E, 2F] alike.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class WeightSpec:
  """A weight: its shape, logical axes, initializer, and where checkpoints keep it.

  `hf` and `gguf` are the tensor names in Hugging Face and GGUF files. Both
  formats store linear weights [out, in] (GGUF's numpy view is reversed from
  its header dims, which lands on the same order); `linear=True` says to
  transpose to our [in, out] before reshaping to `shape`.

  A stacked expert weight (first logical axis 'experts', shape [E, ...]) is
  E copies of one expert's weight (`one_expert()`); a name with '{e}' in it
  stands for E per-expert tensors, a name without for one stacked tensor
  [E, one expert's checkpoint shape...].
  """

  shape: tuple[int, ...]
  axes: tuple[str | None, ...]
  init: str  # 'normal' (fan-in scaled), 'ones', 'zeros'
  hf: str
  gguf: str
  linear: bool = False
  dtype: str | None = None  # None: the model dtype; quantized leaves say 'int8' / 'float32'
  # (i, n): the checkpoint tensor's last dim interleaves n weights and this one is
  # columns i, i + n, ... (GPT-OSS's gate_up_proj: gate even, up odd).
  interleave: tuple[int, int] | None = None
  # The LM head, or the embedding tied to it: int8 and int4 hold it in int8
  # (quant.leaf_layout), fp8 keeps it in the model dtype.
  head: bool = False
  # An MoE router (or Qwen2-MoE's shared-expert gate): its logits choose experts, so it is
  # read in float32 and never quantized.
  router: bool = False

  def __post_init__(self):
    assert len(self.shape) == len(self.axes), (self.shape, self.axes)

  @property
  def num_experts(self) -> int:
    """E for a stacked expert weight, else 0."""
    return self.shape[0] if self.axes and self.axes[0] == "experts" else 0

  def one_expert(self) -> "WeightSpec":
    assert self.num_experts, self
    return dataclasses.replace(self, shape=self.shape[1:], axes=self.axes[1:])

  def checkpoint_names(self, key: str) -> list[str]:
    """The tensors format `key` ('hf' or 'gguf') builds this weight from: one, or one per expert."""
    name = getattr(self, key)
    if "{e}" in name:
      return [name.format(e=e) for e in range(self.num_experts)]
    return [name]

  def checkpoint_shape(self, per_expert: bool = False) -> tuple[int, ...]:
    """The shape HF/GGUF files hold for this weight (for one expert's tensor if `per_expert`)."""
    if self.num_experts:
      one = self.one_expert().checkpoint_shape()
      return one if per_expert else (self.num_experts,) + one
    if not self.linear:  # per-head biases are stored flat: [H * Dh]
      shape = (int(np.prod(self.shape)),) if self.axes[0] in ("heads", "kv_heads") else self.shape
    else:
      fan_in = self.fan_in
      shape = (int(np.prod(self.shape)) // fan_in, fan_in)
    if self.interleave:
      shape = shape[:-1] + (shape[-1] * self.interleave[1],)
    return tuple(shape)

  @property
  def fan_in(self) -> int:
    # wo [H, Dh, D] reads H*Dh inputs; every other linear reads its first dim.
    if self.num_experts:
      return self.one_expert().fan_in
    if self.axes[:2] == ("heads", "head_dim"):
      return self.shape[0] * self.shape[1]
    return self.shape[0]

  def from_checkpoint(self, array: np.ndarray) -> np.ndarray:
    """Turns a tensor in HF/GGUF layout into ours; the caller has checked its shape.

    For a stacked expert weight, `array` is [E, one expert's checkpoint shape...]
    (one stacked tensor, or the per-expert tensors stacked by the caller).
    """
    if self.num_experts:
      one = self.one_expert()
      return np.stack([one.from_checkpoint(np.asarray(a)) for a in array])
    if self.interleave:
      i, n = self.interleave
      array = array[..., i::n]
    if self.linear:
      array = array.T
    return array.reshape(self.shape)


def is_spec(x: Any) -> bool:
  return isinstance(x, WeightSpec)


def param_specs(cfg: ModelConfig, quantization: str | None = None) -> dict[str, Any]:
  """The parameter pytree of the decoder, with a WeightSpec at every leaf.

  quantization ('int8', 'fp8', 'int4'): each linear weight is a `QuantizedWeight` of
  specs (values in the format's dtype, float32 scales (int4: float16), and int4's mins; jaxinfer/quant.py).
  The LM head, or the embedding tied to it, is int8 under int8 and int4; groups and mins
  per weight as quant.leaf_layout says.
  """
  if quantization is not None:
    from jaxinfer.quant import check_quantizable, leaf_spec, parse_quantization
    parse_quantization(quantization)
    specs = param_specs(cfg)
    check_quantizable(specs, quantization)
    return jax.tree.map(lambda s: leaf_spec(s, quantization), specs, is_leaf=is_spec)
  D, V = cfg.hidden_size, cfg.vocab_size
  specs: dict[str, Any] = {
      "embed": WeightSpec((V, D), ("vocab", "embed"), "normal", "model.embed_tokens.weight",
                          "token_embd.weight", head=cfg.tie_word_embeddings),
      "layers": [layer_specs(cfg, i) for i in range(cfg.num_layers)],
      "final_norm": WeightSpec((D,), ("embed",), "ones", "model.norm.weight", "output_norm.weight"),
  }
  if not cfg.tie_word_embeddings:
    specs["lm_head"] = WeightSpec((D, V), ("embed", "vocab"), "normal", "lm_head.weight",
                                  "output.weight", linear=True, head=True)
  return specs


def model_dtype(params: Any):
  """The activation (and KV cache) dtype of a param tree: its final norm's, which no
  quantization touches (the embedding may be int8)."""
  return params["final_norm"].dtype


def layer_specs(cfg: ModelConfig, i: int) -> dict[str, Any]:
  """Decoder layer i: norms, attention, and the FFN its config asks for (dense or MoE)."""
  D = cfg.hidden_size
  hf, gg = f"model.layers.{i}.", f"blk.{i}."
  if cfg.kv_lora_rank:  # DeepSeek-V2/V3 multi-head latent attention (its specs hold attn_norm too)
    from jaxinfer.models.mla import mla_specs  # mla imports this module
    attention = mla_specs(cfg, i)
  else:
    attention = {"attn_norm": WeightSpec((D,), ("embed",), "ones", hf + "input_layernorm.weight",
                                         gg + "attn_norm.weight"),
                 **attention_specs(cfg, i)}
  spec: dict[str, Any] = {
      **attention,
      "mlp_norm": WeightSpec((D,), ("embed",), "ones", hf + "post_attention_layernorm.weight",
                             gg + "ffn_norm.weight"),
  }
  if cfg.is_moe_layer(i):
    spec["moe"] = moe_specs(cfg, i)
  else:
    spec.update(swiglu_specs(D, cfg.intermediate_size, hf + "mlp.", gg, "", ("embed", "mlp")))
  return spec


def attention_specs(cfg: ModelConfig, i: int) -> dict[str, WeightSpec]:
  """Grouped-query attention: q/k/v/o projections, optional q/k/v biases and q/k norms."""
  D, H, K, Dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  hf, gg = f"model.layers.{i}.self_attn.", f"blk.{i}."
  spec = {
      "wq": WeightSpec((D, H, Dh), ("embed", "heads", "head_dim"), "normal",
                       hf + "q_proj.weight", gg + "attn_q.weight", linear=True),
      "wk": WeightSpec((D, K, Dh), ("embed", "kv_heads", "head_dim"), "normal",
                       hf + "k_proj.weight", gg + "attn_k.weight", linear=True),
      "wv": WeightSpec((D, K, Dh), ("embed", "kv_heads", "head_dim"), "normal",
                       hf + "v_proj.weight", gg + "attn_v.weight", linear=True),
      "wo": WeightSpec((H, Dh, D), ("heads", "head_dim", "embed"), "normal",
                       hf + "o_proj.weight", gg + "attn_output.weight", linear=True),
  }
  if cfg.attention_bias:
    spec["bq"] = WeightSpec((H, Dh), ("heads", "head_dim"), "zeros", hf + "q_proj.bias", gg + "attn_q.bias")
    spec["bk"] = WeightSpec((K, Dh), ("kv_heads", "head_dim"), "zeros", hf + "k_proj.bias", gg + "attn_k.bias")
    spec["bv"] = WeightSpec((K, Dh), ("kv_heads", "head_dim"), "zeros", hf + "v_proj.bias", gg + "attn_v.bias")
  if cfg.attention_out_bias:
    spec["bo"] = WeightSpec((D,), ("embed",), "zeros", hf + "o_proj.bias", gg + "attn_output.bias")
  if cfg.attention_sinks:
    spec["sinks"] = WeightSpec((H,), ("heads",), "zeros", hf + "sinks", gg + "attn_sinks.weight")
  if cfg.qk_norm:
    spec["q_norm"] = WeightSpec((Dh,), ("head_dim",), "ones", hf + "q_norm.weight", gg + "attn_q_norm.weight")
    spec["k_norm"] = WeightSpec((Dh,), ("head_dim",), "ones", hf + "k_norm.weight", gg + "attn_k_norm.weight")
  return spec


def swiglu_specs(D: int, F: int, hf: str, gg: str, gg_suffix: str, axes: tuple[str, str],
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 experts: int = 0) -> dict[str, WeightSpec]:
  """w_gate, w_up [D, F] and w_down [F, D]; with `experts`, E of each stacked: [E, D, F], [E, F, D].

  `hf` is the tensor name prefix ('{e}' in it for per-expert tensors); GGUF
  names are blk.N.ffn_{gate,up,down}<gg_suffix>.weight.
  """
  lead, lead_axes = ((experts,), ("experts",)) if experts else ((), ())
  g, u, d = names
  return {
      "w_gate": WeightSpec(lead + (D, F), lead_axes + axes, "normal", f"{hf}{g}.weight",
                           f"{gg}ffn_gate{gg_suffix}.weight", linear=True),
      "w_up": WeightSpec(lead + (D, F), lead_axes + axes, "normal", f"{hf}{u}.weight",
                         f"{gg}ffn_up{gg_suffix}.weight", linear=True),
      "w_down": WeightSpec(lead + (F, D), lead_axes + axes[::-1], "normal", f"{hf}{d}.weight",
                           f"{gg}ffn_down{gg_suffix}.weight", linear=True),
  }


def moe_specs(cfg: ModelConfig, i: int) -> dict[str, Any]:
  """Router, stacked routed experts and optional shared experts of MoE layer i."""
  D, E, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  gg = f"blk.{i}."
  if cfg.architecture == "gpt_oss":
    return gpt_oss_moe_specs(cfg, i)
  if cfg.architecture == "mixtral":
    hf, names = f"model.layers.{i}.block_sparse_moe.", ("w1", "w3", "w2")
  else:
    hf, names = f"model.layers.{i}.mlp.", ("gate_proj", "up_proj", "down_proj")
  spec: dict[str, Any] = {
      "router": WeightSpec((D, E), ("embed", None), "normal", hf + "gate.weight",
                           gg + "ffn_gate_inp.weight", linear=True, router=True),
      **swiglu_specs(D, F, hf + "experts.{e}.", gg, "_exps", ("embed", "mlp"), names, experts=E),
  }
  if cfg.router_bias:
    spec["router_bias"] = WeightSpec((E,), (None,), "zeros", hf + "gate.e_score_correction_bias",
                                     gg + "exp_probs_b.bias")
  if cfg.num_shared_experts:
    # DeepSeek: `shared_experts` (n_shared_experts of them fused into one wider FFN);
    # Qwen2-MoE: one `shared_expert` behind a sigmoid gate.
    shared_hf = hf + ("shared_expert." if cfg.shared_expert_gate else "shared_experts.")
    spec["shared"] = swiglu_specs(D, cfg.shared_expert_intermediate_size, shared_hf, gg, "_shexp",
                                  ("embed", "mlp"))
    if cfg.shared_expert_gate:
      spec["shared"]["gate"] = WeightSpec((D, 1), ("embed", None), "normal",
                                          hf + "shared_expert_gate.weight",
                                          gg + "ffn_gate_inp_shexp.weight", linear=True, router=True)
  return spec


def gpt_oss_moe_specs(cfg: ModelConfig, i: int) -> dict[str, Any]:
  """GPT-OSS: a router with a bias, experts with biases, stacked [in, out] in the checkpoint with
  gate and up interleaved in one `gate_up_proj` [E, D, 2F] (what transformers 5.23 writes; Hub
  checkpoints' MXFP4 `*_blocks` / `*_scales` are dequantized into that by the HF reader)."""
  D, E, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  hf, gg = f"model.layers.{i}.mlp.", f"blk.{i}."
  ex = hf + "experts."

  def w(shape, axes, name, gguf, **kw):
    return WeightSpec((E,) + shape, ("experts",) + axes, "normal", ex + name, gg + gguf, **kw)

  def b(shape, axes, name, gguf, **kw):
    return WeightSpec((E,) + shape, ("experts",) + axes, "zeros", ex + name, gg + gguf, **kw)

  return {
      "router": WeightSpec((D, E), ("embed", None), "normal", hf + "router.weight",
                           gg + "ffn_gate_inp.weight", linear=True, router=True),
      "router_logit_bias": WeightSpec((E,), (None,), "zeros", hf + "router.bias", gg + "ffn_gate_inp.bias"),
      "w_gate": w((D, F), ("embed", "mlp"), "gate_up_proj", "ffn_gate_exps.weight", interleave=(0, 2)),
      "w_up": w((D, F), ("embed", "mlp"), "gate_up_proj", "ffn_up_exps.weight", interleave=(1, 2)),
      "w_down": w((F, D), ("mlp", "embed"), "down_proj", "ffn_down_exps.weight"),
      "b_gate": b((F,), ("mlp",), "gate_up_proj_bias", "ffn_gate_exps.bias", interleave=(0, 2)),
      "b_up": b((F,), ("mlp",), "gate_up_proj_bias", "ffn_up_exps.bias", interleave=(1, 2)),
      "b_down": b((D,), ("embed",), "down_proj_bias", "ffn_down_exps.bias"),
  }


def abstract_params(cfg: ModelConfig, dtype=jnp.float32, shardings=None,
                    quantization: str | None = None) -> Any:
  """ShapeDtypeStructs for every weight: no memory is allocated."""
  specs = param_specs(cfg, quantization)
  if shardings is None:
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype or dtype), specs, is_leaf=is_spec)
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype or dtype, sharding=sh),
                      specs, shardings, is_leaf=is_spec)


def count_params(tree: Any) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32,
                quantization: str | None = None) -> Any:
  """Random weights at the config's real shapes (normal with std 1/sqrt(fan_in)).

  With `quantization`, the same random weights quantized on the device, one weight at a
  time (an 8B model never exists in float32 whole), through the same functions as the
  converter's numpy quantization (tests/test_quant.py bounds how far the two differ).
  """
  specs = param_specs(cfg)
  if quantization is not None:
    from jaxinfer.quant import check_quantizable, leaf_format, parse_quantization, quantize_leaf
    parse_quantization(quantization)
    check_quantizable(specs, quantization)
  leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
  keys = jax.random.split(key, len(leaves))

  def init(spec: WeightSpec, k: jax.Array) -> Any:
    if spec.init == "ones":
      return jnp.ones(spec.shape, dtype)
    if spec.init == "zeros":
      return jnp.zeros(spec.shape, dtype)
    fan_in = spec.fan_in if spec.linear or spec.num_experts else spec.shape[-1]
    w = jax.random.normal(k, spec.shape, jnp.float32) / math.sqrt(fan_in)
    fmt = quantization and leaf_format(spec, quantization)
    return quantize_leaf(spec, w, quantization) if fmt else w.astype(dtype)

  return jax.tree.unflatten(treedef, [init(s, k) for s, k in zip(leaves, keys)])


# ---- fused projections: the tree the model runs on ----------------------------------------------
#
# Checkpoints (HF, GGUF, our orbax) keep q, k, v and gate, up as separate weights under their
# Hugging Face names, and `param_specs` describes that tree. The engine runs on a tree where each
# dense (non-MLA, non-MoE) layer holds each group as one weight, so a decoder layer is four matmuls
# (qkv, o, gate_up, down) instead of seven: fewer, larger GEMVs per step at small batch.
#
#   wqkv      [D, K, G + 2, Dh]  ('embed', 'kv_heads', 'qkv', 'head_dim'), G = H / K: slot g < G of
#                                kv group k is query head k G + g (HF's GQA order: query head h reads
#                                kv head h // G), slot G its key, slot G + 1 its value
#   bqkv      [K, G + 2, Dh]     Qwen2's biases, alike
#   w_gate_up [D, 2, F]          ('embed', 'gate_up', 'mlp'): gate, then up
#
# Splitting 'kv_heads' (or 'mlp') over the 'model' mesh axis hands each device its kv heads
# together with exactly the query heads that read them (its gate and up columns), as the split of
# the separate weights did; the new axes 'qkv' and 'gate_up' are never split (sharding.RULES).
# Fusing concatenates along output axes only, and every format's scales (and mins) are per output
# channel or per (input group, output channel), so a quantized fused weight is the parts' values,
# scales and mins side by side: bit for bit what quantizing the fused float weight would give, and
# each output of the fused matmul is computed from the same numbers as in its part's own matmul.

FUSED: dict[str, tuple[str, ...]] = {"wqkv": ("wq", "wk", "wv"), "bqkv": ("bq", "bk", "bv"),
                                     "w_gate_up": ("w_gate", "w_up")}


def fused_groups(layer: dict[str, Any], names=tuple(FUSED)) -> dict[str, tuple[str, ...]]:
  """The fused weights (of `names`) a checkpoint-layout layer (specs or arrays) makes: every
  FUSED group all of whose parts it has. MLA layers (their own 'wq', no 'wk') and MoE layers
  (their FFN under 'moe') keep their weights as they are."""
  return {name: parts for name, parts in FUSED.items() if name in names and all(p in layer for p in parts)}


def _fuse_at(axes: tuple, name: str) -> int:
  """Where a part's axes (float, values or scales) have the axis the fused one splits: the
  query or kv heads, or 'mlp'."""
  if name == "w_gate_up":
    return axes.index("mlp")
  return next(i for i, a in enumerate(axes) if a in ("heads", "kv_heads"))


def _part_shape(shape: tuple, axes: tuple, name: str, K: int) -> tuple[tuple, int]:
  """A part's shape with its heads axis as [K, heads / K] (or a size-1 axis before 'mlp'), and the
  axis the parts are concatenated along."""
  i = _fuse_at(axes, name)
  if name == "w_gate_up":
    return shape[:i] + (1,) + shape[i:], i
  return shape[:i] + (K, shape[i] // K) + shape[i + 1:], i + 1


def _fused_axes(axes: tuple, name: str) -> tuple:
  i = _fuse_at(axes, name)
  if name == "w_gate_up":
    return axes[:i] + ("gate_up",) + axes[i:]
  return axes[:i] + ("kv_heads", "qkv") + axes[i + 1:]


def _fuse_spec(parts: list[WeightSpec], name: str, K: int) -> WeightSpec:
  first = parts[0]
  shapes = [_part_shape(p.shape, p.axes, name, K) for p in parts]
  at = shapes[0][1]
  shape = shapes[0][0][:at] + (sum(s[at] for s, _ in shapes),) + shapes[0][0][at + 1:]
  return dataclasses.replace(first, shape=shape, axes=_fused_axes(first.axes, name),
                             hf=" + ".join(p.hf for p in parts), gguf=" + ".join(p.gguf for p in parts))


def _fuse_leaves(name: str, leaves: list, specs: list[WeightSpec], K: int) -> Any:
  """One fused weight from its parts: float arrays, QuantizedWeights, or (spec trees) WeightSpecs
  or QuantizedWeights of WeightSpecs. `specs` are the parts' float specs (their logical axes)."""
  from jaxinfer.quant import QuantizedWeight, format_of, is_quantized, quantized_spec
  where = f"{name} ({' + '.join(s.hf for s in specs)})"
  if all(is_spec(x) for x in leaves):
    return _fuse_spec(leaves, name, K)
  if not any(is_quantized(x) for x in leaves):
    return _join(leaves, specs, name, K)
  if not all(is_quantized(x) for x in leaves):
    raise ValueError(f"{where}: some parts are quantized and some not; they cannot be one weight")
  if all(is_spec(x.values) for x in leaves):
    fuse = lambda xs: _fuse_spec(xs, name, K)
    mins = None if leaves[0].mins is None else fuse([x.mins for x in leaves])
    return QuantizedWeight(fuse([x.values for x in leaves]), fuse([x.scales for x in leaves]), mins)
  if len({format_of(x) for x in leaves}) > 1 or len({x.scales.shape[0] for x in leaves}) > 1:
    raise ValueError(f"{where}: its parts are held in different formats or groups "
                     f"({[(format_of(x), x.scales.shape[0]) for x in leaves]}); they cannot be one weight")
  layouts = [quantized_spec(s) for s in specs]  # the values' and scales' axes
  values = _join([x.values for x in leaves], [q.values for q in layouts], name, K)
  scales = _join([x.scales for x in leaves], [q.scales for q in layouts], name, K)
  mins = None
  if any(x.mins is not None for x in leaves):
    # GGUF Q8_0 blocks kept beside requantized int8 groups: a zero min is the symmetric group's.
    zeros = (jnp.zeros_like if isinstance(leaves[0].scales, jax.Array) else np.zeros_like)
    mins = _join([x.mins if x.mins is not None else zeros(x.scales) for x in leaves],
                 [q.scales for q in layouts], name, K)
  return QuantizedWeight(values, scales, mins)


def _join(arrays: list, specs: list[WeightSpec], name: str, K: int):
  """The parts (numpy or jax arrays of one component: float weights, values, scales or mins) side
  by side along the fused axis, each located by its own spec's axes (wq's 'heads', wk's
  'kv_heads')."""
  xp = jnp if any(isinstance(a, jax.Array) for a in arrays) else np
  shaped, at = [], 0
  for a, s in zip(arrays, specs):
    shape, at = _part_shape(tuple(a.shape), s.axes, name, K)
    shaped.append(a.reshape(shape))
  return xp.concatenate(shaped, axis=at)


def fuse_layers(cfg: ModelConfig, tree: Any, names=tuple(FUSED)) -> Any:
  """A checkpoint-layout tree (param_specs' layout: specs, or arrays numpy or jax, float or
  quantized) -> the tree the model runs on, each dense layer's FUSED groups (of `names`) joined.
  Layers already fused, MLA and MoE layers pass as they are; the rest of the tree too."""
  K = cfg.num_kv_heads
  float_specs = param_specs(cfg)["layers"]
  layers = []
  for layer, specs in zip(tree["layers"], float_specs):
    layer = dict(layer)
    for name, parts in fused_groups(layer, names).items():
      layer[name] = _fuse_leaves(name, [layer.pop(p) for p in parts], [specs[p] for p in parts], K)
    layers.append(layer)
  return {**tree, "layers": layers}


def runtime_specs(cfg: ModelConfig, quantization: str | None = None, names=tuple(FUSED)) -> dict[str, Any]:
  """param_specs in the layout the model runs on (fuse_layers)."""
  return fuse_layers(cfg, param_specs(cfg, quantization), names)


def fuse_params(cfg: ModelConfig, params: Any, shardings: Any = None, names=tuple(FUSED)) -> Any:
  """fuse_layers over weights. jax arrays: the parts are joined in one program whose results are
  placed by `shardings` (a tree like the fused params, e.g. sharding.param_shardings(...,
  fused=True), of which only the fused weights' entries are read; None: XLA's default device).
  Every other weight keeps its buffer, and the parts stay where they are (the caller owns them)."""
  if not any(isinstance(a, jax.Array) for a in jax.tree.leaves(params)):
    return fuse_layers(cfg, params, names)
  K = cfg.num_kv_heads
  float_specs = param_specs(cfg)["layers"]
  groups = [fused_groups(layer, names) for layer in params["layers"]]
  parts = [{name: {p: layer[p] for p in group} for name, group in g.items()}
           for layer, g in zip(params["layers"], groups)]

  def join(parts):  # (dicts come back key-sorted from the trace: parts are read by name)
    return [{name: _fuse_leaves(name, [d[p] for p in FUSED[name]], [specs[p] for p in FUSED[name]], K)
             for name, d in layer.items()} for layer, specs in zip(parts, float_specs)]

  out_shardings = None
  if shardings is not None:
    out_shardings = [{name: sh[name] for name in g} for g, sh in zip(groups, shardings["layers"])]
  joined = jax.jit(join, out_shardings=out_shardings)(parts)
  layers = []
  for layer, g, fused in zip(params["layers"], groups, joined):
    gone = {p for group in g.values() for p in group}
    layers.append({**{k: v for k, v in layer.items() if k not in gone}, **fused})
  return {**params, "layers": layers}


def unfuse_layer(cfg: ModelConfig, layer: dict[str, Any], i: int) -> dict[str, Any]:
  """Layer i of the runtime tree back in checkpoint layout (what writing it under its Hugging
  Face names needs, e.g. scripts/train_mtp.py's head): the inverse of fuse_layers. numpy or jax,
  float or quantized."""
  from jaxinfer.quant import QuantizedWeight, is_quantized, quantized_spec
  specs = layer_specs(cfg, i)
  K = cfg.num_kv_heads
  out = dict(layer)

  def split(a, parts: list[WeightSpec], name: str) -> list:
    _, at = _part_shape(parts[0].shape, parts[0].axes, name, K)
    sizes = [_part_shape(p.shape, p.axes, name, K)[0][at] for p in parts]
    cuts = np.cumsum(sizes)[:-1].tolist()
    xp = jnp if isinstance(a, jax.Array) else np
    pieces = xp.split(a, cuts, axis=at)
    if name == "w_gate_up":  # drop the size-1 axis
      return [p.reshape(p.shape[:at] + p.shape[at + 1:]) for p in pieces]
    return [p.reshape(p.shape[:at - 1] + (-1,) + p.shape[at + 1:]) for p in pieces]  # [K, n] -> heads

  for name, parts in FUSED.items():
    if name not in layer:
      continue
    w = out.pop(name)
    part_specs = [specs[p] for p in parts]
    if is_quantized(w):
      layouts = [quantized_spec(s) for s in part_specs]
      values = split(w.values, [q.values for q in layouts], name)
      scales = split(w.scales, [q.scales for q in layouts], name)
      mins = [None] * len(parts) if w.mins is None else split(w.mins, [q.scales for q in layouts], name)
      pieces = [QuantizedWeight(v, s, m) for v, s, m in zip(values, scales, mins)]
    else:
      pieces = split(w, part_specs, name)
    out.update(zip(parts, pieces))
  return out
