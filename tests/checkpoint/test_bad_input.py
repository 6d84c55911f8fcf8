"""Every bad checkpoint input gives one clear error of ours, naming the file and the problem."""

import json
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import tiny_dir
from helpers import write_llama_gguf
from jaxinfer import LLM
from jaxinfer.checkpoint import convert, import_model
from jaxinfer.errors import (CheckpointError, InvalidRequestError, JaxinferError, ModelNotFoundError,
                             UnsupportedModelError)


def copy_model(tmp_path, family="smollm2"):
  dst = tmp_path / family
  shutil.copytree(tiny_dir(family), dst)
  return dst


def test_missing_path(tmp_path):
  with pytest.raises(ModelNotFoundError, match=r"nope: no such file or directory"):
    LLM(tmp_path / "nope")


def test_directory_that_is_not_a_model(tmp_path):
  (tmp_path / "notes.txt").write_text("hello")
  with pytest.raises(ModelNotFoundError, match=r"not a model directory \(no config.json"):
    LLM(tmp_path)


def test_file_that_is_not_a_model(tmp_path):
  (tmp_path / "x.txt").write_text("hello")
  with pytest.raises(ModelNotFoundError, match=r"x.txt: not a model"):
    LLM(tmp_path / "x.txt")


def test_truncated_gguf(tmp_path):
  path = write_llama_gguf(tiny_dir("smollm2"), tmp_path / "m.gguf")
  data = path.read_bytes()
  path.write_bytes(data[:len(data) // 2])
  with pytest.raises(CheckpointError, match=r"m.gguf: truncated or corrupted GGUF file"):
    import_model(path)


def test_corrupted_gguf_magic(tmp_path):
  path = write_llama_gguf(tiny_dir("smollm2"), tmp_path / "m.gguf")
  data = bytearray(path.read_bytes())
  data[:4] = b"XXXX"
  path.write_bytes(bytes(data))
  with pytest.raises(CheckpointError, match=r"m.gguf: not a GGUF file \(bad magic bytes\)"):
    import_model(path)


def test_truncated_safetensors(tmp_path):
  d = copy_model(tmp_path)
  f = d / "model.safetensors"
  f.write_bytes(f.read_bytes()[:1000])
  with pytest.raises(CheckpointError, match=r"model.safetensors: not a valid safetensors file"):
    import_model(d)


def test_unsupported_architecture(tmp_path):
  d = copy_model(tmp_path)
  cfg = json.loads((d / "config.json").read_text())
  cfg["model_type"] = "gpt_bigcode"
  (d / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(UnsupportedModelError, match=r"model_type 'gpt_bigcode' is not supported"):
    import_model(d)


def test_unsupported_quantization_type(tmp_path):
  path = write_llama_gguf(tiny_dir("smollm2"), tmp_path / "m.gguf", gguf.GGMLQuantizationType.IQ4_NL)
  with pytest.raises(UnsupportedModelError, match=r"m.gguf: tensor '.*' has quantization type IQ4_NL, which is not supported"):
    import_model(path)


def test_tensor_with_wrong_shape(tmp_path):
  d = copy_model(tmp_path)
  tensors = load_file(d / "model.safetensors")
  tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((7, 64), np.float32)
  save_file(tensors, d / "model.safetensors")
  with pytest.raises(CheckpointError, match=r"tensor 'model.layers.1.mlp.up_proj.weight' has shape \(7, 64\), "
                                            r"expected \(128, 64\)"):
    import_model(d)


def test_missing_tensor(tmp_path):
  d = copy_model(tmp_path)
  tensors = load_file(d / "model.safetensors")
  del tensors["model.norm.weight"]
  save_file(tensors, d / "model.safetensors")
  with pytest.raises(CheckpointError, match=r"tensor 'model.norm.weight' is missing"):
    import_model(d)


def test_pickle_checkpoints_are_refused_not_loaded(tmp_path):
  d = copy_model(tmp_path)
  (d / "model.safetensors").unlink()
  (d / "pytorch_model.bin").write_bytes(b"\x80\x04 would be a pickle")
  with pytest.raises(CheckpointError, match=r"pickle-based checkpoints are never loaded"):
    import_model(d)


def test_malformed_config_json(tmp_path):
  d = copy_model(tmp_path)
  (d / "config.json").write_text("{not json")
  with pytest.raises(CheckpointError, match=r"config.json: not valid JSON"):
    import_model(d)


def test_bad_dtype():
  with pytest.raises(InvalidRequestError, match=r"dtype must be one of float32, bfloat16, got 'int8'"):
    LLM(tiny_dir("smollm2"), dtype="int8")


def test_convert_refuses_to_overwrite(tmp_path):
  dst = tmp_path / "ck"
  dst.mkdir()
  (dst / "keep.txt").write_text("x")
  with pytest.raises(CheckpointError, match=r"already exists and is not empty"):
    convert(tiny_dir("smollm2"), dst)
  assert (dst / "keep.txt").exists()


@pytest.mark.parametrize("make_bad,message", [
    (lambda p: p / "missing", "no such file or directory"),
    (lambda p: (p / "x.gguf").write_bytes(b"GGUF\x03\x00\x00\x00garbage") and p / "x.gguf",
     "truncated or corrupted GGUF file"),
])
def test_cli_prints_one_line_and_exits_nonzero(tmp_path, make_bad, message):
  src = make_bad(tmp_path)
  r = subprocess.run([sys.executable, "-m", "jaxinfer", "convert", str(src), str(tmp_path / "out")],
                     capture_output=True, text=True)
  assert r.returncode == 1
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("jaxinfer: error: ") and message in lines[0], r.stderr
  assert "Traceback" not in r.stderr


def test_errors_share_one_base_class():
  for cls in (CheckpointError, ModelNotFoundError, UnsupportedModelError, InvalidRequestError):
    assert issubclass(cls, JaxinferError)
