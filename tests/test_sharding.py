"""Sharding on 8 fake CPU devices: weights and KV pages really are split (concrete shard
shapes, not the rule that placed them), logits stay the golden ones, and every mesh the
model cannot be split over is a ShardingError that names the tensor and the axis."""

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import golden, tiny_dir
from jaxinfer import LLM
from jaxinfer.config import ModelConfig
from jaxinfer.errors import JaxinferError, ShardingError
from jaxinfer.sharding import logical_to_spec, make_mesh, make_rules, named_sharding, param_shardings

ENGINE = dict(max_model_len=64, max_num_seqs=4, warmup=False)


def qwen3_config() -> ModelConfig:
  import json
  return ModelConfig.from_hf(json.loads((tiny_dir("qwen3") / "config.json").read_text()))


def shard_shape(arr) -> tuple[int, ...]:
  """The shape one device holds, asserted two ways: the placed data and the sharding's arithmetic."""
  got = arr.addressable_shards[0].data.shape
  assert got == arr.sharding.shard_shape(arr.shape)
  assert all(s.data.shape == got for s in arr.addressable_shards)
  return tuple(got)


def test_rule_table_maps_to_one_axis_a_tuple_or_none():
  mesh = make_mesh(data=2, expert=2, model=2)
  assert logical_to_spec(("embed", "heads", "head_dim"), (64, 8, 16), mesh) == P(None, "model", None)
  assert logical_to_spec(("vocab", "embed"), (320, 64), mesh) == P("model", None)
  # Wide expert parallelism: experts over data and expert together, 8 experts -> 2 per device pair.
  rules = make_rules({"experts": ("data", "expert")})
  axes, shape = ("experts", "embed", "mlp"), (8, 64, 128)
  assert logical_to_spec(axes, shape, mesh, rules) == P(("data", "expert"), None, "model")
  assert named_sharding(axes, shape, mesh, rules).shard_shape(shape) == (2, 64, 64)
  # An explicit None replicates on purpose.
  assert logical_to_spec(("embed", "kv_heads"), (64, 3), mesh, make_rules({"kv_heads": None})) == P(None, None)


@pytest.mark.parametrize("data,expert,model", [(1, 1, 2), (4, 1, 2)])
def test_weights_and_kv_pages_split_over_model(data, expert, model):
  """Tiny qwen3: 4 heads of 32, 2 KV heads, mlp 128, vocab 320; 'model' = 2 halves each."""
  mesh = make_mesh(data, expert, model)
  llm = LLM(tiny_dir("qwen3"), mesh=mesh, **ENGINE)
  layer = llm.runner.params["layers"][0]
  # Fused q/k/v [D, K, G + 2, d] (jaxinfer.params.FUSED): kv heads halved, each with its G = 2
  # query heads, its key and its value; gate/up [D, 2, F]: F halved.
  assert shard_shape(layer["wqkv"]) == (64, 1, 4, 32)
  assert shard_shape(layer["wo"]) == (2, 32, 64)
  assert shard_shape(layer["w_gate_up"]) == (64, 2, 64) and shard_shape(layer["w_down"]) == (64, 64)
  assert shard_shape(llm.runner.params["embed"]) == (160, 64)
  assert shard_shape(llm.runner.params["lm_head"]) == (64, 160)
  assert shard_shape(layer["attn_norm"]) == (64,)
  assert len(layer["wqkv"].sharding.device_set) == data * expert * model
  N = llm.runner.num_pages
  for cache_layer in llm.runner.cache:
    for name in ("k", "v"):
      assert cache_layer[name].shape == (N, 16, 2, 32)
      assert shard_shape(cache_layer[name]) == (N, 16, 1, 32)  # each device holds one KV head's pages
  g = golden("qwen3")
  np.testing.assert_allclose(llm.logits(g["token_ids"].tolist()), g["logits"], atol=1e-4, rtol=0)
  out = llm.generate([[5, 17, 200, 3]], _greedy())[0]
  assert out.token_ids == LLM(tiny_dir("qwen3"), **ENGINE).generate([[5, 17, 200, 3]], _greedy())[0].token_ids


def _greedy():
  from jaxinfer import SamplingParams
  return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_kv_heads_replicated_on_purpose_over_model_4():
  """2 KV heads over model=4 only with the explicit override; heads and the MLP still split."""
  mesh = make_mesh(data=2, model=4)
  llm = LLM(tiny_dir("qwen3"), mesh=mesh, sharding_rules={"kv_heads": None}, **ENGINE)
  layer = llm.runner.params["layers"][0]
  # Query heads split and kv heads whole: no fused wqkv (it splits only along kv heads), so
  # q, k and v stay three weights (sharding.fused_names); gate/up are one.
  assert shard_shape(layer["wq"]) == (64, 1, 32)
  assert shard_shape(layer["wk"]) == (64, 2, 32)  # whole on every device
  assert "wqkv" not in layer and shard_shape(layer["w_gate_up"]) == (64, 2, 32)
  N = llm.runner.num_pages
  assert shard_shape(llm.runner.cache[0]["k"]) == (N, 16, 2, 32)
  g = golden("qwen3")
  np.testing.assert_allclose(llm.logits(g["token_ids"].tolist()), g["logits"], atol=1e-4, rtol=0)


def test_kv_heads_that_do_not_divide_are_an_error_at_load_suggesting_the_override():
  with pytest.raises(ShardingError) as e:
    LLM(tiny_dir("qwen3"), mesh=make_mesh(model=4), **ENGINE)
  msg = str(e.value)
  assert "model.layers.0.self_attn.k_proj.weight" in msg and "['layers'][0]['wk']" in msg
  assert "'kv_heads' dimension (size 2) is not divisible" in msg and "('model',)" in msg and "model=4" in msg
  assert 'sharding_rules={"kv_heads": None}' in msg


def test_heads_that_do_not_divide_are_an_error():
  cfg = qwen3_config()
  with pytest.raises(ShardingError, match=r"o_proj.weight \(params\['layers'\]\[0\]\['wo'\]\): its 'heads' dimension \(size 4\) "
                                          r".*model=8"):
    param_shardings(cfg, make_mesh(model=8), rules=make_rules({"kv_heads": None}))


def test_a_tuple_rule_whose_product_does_not_divide_is_an_error():
  cfg = qwen3_config()
  mesh = make_mesh(data=2, model=4)
  with pytest.raises(ShardingError, match=r"o_proj.weight.*'heads' dimension \(size 4\) is not divisible "
                                          r"by mesh axes \('data', 'model'\) \(data=2 x model=4 = 8 shards\)"):
    param_shardings(cfg, mesh, rules=make_rules({"heads": ("data", "model"), "kv_heads": None}))


def test_two_dims_of_one_tensor_on_one_mesh_axis_are_an_error():
  cfg = qwen3_config()
  with pytest.raises(ShardingError, match=r"embed_tokens.weight.*'vocab' and 'embed' both map to mesh axis 'model'"):
    param_shardings(cfg, make_mesh(model=2), rules=make_rules({"embed": "model"}))


def test_kv_pages_that_do_not_divide_are_an_error_naming_the_cache():
  from jaxinfer.models.cache import CacheSpec
  spec = CacheSpec.from_config(qwen3_config(), np.float32)
  with pytest.raises(ShardingError, match=r"KV cache layer 0 'k'.*'kv_heads' dimension \(size 2\)"):
    spec.shardings(make_mesh(model=4), 8, 16)


def test_bad_meshes_and_rules_are_errors():
  with pytest.raises(ShardingError, match=r"needs 16 devices, have 8") as e:
    make_mesh(data=2, model=8)
  assert isinstance(e.value, JaxinferError)
  mesh = make_mesh(model=2)
  with pytest.raises(ShardingError, match=r"logical axis 'foo' has no sharding rule"):
    logical_to_spec(("foo",), (4,), mesh)
  with pytest.raises(ShardingError, match=r"names mesh axis 'tensor', not in this mesh"):
    logical_to_spec(("heads",), (4,), mesh, make_rules({"heads": "tensor"}))
  with pytest.raises(ShardingError, match=r"rule for 'heads' must be a mesh axis name"):
    make_rules({"heads": 3})
  with pytest.raises(ShardingError, match=r"sharding_rules need a mesh"):
    LLM(tiny_dir("qwen3"), sharding_rules={"kv_heads": None}, **ENGINE)


def test_kv_pool_split_along_pages_by_data():
  """sharding_rules={"pages": "data"}: each data shard holds its own block of pages (and the
  model axis its KV head); the pool is sized to a multiple of the shards; same logits."""
  mesh = make_mesh(data=2, model=2)
  llm = LLM(tiny_dir("qwen3"), mesh=mesh, sharding_rules={"pages": "data"}, **ENGINE)
  N = llm.runner.num_pages
  assert N % 2 == 0
  k = llm.runner.cache[0]["k"]
  assert shard_shape(k) == (N // 2, 16, 1, 32)
  g = golden("qwen3")
  np.testing.assert_allclose(llm.logits(g["token_ids"].tolist()), g["logits"], atol=1e-4, rtol=0)
  prompts = [[5, 17, 200, 3], list(range(1, 40))]
  want = LLM(tiny_dir("qwen3"), **ENGINE).generate(prompts, _greedy())
  assert [o.token_ids for o in llm.generate(prompts, _greedy())] == [o.token_ids for o in want]
  # KV export / import on the split pool: bit-exact, and the pool keeps its sharding.
  r = llm.runner
  before = r.cache[0]["v"].sharding
  pages = r.export_pages([1, 2, N - 1])
  assert pages[1]["v"].shape == (3, 16, 2, 32) and np.abs(pages[1]["v"]).sum() > 0
  r.import_pages([N - 2, 3, 4], pages)
  assert r.cache[0]["v"].sharding.is_equivalent_to(before, 4)
  for layer, got in zip(pages, r.export_pages([N - 2, 3, 4])):
    for name in layer:
      np.testing.assert_array_equal(got[name], layer[name])
