"""Logical-axis sharding on 8 fake CPU devices gives the same numbers as one device."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import golden, tiny_dir
from jaxinfer import LLM
from jaxinfer.sharding import logical_to_spec, make_mesh, param_shardings


def test_rule_table():
  mesh = make_mesh(data=2, model=4)
  assert logical_to_spec(("embed", "heads", "head_dim"), (64, 8, 16), mesh) == P(None, "model", None)
  assert logical_to_spec(("vocab", "embed"), (320, 64), mesh) == P("model", None)
  # 3 kv heads do not split over 4 devices: replicated rather than an error.
  assert logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 3, 16), mesh) == P(None, None, None)


def test_mesh_needs_enough_devices():
  with pytest.raises(ValueError, match=r"needs 16 devices, have 8"):
    make_mesh(data=2, model=8)


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_tensor_parallel_logits_match(family):
  assert len(jax.devices()) == 8
  mesh = make_mesh(data=2, model=4)
  llm = LLM(tiny_dir(family), max_model_len=64, mesh=mesh, warmup=False)
  shardings = param_shardings(llm.config, mesh)
  assert llm.runner.params["layers"][0]["w_up"].sharding == shardings["layers"][0]["w_up"]
  g = golden(family)
  np.testing.assert_allclose(llm.logits(g["token_ids"].tolist()), g["logits"], atol=1e-4, rtol=0)
