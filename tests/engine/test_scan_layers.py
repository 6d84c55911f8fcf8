"""EngineConfig.scan_layers: the runner stacks the layers and the KV pool and its step scans
(models/transformer.py); the outputs are the unrolled engine's, and what cannot scan says why."""

import numpy as np
import pytest

from conftest import golden, tiny_dir
from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.engine import EngineConfig
from jaxinfer.engine.kv_connector import KVTransferError
from jaxinfer.errors import InvalidRequestError
from jaxinfer.models.transformer import is_stacked

ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, warmup=False)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_backend_default_unrolls_and_an_explicit_choice_stays():
  assert EngineConfig().for_backend("cpu").scan_layers is False
  assert EngineConfig().for_backend("gpu").scan_layers is False
  assert EngineConfig(scan_layers=True).for_backend("cpu").scan_layers is True
  with pytest.raises(InvalidRequestError, match=r"scan_layers must be a bool or None, got 'yes'"):
    EngineConfig(scan_layers="yes")


def test_scanned_engine_gives_the_unrolled_logits_and_tokens():
  scanned = LLM(tiny_dir("qwen2"), scan_layers=True, **ENGINE)  # q/k/v biases, GQA
  runner = scanned.engine.runner
  assert is_stacked(runner.params["layers"]) and len(runner.cache) == 1
  L, N = scanned.config.num_layers, runner.num_pages
  assert runner.cache[0]["k"].shape[0] == L * N
  unrolled = LLM(tiny_dir("qwen2"), **ENGINE)
  g = golden("qwen2")
  np.testing.assert_array_equal(scanned.logits(g["token_ids"].tolist()), unrolled.logits(g["token_ids"].tolist()))
  prompts = [[5, 17, 200, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]]
  want = [o.token_ids for o in unrolled.generate(prompts, GREEDY)]
  assert [o.token_ids for o in scanned.generate(prompts, GREEDY)] == want
  with pytest.raises(KVTransferError, match=r"scans layers over one stacked pool"):
    runner.export_pages([1])


def test_what_cannot_scan_is_refused_naming_why():
  with pytest.raises(InvalidRequestError, match=r"scan_layers=True: .* cannot be scanned here: it has MoE layers"):
    LLM(tiny_dir("mixtral"), scan_layers=True, **ENGINE)


def test_scanned_on_a_tensor_parallel_mesh_keeps_the_splits_and_the_golden_logits():
  import jax
  from jaxinfer.sharding import make_mesh
  llm = LLM(tiny_dir("qwen3"), mesh=make_mesh(model=2), scan_layers=True, **ENGINE)
  w, k = llm.engine.runner.params["layers"]["wqkv"], llm.engine.runner.cache[0]["k"]
  assert w.sharding.spec == jax.sharding.PartitionSpec(None, None, "model")  # [L, D, K, G + 2, d]: K split
  assert k.sharding.shard_shape(k.shape)[2] == 1  # [L * N, p, K, d]: one kv head per device
  g = golden("qwen3")
  np.testing.assert_allclose(llm.logits(g["token_ids"].tolist()), g["logits"], atol=1e-4, rtol=0)
