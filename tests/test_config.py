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


@pytest.mark.parametrize("family", FAMILIES)
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
    (dict(num_experts=8, num_experts_per_token=2), r"MoE, MLA and MTP models are not implemented yet"),
])
def test_config_validates_itself(change, message):
  base = ModelConfig.from_hf(LLAMA3_8B)
  with pytest.raises(UnsupportedModelError, match=message):
    dataclasses.replace(base, **change)


def test_unsupported_rope_and_activation():
  with pytest.raises(UnsupportedModelError, match=r"rope scaling type 'yarn' is not supported"):
    ModelConfig.from_hf(dict(LLAMA3_8B, rope_scaling=dict(rope_type="yarn", factor=4.0)))
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
