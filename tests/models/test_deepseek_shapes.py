"""DeepSeek-V3 (671B) at its published shapes, nothing allocated: parameter counts from the weight
specs (total, activated per token, the MTP module) and the bytes each device holds in the
64-device attention-DP + wide-EP layout, from the sharding rules on an abstract mesh.

Published (DeepSeek-V3 technical report, abstract; the Hub model card): 671B total parameters,
37B activated per token; the Hub checkpoint is 685B "which includes 671B of the Main Model
weights and 14B of the Multi-Token Prediction (MTP) Module weights". The counts below are
exact, so a change to any weight's spec shows up here.
"""

import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh

from jaxinfer.config import ModelConfig
from jaxinfer.errors import UnsupportedModelError
from jaxinfer.params import abstract_params, count_params, init_params, is_spec, layer_specs, param_specs
from jaxinfer.sharding import MESH_AXES, make_rules, param_shardings

# deepseek-ai/DeepSeek-V3 config.json, as published (quantization_config and auto_map left out).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}

D, V, H = 7168, 129280, 128
# By hand from the architecture (DeepSeek-V3 report sec. 2.1), in our [in, out] layout:
MLA = (D * 1536 + 1536  # wq_a, q_a_norm
       + 1536 * H * (128 + 64)  # wq_b: nope + rope query per head
       + D * (512 + 64) + 512  # wkv_a (latent + rope key), kv_a_norm
       + 512 * H * (128 + 128)  # wkv_b: W_UK and W_UV per head
       + H * 128 * D)  # wo
NORMS = 2 * D  # attn_norm, mlp_norm
DENSE_FFN = 3 * D * 18432
EXPERT = 3 * D * 2048  # one routed expert (gate, up, down); the shared expert is one more
MOE_FFN = D * 256 + 256 + 256 * EXPERT + EXPERT  # router, correction bias, routed, shared
TOTAL = 3 * (MLA + NORMS + DENSE_FFN) + 58 * (MLA + NORMS + MOE_FFN) + 2 * V * D + D
# Per token: every non-expert weight (the embedding row lookup and the LM head included, as the
# published 37B does), 8 of the 256 routed experts, the shared one.
ACTIVATED = TOTAL - 58 * (256 - 8) * EXPERT
# The MTP module (DeepSeek-V3 report sec. 2.2), layer 61 of the Hub checkpoint: an MoE decoder
# block, enorm and hnorm, eh_proj [2D, D], shared_head.norm, and its own copies of the embedding
# and of the output head (shared with the main model in training, stored again in the checkpoint).
MTP_BLOCK = MLA + NORMS + MOE_FFN
MTP = MTP_BLOCK + 3 * D + 2 * D * D + 2 * V * D

GB = 1e9


@pytest.fixture(scope="module")
def cfg():
  return ModelConfig.from_hf(DEEPSEEK_V3)


def test_published_parameter_counts_without_allocating(cfg):
  key = jax.random.key(0)
  live = {id(a) for a in jax.live_arrays()}  # by identity: arrays of earlier tests may be freed meanwhile
  shapes = jax.eval_shape(lambda k: init_params(cfg, k, jnp.bfloat16), key)
  abstract = abstract_params(cfg, jnp.bfloat16)
  assert [a.shape for a in jax.live_arrays() if id(a) not in live] == []  # nothing was allocated
  assert all(isinstance(x, jax.ShapeDtypeStruct) and x.dtype == jnp.bfloat16 for x in jax.tree.leaves(abstract))
  assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(lambda x: (x.shape, x.dtype), abstract)

  assert count_params(abstract) == TOTAL == 671_026_419_200
  assert round(TOTAL / GB) == 671  # "671B total parameters"
  layers = abstract["layers"]
  assert [count_params(layers[i]) for i in (0, 2, 3, 60)] == [MLA + NORMS + DENSE_FFN] * 2 + [MLA + NORMS + MOE_FFN] * 2
  assert count_params(layers[0]) == 583_483_392 and count_params(layers[3]) == 11_507_286_272
  assert layers[3]["moe"]["w_gate"].shape == (256, D, 2048) and layers[3]["moe"]["w_down"].shape == (256, 2048, D)
  assert layers[3]["moe"]["shared"]["w_up"].shape == (D, 2048)
  assert layers[2]["w_gate"].shape == (D, 18432) and "moe" not in layers[2]
  assert layers[0]["wkv_b"].shape == (512, H, 256) and layers[0]["wq_b"].shape == (1536, H, 192)

  activated = sum(
      math.prod(s.shape) * (cfg.num_experts_per_token / s.num_experts if s.num_experts else 1)
      for s in jax.tree.leaves(param_specs(cfg), is_leaf=is_spec))
  assert activated == ACTIVATED == 37_552_297_472
  assert int(ACTIVATED / GB) == 37  # "37B activated for each token"
  print(f"\nDeepSeek-V3: {TOTAL:,} parameters ({TOTAL / GB:.2f}B), {ACTIVATED:,} activated per token "
        f"({ACTIVATED / GB:.2f}B)")


def test_mtp_module_is_not_modelled_but_counted_from_a_decoder_block(cfg):
  # params has no MTP weights: the config refuses MTP layers, and from_hf ignores
  # num_nextn_predict_layers (as transformers does). Its count: our MoE block's specs + the rest by hand.
  assert cfg.num_mtp_layers == 0
  with pytest.raises(UnsupportedModelError, match="multi-token prediction layers are not implemented"):
    ModelConfig(**{**cfg.to_dict(), "rope_scaling": cfg.rope_scaling, "num_mtp_layers": 1})
  block = count_params(jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16),
                                    layer_specs(cfg, cfg.num_layers - 1), is_leaf=is_spec))
  assert block == MTP_BLOCK
  mtp = block + 3 * D + 2 * D * D + 2 * V * D
  assert mtp == MTP == 13_463_426_304
  # "14B" on the model card is 685B - 671B of Hub-rounded sizes; the Hub's 685B also counts the
  # FP8 weights' float32 block scales (~0.04B). Ours: 671.03B + 13.46B = 684.49B.
  assert 13 * GB < MTP < 14.5 * GB
  assert 684 * GB < TOTAL + MTP < 685 * GB
  print(f"\nDeepSeek-V3 MTP module (not modelled): {MTP:,} parameters ({MTP / GB:.2f}B); "
        f"main + MTP {(TOTAL + MTP) / GB:.2f}B")


def per_device_bytes(cfg, mesh, rules, itemsize=2) -> tuple[int, dict[str, tuple[int, ...]]]:
  """Bytes of weights on one device (every device holds the same amount here) and a few shard shapes."""
  shardings = param_shardings(cfg, mesh, rules=rules)
  specs = param_specs(cfg)
  total = sum(math.prod(sh.shard_shape(s.shape)) * itemsize
              for s, sh in zip(jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(shardings)))
  layer3, s3 = specs["layers"][3], shardings["layers"][3]
  shapes = {"experts w_gate": s3["moe"]["w_gate"].shard_shape(layer3["moe"]["w_gate"].shape),
            "wq_b": s3["wq_b"].shard_shape(layer3["wq_b"].shape),
            "embed": shardings["embed"].shard_shape(specs["embed"].shape)}
  return total, shapes


def test_per_device_bytes_wide_ep_over_64_devices(cfg):
  # Attention-DP + wide EP: (data=8, expert=8, model=1); routed experts over ("data", "expert"),
  # 256 / 64 = 4 per device; everything else whole on every device (attention replicated over data).
  mesh = AbstractMesh((8, 8, 1), MESH_AXES)
  rules = make_rules({"experts": ("data", "expert")})
  wide, shapes = per_device_bytes(cfg, mesh, rules)
  assert shapes == {"experts w_gate": (4, D, 2048), "wq_b": (1536, H, 192), "embed": (V, D)}
  routed = 58 * 256 * EXPERT
  assert wide == 2 * (TOTAL - routed + routed // 64) == 54_669_945_856
  # Experts over 'expert' only (the default rule): 32 experts per device, each replicated 8x over data.
  narrow, narrow_shapes = per_device_bytes(cfg, mesh, make_rules())
  assert narrow_shapes["experts w_gate"] == (32, D, 2048)
  assert narrow == 2 * (TOTAL - routed + routed // 8)
  print(f"\nDeepSeek-V3 bf16 weights per device, 64 devices (data=8, expert=8): wide EP (experts over "
        f"data x expert, 4 per device) {wide:,} B = {wide / GB:.2f} GB ({wide / 2**30:.2f} GiB), of which "
        f"routed experts {2 * routed // 64 / GB:.2f} GB and replicated non-expert weights "
        f"{2 * (TOTAL - routed) / GB:.2f} GB; experts over expert only (32 per device): {narrow / GB:.2f} GB")
