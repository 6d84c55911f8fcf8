"""Async scheduling (EngineConfig.async_scheduling): step n+1 is scheduled, packed and
dispatched before step n's sampled ids reach the host; the device feeds them to step n+1
and the host reads them one call later. Outputs must be transformers' (greedy goldens) and
the synchronous engine's, token for token, through preemption, prefix hits, stops,
penalties, logprobs and structured output (abort and failed steps: tests/engine/test_engine.py)."""

import json

import numpy as np
import pytest

from conftest import DATA, tiny_dir
from helpers import run_engine, with_trained_head
from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.engine import EngineConfig
from jaxinfer.errors import InvalidRequestError
from jaxinfer.sampling import StructuredOutput

# 17 usable pages of 16 tokens: one full-length sequence fits, 16 requests do not.
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=64, num_pages=18, warmup=False)


def make(family="llama3", async_scheduling=True, **kw):
  return LLM(tiny_dir(family), **(ENGINE | dict(async_scheduling=async_scheduling) | kw))


@pytest.fixture(scope="module")
def sync():
  return make(async_scheduling=False)


@pytest.fixture(scope="module")
def llm():
  return make()


@pytest.fixture(scope="module")
def mtp_llm(tmp_path_factory):
  """Async scheduling with MTP drafts (k = 3) from the head trained for the tiny llama3: each
  fed sequence is moved on by a count of accepted drafts that only the device knows when
  the step is packed."""
  return LLM(with_trained_head(tmp_path_factory), **(ENGINE | dict(async_scheduling=True, speculative={"method": "mtp", "num_speculative_tokens": 3})))


def greedy(n, **kw):
  return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("engine", ["llm", "mtp_llm"])
def test_golden_batch_with_preemption_and_prefix_hits_matches_transformers(engine, request):
  """16 mixed prompts in a pool of 17 usable pages (one full sequence): requests are
  preempted while a step of theirs is in flight, recomputed, and a second batch hits the
  prefix cache; every output is transformers' greedy ids. With MTP drafts too."""
  llm = request.getfixturevalue(engine)
  g = json.loads((DATA / "golden" / "batch_llama3.json").read_text())
  p0 = llm.engine.stats()["preemptions"]
  prompts = [r["prompt_ids"] for r in g["records"]]
  outs, running = run_engine(llm.engine, prompts, [greedy(16)] * 16)
  assert llm.engine.stats()["preemptions"] > p0 and max(running) >= 2
  assert [o.token_ids for o in outs] == [r["greedy_ids"] for r in g["records"]]
  again = llm.generate(prompts, greedy(16))
  assert [o.token_ids for o in again] == [r["greedy_ids"] for r in g["records"]]
  assert sum(o.num_cached_tokens for o in again) > 0
  assert llm.engine.kv.num_free_pages == 17 and not llm.engine.has_unfinished()


def test_outputs_come_one_call_later_and_max_tokens_costs_no_extra_step(sync, llm):
  prompts, params = [[1, 2, 3], [4, 5, 6, 7], [9] * 20], [greedy(n) for n in (1, 5, 9)]
  s0 = sync.engine.num_steps
  want = sync.generate(prompts, params)
  engine = llm.engine
  n0 = engine.num_steps
  for i, (p, sp) in enumerate(zip(prompts, params)):
    engine.add_request(f"r{i}", p, sp)
  assert engine.step() == [] and engine.has_unfinished()  # the prefill is on the device
  assert {o.request_id for o in engine.step()} == {"r0", "r1", "r2"}  # its tokens, while step 2 runs
  outs, _ = run_engine(engine, [], [])
  got = llm.generate(prompts, params)
  assert [o.token_ids for o in got] == [o.token_ids for o in want]
  # A request never runs past max_tokens: its last token in flight, it is not scheduled.
  assert (engine.num_steps - n0, sync.engine.num_steps - s0) == (9 + 9, 9)


def test_stops_inside_the_overlap_drop_the_extra_step(sync, llm):
  """A stop token or stop string is seen one call late: the request has already run one
  more step, whose token is dropped; outputs and streamed deltas equal the synchronous ones."""
  prompts = ["Hello world", "naïve café 🙂", "the cat sat"]
  free = sync.generate(prompts, greedy(20))
  stop_text = free[1].text[len(free[1].text) // 2:][:3]
  assert stop_text.strip() and free[1].text.find(stop_text) > 0
  params = [greedy(20, stop_token_ids=[free[0].token_ids[4]]), greedy(20, stop=[stop_text]), greedy(20)]
  want = sync.generate(prompts, params)
  assert [o.finish_reason for o in want] == ["stop", "stop", "length"]
  texts, ids, final = ["", "", ""], [[], [], []], [None] * 3
  for out in llm.stream(prompts, params):
    assert final[out.index] is None  # nothing after the final output
    texts[out.index] += out.new_text
    ids[out.index] += out.new_token_ids
    if out.finished:
      final[out.index] = out
  for w, f, t, i in zip(want, final, texts, ids):
    assert (f.token_ids, f.text, f.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    # (two programs, fused differently: logprobs agree to float32 rounding)
    np.testing.assert_allclose(f.logprobs, w.logprobs, rtol=0, atol=1e-5)
    assert (t, i) == (w.text, w.token_ids)
  # One request that stops by a stop token: one step more than the synchronous engine.
  stop = greedy(20, stop_token_ids=[free[0].token_ids[4]])
  n0, s0 = llm.engine.num_steps, sync.engine.num_steps
  assert llm.generate([prompts[0]], stop)[0].token_ids == sync.generate([prompts[0]], stop)[0].token_ids
  assert (llm.engine.num_steps - n0, sync.engine.num_steps - s0) == (len(want[0].token_ids) + 1,
                                                                      len(want[0].token_ids))
  assert llm.engine.kv.usage == 0.0


def test_seeded_sampling_penalties_and_logprobs_equal_the_synchronous_engine(sync, llm):
  """Penalty counts and the last token live on the device: a fed token must be the one the
  host later reads, and penalties must see it."""
  rng = np.random.default_rng(5)
  prompts = [rng.integers(0, 320, int(n)).tolist() for n in rng.integers(1, 40, 8)]
  params = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=s, max_tokens=12, ignore_eos=True,
                           presence_penalty=0.8, repetition_penalty=1.3, frequency_penalty=0.2 * (s % 3),
                           logprobs=3, prompt_logprobs=2 if s == 4 else None) for s in range(8)]
  want, got = sync.generate(prompts, params), llm.generate(prompts, params)
  for w, g in zip(want, got):
    assert g.token_ids == w.token_ids and len(set(w.token_ids)) > 1
    np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-5)
    assert [list(t) for t in g.top_logprobs] == [list(t) for t in w.top_logprobs]
  assert got[4].prompt_logprobs is not None
  assert len(got[4].prompt_logprobs) == len(want[4].prompt_logprobs) == len(prompts[4])


def test_structured_requests_wait_for_their_tokens_and_others_overlap(sync, llm):
  """A grammar's next mask needs the token in flight, so a step that sampled a constrained
  request is read before the next is packed; outputs equal the synchronous engine's."""
  reqs = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured=StructuredOutput(regex=r"(ab|ba){2,6}"))
          for s in range(3)] + [greedy(12)] * 2
  prompts = ["abab"] * 3 + ["the cat", "hello world"]
  want, got = sync.generate(prompts, reqs), llm.generate(prompts, reqs)
  assert [o.token_ids for o in got] == [o.token_ids for o in want]
  assert all(o.finish_reason == "stop" for o in got[:3])


def test_mtp_runs_equal_the_engine_without_drafts(sync, mtp_llm):
  """Greedy and seeded sampling with logprobs, and stop strings and max_tokens that fall
  inside accepted runs: the same tokens, text, finish reasons and logprobs as the
  synchronous engine without speculation (verification is lossless, and each token is
  drawn with its position's key, so the device's shift must put every token where it is)."""
  prompts = [[{"role": "user", "content": c}] for c in (  # chats, as the head was trained on
      "What is the capital of France? Explain its history briefly.", "Write a haiku about the sea.",
      "List three prime numbers.", "How do I sort a list in Python?")]
  free = sync.generate(prompts, greedy(40))
  stop_text = free[0].text[len(free[0].text) // 2:][:3]
  assert stop_text.strip() and free[0].text.find(stop_text) > 0
  prompts, params = prompts + prompts[1:2] * 6, [
      greedy(40, stop=[stop_text], logprobs=2), greedy(40, logprobs=2), greedy(40),
      SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=40, ignore_eos=True, logprobs=2),
  ] + [greedy(n) for n in range(15, 21)]
  stats = mtp_llm.engine.stats()
  want, got = sync.generate(prompts, params), mtp_llm.generate(prompts, params)
  for w, g in zip(want, got):
    assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-5)
  assert got[0].finish_reason == "stop"
  assert [list(t) for t in got[1].top_logprobs] == [list(t) for t in want[1].top_logprobs]
  after = mtp_llm.engine.stats()
  accepted = after["spec_accepted_tokens"] - stats["spec_accepted_tokens"]
  drafted = after["spec_draft_tokens"] - stats["spec_draft_tokens"]
  assert accepted >= 0.1 * drafted > 0, (accepted, drafted)
  # (runs cut by a stop or max_tokens count in the engine's stats, not in the output)
  assert 0.9 * accepted <= sum(o.num_accepted_draft_tokens for o in got) <= accepted
  assert mtp_llm.engine.kv.usage == 0.0


def test_ngram_drafts_are_looked_up_after_the_step_that_makes_their_tokens():
  """N-gram drafts come from the committed tokens on the host: a step that samples for a
  request that drafts is postprocessed before the next is packed, so every draft is the
  synchronous engine's (the same acceptance, step for step), and the outputs are
  transformers' greedy ids. (Placeholder drafts for an in-flight token would be rejected.)
  Slow (about 30 s on two cores): two engines, each compiling the speculative step buckets."""
  g = json.loads((DATA / "golden" / "batch_llama3.json").read_text())
  prompts = [r["prompt_ids"] for r in g["records"]]
  options = dict(max_num_seqs=16, max_num_batched_tokens=64, warmup=False,  # test_spec_decode's programs
                 speculative={"method": "ngram", "num_speculative_tokens": 3})
  sync = LLM(tiny_dir("llama3"), async_scheduling=False, **options)
  want = sync.generate(prompts, greedy(g["max_new_tokens"]))
  llm = LLM(tiny_dir("llama3"), async_scheduling=True, **options)
  got = llm.generate(prompts, greedy(g["max_new_tokens"]))
  assert [o.token_ids for o in got] == [r["greedy_ids"] for r in g["records"]] == [o.token_ids for o in want]
  stats, want_stats = llm.engine.stats(), sync.engine.stats()
  assert stats["spec_accepted_tokens"] == want_stats["spec_accepted_tokens"] > 0
  assert stats["spec_draft_tokens"] == want_stats["spec_draft_tokens"]


def test_bad_options():
  with pytest.raises(InvalidRequestError, match="async_scheduling must be a bool, got 'yes'"):
    EngineConfig(async_scheduling="yes")
