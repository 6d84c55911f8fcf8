"""Meshes and the one table that maps logical axis names to mesh axes.

Weights name their dimensions logically ('vocab', 'heads', 'mlp', ...) in
their WeightSpec, and the KV cache in its CacheSpec (jaxinfer.models.cache);
`RULES` says which mesh axes each name is split over. Layers never spell out
a PartitionSpec. Mesh axes are ('data', 'expert', 'model'): tensor
parallelism over 'model', experts over 'expert', attention data parallelism
over 'data'.

A rule is one of

  "model"               split the dimension over that mesh axis
  ("data", "expert")    split it over several mesh axes together (wide expert
                        parallelism: every device of both axes holds its own experts)
  None                  replicate it, on purpose

and nothing else happens implicitly: a dimension that its mesh axes do not
divide, two dimensions of one tensor on the same mesh axis, or a logical
axis without a rule is a ShardingError at load time naming the tensor, the
axis, its size and the mesh axes. vLLM replicates KV heads when there are
fewer than tensor-parallel ranks; here that is the explicit override
`sharding_rules={"kv_heads": None}`, which the error suggests.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Union

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.errors import ShardingError
from jaxinfer.params import FUSED, WeightSpec, fuse_layers, fuse_params, is_spec, param_specs

MESH_AXES = ("data", "expert", "model")

Rule = Union[str, tuple[str, ...], None]

# Logical axis -> mesh axis, mesh axes, or None (replicated).
RULES: Mapping[str, Rule] = {
    "vocab": "model",
    "embed": None,
    "heads": "model",
    "kv_heads": "model",
    "head_dim": None,
    "mlp": "model",
    # The fused projections' part axes (params.FUSED): q / k / v slots of a kv group and gate /
    # up. Each device's kv heads (mlp columns) carry all their parts, so these stay whole.
    "qkv": None,
    "gate_up": None,
    "experts": "expert",  # wide expert parallelism: ("data", "expert")
    "q_lora": None,  # MLA's low-rank q / kv bottlenecks (DeepSeek): small, replicated
    "kv_lora": None,
    # The KV cache (jaxinfer.models.cache): pages are whole on every device that holds
    # the layer's heads; an MLA latent has no head axis and is replicated.
    "pages": None,
    "page_size": None,
    "kv_latent": None,
}


def make_rules(overrides: Mapping[str, Rule] | None = None) -> dict[str, Rule]:
  """RULES with `overrides` applied (e.g. {"kv_heads": None}); ShardingError for a malformed rule."""
  rules = dict(RULES)
  for name, rule in (overrides or {}).items():
    if not isinstance(name, str):
      raise ShardingError(f"sharding rule keys are logical axis names (str), got {name!r}")
    mesh_axes(name, rule)
    rules[name] = tuple(rule) if isinstance(rule, list) else rule
  return rules


def mesh_axes(name: str, rule: Any) -> tuple[str, ...]:
  """The mesh axes a rule names (() for None), or ShardingError for a malformed rule."""
  if rule is None:
    return ()
  if isinstance(rule, str):
    return (rule,)
  if isinstance(rule, (tuple, list)) and rule and all(isinstance(a, str) for a in rule):
    return tuple(rule)
  raise ShardingError(f"sharding rule for {name!r} must be a mesh axis name, a tuple of them, or None "
                      f"(replicate), got {rule!r}")


def make_mesh(data: int = 1, expert: int = 1, model: int = 1, devices=None) -> Mesh:
  """A ('data', 'expert', 'model') mesh over the first data*expert*model devices."""
  devices = list(devices if devices is not None else jax.devices())
  for name, n in (("data", data), ("expert", expert), ("model", model)):
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ShardingError(f"mesh axis {name} must be a positive int, got {n!r}")
  need = data * expert * model
  if need > len(devices):
    raise ShardingError(f"mesh data={data} x expert={expert} x model={model} needs {need} devices, "
                        f"have {len(devices)}")
  return Mesh(np.array(devices[:need]).reshape(data, expert, model), MESH_AXES)


def logical_to_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh,
                    rules: Mapping[str, Rule] | None = None, *, name: str = "a tensor") -> PartitionSpec:
  """The PartitionSpec of one tensor (`name` is how errors refer to it), or ShardingError.

  Each dimension's logical axis is looked up in `rules` (default RULES); the
  mesh axes it names must exist, must not be taken by another dimension of
  the same tensor, and together must divide the dimension.
  """
  rules = RULES if rules is None else rules
  out: list[Any] = []
  used: dict[str, str] = {}  # mesh axis -> the logical axis that took it
  for logical, size in zip(axes, shape):
    if logical is None:
      out.append(None)
      continue
    if logical not in rules:
      raise ShardingError(f"{name}: logical axis {logical!r} has no sharding rule; add one to "
                          f'sharding_rules, e.g. {{"{logical}": None}} to replicate it')
    axes_ = mesh_axes(logical, rules[logical])
    for ax in axes_:
      if ax not in mesh.shape:
        raise ShardingError(f"{name}: the rule {logical!r} -> {rules[logical]!r} names mesh axis "
                            f"{ax!r}, not in this mesh's axes {tuple(mesh.axis_names)}")
      if ax in used:
        raise ShardingError(f"{name}: logical axes {used[ax]!r} and {logical!r} both map to mesh axis "
                            f"{ax!r}; one tensor can use a mesh axis once (change one of their rules)")
      used[ax] = logical
    n = math.prod(mesh.shape[ax] for ax in axes_)
    if size % n:
      split = " x ".join(f"{ax}={mesh.shape[ax]}" for ax in axes_)
      raise ShardingError(f"{name}: its {logical!r} dimension (size {size}) is not divisible by mesh "
                          f"axes {axes_} ({split} = {n} shards); choose mesh sizes that divide {size}, "
                          f'or replicate it on purpose with sharding_rules={{"{logical}": None}}')
    out.append(None if not axes_ else axes_[0] if len(axes_) == 1 else axes_)
  return PartitionSpec(*out)


def named_sharding(axes, shape, mesh: Mesh, rules: Mapping[str, Rule] | None = None, *,
                   name: str = "a tensor") -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules, name=name))


def spec_sharding(spec: WeightSpec, mesh: Mesh, rules: Mapping[str, Rule] | None = None,
                  path: str = "") -> NamedSharding:
  where = f"{spec.hf} (params{path})" if path else spec.hf
  return named_sharding(spec.axes, spec.shape, mesh, rules, name=f"weight {where}")


def param_shardings(cfg, mesh: Mesh, quantization: str | None = None,
                    rules: Mapping[str, Rule] | None = None, *, fused: bool = False) -> Any:
  """NamedShardings for every weight of `cfg`, from the weights' logical axes and `rules`
  (RULES with the caller's overrides, see `make_rules`); ShardingError names the first
  weight that the mesh cannot split as the rules ask (by its checkpoint name, the fused tree
  too). `fused`: for the tree the model runs on (params.runtime_specs: wqkv, w_gate_up), else
  the checkpoint layout (params.param_specs).

  Quantized values shard like the float weight; scales like its output axes
  (their group axis stays replicated, so one tree fits any group count).
  """
  specs = param_specs(cfg, quantization)
  shardings = jax.tree_util.tree_map_with_path(
      lambda path, s: spec_sharding(s, mesh, rules, jax.tree_util.keystr(path)), specs, is_leaf=is_spec)
  if not fused:
    return shardings
  return jax.tree_util.tree_map_with_path(
      lambda path, s: spec_sharding(s, mesh, rules, jax.tree_util.keystr(path)),
      fuse_layers(cfg, specs, fused_names(rules)), is_leaf=is_spec)


def fused_names(rules: Mapping[str, Rule] | None = None) -> tuple[str, ...]:
  """The params.FUSED weights the model runs on under `rules`: all of them, except q/k/v where the
  rules split query heads and kv heads differently (kv heads replicated on purpose, K below the
  tensor-parallel size): wqkv's grouped layout can only be split along its kv heads, which would
  replicate the query projection too, so those layers keep their three matmuls."""
  rules = RULES if rules is None else rules
  if rules.get("heads") == rules.get("kv_heads"):
    return tuple(FUSED)
  return tuple(n for n in FUSED if n not in ("wqkv", "bqkv"))


def runtime_params(cfg, params: Any, mesh: Mesh | None = None,
                   rules: Mapping[str, Rule] | None = None) -> Any:
  """Checkpoint-layout weights (what load_model and init_params give) -> the tree the model runs
  on (params.fuse_params), the fused weights placed by the rules on `mesh` (None: one device).
  Already fused layers pass as they are."""
  if mesh is None:
    return fuse_params(cfg, params)
  from jaxinfer.quant import quantization_of, with_mins
  names = fused_names(rules)
  fused = jax.eval_shape(lambda p: fuse_layers(cfg, p, names), params)  # shapes and dtypes only
  q = quantization_of(fuse_layers(cfg, param_specs(cfg), names), fused)
  shardings = with_mins(param_shardings(cfg, mesh, q, rules, fused=True), fused)
  return fuse_params(cfg, params, shardings, names)
