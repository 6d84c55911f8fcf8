"""Convert to orbax, restore with a chosen dtype and sharding, without the source."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import golden, tiny_dir
from jaxinfer import LLM
from jaxinfer.checkpoint import convert, detect_format, load_model
from jaxinfer.cli import main
from jaxinfer.errors import CheckpointError
from jaxinfer.sharding import make_mesh


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  src = tmp_path_factory.mktemp("src") / "llama3"
  shutil.copytree(tiny_dir("llama3"), src)
  dst = tmp_path_factory.mktemp("ck") / "llama3"
  assert main(["convert", str(src), str(dst)]) == 0
  shutil.rmtree(src)  # the checkpoint must stand alone
  return dst


def test_layout_and_logits(converted):
  assert detect_format(converted) == "orbax"
  assert sorted(p.name for p in converted.iterdir()) == ["jaxinfer_checkpoint.json", "params", "tokenizer"]
  g = golden("llama3")
  np.testing.assert_allclose(LLM(converted, max_model_len=64, warmup=False).logits(g["token_ids"].tolist()),
                             g["logits"], atol=1e-4, rtol=0)


def test_tokenizer_and_chat_template_survive(converted):
  a = LLM(converted, max_model_len=64, warmup=False).tokenizer
  from jaxinfer.tokenizer import Tokenizer
  b = Tokenizer.from_hf_dir(tiny_dir("llama3"))
  msgs = [{"role": "user", "content": "Hi there"}]
  assert a.encode_chat(msgs) == b.encode_chat(msgs)
  assert a.chat_template == b.chat_template and a.eos_ids == b.eos_ids


def test_restore_bfloat16(converted):
  loaded = load_model(converted, dtype="bfloat16")
  assert {x.dtype for x in jax.tree.leaves(loaded.params)} == {jnp.dtype(jnp.bfloat16)}


def test_restore_sharded_over_a_mesh(converted):
  mesh = make_mesh(model=4)
  llm = LLM(converted, max_model_len=64, mesh=mesh, sharding_rules={"kv_heads": None}, warmup=False)
  wq = llm.runner.params["layers"][0]["wq"]
  assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
  g = golden("llama3")
  np.testing.assert_allclose(llm.logits(g["token_ids"].tolist()), g["logits"], atol=1e-4, rtol=0)


def test_stored_dtype_bfloat16(tmp_path):
  dst = convert(tiny_dir("qwen3"), tmp_path / "q", dtype="bfloat16")
  assert '"dtype": "bfloat16"' in (dst / "jaxinfer_checkpoint.json").read_text()
  loaded = load_model(dst, dtype="float32")
  assert {x.dtype for x in jax.tree.leaves(loaded.params)} == {jnp.dtype(jnp.float32)}


def test_damaged_params_give_a_clear_error(tmp_path):
  dst = convert(tiny_dir("qwen2"), tmp_path / "q")
  shutil.rmtree(dst / "params")
  (dst / "params").mkdir()
  with pytest.raises(CheckpointError, match=r"params: cannot restore"):
    load_model(dst)


def test_convert_defaults_into_the_checkpoints_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXINFER_CHECKPOINTS", str(tmp_path / "cks"))
  assert main(["convert", str(tiny_dir("qwen2"))]) == 0
  assert detect_format(tmp_path / "cks" / "qwen2") == "orbax"
