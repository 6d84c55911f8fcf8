"""Meshes and the one table that maps logical axis names to mesh axes.

Weights name their dimensions logically ('vocab', 'heads', 'mlp', ...) in
their WeightSpec; `RULES` says which mesh axis each name is split over. Layers
never spell out a PartitionSpec. Mesh axes are ('data', 'expert', 'model'):
tensor parallelism over 'model', experts over 'expert', attention data
parallelism over 'data'.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.params import WeightSpec, is_spec, param_specs

MESH_AXES = ("data", "expert", "model")

# Logical axis -> mesh axis (None: replicated).
RULES: Mapping[str, str | None] = {
    "vocab": "model",
    "embed": None,
    "heads": "model",
    "kv_heads": "model",
    "head_dim": None,
    "mlp": "model",
    "experts": "expert",
}


def make_mesh(data: int = 1, expert: int = 1, model: int = 1, devices=None) -> Mesh:
  """A ('data', 'expert', 'model') mesh over the first data*expert*model devices."""
  devices = list(devices if devices is not None else jax.devices())
  need = data * expert * model
  if need > len(devices):
    raise ValueError(f"mesh data={data} x expert={expert} x model={model} needs {need} devices, "
                     f"have {len(devices)}")
  return Mesh(np.array(devices[:need]).reshape(data, expert, model), MESH_AXES)


def logical_to_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh,
                    rules: Mapping[str, str | None] = RULES) -> PartitionSpec:
  """The PartitionSpec for one weight.

  A dimension that the mesh axis does not divide evenly (3 KV heads over 8
  devices) stays replicated: correct everywhere, and the rule table stays one
  table instead of per-model exceptions.
  """
  out, used = [], set()
  for name, size in zip(axes, shape):
    mesh_axis = rules.get(name) if name else None
    if mesh_axis is None or mesh_axis in used or size % mesh.shape[mesh_axis]:
      out.append(None)
    else:
      out.append(mesh_axis)
      used.add(mesh_axis)
  return PartitionSpec(*out)


def spec_sharding(spec: WeightSpec, mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(spec.axes, spec.shape, mesh))


def param_shardings(cfg, mesh: Mesh, quantization: str | None = None) -> Any:
  """NamedShardings for every weight of `cfg`, from the weights' logical axes.

  Quantized values shard like the float weight; scales like its output axes
  (their group axis stays replicated, so one tree fits any group count).
  """
  return jax.tree.map(lambda s: spec_sharding(s, mesh), param_specs(cfg, quantization), is_leaf=is_spec)
