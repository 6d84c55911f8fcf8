"""ModelConfig from HF config.json and GGUF metadata; parameter specs at real shapes."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from conftest import FAMILIES, tiny_dir
from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.errors import UnsupportedModelError
from jaxinfer.params import abstract_params, count_params, init_params, param_specs

LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                 rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=8192),
                 tie_word_embeddings=False)


def test_llama3_8b_parameter_count_without_allocating():
  cfg = ModelConfig.from_hf(LLAMA3_8B)
  shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), jnp.bfloat16))
  assert count_params(shapes) == 8_030_261_248
  assert count_params(abstract_params(cfg)) == 8_030_261_248
  assert shapes["layers"][0]["wk"].shape == (4096, 8, 128)


MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
# deepseek-ai/DeepSeek-V3's config.json (the fields we read).
DEEPSEEK_V3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                   moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                   num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
                   routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                   v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4,
                   num_experts_per_tok=8, moe_layer_freq=1, first_k_dense_replace=3, norm_topk_prob=True,
                   scoring_func="sigmoid", max_position_embeddings=163840, rms_norm_eps=1e-6,
                   rope_theta=10000, hidden_act="silu", tie_word_embeddings=False,
                   num_nextn_predict_layers=1,
                   rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                                     original_max_position_embeddings=4096, type="yarn"))


@pytest.mark.parametrize("family", FAMILIES + MOE_FAMILIES)
def test_tiny_configs_and_spec_shapes_match_their_checkpoints(family):
  cfg = ModelConfig.from_hf(json.loads((tiny_dir(family) / "config.json").read_text()))
  hash(cfg)  # static argument of jit
  assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
  params = init_params(cfg, jax.random.key(1))
  specs = jax.tree.leaves(param_specs(cfg), is_leaf=lambda x: hasattr(x, "hf"))
  leaves = jax.tree.leaves(params)
  assert [x.shape for x in leaves] == [s.shape for s in specs]
  assert all(float(jnp.abs(x).min()) > 0 for x, s in zip(leaves, specs) if s.init == "ones")
  assert all(float(jnp.std(x)) > 0 for x, s in zip(leaves, specs) if s.init == "normal")


def test_transformers5_rope_parameters_spelling():
  old = ModelConfig.from_hf(LLAMA3_8B)
  new_style = {k: v for k, v in LLAMA3_8B.items() if k not in ("rope_theta", "rope_scaling")}
  new_style["rope_parameters"] = dict(LLAMA3_8B["rope_scaling"], rope_theta=500000.0)
  assert ModelConfig.from_hf(new_style) == old
  assert old.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


def test_from_gguf_metadata():
  meta = {"general.architecture": "llama", "llama.embedding_length": 576, "llama.attention.head_count": 9,
          "llama.attention.head_count_kv": 3, "llama.feed_forward_length": 1536, "llama.block_count": 30,
          "llama.rope.freq_base": 100000.0, "llama.vocab_size": 49152, "llama.context_length": 8192,
          "llama.attention.layer_norm_rms_epsilon": 1e-5}
  cfg = ModelConfig.from_gguf(meta, {"token_embd.weight"})
  assert (cfg.head_dim, cfg.num_kv_heads, cfg.tie_word_embeddings, cfg.vocab_size) == (64, 3, True, 49152)


@pytest.mark.parametrize("change,message", [
    (dict(num_heads=6, num_kv_heads=4), r"num_heads=6 must be a multiple of num_kv_heads=4"),
    (dict(head_dim=7), r"head_dim=7 must be even"),
    (dict(vocab_size=0), r"vocab_size must be a positive int"),
    (dict(architecture="gpt2"), r"architecture 'gpt2' is not supported"),
    (dict(num_experts=8, num_experts_per_token=2), r"moe_intermediate_size must be a positive int"),
    (dict(num_experts=8, num_experts_per_token=9, moe_intermediate_size=32),
     r"num_experts_per_token=9 must be between 1 and num_experts=8"),
    (dict(num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, scoring_func="sparsemax"),
     r"router scoring_func 'sparsemax' is not supported"),
    (dict(num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, n_group=2),
     r"group-limited routing \(n_group=2\) and a router bias are only supported with scoring_func='sigmoid'"),
    (dict(num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, scoring_func="sigmoid",
          n_group=3), r"n_group=3 must divide num_experts=8"),
    (dict(num_experts=8, num_experts_per_token=4, moe_intermediate_size=32, scoring_func="sigmoid",
          n_group=4, topk_group=1), r"topk_group=1 groups of 2 experts hold fewer than num_experts_per_token=4"),
    (dict(num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, mlp_only_layers=(40,)),
     r"mlp_only_layers \[40\] are not layers of a 32-layer model"),
    (dict(num_mtp_layers=1), r"multi-token prediction layers are not implemented yet"),
])
def test_config_validates_itself(change, message):
  base = ModelConfig.from_hf(LLAMA3_8B)
  with pytest.raises(UnsupportedModelError, match=message):
    dataclasses.replace(base, **change)


def test_unsupported_rope_and_activation():
  with pytest.raises(UnsupportedModelError, match=r"rope scaling type 'longrope' is not supported"):
    ModelConfig.from_hf(dict(LLAMA3_8B, rope_scaling=dict(rope_type="longrope", factor=4.0)))
  with pytest.raises(UnsupportedModelError, match=r"hidden_act 'gelu' is not supported"):
    ModelConfig.from_hf(dict(LLAMA3_8B, hidden_act="gelu"))
  with pytest.raises(UnsupportedModelError, match=r"config.json lacks the field 'hidden_size'"):
    ModelConfig.from_hf({k: v for k, v in LLAMA3_8B.items() if k != "hidden_size"})


def test_one_spec_per_weight_names_every_checkpoint_tensor():
  cfg = ModelConfig.from_hf(json.loads((tiny_dir("qwen2") / "config.json").read_text()))
  specs = jax.tree.leaves(param_specs(cfg), is_leaf=lambda x: hasattr(x, "hf"))
  from safetensors import safe_open
  with safe_open(str(tiny_dir("qwen2") / "model.safetensors"), "np") as f:
    assert sorted(s.hf for s in specs) == sorted(f.keys())


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_specs_name_every_checkpoint_tensor_per_expert(family):
  """Stacked [E, ...] expert specs expand to the per-expert names (and shapes) the files hold."""
  from safetensors import safe_open
  cfg = ModelConfig.from_hf(json.loads((tiny_dir(family) / "config.json").read_text()))
  specs = jax.tree.leaves(param_specs(cfg), is_leaf=lambda x: hasattr(x, "hf"))
  with safe_open(str(tiny_dir(family) / "model.safetensors"), "np") as f:
    names = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
  expected = {}
  for s in specs:
    for n in s.checkpoint_names("hf"):
      expected[n] = s.checkpoint_shape(per_expert="{e}" in s.hf)
  assert expected == names
  stacked = [s for s in specs if s.num_experts]
  assert stacked and all(s.shape[0] == 8 and s.axes[0] == "experts" for s in stacked)


def test_moe_layer_choice():
  mixtral = ModelConfig.from_hf(json.loads((tiny_dir("mixtral") / "config.json").read_text()))
  assert (mixtral.num_experts, mixtral.num_experts_per_token, mixtral.moe_intermediate_size) == (8, 2, 32)
  assert mixtral.norm_topk_prob and mixtral.scoring_func == "softmax"
  assert [mixtral.is_moe_layer(i) for i in range(2)] == [True, True]
  qwen = ModelConfig.from_hf(json.loads((tiny_dir("qwen3_moe") / "config.json").read_text()))
  assert qwen.mlp_only_layers == (1,) and not qwen.norm_topk_prob and qwen.qk_norm
  specs = param_specs(qwen)["layers"]
  assert ["moe" in layer for layer in specs] == [True, False, True]
  assert specs[1]["w_up"].shape == (64, 64) and specs[0]["moe"]["w_up"].shape == (8, 64, 32)
  # Qwen3-MoE's decoder_sparse_step: only every step-th layer is sparse.
  hf = json.loads((tiny_dir("qwen3_moe") / "config.json").read_text())
  stepped = ModelConfig.from_hf(dict(hf, decoder_sparse_step=2, mlp_only_layers=[]))
  assert stepped.mlp_only_layers == (0, 2)


def test_deepseek_v3_config():
  cfg = ModelConfig.from_hf(DEEPSEEK_V3)
  assert (cfg.num_experts, cfg.num_experts_per_token, cfg.n_group, cfg.topk_group) == (256, 8, 8, 4)
  assert cfg.scoring_func == "sigmoid" and cfg.router_bias and cfg.norm_topk_prob
  assert cfg.routed_scaling_factor == 2.5 and cfg.mlp_only_layers == (0, 1, 2)
  assert (cfg.num_shared_experts, cfg.shared_expert_intermediate_size) == (1, 2048)
  assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim,
          cfg.v_head_dim) == (512, 1536, 64, 128, 128)
  assert cfg.rope_scaling.kind == "yarn" and cfg.rope_scaling.factor == 40
  assert cfg.rope_scaling.mscale_all_dim == 1.0 and cfg.rope_scaling.original_max_position_embeddings == 4096
  assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("change,message", [
    (dict(scoring_func="softmax"), r"deepseek_v3 router scoring_func='softmax' topk_method='noaux_tc' "
                                   r"is not supported"),
    (dict(topk_method="group_limited_greedy"), r"topk_method='group_limited_greedy' is not supported"),
    (dict(n_group=3), r"n_group=3 must divide num_experts=256"),
    (dict(moe_intermediate_size=None), r"config.json lacks the field 'moe_intermediate_size'"),
])
def test_unsupported_router_settings_are_named(change, message):
  with pytest.raises(UnsupportedModelError, match=message):
    ModelConfig.from_hf(dict(DEEPSEEK_V3, **change))


def test_from_options_builds_the_dataclass_and_names_unknown_keys_of_any_type():
  import types

  from jaxinfer.config import from_options
  from jaxinfer.errors import InvalidRequestError

  @dataclasses.dataclass(frozen=True)
  class Opts:
    a: int = 1
    b: str = "x"

  assert from_options(Opts, types.MappingProxyType({"b": "y"}), "opts") == Opts(b="y")
  with pytest.raises(InvalidRequestError, match=r"unknown opts option\(s\) \['z', 1\]; options are \['a', 'b'\]"):
    from_options(Opts, {1: 2, "z": 3, "a": 4}, "opts")
