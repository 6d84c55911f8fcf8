"""ModelConfig: one frozen, hashable description of a model's architecture.

It is passed explicitly to every model function (and is a static argument of
every jitted one, hence hashable). Built from a Hugging Face `config.json`
(`from_hf`) or from GGUF metadata (`from_gguf`), stored beside converted
checkpoints (`to_dict` / `from_dict`). Dense models leave the MoE, MLA and
MTP fields at zero.

Mixture of experts (Mixtral, Qwen3-MoE, DeepSeek-V3): every layer not listed
in `mlp_only_layers` replaces its dense FFN by `num_experts` experts of width
`moe_intermediate_size`, `num_experts_per_token` of them per token, chosen by
the router that `scoring_func` names:

  softmax  softmax over the expert logits, top-k, renormalized to sum 1 when
           `norm_topk_prob` (Mixtral always; Qwen3-MoE as configured).
  sigmoid  DeepSeek-V3 (`topk_method` noaux_tc): sigmoid scores; the
           selection adds `e_score_correction_bias` (`router_bias`) and keeps
           only the experts of the `topk_group` best of `n_group` groups; the
           weights are the unbiased scores, renormalized when `norm_topk_prob`,
           times `routed_scaling_factor`.

  topk_softmax  GPT-OSS: the top-k of the expert logits (with the router's
           own bias, `router_logit_bias`), softmaxed among themselves. (The
           same weights as softmax + renormalized top-k, computed as GPT-OSS does.)

Shared experts (DeepSeek-V3, Qwen2-MoE) are one dense FFN of width
`shared_expert_intermediate_size` that every token also goes through, scaled
by sigmoid(x . w) when `shared_expert_gate` (Qwen2-MoE).

GPT-OSS adds: biases on every projection of the experts (`expert_bias`) and
on the attention output (`attention_out_bias`); a clamped SwiGLU in the
experts when `swiglu_limit` is set (gate clamped above and up on both sides
at the limit, out = (up + 1) * gate * sigmoid(swiglu_alpha * gate));
attention sinks (`attention_sinks`: a learned logit per head that joins each
softmax's denominator and has no value); and per-layer attention kinds
(`layer_types`: 'sliding_attention' layers see `sliding_window` keys,
'full_attention' layers all of them; empty: every layer is as
`sliding_window` says).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxinfer.errors import InvalidRequestError, UnsupportedModelError


def from_options(cls: type, options: Mapping[str, Any], name: str) -> Any:
  """cls(**options) for a frozen options dataclass given as a dict (LLM(speculative={...}),
  dp_balance, eplb); a key that is not a field is an InvalidRequestError listing the fields."""
  fields = sorted(f.name for f in dataclasses.fields(cls))
  unknown = sorted(set(options) - set(fields), key=repr)  # (keys of mixed types still sort)
  if unknown:
    raise InvalidRequestError(f"unknown {name} option(s) {unknown}; options are {fields}")
  return cls(**options)

# HF model_type / GGUF general.architecture values we implement.
DENSE_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
SCORING_FUNCS = ("softmax", "sigmoid", "topk_softmax")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling: `kind` is 'linear', 'llama3' (Llama 3.1 style) or 'yarn'.

  yarn (YaRN, Peng et al. 2023, sec. 3.2-3.4; DeepSeek-V3's long context):
  frequencies between the wavelengths set by beta_fast and beta_slow
  rotations over `original_max_position_embeddings` are ramped from kept to
  divided by `factor`; the rotated dims are scaled by `attention_factor`
  (None: derived from factor, mscale and mscale_all_dim as Hugging Face
  does), and MLA's softmax scale by mscale(factor, mscale_all_dim) ** 2
  (DeepSeek-V2 sec. 4.3). mscale / mscale_all_dim 0 mean absent; `truncate`
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
  layer_types: tuple[str, ...] = ()  # per layer 'full_attention' / 'sliding_attention' (GPT-OSS)
  attention_out_bias: bool = False  # the output projection carries a bias (GPT-OSS)
  attention_sinks: bool = False  # a learned softmax sink logit per query head (GPT-OSS)
  # Mixture of experts (see the module doc); num_experts=0: a dense model.
  num_experts: int = 0
  num_experts_per_token: int = 0
  moe_intermediate_size: int = 0
  mlp_only_layers: tuple[int, ...] = ()  # layers of an MoE model whose FFN is dense
  scoring_func: str = "softmax"
  norm_topk_prob: bool = True
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  router_bias: bool = False  # DeepSeek-V3's e_score_correction_bias (selection only)
  num_shared_experts: int = 0
  shared_expert_intermediate_size: int = 0
  shared_expert_gate: bool = False
  router_logit_bias: bool = False  # GPT-OSS: a bias added to the router logits (choice and weights)
  expert_bias: bool = False  # GPT-OSS: biases on the experts' gate, up and down projections
  swiglu_limit: float | None = None  # GPT-OSS's clamped SwiGLU in the experts (see the module doc)
  swiglu_alpha: float = 1.702
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
    if self.architecture not in ARCHITECTURES:
      raise UnsupportedModelError(
          f"architecture {self.architecture!r} is not supported "
          f"(supported: {', '.join(ARCHITECTURES)})")
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
    self._check_layer_types()
    self._check_moe()
    if self.num_mtp_layers:
      raise UnsupportedModelError(
          f"{self.name or self.architecture}: multi-token prediction layers are not implemented yet")

  def _check_layer_types(self) -> None:
    who = self.name or self.architecture
    if not self.layer_types:
      return
    if len(self.layer_types) != self.num_layers:
      raise UnsupportedModelError(f"{who}: layer_types has {len(self.layer_types)} entries for "
                                  f"{self.num_layers} layers")
    for i, kind in enumerate(self.layer_types):
      if kind not in LAYER_TYPES:
        raise UnsupportedModelError(f"{who}: layer_types[{i}]={kind!r} is not supported "
                                    f"(supported: {', '.join(LAYER_TYPES)})")
    if "sliding_attention" in self.layer_types and self.sliding_window is None:
      raise UnsupportedModelError(f"{who}: layer_types has sliding_attention layers but no sliding_window")

  def layer_sliding_window(self, i: int) -> int | None:
    """The window of layer i's attention (None: it sees every earlier key)."""
    if self.layer_types and self.layer_types[i] == "full_attention":
      return None
    return self.sliding_window

  def _check_moe(self) -> None:
    who = self.name or self.architecture
    if not self.num_experts:
      if self.architecture in MOE_ARCHITECTURES:
        raise UnsupportedModelError(f"{who}: architecture {self.architecture!r} needs num_experts > 0")
      if self.num_shared_experts or self.mlp_only_layers:
        raise UnsupportedModelError(f"{who}: shared experts / mlp_only_layers need num_experts > 0")
      return
    E, A = self.num_experts, self.num_experts_per_token
    if not isinstance(E, int) or E < 1:
      raise UnsupportedModelError(f"{who}: num_experts must be a positive int, got {E!r}")
    if not (isinstance(A, int) and 1 <= A <= E):
      raise UnsupportedModelError(
          f"{who}: num_experts_per_token={A!r} must be between 1 and num_experts={E}")
    if not isinstance(self.moe_intermediate_size, int) or self.moe_intermediate_size <= 0:
      raise UnsupportedModelError(
          f"{who}: moe_intermediate_size must be a positive int, got {self.moe_intermediate_size!r}")
    bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
    if bad:
      raise UnsupportedModelError(f"{who}: mlp_only_layers {bad} are not layers of a "
                                  f"{self.num_layers}-layer model")
    if self.scoring_func not in SCORING_FUNCS:
      raise UnsupportedModelError(f"{who}: router scoring_func {self.scoring_func!r} is not "
                                  f"supported (supported: {', '.join(SCORING_FUNCS)})")
    if self.scoring_func != "sigmoid" and (self.n_group > 1 or self.router_bias):
      # DeepSeek-V2's group_limited_greedy (softmax + max-per-group) is another router.
      raise UnsupportedModelError(f"{who}: group-limited routing (n_group={self.n_group}) and a "
                                  "router bias are only supported with scoring_func='sigmoid'")
    G, TG = self.n_group, self.topk_group
    if not (isinstance(G, int) and G >= 1 and E % G == 0):
      raise UnsupportedModelError(f"{who}: n_group={G!r} must divide num_experts={E}")
    if not (isinstance(TG, int) and 1 <= TG <= G):
      raise UnsupportedModelError(f"{who}: topk_group={TG!r} must be between 1 and n_group={G}")
    if G > 1 and E // G < 2:
      raise UnsupportedModelError(f"{who}: group-limited routing scores a group by its best 2 "
                                  f"experts, so each of the n_group={G} groups needs >= 2 experts")
    if TG * (E // G) < A:
      raise UnsupportedModelError(f"{who}: topk_group={TG} groups of {E // G} experts hold fewer "
                                  f"than num_experts_per_token={A}")
    if self.swiglu_limit is not None and not self.swiglu_limit > 0:
      raise UnsupportedModelError(f"{who}: swiglu_limit must be > 0, got {self.swiglu_limit}")
    if not self.routed_scaling_factor > 0:
      raise UnsupportedModelError(
          f"{who}: routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")
    if bool(self.num_shared_experts) != bool(self.shared_expert_intermediate_size):
      raise UnsupportedModelError(f"{who}: num_shared_experts={self.num_shared_experts} and "
                                  f"shared_expert_intermediate_size={self.shared_expert_intermediate_size} "
                                  "must both be set or both be 0")

  def is_moe_layer(self, i: int) -> bool:
    """Whether layer i's FFN is the mixture of experts (else the dense SwiGLU)."""
    return self.num_experts > 0 and i not in self.mlp_only_layers

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
    for key in ("mlp_only_layers", "layer_types"):  # JSON has lists; the config must stay hashable
      if key in d:
        d[key] = tuple(d[key])
    return cls(**d)

  # ---- Hugging Face config.json -------------------------------------------

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any]) -> "ModelConfig":
    """Builds a config from a Hugging Face `config.json` dict (transformers 4.x or 5.x)."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
      raise UnsupportedModelError(
          f"model_type {model_type!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
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
      # yarn's own settings, where the config gives them (RopeScaling's defaults otherwise).
      yarn = {k: float(rope[k]) for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                                          "attention_factor") if rope.get(k) is not None}
      if rope.get("truncate") is not None:
        yarn["truncate"] = bool(rope["truncate"])
      cfg["rope_scaling"] = RopeScaling(
          kind=rope_type,
          factor=float(rope.get("factor", 1.0)),
          low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
          high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
          original_max_position_embeddings=int(
              rope.get("original_max_position_embeddings", 8192)),
          **(yarn if rope_type == "yarn" else {}),
      )
    if model_type == "qwen2":
      cfg["attention_bias"] = True  # Qwen2 always has q/k/v biases
    elif model_type == "gpt_oss":
      bias = bool(hf.get("attention_bias", True))
      cfg["attention_bias"] = cfg["attention_out_bias"] = bias
    else:
      cfg["attention_bias"] = bool(hf.get("attention_bias", False))
    cfg["qk_norm"] = model_type in ("qwen3", "qwen3_moe")
    window = hf.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
      window = None
    cfg["sliding_window"] = int(window) if window else None
    if model_type == "gpt_oss":
      # Other families' configs may list layer_types too, but their windows follow their own
      # flags (use_sliding_window, max_window_layers); GPT-OSS's default alternates, sliding first.
      types = hf.get("layer_types")
      if types is None:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg["num_layers"])]
      cfg["layer_types"] = tuple(str(t) for t in types)
    if model_type in MOE_ARCHITECTURES:
      cfg.update(_moe_from_hf(model_type, hf, cfg["num_layers"]))
    return cls(**cfg)

  # ---- GGUF metadata -------------------------------------------------------

  @classmethod
  def from_gguf(cls, meta: Mapping[str, Any], tensor_names: set[str]) -> "ModelConfig":
    """Builds a config from GGUF key/value metadata (already decoded to Python values).

    Mixtral is llama.cpp's 'llama' with `llama.expert_count`; Qwen3-MoE is
    'qwen3moe'. Their routers renormalize the top-k unless
    `<arch>.expert_weights_norm` says false (llama.cpp's default for both);
    a layer without `blk.N.ffn_gate_inp.weight` has a dense FFN.
    """
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3", "qwen3moe"):
      raise UnsupportedModelError(
          f"GGUF architecture {arch!r} is not supported (supported: llama, qwen2, qwen3, qwen3moe)")
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
    num_layers = int(get("block_count"))
    moe: dict[str, Any] = {}
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if experts or arch == "qwen3moe":
      if arch not in ("llama", "qwen3moe"):
        raise UnsupportedModelError(f"GGUF architecture {arch!r} with experts is not supported")
      moe = dict(
          num_experts=int(get("expert_count")), num_experts_per_token=int(get("expert_used_count")),
          moe_intermediate_size=int(meta.get(f"{arch}.expert_feed_forward_length")
                                    or get("feed_forward_length")),
          norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)),
          mlp_only_layers=tuple(i for i in range(num_layers)
                                if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names))
    architecture = {"qwen3moe": "qwen3_moe", "llama": "mixtral" if experts else "llama"}.get(arch, arch)
    return cls(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
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
        **moe,
    )


def _moe_from_hf(model_type: str, hf: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
  """The MoE (and, for DeepSeek-V3, MLA) fields of a Hugging Face config.json."""
  def num(key, *alts, default=None):
    for k in (key, *alts):
      if hf.get(k) is not None:
        return hf[k]
    if default is None:
      raise UnsupportedModelError(f"config.json lacks the field {key!r} ({model_type})")
    return default

  out: dict[str, Any] = dict(num_experts_per_token=int(num("num_experts_per_tok")))
  if model_type == "mixtral":
    # Mixtral's experts are its FFN: intermediate_size is their width; the top-k always renormalize.
    out.update(num_experts=int(num("num_local_experts", "num_experts")),
               moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True)
  elif model_type == "qwen3_moe":
    E = int(num("num_experts", "num_local_experts"))
    step = int(num("decoder_sparse_step", default=1))
    if step < 1:
      raise UnsupportedModelError(f"decoder_sparse_step must be >= 1, got {step}")
    only = set(int(i) for i in hf.get("mlp_only_layers") or ())
    # Qwen3-MoE: layer i is sparse iff it is not listed and (i + 1) % decoder_sparse_step == 0.
    only |= {i for i in range(num_layers) if (i + 1) % step}
    if hf.get("shared_expert_intermediate_size"):
      raise UnsupportedModelError("qwen3_moe with shared experts is not supported")
    out.update(num_experts=E, moe_intermediate_size=int(num("moe_intermediate_size")),
               norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
               mlp_only_layers=tuple(sorted(only)))
  elif model_type == "deepseek_v3":
    scoring = hf.get("scoring_func", "sigmoid")
    method = hf.get("topk_method", "noaux_tc")
    if scoring != "sigmoid" or method != "noaux_tc":
      raise UnsupportedModelError(
          f"deepseek_v3 router scoring_func={scoring!r} topk_method={method!r} is not supported "
          "(supported: scoring_func='sigmoid' with topk_method='noaux_tc')")
    E = int(num("n_routed_experts", "num_local_experts"))
    first_dense = int(num("first_k_dense_replace", default=0))
    freq = int(num("moe_layer_freq", default=1))
    if freq < 1:
      raise UnsupportedModelError(f"moe_layer_freq must be >= 1, got {freq}")
    # DeepSeek: layer i is MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0.
    only = tuple(i for i in range(num_layers) if i < first_dense or i % freq)
    shared = int(num("n_shared_experts", default=0))
    F = int(num("moe_intermediate_size"))
    heads = int(hf["num_attention_heads"])
    out.update(num_experts=E, moe_intermediate_size=F, mlp_only_layers=only,
               scoring_func="sigmoid", router_bias=True,
               norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
               n_group=int(num("n_group", default=1)), topk_group=int(num("topk_group", default=1)),
               routed_scaling_factor=float(num("routed_scaling_factor", default=1.0)),
               num_shared_experts=shared, shared_expert_intermediate_size=F * shared,
               # MLA: no separate K/V heads; head_dim is the rope part's (what HF writes).
               num_kv_heads=heads, head_dim=int(num("qk_rope_head_dim")),
               kv_lora_rank=int(num("kv_lora_rank")), q_lora_rank=int(hf.get("q_lora_rank") or 0),
               qk_rope_head_dim=int(num("qk_rope_head_dim")),
               qk_nope_head_dim=int(num("qk_nope_head_dim")), v_head_dim=int(num("v_head_dim")))
    # The MTP module's weights (layers past num_hidden_layers) are not read, as in transformers.
  elif model_type == "gpt_oss":
    # intermediate_size is the experts' width; every layer is MoE; every layer has sinks.
    limit = hf.get("swiglu_limit", 7.0)
    out.update(num_experts=int(num("num_local_experts", "num_experts")),
               moe_intermediate_size=int(hf["intermediate_size"]), scoring_func="topk_softmax",
               norm_topk_prob=True, router_logit_bias=True, expert_bias=True, attention_sinks=True,
               swiglu_limit=None if limit is None else float(limit),
               swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))
  return out
