"""Every SamplingParams field through the whole engine, checked against a
full-forward reference built from `LLM.logits` (no cache, no batching)."""

import numpy as np
import pytest

from conftest import tiny_dir
from jaxinfer import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
  return LLM(tiny_dir("llama3"), max_num_seqs=8, max_num_batched_tokens=64, warmup=False)


def log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_penalties_match_a_host_reference(llm):
  sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                      presence_penalty=0.4, frequency_penalty=0.3)
  prompt = [5, 9, 5, 200, 31, 9]
  out = llm.generate([prompt], sp)[0]
  ids = list(prompt)
  for _ in range(24):
    logits = llm.logits(ids)[-1].astype(np.float64)
    counts = np.bincount(ids[len(prompt):], minlength=logits.shape[0])
    seen = (counts > 0) | np.isin(np.arange(logits.shape[0]), prompt)
    logits = np.where(seen, np.where(logits > 0, logits / 1.3, logits * 1.3), logits)
    logits = logits - 0.3 * counts - 0.4 * (counts > 0)
    ids.append(int(logits.argmax()))
  assert out.token_ids == ids[len(prompt):]
  plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
  assert plain.token_ids != out.token_ids  # the penalties did something


def test_penalties_survive_batching_and_preemption():
  small = LLM(tiny_dir("llama3"), max_num_seqs=8, max_num_batched_tokens=64, num_pages=18,
              warmup=False)
  sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=0.5)
  prompts = [[i + 1] * (30 + 10 * i) for i in range(6)]
  alone = [small.generate([p], sp)[0].token_ids for p in prompts]
  together = small.generate(prompts, sp)
  assert small.engine.stats()["preemptions"] > 0
  assert [o.token_ids for o in together] == alone


def test_top_logprobs_match_the_full_forward(llm):
  prompt = [7, 8, 9, 10]
  out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3))[0]
  ids = prompt + out.token_ids
  for i, (tok, entry) in enumerate(zip(out.token_ids, out.top_logprobs)):
    ref = log_softmax(llm.logits(ids[:len(prompt) + i])[-1])
    best = np.argsort(-ref)[:3]
    assert set(entry) == set(best.tolist()) | {tok}
    for t, lp in entry.items():
      assert lp == pytest.approx(ref[t], abs=1e-4)
    assert out.logprobs[i] == pytest.approx(ref[tok], abs=1e-4)


def test_prompt_logprobs_across_prefill_chunks(llm):
  prompt = np.random.default_rng(5).integers(0, 320, 150).tolist()  # 3 chunks of <= 64
  out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
  ref = log_softmax(llm.logits(prompt))
  assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 150
  for j in range(1, 150):
    entry = out.prompt_logprobs[j]
    assert set(entry) == set(np.argsort(-ref[j - 1])[:2].tolist()) | {prompt[j]}
    assert entry[prompt[j]] == pytest.approx(ref[j - 1, prompt[j]], abs=1e-4)
  assert out.num_cached_tokens == 0


def test_prompt_logprobs_skip_the_prefix_cache(llm):
  prompt = list(range(1, 70))
  llm.generate([prompt], SamplingParams(max_tokens=1))
  again = llm.generate([prompt], SamplingParams(max_tokens=1))[0]
  with_lp = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
  assert again.num_cached_tokens == 64 and with_lp.num_cached_tokens == 0
  assert len(with_lp.prompt_logprobs) == 69


def find_prompt_whose_greedy_next_is(llm, token):
  rng = np.random.default_rng(0)
  for _ in range(50):
    seq = rng.integers(3, 320, 200).tolist()
    hits = np.flatnonzero(llm.logits(seq).argmax(-1) == token)
    if len(hits):
      return seq[:hits[0] + 1]
  raise AssertionError("no prompt found")


def test_eos_ends_generation_unless_ignore_eos(llm):
  eos = llm.tokenizer.eos_ids[0]
  prompt = find_prompt_whose_greedy_next_is(llm, eos)
  stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0]
  assert stopped.token_ids == [eos] and stopped.finish_reason == "stop" and stopped.text == ""
  ignored = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
  assert ignored.token_ids[0] == eos and len(ignored.token_ids) == 8
  assert ignored.finish_reason == "length"


def pieces(llm, ids):
  """The text each token adds, as a streaming client sees it."""
  d = llm.tokenizer.detokenizer()
  return [d.push(t) for t in ids]


def test_stop_string_spanning_two_tokens(llm):
  sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
  full = llm.generate(["Hello world"], sp)[0]
  parts = pieces(llm, full.token_ids)
  text = "".join(parts)
  # A two-character stop string whose first occurrence straddles tokens i and i + 1.
  i = next(i for i in range(len(parts) - 1) if parts[i] and parts[i + 1]
           and text.find(parts[i][-1] + parts[i + 1][0]) == len("".join(parts[:i + 1])) - 1)
  stop = parts[i][-1] + parts[i + 1][0]
  sp_stop = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=["never", stop])
  out = llm.generate(["Hello world"], sp_stop)[0]
  assert out.finish_reason == "stop"
  assert out.text == "".join(parts[:i]) + parts[i][:-1]
  assert out.token_ids == full.token_ids[:i + 2]
  # Streamed deltas never show the first half of the stop string and add up to the text.
  streamed = [o.new_text for o in llm.stream(["Hello world"], sp_stop)]
  assert "".join(streamed) == out.text


def test_max_tokens_one_and_stop_token_ids(llm):
  sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
  full = llm.generate([[4, 5, 6]], sp)[0].token_ids
  one = llm.generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=1))[0]
  assert one.token_ids == full[:1] and one.finish_reason == "length"
  stop_id = full[3]
  out = llm.generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                 stop_token_ids=[stop_id]))[0]
  assert out.token_ids == full[:full.index(stop_id) + 1] and out.finish_reason == "stop"


def test_top_k_one_is_greedy_and_min_p_one_is_greedy(llm):
  greedy = llm.generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
  for extra in (dict(top_k=1), dict(min_p=1.0), dict(top_p=1e-6)):
    out = llm.generate([[4, 5, 6]], SamplingParams(temperature=1.5, seed=1, max_tokens=8,
                                                   ignore_eos=True, **extra))[0]
    assert out.token_ids == greedy.token_ids, extra
