"""ModelConfig: one frozen, hashable description of a model's architecture.

It is passed explicitly to every model function (and is a static argument of
every jitted one, hence hashable). Built from a Hugging Face `config.json`
(`from_hf`) or from GGUF metadata (`from_gguf`), stored beside converted
checkpoints (`to_dict` / `from_dict`). The MoE, MLA and MTP fields are part of
the shape now so those models slot in without a redesign; dense models leave
them at zero.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxinfer.errors import UnsupportedModelError

# HF model_type / GGUF general.architecture values we implement.
DENSE_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling: `kind` is 'linear', 'llama3' (Llama 3.1 style) or 'yarn'.

  yarn (YaRN, Peng et al. 2023, sec. 3.2-3.4; DeepSeek-V3's long context):
  frequencies between the wavelengths set by beta_fast and beta_slow
  rotations over `original_max_position_embeddings` are ramped from kept to
  divided by `factor`; the rotated dims are scaled by `attention_factor`
  (None: derived from factor, mscale and mscale_all_dim as Hugging Face
  does), and MLA's softmax scale by mscale(factor, mscale_all_dim) ** 2
  (DeepSeek-V2 appendix). mscale / mscale_all_dim 0 mean absent; `truncate`
  rounds the ramp's ends to whole dims.
  """

  kind: str
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 0.0
  mscale_all_dim: float = 0.0
  attention_factor: float | None = None
  truncate: bool = True

  def __post_init__(self):
    if self.kind not in ("linear", "llama3", "yarn"):
      raise UnsupportedModelError(
          f"rope scaling type {self.kind!r} is not supported (supported: linear, llama3, yarn)")
    if self.factor <= 0:
      raise UnsupportedModelError(f"rope scaling factor must be > 0, got {self.factor}")
    if self.kind == "yarn":
      if self.original_max_position_embeddings <= 0:
        raise UnsupportedModelError(
            f"yarn original_max_position_embeddings must be > 0, got {self.original_max_position_embeddings}")
      if not self.beta_fast > 0 or not self.beta_slow > 0:
        raise UnsupportedModelError(
            f"yarn beta_fast={self.beta_fast} and beta_slow={self.beta_slow} must be > 0")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  architecture: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-6
  max_position_embeddings: int = 4096
  tie_word_embeddings: bool = False
  attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
  qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
  sliding_window: int | None = None  # each query sees at most this many keys (Mistral)
  # Mixture of experts (Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS): a later issue.
  num_experts: int = 0
  num_experts_per_token: int = 0
  moe_intermediate_size: int = 0
  num_shared_experts: int = 0
  # Multi-head latent attention (DeepSeek-V3): a later issue.
  kv_lora_rank: int = 0
  q_lora_rank: int = 0
  qk_rope_head_dim: int = 0
  qk_nope_head_dim: int = 0
  v_head_dim: int = 0
  # Multi-token prediction modules (DeepSeek-V3 MTP): a later issue.
  num_mtp_layers: int = 0
  name: str = ""

  def __post_init__(self):
    if self.architecture not in DENSE_ARCHITECTURES:
      raise UnsupportedModelError(
          f"architecture {self.architecture!r} is not supported "
          f"(supported: {', '.join(DENSE_ARCHITECTURES)})")
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
      value = getattr(self, field)
      if not isinstance(value, int) or value <= 0:
        raise UnsupportedModelError(f"config field {field} must be a positive int, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise UnsupportedModelError(
          f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for RoPE")
    if self.sliding_window is not None and self.sliding_window <= 0:
      raise UnsupportedModelError(f"sliding_window must be > 0, got {self.sliding_window}")
    if self.num_experts or self.kv_lora_rank or self.num_mtp_layers:
      raise UnsupportedModelError(
          f"{self.name or self.architecture}: MoE, MLA and MTP models are not implemented yet")

  @property
  def num_queries_per_kv(self) -> int:
    return self.num_heads // self.num_kv_heads

  # ---- serialization -------------------------------------------------------

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
    d = dict(d)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - known
    if unknown:
      raise UnsupportedModelError(f"unknown ModelConfig fields {sorted(unknown)}")
    if d.get("rope_scaling"):
      d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    return cls(**d)

  # ---- Hugging Face config.json -------------------------------------------

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any]) -> "ModelConfig":
    """Builds a config from a Hugging Face `config.json` dict (transformers 4.x or 5.x)."""
    model_type = hf.get("model_type")
    if model_type not in DENSE_ARCHITECTURES:
      raise UnsupportedModelError(
          f"model_type {model_type!r} is not supported (supported: {', '.join(DENSE_ARCHITECTURES)})")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
      raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu)")
    if hf.get("mlp_bias"):
      raise UnsupportedModelError("mlp_bias=true is not supported")
    try:
      hidden = int(hf["hidden_size"])
      heads = int(hf["num_attention_heads"])
      cfg = dict(
          architecture=model_type,
          vocab_size=int(hf["vocab_size"]),
          hidden_size=hidden,
          intermediate_size=int(hf["intermediate_size"]),
          num_layers=int(hf["num_hidden_layers"]),
          num_heads=heads,
          num_kv_heads=int(hf.get("num_key_value_heads") or heads),
          head_dim=int(hf.get("head_dim") or hidden // heads),
          rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
          max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
          tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
          name=str(hf.get("_name_or_path") or model_type),
      )
    except KeyError as e:
      raise UnsupportedModelError(f"config.json lacks the field {e.args[0]!r}") from None
    # transformers 5 spells rope settings as `rope_parameters`; older configs
    # use `rope_theta` + `rope_scaling`.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    cfg["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
      cfg["rope_scaling"] = RopeScaling(
          kind=rope_type,
          factor=float(rope.get("factor", 1.0)),
          low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
          high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
          original_max_position_embeddings=int(
              rope.get("original_max_position_embeddings", 8192)),
      )
    if model_type == "qwen2":
      cfg["attention_bias"] = True  # Qwen2 always has q/k/v biases
    else:
      cfg["attention_bias"] = bool(hf.get("attention_bias", False))
    cfg["qk_norm"] = model_type == "qwen3"
    window = hf.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
      window = None
    cfg["sliding_window"] = int(window) if window else None
    return cls(**cfg)

  # ---- GGUF metadata -------------------------------------------------------

  @classmethod
  def from_gguf(cls, meta: Mapping[str, Any], tensor_names: set[str]) -> "ModelConfig":
    """Builds a config from GGUF key/value metadata (already decoded to Python values)."""
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
      raise UnsupportedModelError(
          f"GGUF architecture {arch!r} is not supported (supported: llama, qwen2, qwen3)")
    if "rope_freqs.weight" in tensor_names:
      raise UnsupportedModelError("GGUF files with a rope_freqs tensor (llama3 rope) are not supported")

    def get(key, default=None):
      value = meta.get(f"{arch}.{key}", default)
      if value is None:
        raise UnsupportedModelError(f"GGUF metadata lacks {arch}.{key}")
      return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    if not vocab and "token_embd.weight" not in tensor_names:
      raise UnsupportedModelError("GGUF metadata has no vocabulary size")
    scaling = None
    if meta.get(f"{arch}.rope.scaling.type") not in (None, "none"):
      scaling = RopeScaling(kind=meta[f"{arch}.rope.scaling.type"],
                            factor=float(get("rope.scaling.factor")))
    return cls(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        name=str(meta.get("general.name") or arch),
    )
