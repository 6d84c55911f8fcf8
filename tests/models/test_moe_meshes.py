"""Tiny Mixtral on the issue's four meshes of 8 devices: transformers' logits and greedy
ids on each, with the heads, experts and K/V pages really split (shard shapes), and
split experts reached by an all-to-all (expert parallelism)."""

import json

import numpy as np
import pytest

from conftest import DATA, golden, tiny_dir
from jaxinfer import LLM, SamplingParams
from jaxinfer.sharding import make_mesh

WIDE_EP_DP = {"pages": "data", "experts": ("data", "expert")}

# mesh (data, expert, model), rules, and the shard shapes that proves each split:
# wqkv [D=64, K=8, G + 2 = 3, d=8] (q/k/v fused, jaxinfer.params.FUSED), an expert stack
# [E=8, D=64, F=32], K pages [N, p, K=8, d=8] (k_pages: how many ways the pages and the kv heads
# are split).
CASES = {
    "tensor (1,1,8)": ((1, 1, 8), None, dict(wqkv=(64, 1, 3, 8), experts=(8, 64, 4), k_pages=(1, 8))),
    "expert (1,8,1)": ((1, 8, 1), None, dict(wqkv=(64, 8, 3, 8), experts=(1, 64, 32), k_pages=(1, 1))),
    "mixed (2,2,2)": ((2, 2, 2), WIDE_EP_DP, dict(wqkv=(64, 4, 3, 8), experts=(2, 64, 16), k_pages=(2, 2))),
    "data (8,1,1)": ((8, 1, 1), WIDE_EP_DP, dict(wqkv=(64, 8, 3, 8), experts=(1, 64, 32), k_pages=(8, 1))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_mixtral_on_a_mesh_is_split_and_matches_transformers(name):
  shape, rules, want = CASES[name]
  llm = LLM(tiny_dir("mixtral"), mesh=make_mesh(*shape), sharding_rules=rules, max_model_len=64,
            max_num_seqs=4, max_num_batched_tokens=32, warmup=False)
  layer = llm.runner.params["layers"][0]
  shard = lambda a: a.sharding.shard_shape(a.shape)
  assert shard(layer["wqkv"]) == want["wqkv"]
  assert shard(layer["moe"]["w_gate"]) == want["experts"]
  k = llm.runner.cache[0]["k"]
  pages_split, heads_split = want["k_pages"]
  assert shard(k) == (k.shape[0] // pages_split, k.shape[1], 8 // heads_split, 8)

  g = golden("mixtral")
  np.testing.assert_allclose(llm.logits(g["token_ids"].tolist()), g["logits"], atol=1e-4, rtol=0)
  if want["experts"][0] < 8:  # experts split: tokens go to them by all-to-all, weights stay put
    ids = np.asarray(g["token_ids"], np.int32)
    program = llm.runner._logits.lower(llm.runner.params, ids, np.int32(len(ids))).as_text()
    assert "all_to_all" in program
  batch = json.loads((DATA / "golden" / "batch_mixtral.json").read_text())["records"][:4]
  outs = llm.generate([r["prompt_ids"] for r in batch],
                      SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
  assert [o.token_ids for o in outs] == [r["greedy_ids"][:8] for r in batch]
