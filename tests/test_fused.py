"""Fused projections (jaxinfer.params.FUSED): wq/wk/wv -> wqkv and w_gate/w_up -> w_gate_up at
load, for every format. Fusing only puts the parts' numbers side by side, so the fused model's
logits are the unfused one's bit for bit, and under tensor parallelism each device holds its own
kv heads with exactly the query heads that read them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_dir
from jaxinfer.checkpoint.hf import read_config
from jaxinfer.models.cache import init_cache
from jaxinfer.models.transformer import PagedBatch, compute_logits, forward
from jaxinfer.params import fuse_layers, fuse_params, init_params, param_specs, runtime_specs, unfuse_layer
from jaxinfer.quant import QuantizedWeight, is_quantized, quantize_leaf

FORMATS = (None, "int8", "int8-channel", "fp8", "int4")


def _logits(cfg, params):
  """One prefill of 5 tokens and one decode token of a second sequence, through forward."""
  page = 16
  T, n = 8, 6  # 5 prompt tokens of sequence 0, 1 decode token of sequence 1, 2 of padding
  tokens = jnp.array([3, 17, 5, 200, 9, 42, 0, 0], jnp.int32)
  pos = jnp.array([0, 1, 2, 3, 4, 7, 0, 0], jnp.int32)
  slots = jnp.array([16, 17, 18, 19, 20, 39, 0, 0], jnp.int32)
  batch = PagedBatch(slots, jnp.array([5, 8], jnp.int32), jnp.array([[1], [2]], jnp.int32),
                     jnp.array([0, 5, 6], jnp.int32), jnp.int32(2))
  cache = init_cache(cfg, 3, page)

  def run(params, cache):
    hidden, _ = forward(params, cfg, tokens, pos, cache, batch, attention_impl="xla")
    return compute_logits(params, cfg, hidden[:n])

  assert T == tokens.shape[0]
  return np.asarray(jax.jit(run)(params, cache))


@pytest.mark.parametrize("family,quantization", [("qwen2", q) for q in FORMATS] + [("qwen3", None), ("qwen3", "int4")])
def test_fused_logits_equal_the_unfused_ones_bit_for_bit(family, quantization):
  """qwen2 has q/k/v biases, qwen3 q/k norms and head_dim * H != D; both GQA (G = 2)."""
  cfg = read_config(tiny_dir(family))
  params = init_params(cfg, jax.random.key(3), quantization=quantization)
  fused = fuse_params(cfg, params)
  layer = fused["layers"][0]
  assert not {"wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up"} & set(layer)
  K, G, d, D = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
  assert layer["wqkv"].shape == ((K, G + 2, d, D) if quantization else (D, K, G + 2, d))
  want = _logits(cfg, params)
  assert np.abs(want).max() > 0.1
  np.testing.assert_array_equal(_logits(cfg, fused), want)


@pytest.mark.parametrize("quantization", FORMATS[1:])
def test_fusing_quantized_parts_is_quantizing_the_fused_weight(quantization):
  """Scales (and mins) per output channel or per (input group, output channel): quantizing the
  fused float weight gives the fused quantized parts, values, scales and mins alike."""
  cfg = read_config(tiny_dir("qwen2"))
  rng = np.random.default_rng(0)
  specs = param_specs(cfg)["layers"][0]
  floats = {k: (rng.standard_normal(specs[k].shape) * rng.uniform(0.1, 2, specs[k].shape[-1])).astype(np.float32)
            for k in ("wq", "wk", "wv", "w_gate", "w_up")}
  parts = {k: quantize_leaf(specs[k], w, quantization) for k, w in floats.items()}
  fused_parts = fuse_layers(cfg, {"layers": [parts]})["layers"][0]
  fused_floats = fuse_layers(cfg, {"layers": [floats]})["layers"][0]
  fused_specs = runtime_specs(cfg)["layers"][0]
  for name in ("wqkv", "w_gate_up"):
    direct = quantize_leaf(fused_specs[name], fused_floats[name], quantization)
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(fused_parts[name])):
      assert a.dtype == b.dtype and a.shape == b.shape
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_unfuse_gives_back_the_checkpoint_layout(quantization):
  cfg = read_config(tiny_dir("qwen2"))
  params = jax.device_get(init_params(cfg, jax.random.key(0), quantization=quantization))
  back = unfuse_layer(cfg, fuse_layers(cfg, params)["layers"][1], 1)
  assert set(back) == set(params["layers"][1])
  for k, v in params["layers"][1].items():
    for a, b in zip(jax.tree.leaves(v), jax.tree.leaves(back[k])):
      assert a.shape == b.shape and a.dtype == b.dtype
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_the_fused_layout_puts_kv_group_k_with_its_query_heads():
  """wqkv[:, k, g] is query head k G + g for g < G, wk's head k at G, wv's at G + 1."""
  cfg = read_config(tiny_dir("llama3"))  # G = 4
  params = jax.device_get(init_params(cfg, jax.random.key(1)))
  p = params["layers"][0]
  w = fuse_layers(cfg, params)["layers"][0]["wqkv"]
  G = cfg.num_heads // cfg.num_kv_heads
  for k in range(cfg.num_kv_heads):
    for g in range(G):
      np.testing.assert_array_equal(w[:, k, g], p["wq"][:, k * G + g])
    np.testing.assert_array_equal(w[:, k, G], p["wk"][:, k])
    np.testing.assert_array_equal(w[:, k, G + 1], p["wv"][:, k])
  gu = fuse_layers(cfg, params)["layers"][0]["w_gate_up"]
  np.testing.assert_array_equal(gu[:, 0], p["w_gate"])
  np.testing.assert_array_equal(gu[:, 1], p["w_up"])


def test_mixed_formats_cannot_be_one_weight_and_say_which():
  cfg = read_config(tiny_dir("qwen2"))
  specs = param_specs(cfg)["layers"][0]
  rng = np.random.default_rng(0)
  layer = {k: quantize_leaf(specs[k], rng.standard_normal(specs[k].shape).astype(np.float32), q)
           for k, q in (("wq", "int8"), ("wk", "int8"), ("wv", "int4"))}
  with pytest.raises(ValueError, match=r"wqkv \(model.layers.0.self_attn.q_proj.weight \+ .*different formats"):
    fuse_layers(cfg, {"layers": [layer]})
  # A Q8_0 part (no mins) beside asymmetric int8 groups: zero mins, the same weight.
  wv = layer["wk"]
  layer["wv"] = QuantizedWeight(wv.values, wv.scales)  # mins dropped
  fused = fuse_layers(cfg, {"layers": [layer]})["layers"][0]["wqkv"]
  assert is_quantized(fused) and np.all(np.asarray(fused.mins)[:, :, -1] == 0)


def test_each_tensor_parallel_shard_holds_its_kv_heads_with_their_query_heads():
  """qwen3 (H = 4, K = 2) over model=2: device d's wqkv block is kv head d's [q 2d, q 2d + 1, k d,
  v d]; gate_up's block is gate and up columns of the same F half. With kv heads replicated on
  purpose, q/k/v stay three weights (query heads still split) and gate/up is still fused."""
  from jaxinfer.sharding import make_mesh, make_rules, param_shardings, runtime_params
  cfg = read_config(tiny_dir("qwen3"))
  host = jax.device_get(init_params(cfg, jax.random.key(2)))
  p = host["layers"][0]
  mesh = make_mesh(model=2)

  def loaded(rules):  # placed as load_model places a checkpoint's weights, then joined as the runner does
    return runtime_params(cfg, jax.device_put(host, param_shardings(cfg, mesh, rules=rules)), mesh, rules)

  params = loaded(make_rules())
  w, gu = params["layers"][0]["wqkv"], params["layers"][0]["w_gate_up"]
  G, F = 2, cfg.intermediate_size
  for shard in w.addressable_shards:
    d = shard.index[1].start  # the kv head this device holds
    got = np.asarray(shard.data)
    assert got.shape == (cfg.hidden_size, 1, G + 2, cfg.head_dim)
    np.testing.assert_array_equal(got[:, 0, :G], p["wq"][:, d * G:(d + 1) * G])
    np.testing.assert_array_equal(got[:, 0, G], p["wk"][:, d])
    np.testing.assert_array_equal(got[:, 0, G + 1], p["wv"][:, d])
  for shard in gu.addressable_shards:
    cols = shard.index[2]
    assert np.asarray(shard.data).shape == (cfg.hidden_size, 2, F // 2)
    np.testing.assert_array_equal(np.asarray(shard.data)[:, 0], p["w_gate"][:, cols])
    np.testing.assert_array_equal(np.asarray(shard.data)[:, 1], p["w_up"][:, cols])
  layer = loaded(make_rules({"kv_heads": None}))["layers"][0]
  assert "wqkv" not in layer and "w_gate_up" in layer
  assert layer["wq"].sharding.shard_shape(layer["wq"].shape) == (cfg.hidden_size, 2, cfg.head_dim)
