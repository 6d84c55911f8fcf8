"""The real embedded model against transformers: prompt ids, greedy ids, logits."""

import numpy as np
import pytest

from conftest import DATA
from jaxinfer import SamplingParams

pytestmark = pytest.mark.slow


def test_chat_prompt_token_ids_match_transformers(smollm, smollm_golden):
  for record in smollm_golden["records"]:
    _, ids = smollm.encode_prompt([{"role": "user", "content": record["prompt"]}])
    assert ids == record["prompt_ids"]


def test_greedy_ids_identical_to_transformers(smollm, smollm_golden):
  """Slow (~25-35 s on two busy cores): the golden chats' 32 greedy tokens each, run through
  the 30 layers of the real model, whose ids are the point (a tiny model's would not be).
  Running is most of it: this file's four engine tests take ~40 s of CPU with their seven
  step programs in the compilation cache, ~64 s without."""
  records = smollm_golden["records"]
  chats = [[{"role": "user", "content": r["prompt"]}] for r in records]
  outputs = smollm.generate(chats, SamplingParams(temperature=0.0, max_tokens=32))
  for out, record in zip(outputs, records):
    assert out.token_ids == record["greedy_ids"], record["prompt"]
    assert out.text == record["text"]
  assert "Paris" in outputs[0].text


def test_logits_match_transformers(smollm):
  g = np.load(DATA / "golden" / "smollm2-135m.npz", allow_pickle=False)
  logits = smollm.logits(g["token_ids"].tolist())
  assert logits.shape == (len(g["token_ids"]), 49152)
  np.testing.assert_array_equal(logits.argmax(-1), g["argmax"])
  # 30 float32 layers in a different summation order than torch: |logits| ~ 20,
  # differences ~1e-4 (5e-6 relative).
  np.testing.assert_allclose(logits[:, g["vocab_cols"]], g["logits_cols"], atol=5e-4, rtol=0)
  np.testing.assert_allclose(logits[-1], g["last_logits"], atol=5e-4, rtol=0)


def batch_golden():
  import json
  return json.loads((DATA / "golden" / "batch_smollm2-135m.json").read_text())


def test_sixteen_concurrent_chats_match_transformers_then_hit_the_prefix_cache(smollm):
  """On the session's default-config LLM: its programs are the ones the quickstart's
  warm-up compiles, so CI compiles SmolLM2's step once per bucket for the whole suite.
  Slow (~30 s on two busy cores): sixteen prompts of 35-189 tokens and 24 new tokens each
  run twice through the 30-layer model (the second time from the prefix cache)."""
  g = batch_golden()
  prompts = [r["prompt_ids"] for r in g["records"]]
  llm = smollm
  greedy = SamplingParams(temperature=0, max_tokens=g["max_new_tokens"], ignore_eos=True)
  first = llm.generate(prompts, greedy)
  assert [o.token_ids for o in first] == [r["greedy_ids"] for r in g["records"]]
  computed = llm.engine.num_computed_tokens
  second = llm.generate(prompts, greedy)
  assert [o.token_ids for o in second] == [r["greedy_ids"] for r in g["records"]]
  cached = [(len(p) - 1) // 16 * 16 for p in prompts]
  assert [o.num_cached_tokens for o in second] == cached
  assert llm.engine.num_computed_tokens - computed == sum(len(p) - c for p, c in zip(prompts, cached)) + 16 * 23


@pytest.mark.parametrize("method,async_scheduling", [("mtp", True), ("ngram", False)])
def test_eight_chats_with_drafts_match_transformers(default_checkpoint, method, async_scheduling):
  """Speculation changes no greedy token: the first eight golden chats (35-128 prompt
  tokens, so chunked prefill mixes with verification) with the shipped MTP head, its
  drafts and acceptance kept on the device by async scheduling, and with prompt lookup.
  k = 2; a 16-token step budget keeps it to five programs per method. Eight, not all
  sixteen: the other eight's 1240 prompt tokens would add ~80 sixteen-token steps of a
  30-layer model per method to CI and no new case. Slow all the same (~35-45 s per method
  on two busy cores): an engine of its own per method (speculation changes the programs),
  and a tiny model's drafts would not be the shipped head's."""
  from jaxinfer import LLM
  g = batch_golden()
  records = g["records"][:8]
  prompts = [r["prompt_ids"] for r in records]
  llm = LLM(default_checkpoint, speculative={"method": method, "num_speculative_tokens": 2},
            max_num_seqs=16, max_num_batched_tokens=16, warmup=False, async_scheduling=async_scheduling)
  outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=g["max_new_tokens"], ignore_eos=True))
  assert [o.token_ids for o in outs] == [r["greedy_ids"] for r in records]
  stats = llm.engine.stats()
  assert stats["spec_accepted_tokens"] > 0 and stats["spec_mean_acceptance_length"] > 1
  assert llm.engine.kv.usage == 0.0
