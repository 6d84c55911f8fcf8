"""Offline JSON Lines generation: records, bad lines, overrides, resume."""

import json
import subprocess
import sys

import pytest

from conftest import tiny_dir
from jaxinfer import SamplingParams
from jaxinfer.offline import generate_jsonl

LINES = [
    {"id": "a", "prompt": "Hello world", "max_tokens": 5},
    {"id": "b", "messages": [{"role": "user", "content": "Hi"}], "sampling_params": {"max_tokens": 3}},
    "not json",
    {"id": "c", "prompt": "x", "top_p": 7},
    {"prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 2},
    {"id": "d", "prompt": "y", "colour": "red"},
    {"id": "e"},
    {"id": "a", "prompt": "again"},
    {"id": "f", "prompt": [1] * 300},
]


def write_input(path, lines=LINES):
  path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
  return path


def read(path):
  return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_records_errors_and_overrides(tiny_llms, tmp_path):
  llm = tiny_llms["llama3"]
  out = tmp_path / "out.jsonl"
  s = generate_jsonl(llm, write_input(tmp_path / "in.jsonl"), out,
                     SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), progress=False)
  recs = read(out)
  assert (s.done, s.errors, s.skipped) == (3, 6, 0)
  assert recs["a"]["num_generated_tokens"] == 5 and recs["a"]["finish_reason"] == "length"
  assert recs["b"]["num_generated_tokens"] == 3
  assert recs["line-5"]["token_ids"] == llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids
  assert len(recs["line-5"]["top_logprobs"]) == 4 and recs["line-5"]["num_prompt_tokens"] == 3
  assert recs["line-3"]["error"].startswith("line 3: not valid JSON")
  assert recs["c"]["error"] == "line 4: top_p must be in (0, 1], got 7"
  assert recs["d"]["error"] == "line 6: unknown field(s) ['colour']"
  assert recs["e"]["error"] == "line 7: give exactly one of 'prompt' or 'messages'"
  assert recs["line-8"]["error"] == "line 8: duplicate id 'a'"
  assert "exceeds max_model_len=256" in recs["f"]["error"]
  # Text prompts went through the chat template.
  assert recs["a"]["num_prompt_tokens"] == len(llm.tokenizer.encode_chat([{"role": "user", "content": "Hello world"}]))


def test_resume_skips_done_ids_and_drops_a_half_written_line(tiny_llms, tmp_path):
  llm = tiny_llms["llama3"]
  lines = [{"id": f"q{i}", "prompt": [i + 1] * (i + 1)} for i in range(6)]
  inp = write_input(tmp_path / "in.jsonl", lines)
  out = tmp_path / "out.jsonl"
  greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
  generate_jsonl(llm, inp, out, greedy, progress=False)
  full = read(out)
  # As if the run had died after two records and half of a third.
  kept = out.read_text().splitlines()[:2]
  out.write_text("\n".join(kept) + "\n" + '{"id": "q9", "te')
  s = generate_jsonl(llm, inp, out, greedy, progress=False)
  assert (s.done, s.skipped) == (4, 2)
  assert read(out) == full
  assert len(out.read_text().splitlines()) == 6


def test_missing_input_is_a_clear_error(tiny_llms, tmp_path):
  from jaxinfer.errors import InvalidRequestError
  with pytest.raises(InvalidRequestError, match="input file .*nope.jsonl does not exist"):
    generate_jsonl(tiny_llms["llama3"], tmp_path / "nope.jsonl", tmp_path / "o.jsonl")


def test_cli_input_output(tmp_path):
  inp = write_input(tmp_path / "in.jsonl", [{"id": "x", "prompt": "Hello"}, "oops"])
  out = tmp_path / "out.jsonl"
  cmd = [sys.executable, "-m", "jaxinfer", "generate", "--model", str(tiny_dir("llama3")),
         "--max-tokens", "3", "--max-num-batched-tokens", "32", "--kv-cache-dtype", "int8"]
  r = subprocess.run(cmd + ["--input", str(inp), "--output", str(out)], capture_output=True, text=True)
  assert r.returncode == 0, r.stderr
  assert "1 generated, 1 errors, 0 already done" in r.stderr
  # The pool line: 2 layers x k, v x 1 kv head x (16 int8 values + a float32 scale) per token.
  assert "of int8 (80 bytes per token, scales included)" in r.stderr
  assert set(read(out)) == {"x", "line-2"}
  r = subprocess.run(cmd + ["--input", str(inp)], capture_output=True, text=True)
  assert r.returncode == 1 and "--input needs --output" in r.stderr


def test_async_scheduling_is_the_cli_default_and_can_be_turned_off():
  from jaxinfer.cli import build_parser
  from jaxinfer.engine.engine import EngineConfig
  parse = build_parser().parse_args
  assert EngineConfig().async_scheduling is True
  assert parse(["generate", "hi"]).async_scheduling is True
  assert parse(["generate", "--no-async-scheduling", "hi"]).async_scheduling is False
  assert parse(["serve", "--no-async-scheduling"]).async_scheduling is False
