"""LLM.generate / LLM.logits on tiny models: cache path vs full forward, batching, errors."""

import subprocess
import sys

import numpy as np
import pytest

from conftest import tiny_dir
from jaxinfer import SamplingParams
from jaxinfer.errors import InvalidRequestError, TokenizerError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def greedy_by_full_forward(llm, prompt, n):
  ids = list(prompt)
  for _ in range(n):
    ids.append(int(llm.logits(ids)[-1].argmax()))
  return ids[len(prompt):]


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_cached_decoding_equals_full_forward(tiny_llms, family):
  llm = tiny_llms[family]
  prompt = [5, 17, 200, 3, 99, 42, 7]
  out = llm.generate([prompt], GREEDY)[0]
  assert out.token_ids == greedy_by_full_forward(llm, prompt, 12)
  assert out.finish_reason == "length" and len(out.logprobs) == 12
  assert all(lp <= 0 for lp in out.logprobs)


def test_batch_of_mixed_lengths_equals_each_alone(tiny_llms):
  llm = tiny_llms["qwen3"]
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 320, n).tolist() for n in (3, 40, 9, 1, 70, 16, 5, 33, 2, 11)]
  together = llm.generate(prompts, GREEDY)
  for p, out in zip(prompts, together):
    assert out.prompt_token_ids == p
    assert out.token_ids == llm.generate([p], GREEDY)[0].token_ids


@pytest.mark.parametrize("family", ["llama3", "mistral"])  # byte-level BPE; sentencepiece
def test_generate_detokenizing_at_the_end_equals_streaming_token_by_token(tiny_llms, family):
  """LLM.generate makes no output before the end and detokenizes then (engine/output.py:
  OutputState.deferred); LLM.stream detokenizes each token as it comes. Same text, same ids."""
  llm = tiny_llms[family]
  params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)  # random bytes too
  prompts = ["Hello world", "Über 1000 ünïcödé"]
  final = llm.generate(prompts, params)
  streamed = {}
  for out in llm.stream(prompts, params):
    streamed.setdefault(out.index, []).append(out)
  for i, out in enumerate(final):
    last = streamed[i][-1]
    assert last.finished and (out.text, out.token_ids) == (last.text, last.token_ids)
    assert "".join(o.new_text for o in streamed[i]) == out.text
    assert len(streamed[i]) > 1  # streamed outputs came step by step; generate's only at the end
  assert any(out.text for out in final)


def test_stop_token_ids_and_max_tokens(tiny_llms):
  llm = tiny_llms["qwen2"]
  full = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
  stop_at = full[4]
  out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]))[0]
  assert out.token_ids == full[:full.index(stop_at) + 1] and out.finish_reason == "stop"


def test_stop_strings_cut_the_text(tiny_llms):
  llm = tiny_llms["llama3"]
  full = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
  assert len(full.text) > 4
  stop = full.text[2:4]
  out = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0]
  assert out.finish_reason == "stop" and out.text == full.text[:full.text.index(stop)]


def test_chat_prompt_uses_the_models_template(tiny_llms):
  llm = tiny_llms["llama3"]
  msgs = [{"role": "user", "content": "Hi"}]
  out = llm.generate([msgs], SamplingParams(temperature=0, max_tokens=2))[0]
  assert out.prompt == "<s>[user] Hi</s>\n[assistant] "
  assert out.prompt_token_ids == llm.tokenizer.encode_chat(msgs)


@pytest.mark.parametrize("prompt,params,error,message", [
    ([], None, InvalidRequestError, r"prompt is empty"),
    ("", None, InvalidRequestError, r"prompt is empty"),
    ([1, 2, 320], None, InvalidRequestError, r"prompt token id 320 is out of range \[0, 320\)"),
    ([1, 2.5], None, InvalidRequestError, r"prompt token ids must be ints"),
    ([1, 2], SamplingParams(max_tokens=255), InvalidRequestError,
     r"prompt 0: 2 prompt tokens \+ max_tokens=255 exceeds max_model_len=256"),
    ("text", None, TokenizerError, r"has no tokenizer files: a text prompt needs one"),
    ([{"role": "user"}], None, TokenizerError, r"a chat prompt needs one"),
])
def test_bad_requests_raise_clear_errors(tiny_llms, prompt, params, error, message):
  with pytest.raises(error, match=message):
    tiny_llms["qwen2"].generate([prompt], params)


def test_cli_generate_on_a_tiny_model(tiny_llms):
  # A 4-token step budget: the warm-up compiles 3 step buckets, not 10.
  r = subprocess.run([sys.executable, "-m", "jaxinfer", "generate", "--model", str(tiny_dir("llama3")),
                      "--max-tokens", "5", "--temperature", "0", "--no-chat-template",
                      "--max-num-batched-tokens", "4", "--max-num-seqs", "2", "--max-model-len", "64", "Hello"],
                     capture_output=True, text=True)
  assert r.returncode == 0, r.stderr
  want = tiny_llms["llama3"].generate(["Hello"], SamplingParams(temperature=0, max_tokens=5),
                                      apply_chat_template=False)[0].text
  assert want.strip() and r.stdout == want.strip() + "\n"


def test_cli_rejects_bad_sampling_value():
  r = subprocess.run([sys.executable, "-m", "jaxinfer", "generate", "--model", str(tiny_dir("llama3")),
                      "--top-p", "0", "Hello"], capture_output=True, text=True)
  assert r.returncode == 1
  assert r.stderr.strip() == "jaxinfer: error: top_p must be in (0, 1], got 0.0"


@pytest.mark.slow
def test_default_model_answers_paris(default_checkpoint):
  r = subprocess.run([sys.executable, "scripts/generate.py", "What is the capital of France?"],
                     capture_output=True, text=True, cwd=tiny_dir("llama3").parents[3])
  assert r.returncode == 0, r.stderr
  assert "Paris" in r.stdout
