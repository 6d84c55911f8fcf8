"""One spec per weight; everything else about parameters derives from it.

`param_specs(cfg)` returns the parameter pytree with a `WeightSpec` at every
leaf: shape, logical axis names, initializer and the weight's name in Hugging
Face and GGUF checkpoints. From that one tree come random init
(`init_params`), allocation-free shapes (`abstract_params`, for
`jax.eval_shape`-style checks and orbax restore targets), shardings
(`jaxinfer.sharding.param_shardings`) and checkpoint import
(`jaxinfer.checkpoint`).

Layout legend: V vocab, D hidden (embed), H query heads, K kv heads,
Dh head_dim, F mlp (intermediate) width. Linear weights are stored [in, out]
so layers are plain einsums ('BTD,DHK->BTHK').
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
  """

  shape: tuple[int, ...]
  axes: tuple[str | None, ...]
  init: str  # 'normal' (fan-in scaled), 'ones', 'zeros'
  hf: str
  gguf: str
  linear: bool = False
  dtype: str | None = None  # None: the model dtype; quantized leaves say 'int8' / 'float32'

  def __post_init__(self):
    assert len(self.shape) == len(self.axes), (self.shape, self.axes)

  def checkpoint_shape(self) -> tuple[int, ...]:
    """The shape HF/GGUF files hold for this weight."""
    if not self.linear:  # per-head biases are stored flat: [H * Dh]
      return (int(np.prod(self.shape)),) if self.axes[0] in ("heads", "kv_heads") else self.shape
    fan_in = self.fan_in
    return (int(np.prod(self.shape)) // fan_in, fan_in)

  @property
  def fan_in(self) -> int:
    # wo [H, Dh, D] reads H*Dh inputs; every other linear reads its first dim.
    if self.axes[:2] == ("heads", "head_dim"):
      return self.shape[0] * self.shape[1]
    return self.shape[0]

  def from_checkpoint(self, array: np.ndarray) -> np.ndarray:
    """Turns a tensor in HF/GGUF layout into ours; the caller has checked its shape."""
    if self.linear:
      array = array.T
    return array.reshape(self.shape)


def is_spec(x: Any) -> bool:
  return isinstance(x, WeightSpec)


def param_specs(cfg: ModelConfig, quantization: str | None = None) -> dict[str, Any]:
  """The parameter pytree of a dense decoder, with a WeightSpec at every leaf.

  quantization='int8': each linear weight but the LM head is a
  `QuantizedWeight` of two specs (int8 values, per-channel float32 scales).
  """
  if quantization is not None:
    from jaxinfer.quant import parse_quantization, quantizable, quantized_spec
    parse_quantization(quantization)
    return jax.tree.map(lambda s: quantized_spec(s) if quantizable(s) else s, param_specs(cfg),
                        is_leaf=is_spec)
  D, H, K, Dh, F, V = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                       cfg.intermediate_size, cfg.vocab_size)

  def layer(i: int) -> dict[str, WeightSpec]:
    hf, gg = f"model.layers.{i}.", f"blk.{i}."
    spec = {
        "attn_norm": WeightSpec((D,), ("embed",), "ones", hf + "input_layernorm.weight",
                                gg + "attn_norm.weight"),
        "wq": WeightSpec((D, H, Dh), ("embed", "heads", "head_dim"), "normal",
                         hf + "self_attn.q_proj.weight", gg + "attn_q.weight", linear=True),
        "wk": WeightSpec((D, K, Dh), ("embed", "kv_heads", "head_dim"), "normal",
                         hf + "self_attn.k_proj.weight", gg + "attn_k.weight", linear=True),
        "wv": WeightSpec((D, K, Dh), ("embed", "kv_heads", "head_dim"), "normal",
                         hf + "self_attn.v_proj.weight", gg + "attn_v.weight", linear=True),
        "wo": WeightSpec((H, Dh, D), ("heads", "head_dim", "embed"), "normal",
                         hf + "self_attn.o_proj.weight", gg + "attn_output.weight", linear=True),
        "mlp_norm": WeightSpec((D,), ("embed",), "ones", hf + "post_attention_layernorm.weight",
                               gg + "ffn_norm.weight"),
        "w_gate": WeightSpec((D, F), ("embed", "mlp"), "normal", hf + "mlp.gate_proj.weight",
                             gg + "ffn_gate.weight", linear=True),
        "w_up": WeightSpec((D, F), ("embed", "mlp"), "normal", hf + "mlp.up_proj.weight",
                           gg + "ffn_up.weight", linear=True),
        "w_down": WeightSpec((F, D), ("mlp", "embed"), "normal", hf + "mlp.down_proj.weight",
                             gg + "ffn_down.weight", linear=True),
    }
    if cfg.attention_bias:
      spec["bq"] = WeightSpec((H, Dh), ("heads", "head_dim"), "zeros",
                              hf + "self_attn.q_proj.bias", gg + "attn_q.bias")
      spec["bk"] = WeightSpec((K, Dh), ("kv_heads", "head_dim"), "zeros",
                              hf + "self_attn.k_proj.bias", gg + "attn_k.bias")
      spec["bv"] = WeightSpec((K, Dh), ("kv_heads", "head_dim"), "zeros",
                              hf + "self_attn.v_proj.bias", gg + "attn_v.bias")
    if cfg.qk_norm:
      spec["q_norm"] = WeightSpec((Dh,), ("head_dim",), "ones", hf + "self_attn.q_norm.weight",
                                  gg + "attn_q_norm.weight")
      spec["k_norm"] = WeightSpec((Dh,), ("head_dim",), "ones", hf + "self_attn.k_norm.weight",
                                  gg + "attn_k_norm.weight")
    return spec

  specs: dict[str, Any] = {
      "embed": WeightSpec((V, D), ("vocab", "embed"), "normal", "model.embed_tokens.weight",
                          "token_embd.weight"),
      "layers": [layer(i) for i in range(cfg.num_layers)],
      "final_norm": WeightSpec((D,), ("embed",), "ones", "model.norm.weight", "output_norm.weight"),
  }
  if not cfg.tie_word_embeddings:
    specs["lm_head"] = WeightSpec((D, V), ("embed", "vocab"), "normal", "lm_head.weight",
                                  "output.weight", linear=True)
  return specs


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

  With `quantization`, the same random weights quantized (on the host).
  """
  if quantization is not None:
    from jaxinfer.quant import cast_floats, parse_quantization, quantize_tree
    parse_quantization(quantization)
    floats = jax.device_get(init_params(cfg, key, jnp.float32))
    return jax.device_put(cast_floats(quantize_tree(param_specs(cfg), floats), dtype))
  specs = param_specs(cfg)
  leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
  keys = jax.random.split(key, len(leaves))

  def init(spec: WeightSpec, k: jax.Array) -> jax.Array:
    if spec.init == "ones":
      return jnp.ones(spec.shape, dtype)
    if spec.init == "zeros":
      return jnp.zeros(spec.shape, dtype)
    fan_in = spec.fan_in if spec.linear else spec.shape[-1]
    return (jax.random.normal(k, spec.shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)

  return jax.tree.unflatten(treedef, [init(s, k) for s, k in zip(leaves, keys)])
