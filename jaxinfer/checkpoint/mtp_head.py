"""MTP heads (jaxinfer.models.mtp): found, read and written in DeepSeek-V3's safetensors names.

A head comes from, first found:

  1. beside the checkpoint: `<dir>/mtp_head.safetensors` (+ `mtp_head.json`) for a directory
     (Hugging Face or jaxinfer/orbax), `<file>.mtp_head.safetensors` for a GGUF file: what
     scripts/train_mtp.py writes;
  2. the checkpoint itself: a Hugging Face DeepSeek-V3/R1 directory whose tensors include
     layer `num_hidden_layers` (`model.layers.{L}.eh_proj.weight` and the rest);
  3. the heads jaxinfer ships (jaxinfer/data/mtp/<model name>.safetensors, `shipped_paths`),
     for the default model.

Every source uses the same names (`mtp_specs`), so a trained head is a DeepSeek-style MTP
layer. `shared_head.head` is read when present (DeepSeek's is a copy of lm_head) and
otherwise the target's LM head is used; `model.layers.{L}.embed_tokens` (also a copy)
is never read. A missing tensor or one whose shape does not fit the model is a
CheckpointError naming it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import jax
import ml_dtypes
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError

HEAD_FILE = "mtp_head.safetensors"
HEAD_CONFIG = "mtp_head.json"
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "mtp"

_DTYPE_NAMES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float16): "F16"}


def head_paths(model_path: str | Path) -> tuple[Path, Path]:
  """Where scripts/train_mtp.py saves the head of the checkpoint at `model_path` (and its json)."""
  p = Path(model_path).expanduser()
  if p.is_dir():
    return p / HEAD_FILE, p / HEAD_CONFIG
  return p.with_name(p.name + "." + HEAD_FILE), p.with_name(p.name + "." + HEAD_CONFIG)


def shipped_paths(cfg: ModelConfig) -> tuple[Path, Path]:
  """The shipped head of the model named cfg.name (lower case, runs of other characters as '-')."""
  slug = re.sub(r"[^a-z0-9._]+", "-", cfg.name.lower()).strip("-")
  return SHIPPED_DIR / f"{slug}.safetensors", SHIPPED_DIR / f"{slug}.json"


def assemble_mtp(cfg: ModelConfig, source: str, fetch: Callable[[str], np.ndarray | None],
                 own_head: bool = False) -> Any:
  """The mtp_specs tree of numpy arrays in our layout, each tensor asked of `fetch(name)`
  (None if absent); CheckpointError naming a tensor that is missing or mis-shaped."""
  from jaxinfer.models.mtp import mtp_specs
  from jaxinfer.params import is_spec
  leaves, treedef = jax.tree.flatten(mtp_specs(cfg, own_head), is_leaf=is_spec)

  def read(name: str, expected: tuple[int, ...]) -> np.ndarray:
    a = fetch(name)
    if a is None:
      raise CheckpointError(f"{source}: MTP tensor {name!r} is missing")
    if tuple(a.shape) != expected:
      raise CheckpointError(f"{source}: MTP tensor {name!r} has shape {tuple(a.shape)}, expected "
                            f"{expected} for this model ({cfg.name or cfg.architecture})")
    return np.asarray(a)

  out = []
  for spec in leaves:
    names = spec.checkpoint_names("hf")
    if "{e}" in spec.hf:
      out.append(spec.from_checkpoint(np.stack([read(n, spec.checkpoint_shape(per_expert=True))
                                                for n in names])))
    else:
      out.append(spec.from_checkpoint(read(names[0], spec.checkpoint_shape())))
  return jax.tree.unflatten(treedef, out)


def _head_name(cfg: ModelConfig) -> str:
  from jaxinfer.models.mtp import mtp_layer_index
  return f"model.layers.{mtp_layer_index(cfg)}.shared_head.head.weight"


def read_safetensors_head(path: Path, cfg: ModelConfig) -> Any:
  """A head from one safetensors file (what train_mtp writes)."""
  from jaxinfer.checkpoint.hf import _read_raw
  from safetensors import SafetensorError, safe_open
  try:
    f = safe_open(str(path), framework="numpy")
  except (SafetensorError, OSError, ValueError) as e:
    raise CheckpointError(f"{path}: not a valid safetensors file ({e})") from None
  names = set(f.keys())

  def fetch(name):
    if name not in names:
      return None
    try:
      return f.get_tensor(name)
    except TypeError:  # bfloat16
      return _read_raw(path, name)

  return assemble_mtp(cfg, str(path), fetch, own_head=_head_name(cfg) in names)


def read_hf_head(directory: Path, cfg: ModelConfig) -> Any | None:
  """DeepSeek-V3/R1's own MTP layer from a Hugging Face directory, or None if it has none."""
  from jaxinfer.checkpoint.hf import _open, _read_raw, _tensor_files
  from jaxinfer.models.mtp import mtp_layer_index
  files = _tensor_files(directory)
  if f"model.layers.{mtp_layer_index(cfg)}.eh_proj.weight" not in files:
    return None
  handles: dict[Path, Any] = {}

  def fetch(name):
    path = files.get(name)
    if path is None:
      return None
    if path not in handles:
      handles[path] = _open(path)
    try:
      return handles[path].get_tensor(name)
    except TypeError:
      return _read_raw(path, name)

  return assemble_mtp(cfg, str(directory), fetch, own_head=_head_name(cfg) in files)


def find_mtp_head(model_path: str | Path | None, cfg: ModelConfig) -> tuple[str, Any] | None:
  """(where it came from, numpy tree) of the first head found for this checkpoint, or None."""
  if model_path is not None:
    path = Path(model_path).expanduser()
    head, _ = head_paths(path)
    if head.is_file():
      return str(head), read_safetensors_head(head, cfg)
    if path.is_dir() and (path / "config.json").is_file():
      weights = read_hf_head(path, cfg)
      if weights is not None:
        return str(path), weights
  head, _ = shipped_paths(cfg)
  if cfg.name and head.is_file():
    return str(head), read_safetensors_head(head, cfg)
  return None


def _hf_tensors(cfg: ModelConfig, weights: Any) -> dict[str, np.ndarray]:
  """Our layout -> checkpoint layout, by name (the inverse of assemble_mtp)."""
  from jaxinfer.models.mtp import mtp_specs
  from jaxinfer.params import is_spec
  specs = mtp_specs(cfg, own_head="head" in weights)
  out = {}
  for spec, a in zip(jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(weights)):
    a = np.asarray(a)
    if spec.num_experts:
      one = spec.one_expert()
      parts = [_to_checkpoint(one, a[e]) for e in range(spec.num_experts)]
      if "{e}" in spec.hf:
        out.update({n: p for n, p in zip(spec.checkpoint_names("hf"), parts)})
      else:
        out[spec.hf] = np.stack(parts)
    else:
      out[spec.hf] = _to_checkpoint(spec, a)
  return out


def _to_checkpoint(spec, a: np.ndarray) -> np.ndarray:
  if spec.interleave:
    raise CheckpointError("saving interleaved (GPT-OSS) expert weights is not supported")
  shape = spec.checkpoint_shape()
  if spec.linear:
    return np.ascontiguousarray(a.reshape(spec.fan_in, -1).T).reshape(shape)
  return np.ascontiguousarray(a.reshape(shape))


def save_mtp_head(model_path: str | Path, cfg: ModelConfig, weights: Any, meta: dict | None = None,
                  dtype=ml_dtypes.bfloat16, paths: tuple[Path, Path] | None = None) -> Path:
  """Writes the head beside the checkpoint (or at `paths`) in DeepSeek's names, `dtype` floats,
  and a json with the model config and `meta` (training settings). Returns the safetensors path."""
  head, info = paths or head_paths(model_path)
  tensors = {n: a.astype(dtype) for n, a in _hf_tensors(cfg, jax.device_get(weights)).items()}
  header, offset, blobs = {}, 0, []
  for name in sorted(tensors):
    a = tensors[name]
    b = a.tobytes()
    header[name] = {"dtype": _DTYPE_NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
    offset += len(b)
    blobs.append(b)
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
  head.parent.mkdir(parents=True, exist_ok=True)
  tmp = head.with_name(head.name + ".part")
  with open(tmp, "wb") as f:
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    for b in blobs:
      f.write(b)
  tmp.replace(head)
  info.write_text(json.dumps({"model": cfg.name, "config": cfg.to_dict(), **(meta or {})}, indent=1,
                             default=str) + "\n")
  return head
