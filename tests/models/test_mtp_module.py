"""The MTP module's parameters and DeepSeek-V3's MTP layer read from safetensors by name."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import tiny_dir
from jaxinfer.checkpoint.hf import read_config
from jaxinfer.checkpoint.mtp_head import (find_mtp_head, read_hf_head, read_safetensors_head,
                                          save_mtp_head)
from jaxinfer.errors import CheckpointError
from jaxinfer.models.mtp import mtp_layer_index, mtp_specs
from jaxinfer.params import is_spec


def mtp_tensors(cfg, rng, head=False) -> dict[str, np.ndarray]:
  """Distinct random tensors under every name the MTP layer has, in checkpoint layout."""
  out = {}
  for spec in jax.tree.leaves(mtp_specs(cfg, own_head=head), is_leaf=is_spec):
    shape = spec.checkpoint_shape(per_expert=True) if "{e}" in spec.hf else spec.checkpoint_shape()
    for name in spec.checkpoint_names("hf"):
      out[name] = rng.normal(size=shape).astype(np.float32)
  L = mtp_layer_index(cfg)
  out[f"model.layers.{L}.embed_tokens.weight"] = rng.normal(size=(cfg.vocab_size, cfg.hidden_size)).astype(np.float32)
  return out


@pytest.fixture
def deepseek_with_mtp(tmp_path):
  """The tiny DeepSeek-V3 with an MTP layer (layer 3) in a second safetensors file."""
  d = tmp_path / "deepseek_v3"
  shutil.copytree(tiny_dir("deepseek_v3"), d)
  cfg = read_config(d)
  tensors = mtp_tensors(cfg, np.random.default_rng(0))
  save_file(tensors, str(d / "model-mtp.safetensors"))
  return d, cfg, tensors


def test_deepseek_mtp_layer_lands_where_it_should(deepseek_with_mtp):
  d, cfg, t = deepseek_with_mtp
  L = cfg.num_layers
  assert L == 3
  w = read_hf_head(d, cfg)
  pre = f"model.layers.{L}."
  np.testing.assert_array_equal(w["enorm"], t[pre + "enorm.weight"])
  np.testing.assert_array_equal(w["hnorm"], t[pre + "hnorm.weight"])
  np.testing.assert_array_equal(w["norm"], t[pre + "shared_head.norm.weight"])
  np.testing.assert_array_equal(w["eh_proj"], t[pre + "eh_proj.weight"].T)  # [D, 2D] -> [in 2D, out D]
  assert "head" not in w  # absent: the target's LM head is shared
  b = w["block"]
  np.testing.assert_array_equal(b["attn_norm"], t[pre + "input_layernorm.weight"])
  np.testing.assert_array_equal(b["kv_a_norm"], t[pre + "self_attn.kv_a_layernorm.weight"])
  np.testing.assert_array_equal(b["wkv_a"], t[pre + "self_attn.kv_a_proj_with_mqa.weight"].T)
  np.testing.assert_array_equal(b["wq_a"], t[pre + "self_attn.q_a_proj.weight"].T)
  D = cfg.hidden_size
  np.testing.assert_array_equal(b["wo"].reshape(-1, D), t[pre + "self_attn.o_proj.weight"].T)
  moe = b["moe"]  # layer 3 >= first_k_dense_replace: MoE, like DeepSeek-V3's layer 61
  np.testing.assert_array_equal(moe["router"], t[pre + "mlp.gate.weight"].T)
  np.testing.assert_array_equal(moe["router_bias"], t[pre + "mlp.gate.e_score_correction_bias"])
  for e in range(cfg.num_experts):
    np.testing.assert_array_equal(moe["w_gate"][e], t[pre + f"mlp.experts.{e}.gate_proj.weight"].T)
    np.testing.assert_array_equal(moe["w_down"][e], t[pre + f"mlp.experts.{e}.down_proj.weight"].T)
  np.testing.assert_array_equal(moe["shared"]["w_up"], t[pre + "mlp.shared_experts.up_proj.weight"].T)
  # Every written tensor but the embedding copy is read, each exactly once.
  specs = jax.tree.leaves(mtp_specs(cfg), is_leaf=is_spec)
  used = [n for s in specs for n in s.checkpoint_names("hf")]
  assert sorted(used) == sorted(n for n in t if not n.endswith("embed_tokens.weight"))
  for spec, leaf in zip(specs, jax.tree.leaves(w)):
    names = spec.checkpoint_names("hf")
    written = np.stack([t[n] for n in names]) if "{e}" in spec.hf else t[names[0]]
    np.testing.assert_array_equal(leaf, spec.from_checkpoint(written))
  # find_mtp_head finds it in the checkpoint itself.
  source, found = find_mtp_head(d, cfg)
  assert source == str(d)
  jax.tree.map(np.testing.assert_array_equal, found, w)


def test_an_own_shared_head_is_read(tmp_path):
  d = tmp_path / "ds"
  shutil.copytree(tiny_dir("deepseek_v3"), d)
  cfg = read_config(d)
  t = mtp_tensors(cfg, np.random.default_rng(1), head=True)
  save_file(t, str(d / "model-mtp.safetensors"))
  w = read_hf_head(d, cfg)
  np.testing.assert_array_equal(w["head"], t["model.layers.3.shared_head.head.weight"].T)


@pytest.mark.parametrize("broken,message", [
    ("missing", r"MTP tensor 'model\.layers\.3\.hnorm\.weight' is missing"),
    ("shape", r"MTP tensor 'model\.layers\.3\.eh_proj\.weight' has shape \(64, 96\), expected \(64, 128\)"),
    ("expert", r"MTP tensor 'model\.layers\.3\.mlp\.experts\.5\.up_proj\.weight' is missing"),
])
def test_a_missing_or_misshaped_mtp_tensor_is_named(tmp_path, broken, message):
  d = tmp_path / "ds"
  shutil.copytree(tiny_dir("deepseek_v3"), d)
  cfg = read_config(d)
  t = mtp_tensors(cfg, np.random.default_rng(2))
  if broken == "missing":
    del t["model.layers.3.hnorm.weight"]
  elif broken == "shape":
    t["model.layers.3.eh_proj.weight"] = t["model.layers.3.eh_proj.weight"][:, :96].copy()
  else:
    del t["model.layers.3.mlp.experts.5.up_proj.weight"]
  save_file(t, str(d / "model-mtp.safetensors"))
  with pytest.raises(CheckpointError, match=message):
    read_hf_head(d, cfg)


def test_a_saved_head_reads_back_exactly_beside_the_checkpoint(tmp_path):
  """What scripts/train_mtp.py writes (DeepSeek's names, float32 here) is found beside the checkpoint."""
  d = tmp_path / "llama3"
  shutil.copytree(tiny_dir("llama3"), d)
  cfg = read_config(d)
  assert find_mtp_head(d, cfg) is None
  leaves, treedef = jax.tree.flatten(mtp_specs(cfg), is_leaf=is_spec)
  rng = np.random.default_rng(3)
  w = jax.tree.unflatten(treedef, [rng.normal(size=s.shape).astype(np.float32) for s in leaves])
  path = save_mtp_head(d, cfg, w, {"steps": 1}, dtype=np.float32)
  assert path == d / "mtp_head.safetensors"
  assert json.loads((d / "mtp_head.json").read_text())["steps"] == 1
  source, got = find_mtp_head(d, cfg)
  assert source == str(path)
  jax.tree.map(np.testing.assert_array_equal, got, w)
  # A head for other shapes (a wider MLP) is named by its first tensor that does not fit.
  wider = dataclasses.replace(cfg, intermediate_size=2 * cfg.intermediate_size)
  with pytest.raises(CheckpointError, match=r"MTP tensor 'model\.layers\.2\.mlp\.down_proj\.weight' has shape"):
    read_safetensors_head(path, wider)
