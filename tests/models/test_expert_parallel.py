"""Expert parallelism (models/expert_parallel.py) on 8 fake CPU devices: the all-to-all EP FFN
equals the single-program `moe.moe_ffn` for experts split 8 ways and 4 ways over (data, expert),
for the softmax and DeepSeek-V3 routers, at token counts that divide nothing and with all tokens
routed to the same experts (the capacity worst case); the experts really are split inside and the
program really contains an all-to-all (not a gather of the weights)."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import USER_XLA, tiny_dir
from jaxinfer.config import ModelConfig
from jaxinfer.errors import ShardingError
from jaxinfer.models import moe
from jaxinfer.models.expert_parallel import capacity, ep_moe_ffn
from jaxinfer.params import is_spec, moe_specs
from jaxinfer.sharding import make_mesh, make_rules, mesh_axes, named_sharding

WIDE = {"experts": ("data", "expert")}
MESHES = {"expert8": ((1, 8, 1), None), "wide_2x2x2": ((2, 2, 2), WIDE)}


def config(router: str) -> ModelConfig:
  family = "gpt_oss" if router == "gpt_oss" else "mixtral"
  cfg = ModelConfig.from_hf(json.loads((tiny_dir(family) / "config.json").read_text()))
  if router == "deepseek_shared":
    cfg = ModelConfig(**(cfg.to_dict() | dict(
        architecture="qwen3_moe", scoring_func="sigmoid", router_bias=True, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, num_shared_experts=1, shared_expert_intermediate_size=48)))
  return cfg


def random_params(cfg: ModelConfig, seed=1):
  rng = np.random.default_rng(seed)

  def one(spec):
    scale = 1 / np.sqrt(spec.fan_in) if spec.linear else 0.1
    return jnp.asarray(rng.normal(size=spec.shape) * scale, jnp.float32)

  return jax.tree.map(one, moe_specs(cfg, 0), is_leaf=is_spec)


def skew(p, cfg):
  """Every token picks the same experts: the softmax router ties (zero weights, top-k takes the
  lowest ids 0 and 1); DeepSeek's bias steers all to experts 6 and 7 (one group, one device),
  GPT-OSS's logit bias to experts 2 and 3."""
  p = dict(p, router=jnp.zeros_like(p["router"]))
  if cfg.router_bias:
    p["router_bias"] = jnp.zeros_like(p["router_bias"]).at[6:].set(10.0)
  if cfg.router_logit_bias:
    p["router_logit_bias"] = jnp.zeros_like(p["router_logit_bias"]).at[2:4].set(jnp.array([2.0, 1.0]))
  return p


def on_mesh(p, cfg, shape, overrides):
  mesh, rules = make_mesh(*shape), make_rules(overrides)
  shardings = jax.tree.map(lambda s: named_sharding(s.axes, s.shape, mesh, rules), moe_specs(cfg, 0),
                           is_leaf=is_spec)
  ep = jax.jit(lambda p, x, valid=None: ep_moe_ffn(
      p, cfg, x, valid, mesh=mesh, expert_axes=mesh_axes("experts", rules["experts"]),
      mlp_axes=mesh_axes("mlp", rules["mlp"])))
  return ep, jax.device_put(p, shardings), mesh


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("router", ["mixtral", "deepseek_shared", "gpt_oss"])
@pytest.mark.parametrize("routing, T", [("random", 13), ("skewed", 3)])  # T divides no mesh axis
def test_ep_equals_the_single_program_moe_ffn(mesh_name, router, routing, T):
  """T=13 divides by nothing; T=3: 6 copies < 8 experts, moe_ffn's per-copy path. GPT-OSS: expert
  biases (the down bias added once across the 'model' shards) and the clamped SwiGLU."""
  cfg = config(router)
  p = random_params(cfg)
  if routing == "skewed":
    p = skew(p, cfg)
  x = jax.random.normal(jax.random.key(2), (T, cfg.hidden_size))
  valid = jnp.arange(T) < T - 1  # the last token is padding: routed, not counted
  ref, ref_stats = jax.jit(moe.moe_ffn, static_argnums=1)(p, cfg, x, valid)
  _, ids = moe.route(p, cfg, x)
  if routing == "skewed":
    assert (np.asarray(ids) == np.asarray(ids)[0]).all()
  assert np.abs(np.asarray(ref)).min() > 0
  shape, overrides = MESHES[mesh_name]
  ep, ps, _ = on_mesh(p, cfg, shape, overrides)
  out, stats = ep(ps, x, valid)
  assert out.shape == (T, cfg.hidden_size) and out.dtype == jnp.float32
  np.testing.assert_allclose(out, ref, atol=2e-6, rtol=1e-5)
  np.testing.assert_array_equal(stats.tokens_per_expert, ref_stats.tokens_per_expert)


def shard_map_input_shapes(f, *args):
  """The per-device shapes of the EP shard_map's inputs, from the traced program."""
  jaxpr = jax.make_jaxpr(f)(*args)
  found = []

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name == "shard_map":
        found.append([v.aval.shape for v in eqn.params["jaxpr"].invars])
      for v in eqn.params.values():
        if hasattr(v, "eqns"):
          walk(v)
        elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
          walk(v.jaxpr)
  walk(jaxpr.jaxpr)
  return found


@pytest.mark.parametrize("mesh_name,n,tp", [("expert8", 8, 1), ("wide_2x2x2", 4, 2)])
def test_experts_are_split_and_tokens_move_by_all_to_all(mesh_name, n, tp):
  cfg = config("mixtral")
  E, D, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
  p = random_params(cfg)
  x = jax.random.normal(jax.random.key(2), (13, D))
  shape, overrides = MESHES[mesh_name]
  ep, ps, _ = on_mesh(p, cfg, shape, overrides)
  # Inside the shard_map each device holds E / n experts and F / tp of each.
  (inputs,) = shard_map_input_shapes(ep, ps, x)
  expert_shapes = inputs[:3]  # w_down, w_gate, w_up (dict order)
  assert sorted(expert_shapes) == sorted([(E // n, F // tp, D), (E // n, D, F // tp), (E // n, D, F // tp)])
  assert inputs[-1] == (-(-13 // n), D)  # and its own tokens
  hlo = ep.lower(ps, x).compile(compiler_options=USER_XLA).as_text()
  assert "all-to-all(" in hlo
  # Nothing 3-D is all-gathered: the [E/n, ., .] expert weights never travel.
  for line in hlo.splitlines():
    if "all-gather(" in line:
      out_shape = re.search(r"= \w+\[([\d,]*)\]", line)
      assert out_shape and out_shape.group(1).count(",") < 2, line


@pytest.mark.parametrize("router", ["mixtral", "gpt_oss"])
def test_ep_with_int8_experts_equals_the_single_program_moe_ffn(router):
  """int8 experts on the wide mesh: values and their [E, 1, out] scales split by expert, and
  w_gate / w_up's scales by F with their values ('model', tp 2), w_down's not (its output is
  D): the same output as the single-program moe_ffn over the same quantized layer."""
  from jaxinfer.quant import is_quantized, leaf_spec, quantize_tree
  cfg = config(router)
  float_specs = moe_specs(cfg, 0)
  p = jax.tree.map(jnp.asarray, quantize_tree(float_specs, jax.tree.map(np.asarray, random_params(cfg)), "int8"))
  specs = jax.tree.map(lambda s: leaf_spec(s, "int8"), float_specs, is_leaf=is_spec)
  mesh, rules = make_mesh(2, 2, 2), make_rules(WIDE)
  shardings = jax.tree.map(lambda s: named_sharding(s.axes, s.shape, mesh, rules), specs, is_leaf=is_spec)
  ps = jax.device_put(p, shardings)
  assert ps["w_gate"].scales.sharding.shard_shape((8, 1, 32)) == (2, 1, 16)
  assert ps["w_down"].scales.sharding.shard_shape((8, 1, 64)) == (2, 1, 64)
  x = jax.random.normal(jax.random.key(2), (13, cfg.hidden_size))
  ref, _ = jax.jit(moe.moe_ffn, static_argnums=1)(p, cfg, x)
  out, _ = jax.jit(lambda p, x: ep_moe_ffn(p, cfg, x, mesh=mesh, expert_axes=("data", "expert"),
                                           mlp_axes=("model",)))(ps, x)
  assert is_quantized(ps["w_up"]) and np.abs(np.asarray(ref)).min() > 0
  np.testing.assert_allclose(out, ref, atol=2e-6, rtol=1e-5)


def test_capacity_is_the_worst_case():
  assert capacity(7, 2, 2) == 14  # all 7 tokens of a source pick 2 experts of one device
  assert capacity(7, 2, 1) == 7  # one expert per device: a token sends it at most one copy
  assert capacity(4, 8, 32) == 32


def test_wide_ep_nested_in_attention_dp_shard_map():
  """Under attention DP the runner's shard_map over 'data' is already manual; each data shard's
  tokens still reach all 4 devices' experts through the ('data', 'expert') all-to-all."""
  cfg = config("deepseek_shared")
  p = random_params(cfg)
  _, ps, mesh = on_mesh(p, cfg, (2, 2, 2), WIDE)
  x = jax.random.normal(jax.random.key(3), (2 * 13, cfg.hidden_size))
  ref = np.concatenate([jax.jit(moe.moe_ffn, static_argnums=1)(p, cfg, x[i * 13:(i + 1) * 13])[0]
                        for i in range(2)])
  # Each data shard gets the contiguous block of experts that it and its 'expert' peers hold.
  pspec = {k: P("data") if k.startswith("w_") else P() for k in p}
  pspec["shared"] = jax.tree.map(lambda _: P(), p["shared"])

  def shard(p, x):
    return ep_moe_ffn(p, cfg, x, mesh=mesh, expert_axes=("data", "expert"), mlp_axes=("model",))[0]
  f = jax.jit(jax.shard_map(shard, mesh=mesh, axis_names={"data"}, check_vma=False,
                            in_specs=(pspec, P("data")), out_specs=P("data")))
  np.testing.assert_allclose(f(ps, x), ref, atol=2e-6, rtol=1e-5)
  hlo = f.lower(ps, x).compile(compiler_options=USER_XLA).as_text()
  groups = [l for l in hlo.splitlines() if "all-to-all(" in l]
  assert groups and all("replica_groups={{0,2,4,6},{1,3,5,7}}" in l for l in groups)


def test_experts_that_do_not_divide_are_named():
  cfg = ModelConfig(**(config("mixtral").to_dict() | dict(num_experts=12)))
  p = random_params(cfg)
  x = jnp.ones((4, cfg.hidden_size))
  with pytest.raises(ShardingError, match="12 experts"):
    ep_moe_ffn(p, cfg, x, mesh=make_mesh(1, 8, 1), expert_axes=("expert",))
