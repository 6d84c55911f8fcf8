"""Our own format: an orbax-checkpoint directory that also holds config and tokenizer.

Layout of a converted checkpoint:

  DST/
    jaxinfer_checkpoint.json   format version, ModelConfig, source, stored dtype, quantization
    params/                    orbax (OCDBT) pytree, one array per WeightSpec; a quantized
                               weight is {'values': int8 | float8_e4m3fn | int4,
                               'scales': float32 [G, out...] (int4: float16)} (+ 'mins', same shape, for int4)
    tokenizer/                 tokenizer.json or tokenizer.model + tokenizer_meta.json

It is written to `DST.partial` and renamed at the end, so an interrupted
conversion never leaves something that looks like a checkpoint.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxinfer.checkpoint.common import ImportedModel
from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError, JaxinferError
from jaxinfer.params import WeightSpec, abstract_params, is_spec, param_specs
from jaxinfer.quant import (QUANTIZATIONS, VALUE_DTYPES, QuantizedWeight, cast_floats, check_quantized,
                            is_quantized, leaf_format, quantization_of, quantize_tree, scale_dtype, with_mins)
from jaxinfer.tokenizer import Tokenizer

MANIFEST = "jaxinfer_checkpoint.json"
FORMAT_VERSION = 2
# What each version changed and the stored quantizations that change makes unreadable: a
# checkpoint written before the change is refused by its version (with the command that
# rewrites it), since read as the new format its numbers would be wrong weights, not an error.
# One written before a change that did not touch its quantization still loads.
FORMAT_CHANGES: dict[int, tuple[frozenset[str | None], str]] = {
    2: (frozenset({"int4"}), "int4 scales and mins became float16 and the mins the group minimum "
                             "(they were float32, and min + 8 scale)"),
}
# How quantized values are laid out (jaxinfer/quant.py): output axes first since this key
# appeared; a quantized checkpoint without it holds [in, out] values and must be rewritten.
VALUES_LAYOUT = "out_in"


def is_checkpoint(path: Path) -> bool:
  return (path / MANIFEST).is_file()


def save(model: ImportedModel, dst: str | Path, dtype: str = "float32", overwrite: bool = False) -> Path:
  dst = Path(dst).expanduser().resolve()
  if dst.exists() and any(dst.iterdir()):
    if not overwrite:
      raise CheckpointError(f"{dst}: already exists and is not empty (pass overwrite=True / --overwrite)")
  tmp = dst.with_name(dst.name + ".partial")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  try:
    quantization = quantization_of(param_specs(model.config), model.weights)
  except ValueError as e:
    raise CheckpointError(f"{dst}: {e}") from None
  weights = _to_state(cast_floats(jax.tree.map(np.asarray, model.weights), dtype))
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp / "params", weights)
  checkpointer.wait_until_finished()
  if model.tokenizer is not None:
    model.tokenizer.save(tmp / "tokenizer")
  manifest = dict(format_version=FORMAT_VERSION, config=model.config.to_dict(),
                  source=model.source, dtype=dtype, quantization=quantization)
  if manifest["quantization"]:
    manifest["values_layout"] = VALUES_LAYOUT
  (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
  if dst.exists():
    shutil.rmtree(dst)
  tmp.rename(dst)
  return dst


def read_manifest(path: Path) -> dict[str, Any]:
  try:
    manifest = json.loads((path / MANIFEST).read_text())
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{path / MANIFEST}: cannot read ({e})") from None
  version = manifest.get("format_version")
  if not isinstance(version, int) or version < 1 or version > FORMAT_VERSION:
    raise CheckpointError(f"{path / MANIFEST}: format_version {version!r} is not one this jaxinfer reads "
                          f"(1 to {FORMAT_VERSION}): written by a newer jaxinfer, or not by jaxinfer")
  quantization = manifest.get("quantization")
  for changed in range(version + 1, FORMAT_VERSION + 1):
    affected, what = FORMAT_CHANGES.get(changed, (frozenset(), ""))
    if quantization in affected:
      raise CheckpointError(f"{path / MANIFEST}: format_version {version}, older than {changed}, in which {what}; "
                            f"rewrite it with `{convert_command(path, manifest)}`")
  return manifest


def convert_command(path: Path, manifest: dict[str, Any]) -> str:
  """The `jaxinfer convert` command line that rewrites the checkpoint at `path` from its source."""
  cmd = ["jaxinfer", "convert", str(manifest.get("source", "SOURCE")), str(path),
         "--dtype", str(manifest.get("dtype", "float32"))]
  if manifest.get("quantization"):
    cmd += ["--quantize", manifest["quantization"]]
  return shlex.join(cmd + ["--overwrite"])


def is_current(path: Path) -> bool:
  """Whether `path` is a checkpoint this jaxinfer reads as it is (read_manifest accepts it)."""
  try:
    read_manifest(path)
  except CheckpointError:
    return False
  return True


def _to_state(tree: Any) -> Any:
  """QuantizedWeight nodes -> plain {'values', 'scales'(, 'mins')} dicts: what orbax stores."""
  def one(w):
    if not is_quantized(w):
      return w
    state = {"values": w.values, "scales": w.scales}
    return state if w.mins is None else {**state, "mins": w.mins}
  return jax.tree.map(one, tree, is_leaf=is_quantized)


def _from_state(specs: Any, state: Any) -> Any:
  return jax.tree.map(lambda s, a: QuantizedWeight(a["values"], a["scales"], a.get("mins")) if is_quantized(s)
                      else a, specs, state, is_leaf=lambda x: is_spec(x) or is_quantized(x))


def _quantized_target(path: Path, cfg: ModelConfig, dtype, shardings: Any, quantization: str) -> Any:
  """The restore target of a quantized checkpoint: scales' group counts come from the stored
  metadata (per channel, or groups of 32), checked against the values per tensor; int4's
  mins are placed like its scales."""
  try:
    stored = ocp.StandardCheckpointer().metadata(path / "params").item_metadata
    stored = getattr(stored, "tree", stored)
  except Exception as e:  # orbax raises many types for damaged metadata
    raise CheckpointError(f"{path / 'params'}: cannot read metadata ({type(e).__name__}: {str(e)[:300]})") from None
  is_node = lambda x: is_spec(x) or is_quantized(x)

  def target(keys, spec, float_spec: WeightSpec, sharding):
    if not is_quantized(spec):
      return jax.ShapeDtypeStruct(spec.shape, dtype, sharding=sharding)
    name = f"{path}: tensor {float_spec.hf!r}"
    meta = stored
    for k in keys:
      key = k.key if isinstance(k, jax.tree_util.DictKey) else k.idx
      try:
        meta = meta[key]
      except (KeyError, IndexError, TypeError):
        raise CheckpointError(f"{name} is missing from the checkpoint") from None
    fmt = leaf_format(float_spec, quantization)  # the head is int8 under int4
    if not isinstance(meta, dict) and float_spec.head:
      raise CheckpointError(f"{name}: this {quantization} checkpoint keeps the LM head in floats, as "
                            f"jaxinfer did before int4 held it in int8; re-run `jaxinfer convert ... "
                            f"--quantize {quantization}`")
    if not isinstance(meta, dict) or not {"values", "scales"} <= set(meta) <= {"values", "scales", "mins"}:
      raise CheckpointError(f"{name} is not stored quantized ({fmt} values + scales)")
    mins = meta.get("mins")
    check_quantized(name, tuple(meta["values"].shape), meta["values"].dtype, tuple(meta["scales"].shape),
                    float_spec, fmt, None if mins is None else tuple(mins.shape))
    dtype_of_scales = scale_dtype(fmt)
    if fmt == "int4" and np.dtype(meta["scales"].dtype) != dtype_of_scales:
      raise CheckpointError(f"{name}: int4 scales are {np.dtype(meta['scales'].dtype)}, not {dtype_of_scales} as "
                            f"format_version {FORMAT_VERSION} stores them; re-run `jaxinfer convert ... --quantize int4`")
    scales = jax.ShapeDtypeStruct(tuple(meta["scales"].shape), dtype_of_scales, sharding=sharding.scales)
    return QuantizedWeight(jax.ShapeDtypeStruct(spec.shape, VALUE_DTYPES[fmt], sharding=sharding.values),
                           scales, None if mins is None else scales)

  return jax.tree_util.tree_map_with_path(target, param_specs(cfg, quantization), param_specs(cfg), shardings,
                                          is_leaf=is_node)


def restore(path: str | Path, dtype, shardings_fn=None, quantization: str | None = None
            ) -> tuple[ModelConfig, Any, Tokenizer | None]:
  """Restores weights cast to `dtype` (orbax casts while reading), placed by
  `shardings_fn(config, quantization)` (default: the first device).

  A checkpoint written quantized loads quantized (its values, float32
  scales) whatever `quantization` says; a float one with a `quantization`
  is quantized here (jaxinfer.quant.quantize_tree).
  """
  path = Path(path).expanduser().resolve()
  manifest = read_manifest(path)
  cfg = ModelConfig.from_dict(manifest["config"])
  stored_q = manifest.get("quantization")
  if stored_q not in (None,) + QUANTIZATIONS:
    raise CheckpointError(f"{path / MANIFEST}: unknown quantization {stored_q!r}")
  if stored_q and manifest.get("values_layout") != VALUES_LAYOUT:
    raise CheckpointError(f"{path / MANIFEST}: {stored_q} values stored as [in, out] by an older jaxinfer "
                          f"(now [out, in]); rewrite it with `{convert_command(path, manifest)}`")
  load_q = stored_q or quantization
  if shardings_fn is not None:
    shardings = shardings_fn(cfg, load_q) if load_q else shardings_fn(cfg)
  else:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, abstract_params(cfg, quantization=load_q))
  if stored_q:
    target = _quantized_target(path, cfg, dtype, shardings, stored_q)
  elif quantization:  # read float32 onto the host's first device, quantize below
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = abstract_params(cfg, np.float32, jax.tree.map(lambda _: device, abstract_params(cfg)))
  else:
    target = abstract_params(cfg, dtype, shardings)
  try:
    params = ocp.StandardCheckpointer().restore(path / "params", _to_state(target))
  except JaxinferError:
    raise
  except Exception as e:  # orbax/tensorstore raise many types for damaged data
    raise CheckpointError(f"{path / 'params'}: cannot restore ({type(e).__name__}: {str(e)[:300]})") from None
  specs = param_specs(cfg, load_q)
  if stored_q:
    params = _from_state(specs, params)
  elif quantization:
    host = quantize_tree(param_specs(cfg), jax.device_get(params), quantization)
    params = jax.device_put(cast_floats(host, dtype), with_mins(shardings, host))
  tokenizer = Tokenizer.load(path / "tokenizer") if (path / "tokenizer").is_dir() else None
  return cfg, params, tokenizer
