"""Speculative decoding: drafters, verification in the ragged step, losslessness."""

import json

import numpy as np
import pytest

from conftest import DATA, tiny_dir
from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.spec_decode import NgramDrafter, SpeculativeConfig
from jaxinfer.errors import InvalidRequestError


def ngram(k):
  return {"method": "ngram", "num_speculative_tokens": k}


def make_llm(family="llama3", **kw):
  kw = dict(max_num_seqs=16, max_num_batched_tokens=64, warmup=False) | kw
  return LLM(tiny_dir(family), **kw)


# ---- drafters and options --------------------------------------------------------------

def test_ngram_drafter_continues_the_latest_longest_match():
  d = NgramDrafter(1, 3)
  #        0  1  2  3  4  5  6  7  8  9
  ids = [5, 6, 7, 9, 5, 6, 7, 8, 1, 5, 6, 7]
  assert d.propose(ids, 2) == [8, 1]  # trailing 3-gram 5 6 7: latest earlier match at 4
  assert d.propose(ids, 9) == [8, 1, 5, 6, 7]  # the continuation runs out at the end
  assert d.propose([1, 2, 3, 4], 3) == []  # nothing repeats
  assert d.propose([4, 2, 4], 2) == [2, 4]  # falls back to a 1-gram
  assert NgramDrafter(2, 3).propose([4, 2, 4], 2) == []  # ... unless ngram_min forbids it
  assert d.propose([7], 3) == []


@pytest.mark.parametrize("value,message", [
    (dict(method="ngram", num_speculative_tokens=0), r"num_speculative_tokens must be an int in \[1, 8\], got 0"),
    (dict(method="ngram", num_speculative_tokens=9), r"num_speculative_tokens must be an int in \[1, 8\], got 9"),
    (dict(method="medusa"), r"speculative method must be one of \('ngram', 'mtp'\), got 'medusa'"),
    (dict(method="ngram", lookahead=2), r"unknown speculative option\(s\) \['lookahead'\]"),
    (dict(ngram_min=3, ngram_max=2), r"ngram_min=3 exceeds ngram_max=2"),
    (dict(relaxed_top_n=-1), r"relaxed_top_n must be an int in \[0, 64\] \(0: off\), got -1"),
    (dict(relaxed_top_n=2, relaxed_delta=1.5), r"relaxed_delta must be a probability in \[0, 1\], got 1.5"),
    (dict(relaxed_delta=0.1), r"relaxed_delta=0.1 needs relaxed_top_n >= 1"),
    ("ngram", r"speculative must be a dict or SpeculativeConfig, got str"),
])
def test_bad_speculative_options_name_the_option(value, message):
  with pytest.raises(InvalidRequestError, match=message):
    SpeculativeConfig.parse(value)


# ---- greedy: identical to transformers ---------------------------------------------------

def batch_golden(name):
  return json.loads((DATA / "golden" / f"batch_{name}.json").read_text())


def greedy(n):
  return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def plain():
  """The engine without drafts that the sampling tests hold the speculating ones to: one for
  the module, so its programs are traced and compiled once. A prompt it has run before hits
  its prefix cache, which changes no token (tests/engine/test_engine.py)."""
  return make_llm()


def test_a_speculating_step_pads_sequence_rows_by_k_plus_one_tokens():
  """A decoding sequence verifies k + 1 tokens, so a T-token program holds T // (k + 1)
  sequences (each padded row would cost k + 1 LM-head rows); the largest holds any step."""
  runner = make_llm(speculative=ngram(3)).runner
  assert runner.token_buckets == (1, 2, 4, 8, 16, 32, 64)
  assert [runner.num_seqs_bucket(T) for T in runner.token_buckets] == [1, 1, 1, 2, 4, 8, 16]
  assert runner.step_bucket(4, 1) == 4  # one sequence verifying 3 drafts
  assert runner.step_bucket(4, 4) == 16  # four one-token prefill chunks: more sequence rows
  assert runner.step_bucket(16, 16) == 64
  with pytest.raises(ValueError, match="exceed the largest step"):
    runner.step_bucket(65, 1)
  plain = make_llm().runner
  assert [plain.num_seqs_bucket(T) for T in plain.token_buckets] == [1, 2, 4, 8, 16, 16, 16]


# The small pool compiles the step again (another cache shape): once is enough.
@pytest.mark.parametrize("family,k,preempt", [("llama3", 1, False), ("llama3", 3, True), ("mistral", 2, False)])
def test_greedy_with_ngram_drafts_equals_transformers(family, k, preempt):
  """The golden batch (16 requests, chunked prefill mixed with verification); then a
  second run that hits the prefix cache; then a pool so small that requests are preempted."""
  g = batch_golden(family)
  prompts = [r["prompt_ids"] for r in g["records"]]
  want = [r["greedy_ids"] for r in g["records"]]
  llm = make_llm(family, speculative=ngram(k))
  for _ in range(2):
    outs = llm.generate(prompts, greedy(g["max_new_tokens"]))
    assert [o.token_ids for o in outs] == want
  stats = llm.engine.stats()
  assert stats["spec_accepted_tokens"] > 0  # drafts were verified and some accepted
  assert 1 < stats["spec_mean_acceptance_length"] <= k + 1
  assert sum(o.num_cached_tokens for o in outs) > 0
  assert llm.engine.kv.usage == 0.0
  if not preempt:
    return
  small = make_llm(family, speculative=ngram(k), num_pages=17)
  assert [o.token_ids for o in small.generate(prompts, greedy(g["max_new_tokens"]))] == want
  assert small.engine.stats()["preemptions"] > 0


def test_relaxed_acceptance_commits_near_top_drafts_for_greedy_rows_only(plain):
  """Relaxed acceptance (opt-in, lossy): by the model's own full forward (LLM.logits), each
  committed greedy token is the argmax or a draft among the top 3 within 0.3 of the top
  probability, with that token's logprob; some are not the argmax. Seeded sampled rows in
  the same steps still commit what they commit without speculation."""
  g = batch_golden("llama3")
  prompts = [r["prompt_ids"] for r in g["records"]]
  params = [SamplingParams(temperature=0, max_tokens=g["max_new_tokens"], ignore_eos=True, logprobs=1) if i % 4
            else SamplingParams(temperature=0.8, seed=i, max_tokens=16, ignore_eos=True) for i in range(len(prompts))]
  llm = make_llm(speculative=ngram(3) | dict(relaxed_top_n=3, relaxed_delta=0.3))
  outs = llm.generate(prompts, params)
  sampled = [i for i, p in enumerate(params) if p.temperature]
  want = plain.generate([prompts[i] for i in sampled], [params[i] for i in sampled])
  assert [outs[i].token_ids for i in sampled] == [w.token_ids for w in want]
  relaxed = 0
  for prompt, p, o in zip(prompts, params, outs):
    if p.temperature:
      continue
    logits = llm.logits(prompt + o.token_ids[:-1])[len(prompt) - 1:].astype(np.float64)  # row i predicts token i
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    for row, pr, t, lp in zip(logits, probs, o.token_ids, o.logprobs):
      if t != row.argmax():
        relaxed += 1
        assert np.sum(row > row[t]) < 3 and pr[t] >= pr.max() - 0.3 - 1e-5
      np.testing.assert_allclose(lp, np.log(pr[t]), atol=1e-4)
  assert relaxed > 0
  assert llm.engine.stats()["spec_accepted_tokens"] >= relaxed


# ---- sampling: the same tokens, and the target's distribution ----------------------------

def test_seeded_sampling_commits_the_same_tokens_with_and_without_drafts(plain):
  """Each target token is drawn with the key its position has without speculation, so a
  seeded request's tokens, logprobs, stop and length handling are unchanged."""
  g = batch_golden("llama3")
  prompts = [r["prompt_ids"] for r in g["records"]]
  base = plain.generate(prompts, greedy(24))
  stop_at = [o.token_ids[5] for o in base]  # a stop id that greedy decoding meets mid-run
  params = [SamplingParams(temperature=(0.0, 0.2, 0.8, 0.2)[i % 4], top_k=(0, 7)[i % 2], top_p=(1.0, 0.9)[i % 3 == 0],
                           seed=100 + i, max_tokens=(24, 9)[i % 2], ignore_eos=True, logprobs=2,
                           stop_token_ids=(stop_at[i],) if i % 4 == 0 else ())
            for i in range(len(prompts))]
  want = plain.generate(prompts, params)
  llm = make_llm(speculative=ngram(3))
  got = llm.generate(prompts, params)
  for w, o in zip(want, got):
    assert o.token_ids == w.token_ids
    assert o.finish_reason == w.finish_reason
    np.testing.assert_allclose(o.logprobs, w.logprobs, atol=1e-4)
  assert [o.finish_reason for o in got[::4]] == ["stop"] * 4  # stopped inside a run
  assert all(len(o.token_ids) == 9 for o in got[1::2])  # max_tokens never overshot
  assert llm.engine.stats()["spec_accepted_tokens"] > 0


def test_the_fused_accept_kernel_in_the_step_commits_what_sample_and_accept_do():
  """With the Pallas attention (here in interpret mode) a plain speculative batch runs
  pallas_kernels.spec_accept in the step: greedy and seeded requests commit the same tokens
  and logprobs as the XLA path's sample() + accept()."""
  opts = dict(speculative=ngram(3), max_num_seqs=4, max_num_batched_tokens=16)
  g = batch_golden("llama3")
  prompts = [r["prompt_ids"] for r in g["records"][4:8]]
  params = [SamplingParams(temperature=(0.0, 0.9)[i % 2], seed=40 + i, max_tokens=24, ignore_eos=True,
                           logprobs=1) for i in range(4)]
  want = make_llm(attention_impl="xla", **opts).generate(prompts, params)
  kernel = make_llm(attention_impl="pallas_interpret", **opts)
  got = kernel.generate(prompts, params)
  for w, o in zip(want, got):
    assert o.token_ids == w.token_ids
    np.testing.assert_allclose(o.logprobs, w.logprobs, atol=1e-5)
  assert kernel.engine.stats()["spec_accepted_tokens"] > 0


class FixedDrafter:
  """Drafts chosen by the test: the model's own greedy continuation ('good') or a token
  the model never samples ('poor')."""

  def __init__(self, table):
    self.table = table

  def propose(self, token_ids, k):
    return list(self.table.get(tuple(token_ids), ()))[:k]


@pytest.mark.parametrize("quality", ["good", "poor"])
def test_three_token_distribution_matches_the_model(quality):
  """Chi-square of 3 sampled tokens (top_k=2, temperature 1) over 600 seeds, against the
  exact joint distribution computed from the model's logits. After the first token, the
  second is drafted (good: the model's top choice; poor: a token top-k never keeps) and
  verified; the third is the bonus token, or comes in the next step after a rejection."""
  llm = make_llm(speculative=ngram(1))
  prompt = [1, 17, 42, 99, 5]
  K = 2

  def top(ids):
    z = llm.logits(ids)[-1].astype(np.float64)
    best = np.argsort(-z)[:K]
    p = np.exp(z[best] - z[best].max())
    return [int(t) for t in best], p / p.sum()

  exact, table = {}, {}
  first, p1 = top(prompt)
  for a, pa in zip(first, p1):
    second, p2 = top(prompt + [a])
    table[tuple(prompt + [a])] = [second[0]] if quality == "good" else [300]
    for b, pb in zip(second, p2):
      third, p3 = top(prompt + [a, b])
      exact.update({(a, b, c): pa * pb * pc for c, pc in zip(third, p3)})
  llm.engine.drafter = FixedDrafter(table)
  n = 600
  outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, top_k=K, seed=s, max_tokens=3,
                                                    ignore_eos=True) for s in range(n)])
  counts = {}
  for o in outs:
    counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
  assert set(counts) <= set(exact)
  chi2 = sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in exact.items())
  # 8 cells, 7 degrees of freedom: P(chi2 > 24.3) = 0.001 for a correct sampler.
  assert chi2 < 24.3, (chi2, counts)
  stats = llm.engine.stats()
  assert stats["spec_draft_tokens"] == n  # one draft per request, after its first token
  if quality == "good":
    assert stats["spec_accepted_tokens"] > n / 3
  else:
    assert stats["spec_accepted_tokens"] == 0


def test_abort_mid_speculation_frees_every_page():
  llm = make_llm(speculative=ngram(3))
  engine = llm.engine
  g = batch_golden("llama3")
  for i, r in enumerate(g["records"][:6]):
    engine.add_request(f"r{i}", r["prompt_ids"], greedy(40))
  while engine.stats()["spec_verify_steps"] == 0:
    engine.step()
  for i in range(6):
    engine.abort(f"r{i}")
  assert not engine.has_unfinished()
  assert engine.kv.usage == 0.0


def test_cli_generates_with_speculation_and_rejects_a_bad_count(capsys):
  from jaxinfer.cli import main
  model = str(tiny_dir("llama3"))
  # make_llm's engine flags and k = 3: the warm-up finds the golden test's programs compiled.
  assert main(["generate", "--model", model, "--speculative-method", "ngram", "--num-speculative-tokens",
               "3", "--max-num-seqs", "16", "--max-num-batched-tokens", "64", "--max-tokens", "4",
               "--no-chat-template", "--quiet", "hello"]) == 0
  assert main(["generate", "--model", model, "--speculative-method", "ngram", "--num-speculative-tokens",
               "0", "hello"]) == 1
  assert "num_speculative_tokens must be an int in [1, 8], got 0" in capsys.readouterr().err
  assert main(["generate", "--model", model, "--speculative-method", "ngram", "--speculative-relaxed-top-n",
               "2", "--speculative-relaxed-delta", "1.5", "hello"]) == 1
  assert "relaxed_delta must be a probability in [0, 1], got 1.5" in capsys.readouterr().err


def test_acceptance_stats_reach_prometheus_and_each_requests_usage():
  from jaxinfer.serving import Client, InferenceServer, ServerConfig
  from jaxinfer.serving.metrics import Metrics
  llm = make_llm(speculative=ngram(3))
  g = batch_golden("llama3")
  prompts = [r["prompt_ids"] for r in g["records"][:4]]
  outs = llm.generate(prompts, greedy(30))
  stats = llm.engine.stats()
  # Never drafted past max_tokens, no stop: every accepted draft joined an output.
  assert sum(o.num_accepted_draft_tokens for o in outs) == stats["spec_accepted_tokens"]
  server = InferenceServer(llm, ServerConfig(port=0, metrics_port=0), warmup=False).start_in_thread()
  try:
    with Client(f"127.0.0.1:{server.port}", timeout=120) as c:
      for p, o in zip(prompts, outs):
        got = c.generate(p, temperature=0, max_tokens=30, ignore_eos=True)
        assert got.token_ids == o.token_ids
        assert got.usage.accepted_draft_tokens == o.num_accepted_draft_tokens
  finally:
    server.stop_in_thread(5)
  assert sum(o.num_accepted_draft_tokens for o in outs) > 0
  m = Metrics()
  m.set_engine_stats(stats)
  text = m.exposition().decode()
  assert f"jaxinfer_spec_decode_draft_tokens {float(stats['spec_draft_tokens'])}" in text
  assert f"jaxinfer_spec_decode_accepted_tokens {float(stats['spec_accepted_tokens'])}" in text
  assert stats["spec_draft_tokens"] >= stats["spec_accepted_tokens"] > 0


def test_acceptance_stats_of_scripted_drafts_are_the_hand_counted_ones():
  """One greedy request, k = 3, max_tokens = 9, drafts scripted from its golden ids g:
  step 1 prefills and commits g0; step 2 drafts g1 g2 g3 (all accepted, + bonus g4);
  step 3 drafts g5 300 g7 (g5 accepted, 300 rejected: g6 sampled in its place); step 4 has
  room for one draft (9 - 7 - 1 for the bonus token): g7, accepted, + g8.
  Per position: proposed [3, 2, 2], accepted [3, 1, 1]."""
  llm = make_llm(speculative=ngram(3))
  r = batch_golden("llama3")["records"][0]
  p, g = r["prompt_ids"], r["greedy_ids"]
  assert len(p) <= 64 and len(g) >= 9 and 300 not in g[5:8]  # one prefill step; 300 is wrong
  llm.engine.drafter = FixedDrafter({tuple(p + g[:1]): g[1:4], tuple(p + g[:5]): [g[5], 300, g[7]],
                                     tuple(p + g[:7]): g[7:10]})
  out = llm.generate([p], greedy(9))[0]
  assert out.token_ids == g[:9]
  assert out.num_accepted_draft_tokens == 5
  stats = llm.engine.stats()
  assert {k: v for k, v in stats.items() if k.startswith("spec_")} == {
      "spec_verify_steps": 3, "spec_draft_tokens": 7, "spec_accepted_tokens": 5,
      "spec_mean_acceptance_length": pytest.approx(8 / 3),  # 1 + 5 accepted / 3 verifying steps
      "spec_acceptance_rate_1": 1.0, "spec_acceptance_rate_2": 0.5, "spec_acceptance_rate_3": 0.5}
  assert stats["steps"] == 4
