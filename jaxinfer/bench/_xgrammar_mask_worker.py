"""xgrammar's per-step mask time for `jaxinfer bench structured`, run in a venv with torch + xgrammar.

Reads one JSON spec on stdin: tokenizer_json, vocab_size, eos_ids, cases = [{grammar,
schema | regex, text_ids, batch}], iters. For each case: B matchers, the i-th
advanced by i * n / B tokens of text_ids, then fill_next_token_bitmask for
all B rows, median of iters (ms). Prints one JSON line: [{grammar, batch, ms, min_ms, compile_ms}].
jaxinfer never imports xgrammar (it needs torch, transformers and triton at runtime).
"""

import json
import statistics
import sys
import time

import transformers
import xgrammar as xgr


def main():
  spec = json.load(sys.stdin)
  hf = transformers.PreTrainedTokenizerFast(tokenizer_file=spec["tokenizer_json"])
  info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=spec["vocab_size"], stop_token_ids=spec["eos_ids"])
  compiler = xgr.GrammarCompiler(info)
  out = []
  for case in spec["cases"]:
    t0 = time.perf_counter()
    if case["grammar"] == "json_schema":
      compiled = compiler.compile_json_schema(json.dumps(case["schema"]), any_whitespace=False,
                                              separators=(", ", ": "))
    elif case["grammar"] == "json_object":
      compiled = compiler.compile_builtin_json_grammar()
    else:
      compiled = compiler.compile_regex(case["regex"])
    compile_ms = (time.perf_counter() - t0) * 1e3
    B, ids = case["batch"], case["text_ids"]
    matchers = []
    for i in range(B):
      m = xgr.GrammarMatcher(compiled)
      for t in ids[:i * (len(ids) - 1) // B]:
        assert m.accept_token(t), (case["grammar"], t)
      matchers.append(m)
    mask = xgr.allocate_token_bitmask(B, spec["vocab_size"])

    def fill():
      for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(mask, i)

    fill()
    times = []
    for _ in range(spec["iters"]):
      t0 = time.perf_counter()
      fill()
      times.append((time.perf_counter() - t0) * 1e3)
    out.append(dict(grammar=case["grammar"], batch=B, ms=statistics.median(times), min_ms=min(times),
                    compile_ms=compile_ms))
  print(json.dumps(out))


if __name__ == "__main__":
  main()
