"""The engine end to end on tiny models: continuous batching, chunked prefill,
preemption and prefix caching all reproduce transformers' greedy ids exactly."""

import json

import jax
import numpy as np
import pytest

from conftest import DATA, tiny_dir
from helpers import FailingTokenizer, run_engine, widen_heads
from jaxinfer import LLM, SamplingParams
from jaxinfer.errors import InvalidRequestError


def batch_golden(name):
  return json.loads((DATA / "golden" / f"batch_{name}.json").read_text())


def greedy(n):
  return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def make_llm(family, **kw):
  kw = dict(max_num_seqs=16, max_num_batched_tokens=64, warmup=False) | kw
  return LLM(tiny_dir(family), **kw)


@pytest.mark.parametrize("family", ["llama3", "mistral"])  # mistral: sliding window 8 over pages
def test_sixteen_concurrent_requests_match_transformers_greedy(family):
  """Slow (over 30 s on two cores with a cold compilation cache): the mixed batch reaches
  every step bucket, and reaching them all is the point; each compiles once."""
  g = batch_golden(family)
  llm = make_llm(family)
  prompts = [r["prompt_ids"] for r in g["records"]]
  outs, running = run_engine(llm.engine, prompts, [greedy(g["max_new_tokens"])] * len(prompts))
  for r, out in zip(g["records"], outs):
    assert out.token_ids == r["greedy_ids"]
  # Continuous batching really happened: most of the 16 ran at once (the shortest finish
  # first), with chunked prefill under a 64-token budget (the longest prompt needs 4 steps).
  assert max(running) >= 12
  assert llm.engine.num_steps > g["max_new_tokens"] + 220 // 64
  assert llm.engine.kv.usage == 0.0  # every page back (cached ones are evictable)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "mistral"])
def test_golden_batch_through_the_pallas_kernel_in_interpret_mode(family):
  """The same 16 mixed prefill/decode requests, attention forced to the Pallas
  kernel (interpret mode on CPU): still transformers' greedy ids. Slow (over 30 s on two
  cores): interpret mode unrolls the kernel's grid into XLA ops, and every step bucket the
  batch reaches compiles that way."""
  g = batch_golden(family)
  llm = make_llm(family, attention_impl="pallas_interpret")
  assert llm.runner.attention_impl == "pallas_interpret"
  prompts = [r["prompt_ids"] for r in g["records"]]
  outs, _ = run_engine(llm.engine, prompts, [greedy(g["max_new_tokens"])] * len(prompts))
  for r, out in zip(g["records"], outs):
    assert out.token_ids == r["greedy_ids"]


@pytest.mark.mosaic
def test_golden_batch_through_the_mosaic_kernel_in_interpret_mode(tmp_path, monkeypatch):
  """Attention forced to the Mosaic GPU kernel (Mosaic GPU interpret mode on CPU): still
  transformers' greedy ids. The tiny mistral (G = 2, sliding window 8) with its heads
  widened to 64 dims (the kernel's smallest; `widen_heads` keeps the function) and a
  bfloat16 cache (the kernel's dtype; transformers' float32 ids still come out). Two
  prompts of the batch golden: 7 tokens, and 70 (chunked prefill under the 64-token
  budget beside the other's decode), 6 new tokens each: interpret mode costs seconds per
  step, so the batch is small."""
  from pallas_kernels import ragged_paged_attention_mgpu as mgpu
  if not mgpu.MOSAIC_AVAILABLE:
    pytest.skip("Mosaic GPU interpret mode needs jax >= 0.11 (Python 3.12 venv)")
  calls = []
  kernel = mgpu.ragged_paged_attention_mgpu
  # Counted as the step is traced: the ops dispatch took this kernel, not the Triton fallback.
  monkeypatch.setattr(mgpu, "ragged_paged_attention_mgpu", lambda *a, **k: calls.append(1) or kernel(*a, **k))
  g = batch_golden("mistral")
  records = [g["records"][i] for i in (1, 5)]
  assert [len(r["prompt_ids"]) for r in records] == [7, 70]
  llm = LLM(widen_heads(tiny_dir("mistral"), tmp_path / "mistral"), max_num_seqs=16, max_num_batched_tokens=64,
            warmup=False, attention_impl="mosaic_interpret", kv_cache_dtype="bfloat16")
  assert llm.runner.attention_impl == "mosaic_interpret"
  n = 6
  outs, _ = run_engine(llm.engine, [r["prompt_ids"] for r in records], [greedy(n)] * len(records))
  assert calls
  for r, out in zip(records, outs):
    assert out.token_ids == r["greedy_ids"][:n]


def test_attention_impl_is_checked():
  with pytest.raises(InvalidRequestError, match="attention_impl must be one of"):
    make_llm("llama3", attention_impl="cudnn")
  with pytest.raises(InvalidRequestError, match="compiles for GPU only"):
    make_llm("llama3", attention_impl="pallas")  # this machine has no GPU
  assert make_llm("llama3").runner.attention_impl == "xla"  # 'auto' on CPU


def test_preemption_when_pages_run_out_changes_nothing():
  """Slow (over 30 s on two cores): the small pool is another cache shape, so its step
  buckets compile anew, and the 16 requests are recomputed after each preemption."""
  g = batch_golden("llama3")
  # 17 usable pages of 16 tokens: one full-length sequence fits, 16 requests do not.
  llm = make_llm("llama3", num_pages=18, page_size=16)
  prompts = [r["prompt_ids"] for r in g["records"]]
  outs, _ = run_engine(llm.engine, prompts, [greedy(16)] * 16)
  assert llm.engine.stats()["preemptions"] > 0
  for r, out in zip(g["records"], outs):
    assert out.token_ids == r["greedy_ids"]
  assert llm.engine.kv.num_free_pages == 17


def test_prefix_cache_hits_skip_prompt_tokens_and_change_nothing():
  g = batch_golden("llama3")
  llm = make_llm("llama3")
  prompts = [r["prompt_ids"] for r in g["records"]]
  first = llm.generate(prompts, greedy(16))
  computed_first = llm.engine.num_computed_tokens
  second = llm.generate(prompts, greedy(16))
  computed_second = llm.engine.num_computed_tokens - computed_first
  for r, a, b in zip(g["records"], first, second):
    assert a.token_ids == b.token_ids == r["greedy_ids"]
  # The second run takes every full 16-token block of each prompt from the cache.
  cached = [(len(p) - 1) // 16 * 16 for p in prompts]
  assert [o.num_cached_tokens for o in second] == cached
  # Computed now: each prompt past its cached blocks, then 15 fed-back tokens each.
  assert computed_second == sum(len(p) - c for p, c in zip(prompts, cached)) + 16 * 15
  assert computed_second < computed_first
  # Within the first run the 40-token shared prefix was already reused (2 blocks) by
  # prompts admitted after the first of them finished its prefill.
  assert sum(o.num_cached_tokens for o in first) > 0
  assert llm.engine.stats()["prefix_hit_rate"] > 0


def test_prefix_caching_off_computes_everything():
  llm = make_llm("llama3", enable_prefix_caching=False)
  prompts = [list(range(1, 60))] * 2
  llm.generate(prompts, greedy(4))
  llm.generate(prompts, greedy(4))
  assert llm.engine.num_computed_tokens == 4 * (59 + 3)


@pytest.mark.parametrize("async_scheduling", [False, True])  # async: r2's step 5 is on the device
def test_abort_frees_pages_at_once_and_others_continue(async_scheduling):
  g = batch_golden("llama3")
  engine = make_llm("llama3", async_scheduling=async_scheduling).engine
  prompts = [r["prompt_ids"] for r in g["records"][:6]]
  for i, p in enumerate(prompts):
    engine.add_request(f"r{i}", p, greedy(16))
  for _ in range(5):
    engine.step()
  pages_of_r2 = len(engine.kv.pages("r2"))
  free_before = engine.kv.num_free_pages
  assert pages_of_r2 > 0
  final = engine.abort("r2")
  assert final.finish_reason == "abort" and final.finished
  assert engine.kv.pages("r2") == [] and engine.kv.num_free_pages == free_before + pages_of_r2
  assert engine.abort("r2") is None  # aborting twice is harmless
  done = {}
  while engine.has_unfinished():
    for out in engine.step():
      assert out.request_id != "r2"
      if out.finished:
        done[out.request_id] = out.token_ids
  assert done == {f"r{i}": g["records"][i]["greedy_ids"] for i in (0, 1, 3, 4, 5)}
  assert engine.kv.usage == 0.0


def test_abort_of_a_waiting_request():
  engine = make_llm("llama3", max_num_seqs=1).engine
  engine.add_request("a", [1, 2, 3], greedy(3))
  engine.add_request("b", [4, 5, 6], greedy(3))
  engine.step()
  assert engine.abort("b").finish_reason == "abort"
  while engine.has_unfinished():
    engine.step()
  assert engine.num_unfinished == 0


def test_engine_api_rejects_bad_requests_and_keeps_running():
  engine = make_llm("qwen2").engine
  engine.add_request("ok", [1, 2, 3], greedy(4))
  with pytest.raises(InvalidRequestError, match="request id 'ok' is already in use"):
    engine.add_request("ok", [1], greedy(1))
  with pytest.raises(InvalidRequestError, match="prompt token id 999 is out of range"):
    engine.add_request("bad", [1, 999], greedy(1))
  with pytest.raises(InvalidRequestError, match=r"250 prompt tokens \+ max_tokens=7 exceeds max_model_len=256"):
    engine.add_request("long", [1] * 250, greedy(7))
  with pytest.raises(InvalidRequestError, match="sampling params must be a SamplingParams"):
    engine.add_request("typo", [1], {"temperature": 0})
  outs = []
  while engine.has_unfinished():
    outs += engine.step()
  assert [o.request_id for o in outs] == ["ok"] * 4 and outs[-1].finish_reason == "length"


def test_pool_smaller_than_one_sequence_is_refused():
  with pytest.raises(InvalidRequestError, match=r"cannot hold one sequence of max_model_len=256"):
    make_llm("qwen2", num_pages=8)


def test_seeded_sampling_is_batch_invariant():
  """Slow (over 30 s on two cores): a request alone and in a ragged batch of ten run in
  different step buckets (the invariance is across them); each compiles."""
  llm = make_llm("llama2")
  sp = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=77, max_tokens=12, ignore_eos=True)
  alone = llm.generate([[3, 1, 4, 1, 5]], sp)[0].token_ids
  rng = np.random.default_rng(3)
  others = [rng.integers(0, 320, int(n)).tolist() for n in rng.integers(1, 120, 9)]
  mixed = SamplingParams(temperature=1.3, seed=1, max_tokens=20, ignore_eos=True)
  outs = llm.generate(others[:4] + [[3, 1, 4, 1, 5]] + others[4:], [mixed] * 4 + [sp] + [mixed] * 5)
  assert outs[4].token_ids == alone
  # Unseeded requests still sample differently from each other.
  free = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
  a, b = llm.generate([[3, 1, 4, 1, 5]] * 2, free)
  assert a.token_ids != b.token_ids


def test_stream_deltas_add_up_to_generate():
  llm = make_llm("llama3")
  sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
  prompts = ["Hello world", "naïve café 🙂"]
  expected = llm.generate(prompts, sp)
  texts, ids, finished = ["", ""], [[], []], [None, None]
  for out in llm.stream(prompts, sp):
    assert finished[out.index] is None  # nothing after the final output
    texts[out.index] += out.new_text
    ids[out.index] += out.new_token_ids
    if out.finished:
      finished[out.index] = out.finish_reason
  assert texts == [e.text for e in expected] and ids == [e.token_ids for e in expected]
  assert finished == ["length", "length"]


def test_leaving_a_stream_early_aborts_its_requests():
  llm = make_llm("llama3")
  for out in llm.stream(["Hello world"] * 3, greedy(30)):
    break
  assert not llm.engine.has_unfinished() and llm.engine.kv.usage == 0.0


def test_warmup_compiles_every_bucket_and_requests_compile_nothing_more():
  """Then freezes the heap. Slow by design: warm-up compiles every bucket of the SmolLM2-shaped model with the
  persistent compilation cache off, so that each compile is seen and counted."""
  import gc

  import jax
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, _secs, **kw: compiles.append(event) if "backend_compile" in event else None)
  gc.unfreeze()
  llm = make_llm("smollm2", max_num_batched_tokens=16, max_num_seqs=8, warmup=True,
                 compilation_cache_dir="")
  assert gc.get_freeze_count() > 0  # warm-up ended with runner.freeze_heap
  runner = llm.runner
  assert runner.token_buckets == (1, 2, 4, 8, 16)
  after_warmup = runner.compiled_programs()
  # A forward per token bucket; per row bucket (1, 2, 4, 8) the sampler's 4 warm modes and the
  # one that reads a grammar mask; the penalty-history loader.
  assert after_warmup == len(runner.token_buckets) + 4 * 5 + 1
  before = len(compiles)
  rng = np.random.default_rng(1)
  for n in (1, 2, 3, 5, 9, 16):  # random shapes, sampling and penalties
    prompts = [rng.integers(0, 320, int(rng.integers(1, 100))).tolist() for _ in range(n)]
    params = [SamplingParams(temperature=float(rng.uniform(0, 1.5)), top_k=int(rng.integers(0, 10)),
                             repetition_penalty=float(rng.uniform(1, 1.5)), logprobs=int(rng.integers(0, 5)),
                             max_tokens=int(rng.integers(1, 40))) for _ in range(n)]
    llm.generate(prompts, params)
  assert len(compiles) == before and runner.compiled_programs() == after_warmup
  # Prompt logprobs and full-sequence logits compile on first use, once per bucket.
  llm.generate([[1, 2, 3]], SamplingParams(prompt_logprobs=1, max_tokens=2))
  llm.logits([3] * 90)
  llm.logits([4] * 120)
  assert runner.compiled_programs() == after_warmup + 2 <= runner.max_programs()


def test_a_request_that_fails_in_postprocessing_ends_alone():
  """r1's detokenizer raises at its third token: r1 ends with 'error' and its three tokens,
  r0 and r2 (added before and after it) get their greedy ids, and every page is free."""
  llm = make_llm("llama3")
  engine = llm.engine
  want = llm.generate([[1, 2, 3], [4, 5, 6]], greedy(12))
  tok = engine.outputs.tokenizer = FailingTokenizer(engine.tokenizer, fail_at=3)  # detokenizers come from it
  engine.add_request("r0", [1, 2, 3], greedy(12))
  tok.armed = True
  engine.add_request("r1", [9, 9], greedy(12))
  tok.armed = False
  engine.add_request("r2", [4, 5, 6], greedy(12))
  final = {}
  while engine.has_unfinished():
    final.update((o.request_id, o) for o in engine.step() if o.finished)
  assert final["r1"].finish_reason == "error" and final["r1"].error == "RuntimeError: boom"
  assert len(final["r1"].token_ids) == 3
  assert [final["r0"].token_ids, final["r2"].token_ids] == [want[0].token_ids, want[1].token_ids]
  assert engine.kv.num_free_pages == engine.kv.num_pages - 1


@pytest.mark.parametrize("lose_state,async_scheduling", [(False, False), (True, False), (True, True)])
def test_a_failed_device_step_ends_its_requests_and_the_engine_goes_on(lose_state, async_scheduling):
  """Async: the failing launch comes while the step before it is in flight; that step's
  tokens are still committed before its requests end."""
  llm = make_llm("llama3", async_scheduling=async_scheduling)
  engine, runner = llm.engine, llm.runner
  want = llm.generate([[1, 2, 3]], greedy(10))[0]
  real = runner.launch
  calls = []

  def launch(*args, **kw):  # the runner's public entry for a step: its third launch fails
    calls.append(1)
    if len(calls) == 3:
      if lose_state:  # as if the donated cache had been consumed by a failed launch
        for x in jax.tree.leaves(runner.cache):
          x.delete()
      raise RuntimeError("device fault")
    return real(*args, **kw)

  runner.launch = launch
  outs, _ = run_engine(engine, [[1, 2, 3], [4, 5]], [greedy(10)] * 2)
  assert [o.finish_reason for o in outs] == ["error", "error"]
  assert outs[0].error == "RuntimeError: device fault" and len(outs[0].token_ids) == 2
  assert runner.state_lost() is False
  assert engine.kv.num_free_pages == engine.kv.num_pages - 1
  runner.launch = real
  assert llm.generate([[1, 2, 3]], greedy(10))[0].token_ids == want.token_ids



def test_the_default_kv_budget_is_by_backend_and_memory():
  from jaxinfer.engine.engine import DEFAULT_KV_BYTES, KV_MEMORY_FRACTION, kv_budget
  gib = 1 << 30
  assert kv_budget([None]) == DEFAULT_KV_BYTES == gib  # the CPU reports no memory
  # One GPU: the fraction of its allocator's limit, less the weights in use.
  assert kv_budget([{"bytes_limit": 100 * gib, "bytes_in_use": 16 * gib}]) == int(KV_MEMORY_FRACTION * 100 * gib) - 16 * gib
  # A mesh: the tightest device's figure; a device without stats: the fixed default.
  two = [{"bytes_limit": 100 * gib, "bytes_in_use": 10 * gib}, {"bytes_limit": 100 * gib, "bytes_in_use": 20 * gib}]
  assert kv_budget(two) == int(KV_MEMORY_FRACTION * 100 * gib) - 20 * gib
  assert kv_budget([two[0], None]) == DEFAULT_KV_BYTES
  # A full device: nothing (the engine then says the pool cannot hold one sequence).
  assert kv_budget([{"bytes_limit": gib, "bytes_in_use": gib}]) == 0
