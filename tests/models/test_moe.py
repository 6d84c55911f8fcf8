"""Mixture of experts: Mixtral and Qwen3-MoE against transformers (logits and greedy ids through
the engine), the routers against hand-worked and transformers' results, the ragged_dot grouped
FFN against a per-token loop, and the errors bad MoE input gives."""

import json
import shutil

import cpu_kernels
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import DATA, golden, tiny_dir
from helpers import run_engine
from jaxinfer import LLM, SamplingParams
from jaxinfer.checkpoint import import_model
from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError, UnsupportedModelError
from jaxinfer.models import moe
from jaxinfer.params import fuse_layers, init_params, is_spec, moe_specs, param_specs, runtime_specs
from jaxinfer.quant import dequantize_weight, is_quantized, quantize_tree

MOE_FAMILIES = ("mixtral", "qwen3_moe")


def batch_golden(name):
  return json.loads((DATA / "golden" / f"batch_{name}.json").read_text())


def greedy(n):
  return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def config_of(family) -> ModelConfig:
  return ModelConfig.from_hf(json.loads((tiny_dir(family) / "config.json").read_text()))


# ---- the models against transformers ------------------------------------------------------------

@pytest.mark.parametrize("family", MOE_FAMILIES + ("deepseek_v3",))
def test_logits_match_transformers_float32(family):
  g = golden(family)
  llm = LLM(tiny_dir(family), dtype="float32", max_model_len=64, warmup=False)
  logits = llm.logits(g["token_ids"].tolist())
  assert logits.shape == g["logits"].shape and logits.dtype == np.float32
  np.testing.assert_allclose(logits, g["logits"], atol=1e-4, rtol=0)


def test_the_tiny_models_exercise_what_they_should():
  mixtral, qwen, deepseek = config_of("mixtral"), config_of("qwen3_moe"), config_of("deepseek_v3")
  assert mixtral.num_heads == mixtral.num_kv_heads == 8 and mixtral.norm_topk_prob
  assert qwen.num_kv_heads == 4 and not qwen.norm_topk_prob  # the plain (unrenormalized) top-k
  assert [qwen.is_moe_layer(i) for i in range(qwen.num_layers)] == [True, False, True]  # mixed stack
  # DeepSeek-V3: MLA (q LoRA, yarn), layer 0 dense, 2 of 4 expert groups, a shared expert, a bias.
  assert deepseek.kv_lora_rank and deepseek.q_lora_rank and deepseek.rope_scaling.kind == "yarn"
  assert deepseek.mlp_only_layers == (0,) and (deepseek.n_group, deepseek.topk_group) == (4, 2)
  assert deepseek.num_shared_experts == 1 and deepseek.router_bias and deepseek.routed_scaling_factor == 2.5
  bias = load_file(tiny_dir("deepseek_v3") / "model.safetensors")["model.layers.1.mlp.gate.e_score_correction_bias"]
  assert np.abs(bias).min() > 0
  for cfg in (mixtral, qwen, deepseek):
    assert (cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size) == (8, 2, 32)


def test_continuous_batching_and_prefix_hits_match_transformers_greedy():
  g = batch_golden("mixtral")
  llm = LLM(tiny_dir("mixtral"), max_num_seqs=16, max_num_batched_tokens=64, warmup=False)
  prompts = [r["prompt_ids"] for r in g["records"]]
  outs, running = run_engine(llm.engine, prompts, [greedy(g["max_new_tokens"])] * len(prompts))
  assert [o.token_ids for o in outs] == [r["greedy_ids"] for r in g["records"]]
  assert max(running) >= 12  # most of the 16 ran at once, mixing prefills and decodes
  # Again: every full 16-token block of each prompt comes from the prefix cache.
  again = llm.generate(prompts, greedy(g["max_new_tokens"]))
  assert [o.token_ids for o in again] == [r["greedy_ids"] for r in g["records"]]
  assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 16 * 16 for p in prompts]


def test_preemption_and_prefix_hits_in_a_small_pool_change_nothing():
  """Qwen3-MoE (a dense layer between two MoE ones), 17 usable pages of 16 tokens: one
  full-length sequence fits, 16 requests do not, so some are preempted and recomputed."""
  g = batch_golden("qwen3_moe")
  llm = LLM(tiny_dir("qwen3_moe"), max_num_seqs=16, max_num_batched_tokens=64, num_pages=18,
            page_size=16, warmup=False)
  prompts = [r["prompt_ids"] for r in g["records"]]
  outs, running = run_engine(llm.engine, prompts, [greedy(g["max_new_tokens"])] * len(prompts))
  assert llm.engine.stats()["preemptions"] > 0 and max(running) > 1
  assert [o.token_ids for o in outs] == [r["greedy_ids"] for r in g["records"]]
  # Prompts 8..15 share a 40-token prefix: a rerun finds cached blocks even in this pool.
  again = llm.generate(prompts, greedy(g["max_new_tokens"]))
  assert [o.token_ids for o in again] == [r["greedy_ids"] for r in g["records"]]
  assert sum(o.num_cached_tokens for o in again) > 0


@pytest.mark.slow
def test_deepseek_v3_greedy_with_preemption_and_prefix_hits_matches_transformers():
  """MLA's latent cache and DeepSeek's router through the engine: the same small pool."""
  g = batch_golden("deepseek_v3")
  llm = LLM(tiny_dir("deepseek_v3"), max_num_seqs=16, max_num_batched_tokens=64, num_pages=18,
            page_size=16, warmup=False)
  prompts = [r["prompt_ids"] for r in g["records"]]
  outs, _ = run_engine(llm.engine, prompts, [greedy(g["max_new_tokens"])] * len(prompts))
  assert llm.engine.stats()["preemptions"] > 0
  assert [o.token_ids for o in outs] == [r["greedy_ids"] for r in g["records"]]
  again = llm.generate(prompts, greedy(g["max_new_tokens"]))
  assert [o.token_ids for o in again] == [r["greedy_ids"] for r in g["records"]]
  assert sum(o.num_cached_tokens for o in again) > 0


def test_bfloat16_logits_stay_close():
  g = golden("qwen3_moe")
  logits = LLM(tiny_dir("qwen3_moe"), dtype="bfloat16", max_model_len=64, warmup=False).logits(
      g["token_ids"].tolist())
  assert np.abs(logits - g["logits"]).max() < 0.1
  assert (logits.argmax(-1) == g["logits"].argmax(-1)).mean() >= 0.9


# ---- routers ------------------------------------------------------------------------------------

def test_softmax_topk_by_hand():
  # softmax(log [1, 2, 3, 4]) = [.1, .2, .3, .4]: the top 2 are experts 3 and 2.
  logits = jnp.log(jnp.array([[1.0, 2.0, 3.0, 4.0], [4.0, 1.0, 3.0, 2.0]]))
  w, ids = moe.route_softmax_topk(logits, 2, renormalize=False)
  np.testing.assert_array_equal(ids, [[3, 2], [0, 2]])
  np.testing.assert_allclose(w, [[0.4, 0.3], [0.4, 0.3]], rtol=1e-6)
  w, ids = moe.route_softmax_topk(logits, 2, renormalize=True)  # Mixtral: the two sum to 1
  np.testing.assert_allclose(w, [[4 / 7, 3 / 7], [4 / 7, 3 / 7]], rtol=1e-6)


@pytest.mark.parametrize("case", ["grouped", "ungrouped"])
def test_deepseek_v3_router_matches_transformers(case):
  g = np.load(DATA / "golden" / "moe_router.npz")
  E, k, n_group, topk_group, norm, scaling = g[f"{case}_config"]
  logits = moe.router_logits(jnp.asarray(g[f"{case}_x"]), jnp.asarray(g[f"{case}_weight"]))
  w, ids = moe.route_deepseek_v3(logits, jnp.asarray(g[f"{case}_bias"]), int(k), int(n_group),
                                 int(topk_group), float(scaling), bool(norm))
  order = np.argsort(np.asarray(ids), axis=-1)
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, -1), g[f"{case}_ids"])
  np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, -1), g[f"{case}_weights"],
                             atol=1e-6, rtol=1e-5)


def test_group_limit_and_bias_change_the_choice_but_not_the_weights():
  # 8 experts in 4 groups of 2; only the best group may be used (topk_group=1).
  logits = jnp.array([[3.0, -3.0, 2.0, 2.0, 2.5, -9.0, 0.0, 0.0]])
  w, ids = moe.route_deepseek_v3(logits, None, 2, 4, 1, 1.0, renormalize=False)
  # Group sums of the top 2: g0 .95+.05, g1 .88+.88 (best), g2 .92+0, g3 .5+.5.
  assert sorted(np.asarray(ids)[0].tolist()) == [2, 3]
  # A bias on expert 6 moves the choice to group 3 but the weights stay the plain sigmoid scores.
  bias = jnp.zeros(8).at[6].set(5.0)
  w, ids = moe.route_deepseek_v3(logits, bias, 2, 4, 1, 2.0, renormalize=False)
  assert sorted(np.asarray(ids)[0].tolist()) == [6, 7]
  np.testing.assert_allclose(w, [[1.0, 1.0]], rtol=1e-6)  # 2.0 * sigmoid(0)


# ---- the grouped expert matmul -------------------------------------------------------------------

def random_moe_params(cfg: ModelConfig, dtype=jnp.float32, seed=1):
  """Layer 0's MoE weights, random and non-zero (the router bias too), from its specs."""
  rng = np.random.default_rng(seed)

  def one(spec):
    scale = 1 / np.sqrt(spec.fan_in) if spec.linear else 0.1
    return jnp.asarray(rng.normal(size=spec.shape) * scale, dtype)

  return jax.tree.map(one, moe_specs(cfg, 0), is_leaf=is_spec)


@pytest.mark.parametrize("variant,T", [("mixtral", 13), ("mixtral", 3), ("deepseek_shared", 13),
                                       ("qwen2_gated_shared", 13)])
def test_ragged_dot_grouped_ffn_equals_a_per_token_loop(variant, T):
  """T=13: 26 copies through ragged_dot; T=3: 6 copies < 8 experts take the per-copy gather."""
  cfg = config_of("mixtral")
  if variant == "deepseek_shared":
    cfg = ModelConfig(**(cfg.to_dict() | dict(
        architecture="qwen3_moe", scoring_func="sigmoid", router_bias=True, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, num_shared_experts=2, shared_expert_intermediate_size=64)))
  elif variant == "qwen2_gated_shared":
    cfg = ModelConfig(**(cfg.to_dict() | dict(
        architecture="qwen3_moe", norm_topk_prob=False, num_shared_experts=1,
        shared_expert_intermediate_size=48, shared_expert_gate=True)))
  p = random_moe_params(cfg)
  x = jax.random.normal(jax.random.key(2), (T, cfg.hidden_size))
  out, stats = jax.jit(moe.moe_ffn, static_argnums=1)(p, cfg, x)
  ref = moe.reference_moe_ffn(p, cfg, x)
  assert np.abs(ref).min() > 0
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)
  _, ids = moe.route(p, cfg, x)
  np.testing.assert_array_equal(stats.tokens_per_expert, np.bincount(np.asarray(ids).ravel(), minlength=8))


def test_grouped_ffn_in_bfloat16():
  cfg = config_of("mixtral")
  p = random_moe_params(cfg, jnp.bfloat16)
  x = jax.random.normal(jax.random.key(2), (9, cfg.hidden_size), jnp.bfloat16)
  out, _ = moe.moe_ffn(p, cfg, x)
  assert out.dtype == jnp.bfloat16
  ref = moe.reference_moe_ffn(p, cfg, x)  # same routing, float64 experts
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=0.05, rtol=0.05)


def test_router_stats_count_real_tokens_only():
  from jaxinfer.models.cache import init_cache
  from jaxinfer.models.transformer import PagedBatch, forward
  cfg = config_of("qwen3_moe")
  params = init_params(cfg, jax.random.key(0))
  T, n, page = 16, 11, 16  # 11 real tokens, 5 of bucket padding
  cache = init_cache(cfg, 3, page)
  pos = jnp.arange(T, dtype=jnp.int32)
  batch = PagedBatch(jnp.where(pos < n, pos + page, 0), jnp.array([n], jnp.int32),
                     jnp.array([[1, 2]], jnp.int32), jnp.array([0, n], jnp.int32), jnp.int32(1))
  tokens = jnp.arange(1, T + 1, dtype=jnp.int32)
  run = jax.jit(forward, static_argnums=1, static_argnames="return_router_stats")
  hidden, _, stats = run(params, cfg, tokens, pos, cache, batch, return_router_stats=True)
  assert hidden.shape == (T, cfg.hidden_size)
  assert stats.tokens_per_expert.shape == (2, 8)  # layers 0 and 2 are MoE
  np.testing.assert_array_equal(stats.tokens_per_expert.sum(-1), [n * 2, n * 2])


def test_converted_checkpoint_restores_the_stacked_experts(tmp_path):
  from jaxinfer.checkpoint import convert
  dst = convert(tiny_dir("qwen3_moe"), tmp_path / "ckpt")
  g = golden("qwen3_moe")
  llm = LLM(dst, dtype="float32", max_model_len=64, warmup=False)
  assert llm.runner.params["layers"][0]["moe"]["w_down"].shape == (8, 32, 64)
  np.testing.assert_allclose(llm.logits(g["token_ids"].tolist()), g["logits"], atol=1e-4, rtol=0)


# ---- GGUF ---------------------------------------------------------------------------------------

def to_checkpoint(spec, w: np.ndarray) -> np.ndarray:
  """Our layout -> HF/GGUF's ([out, in] linears, experts stacked first): from_checkpoint reversed."""
  if spec.num_experts:
    return np.stack([to_checkpoint(spec.one_expert(), w[e]) for e in range(spec.num_experts)])
  return np.ascontiguousarray(w.reshape(spec.fan_in, -1).T) if spec.linear else w


def write_moe_gguf(family: str, out, arch: str, qtype=None):
  """A GGUF of a tiny HF MoE dir as llama.cpp lays one out (Mixtral: 'llama' + expert count,
  its q/k rows permuted; Qwen3-MoE: 'qwen3moe'), from the weights our HF importer reads;
  `qtype` (e.g. Q8_0): every linear and expert tensor in that GGUF type."""
  import gguf
  from helpers import permute_rope_rows
  from jaxinfer.params import param_specs
  model = import_model(tiny_dir(family))
  cfg = model.config
  w = gguf.GGUFWriter(str(out), arch)
  w.add_block_count(cfg.num_layers)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_heads)
  w.add_head_count_kv(cfg.num_kv_heads)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_vocab_size(cfg.vocab_size)
  w.add_expert_count(cfg.num_experts)
  w.add_expert_used_count(cfg.num_experts_per_token)
  w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
  w.add_expert_weights_norm(cfg.norm_topk_prob)
  w.add_name(f"tiny-{family}")
  specs = jax.tree.leaves(param_specs(cfg), is_leaf=is_spec)
  # Our GGUF names are llama.cpp's names for this architecture (as gguf-py lists them); a dense
  # layer in a qwen3moe file (llama.cpp has none) is named as in a qwen3 one.
  kinds = gguf.MODEL_TENSORS[{"llama": gguf.MODEL_ARCH.LLAMA, "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE}[arch]]
  kinds = kinds + gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN3] * (arch == "qwen3moe")
  known = {gguf.TENSOR_NAMES[k].format(bid=i) for k in kinds for i in range(cfg.num_layers)}
  assert {s.gguf.rsplit(".", 1)[0] for s in specs} <= known
  for spec, a in zip(specs, jax.tree.leaves(model.weights)):
    t = to_checkpoint(spec, np.asarray(a, np.float32))
    if arch == "llama" and spec.gguf.endswith(("attn_q.weight", "attn_k.weight")):
      t = permute_rope_rows(t, cfg.num_heads if "attn_q" in spec.gguf else cfg.num_kv_heads)
    if qtype is not None and (spec.linear or spec.num_experts) and not spec.router:
      w.add_tensor(spec.gguf, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    else:
      w.add_tensor(spec.gguf, t)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return out


@pytest.mark.parametrize("family,arch", [("mixtral", "llama"), ("qwen3_moe", "qwen3moe")])
def test_gguf_moe_import_matches_transformers(tmp_path, family, arch):
  path = write_moe_gguf(family, tmp_path / f"{family}.gguf", arch)
  hf_cfg = config_of(family)
  g = golden(family)
  llm = LLM(path, dtype="float32", max_model_len=64, warmup=False)
  cfg = llm.config
  assert cfg.architecture == family and cfg.num_experts == 8 and cfg.num_experts_per_token == 2
  assert cfg.norm_topk_prob == hf_cfg.norm_topk_prob and cfg.mlp_only_layers == hf_cfg.mlp_only_layers
  np.testing.assert_allclose(llm.logits(g["token_ids"].tolist()), g["logits"], atol=1e-4, rtol=0)


def test_gguf_q8_0_experts_are_requantized_per_channel_with_one_log_line(tmp_path, caplog):
  """int8 keeps a Q8_0 file's dense linears as their blocks; its expert tensors become per
  (expert, channel) int8 of their dequantized values (what the grouped expert matmul takes),
  said once."""
  import gguf
  import logging
  path = write_moe_gguf("mixtral", tmp_path / "q8.gguf", "llama", gguf.GGMLQuantizationType.Q8_0)
  with caplog.at_level(logging.WARNING, logger="jaxinfer.checkpoint.gguf"):
    model = import_model(path, "int8")
  lines = [r.getMessage() for r in caplog.records if "not loaded quantized" in r.getMessage()]
  assert len(lines) == 1 and "Q8_0 expert tensors" in lines[0] and "int8 per channel" in lines[0], lines
  layer = model.weights["layers"][0]
  assert layer["wq"].scales.shape[0] == 64 // 32  # Q8_0 blocks kept
  want = quantize_tree(moe_specs(model.config, 0), import_model(path).weights["layers"][0]["moe"], "int8")["w_up"]
  got = layer["moe"]["w_up"]
  assert got.values.shape == (8, 32, 64) and got.scales.shape == (8, 1, 32)  # [E, out, in]
  np.testing.assert_array_equal(got.values, want.values)
  np.testing.assert_array_equal(got.scales, want.scales)


# ---- bad input ---------------------------------------------------------------------------------

def copy_model(tmp_path, family):
  dst = tmp_path / family
  shutil.copytree(tiny_dir(family), dst)
  return dst


def test_checkpoint_missing_an_expert_names_the_tensor(tmp_path):
  d = copy_model(tmp_path, "qwen3_moe")
  tensors = load_file(d / "model.safetensors")
  del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
  save_file(tensors, d / "model.safetensors")
  with pytest.raises(CheckpointError, match=r"tensor 'model.layers.2.mlp.experts.5.up_proj.weight' is missing"):
    import_model(d)


def test_expert_with_a_wrong_shape_names_the_tensor(tmp_path):
  d = copy_model(tmp_path, "mixtral")
  tensors = load_file(d / "model.safetensors")
  tensors["model.layers.1.block_sparse_moe.experts.7.w2.weight"] = np.zeros((64, 31), np.float32)
  save_file(tensors, d / "model.safetensors")
  with pytest.raises(CheckpointError, match=r"tensor 'model.layers.1.block_sparse_moe.experts.7.w2.weight' "
                                            r"has shape \(64, 31\), expected \(64, 32\)"):
    import_model(d)


@pytest.mark.parametrize("change,message", [
    (dict(num_experts_per_tok=9), r"num_experts_per_token=9 must be between 1 and num_experts=8"),
    (dict(shared_expert_intermediate_size=16), r"qwen3_moe with shared experts is not supported"),
    (dict(moe_intermediate_size=None), r"config.json lacks the field 'moe_intermediate_size'"),
])
def test_unsupported_moe_settings_are_named(tmp_path, change, message):
  d = copy_model(tmp_path, "qwen3_moe")
  cfg = json.loads((d / "config.json").read_text())
  (d / "config.json").write_text(json.dumps(cfg | change))
  with pytest.raises(UnsupportedModelError, match=message):
    LLM(d, warmup=False)


def test_int4_quantization_of_experts_is_refused_by_name():
  with pytest.raises(UnsupportedModelError, match=r"quantization='int4' is not supported for "
                                                  r"mixture-of-experts weights \(layers/0/moe/w_down.*use int8 or fp8"):
    LLM(tiny_dir("mixtral"), quantization="int4", warmup=False)


# ---- quantized experts --------------------------------------------------------------------------

def quantized_moe_params(cfg, quantization):
  """(the layer's params with int8 / fp8 experts and shared experts, the same with every
  quantized weight replaced by its dequantized float32 values)."""
  specs = moe_specs(cfg, 0)
  host = jax.tree.map(np.asarray, random_moe_params(cfg))
  q = quantize_tree(specs, host, quantization)
  deq = jax.tree.map(lambda s, w: jnp.asarray(dequantize_weight(s, w)) if is_quantized(w) else jnp.asarray(w),
                     specs, q, is_leaf=lambda x: is_spec(x) or is_quantized(x))
  return jax.tree.map(jnp.asarray, q), deq


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
@pytest.mark.parametrize("variant,T", [("mixtral", 13), ("mixtral", 3), ("deepseek_shared", 13),
                                       ("gpt_oss", 13), ("gpt_oss", 3)])
def test_quantized_experts_equal_a_per_token_loop_over_their_dequantized_weights(quantization, variant, T):
  """Scales per (expert, output channel) multiply each row by its own expert's scales: the
  grouped ragged_dot (T=13) and the per-copy gather (T=3) against reference_moe_ffn in float64
  over the dequantized weights. The router stays float (it chooses the experts). A scale taken
  from another expert or channel moves the output by tens of percent."""
  cfg = config_of("mixtral")
  if variant == "deepseek_shared":
    cfg = ModelConfig(**(cfg.to_dict() | dict(
        architecture="qwen3_moe", scoring_func="sigmoid", router_bias=True, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, num_shared_experts=2, shared_expert_intermediate_size=64)))
  elif variant == "gpt_oss":  # expert biases, the clamped SwiGLU, [in, out] experts that are not `linear`
    cfg = config_of("gpt_oss")
  p, deq = quantized_moe_params(cfg, quantization)
  assert is_quantized(p["w_gate"]) and p["w_gate"].scales.shape == (8, 1, cfg.moe_intermediate_size)
  assert is_quantized(p["w_down"]) and p["w_down"].scales.shape == (8, 1, cfg.hidden_size)
  assert not is_quantized(p["router"])
  if "shared" in p:
    assert is_quantized(p["shared"]["w_up"])
  x = jax.random.normal(jax.random.key(2), (T, cfg.hidden_size))
  out, _ = jax.jit(moe.moe_ffn, static_argnums=1)(p, cfg, x)
  ref = moe.reference_moe_ffn(deq, cfg, x)
  assert np.abs(ref).min() > 0
  # The shared experts' int8 linears carry their activations to 2^-16 of each row's maximum
  # (measured max |diff| 1.3e-4 with them, outputs ~0.5-3 in size; a scale from another expert
  # or channel moves them by 0.1 or more). Their fp8 linears, on a CPU whose kernel rounds x to
  # bfloat16 (cpu_kernels.fp8_activations()), to 2^-9 of each element: measured 0.010.
  atol = 5e-5
  if "shared" in p and quantization == "int8":
    atol = 5e-4
  elif "shared" in p and cpu_kernels.fp8_activations() == "bfloat16":
    atol = 2e-2
  np.testing.assert_allclose(out, ref, atol=atol, rtol=1e-4)


@pytest.fixture(scope="module")
def int8_mixtral(tmp_path_factory):
  """tiny Mixtral converted with --quantize int8, and the float32 model of its dequantized weights."""
  from jaxinfer.checkpoint import convert
  dst = convert(tiny_dir("mixtral"), tmp_path_factory.mktemp("moe") / "int8", quantize="int8")
  sp = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, warmup=False)
  llm = LLM(dst, **sp)
  ref = LLM(tiny_dir("mixtral"), dtype="float32", **sp)
  ref.runner.params = jax.tree.map(
      lambda s, w: jnp.asarray(dequantize_weight(s, jax.device_get(w))) if is_quantized(w) else w,
      runtime_specs(llm.config), llm.runner.params, is_leaf=lambda x: is_spec(x) or is_quantized(x))
  return llm, ref


def test_int8_moe_checkpoint_holds_int8_experts_and_runs_like_their_dequantized_floats(int8_mixtral):
  """Converted and restored: experts int8 [E, D, F] with [E, 1, F] scales, bit-exact to quantizing
  at import; logits equal the float32 model of the same (dequantized) weights up to the split
  int8 activations' 2^-16 (logits ~3.7 in size; a scale mix-up moves them by whole units), and
  within the measured distance of transformers' float32 (max 0.79: quantization flips some
  near-tied expert choices of the random router)."""
  llm, ref = int8_mixtral
  moe_p = llm.runner.params["layers"][1]["moe"]
  assert moe_p["w_up"].values.dtype == np.int8 and moe_p["w_up"].scales.shape == (8, 1, 32)
  assert moe_p["router"].dtype == np.float32
  written = quantize_tree(param_specs(llm.config), import_model(tiny_dir("mixtral")).weights, "int8")
  written = fuse_layers(llm.config, written)  # the runner's q/k/v are one weight (params.FUSED)
  assert jax.tree.structure(written) == jax.tree.structure(llm.runner.params)
  for a, b in zip(jax.tree.leaves(written), jax.tree.leaves(llm.runner.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  g = golden("mixtral")
  ids = g["token_ids"].tolist()
  got = llm.logits(ids)
  np.testing.assert_allclose(got, ref.logits(ids), atol=2e-3, rtol=0)
  assert np.abs(got - g["logits"]).max() < 1.2 and np.abs(got - g["logits"]).mean() < 0.06


def test_int8_moe_greedy_batch_invariance(int8_mixtral):
  """Prompts run together (ragged_dot over the batch's copies) give what each gives alone
  (the per-copy gather at decode), one prompt longer than the 32-token step."""
  llm, _ = int8_mixtral
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 300, n).tolist() for n in (3, 40, 9)]
  together = llm.generate(prompts, greedy(8))
  for p, out in zip(prompts, together):
    assert out.token_ids == llm.generate([p], greedy(8))[0].token_ids


def test_expert_scales_that_do_not_match_name_the_tensor(tmp_path):
  from jaxinfer.checkpoint import load_model, orbax_io
  from jaxinfer.quant import QuantizedWeight
  model = import_model(tiny_dir("mixtral"), "int8")
  w = model.weights["layers"][0]["moe"]["w_down"]
  model.weights["layers"][0]["moe"]["w_down"] = QuantizedWeight(w.values, np.repeat(w.scales, 2, axis=1))
  dst = orbax_io.save(model, tmp_path / "bad")
  with pytest.raises(CheckpointError, match=r"experts.\{e\}.w2.weight.*scales have shape \(8, 2, 64\), "
                                            r"expected \(8, 1, 64\) \(per expert and output channel\)"):
    load_model(dst)


@pytest.mark.parametrize("mesh_shape, rules", [(None, None), ((2, 1, 1), {"pages": "data"})])
def test_expert_load_counts_every_real_token_copy_once(mesh_shape, rules):
  """The engine's per-layer expert counts add up to top-k copies of each token it ran
  (bucket padding excluded; under attention DP, both shards' tokens), and reach Prometheus."""
  from jaxinfer.serving.metrics import Metrics
  from jaxinfer.sharding import make_mesh
  mesh = make_mesh(*mesh_shape) if mesh_shape else None
  llm = LLM(tiny_dir("mixtral"), mesh=mesh, sharding_rules=rules, max_model_len=64, max_num_seqs=4,
            max_num_batched_tokens=32, warmup=False)
  llm.generate([[5, 17, 200, 3], list(range(1, 12)), [9]], greedy(5))
  engine = llm.engine
  per_layer = engine.expert_tokens
  assert per_layer.shape == (2, 8)
  assert per_layer.sum(axis=1).tolist() == [2 * engine.num_computed_tokens] * 2  # top-2, 2 MoE layers
  stats = engine.stats()
  assert stats["moe_expert_tokens"] == per_layer.sum(axis=0).tolist()
  assert stats["moe_expert_imbalance"] == pytest.approx(max(r.max() / r.mean() for r in per_layer))
  metrics = Metrics()
  metrics.set_engine_stats(stats)
  text = metrics.exposition().decode()
  for e, n in enumerate(stats["moe_expert_tokens"]):
    assert f'jaxinfer_moe_expert_tokens{{expert="{e}"}} {float(n)}' in text
