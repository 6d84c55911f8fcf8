"""Speculative decoding on the default model: decode tokens/s without speculation,
with n-gram drafts and with the shipped MTP head (jaxinfer/data/mtp, trained by
scripts/train_mtp.py) (k = 1, 2, 3 each), at batch 1 and batch 16, side by side in one run.

  jaxinfer bench spec [--dtype float32] [--max-tokens 128] [--ks 1,2,3] [--methods ngram,mtp]

Prompts are chats we ship here: half ask the model to rework a text given in
the prompt (where prompt lookup finds drafts), half are open questions.
Greedy, EOS ignored, so every configuration generates the same number of
tokens, and the script checks they are the same tokens. Prints a table;
writes benchmarks/results/spec-<date>.json with the CPU and the commit.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

from jaxinfer.bench.harness import environment, load_average, write_results

TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork, "
        "trimmed the wick and polished the great lens until it shone. Ships passing the rocky point "
        "looked for his light, and on stormy nights he stayed awake until dawn, watching the sea.")
CODE = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
        "    return total / len(values)\n")
PROMPTS = [
    f"Rewrite this story in the past perfect tense:\n\n{TEXT}",
    f"Add type hints and a docstring to this Python function, and show the whole function:\n\n{CODE}",
    f"Repeat the following text, but replace 'lighthouse keeper' with 'old sailor':\n\n{TEXT}",
    f"Summarize this text in three sentences, quoting it where you can:\n\n{TEXT}",
    "What is the capital of France? Explain its history briefly.",
    "Write a short poem about autumn leaves.",
    "List five tips for learning a new language.",
    "Explain how a bicycle works to a child.",
]


def run_config(dtype: str, spec: dict | None, max_tokens: int, batches: list[int], max_batched: int = 256) -> list[dict]:
  """One engine (one warm-up) per configuration, timed at each batch size."""
  from jaxinfer import LLM, SamplingParams
  llm = LLM(None, dtype=dtype, speculative=spec, max_num_seqs=max(16, *batches),
            max_num_batched_tokens=max_batched)
  chats = [[{"role": "user", "content": p}] for p in PROMPTS]
  sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
  llm.generate(chats[:1], SamplingParams(temperature=0, max_tokens=4))  # first-use work out of the timing
  rows = []
  for batch in batches:
    engine = llm.engine
    base = dict(engine.stats())
    proposed0, accepted0 = engine.spec_proposed.copy(), engine.spec_accepted.copy()
    t0 = time.perf_counter()
    if batch == 1:  # two prompts of each kind, one at a time
      outs = [llm.generate([c], sp)[0] for c in chats[:2] + chats[4:6]]
    else:
      outs = llm.generate((chats * (-(-batch // len(chats))))[:batch], sp)
    dt = time.perf_counter() - t0
    stats = engine.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    row = dict(method=spec["method"] if spec else "none", k=spec["num_speculative_tokens"] if spec else 0,
               batch=batch, tokens=tokens, seconds=dt, tokens_per_s=tokens / dt,
               steps=stats["steps"] - base["steps"], ids=[o.token_ids for o in outs])
    if spec:
      proposed, accepted = engine.spec_proposed - proposed0, engine.spec_accepted - accepted0
      verify = stats["spec_verify_steps"] - base["spec_verify_steps"]
      row["mean_acceptance_length"] = float(1 + accepted.sum() / verify) if verify else 1.0
      row["acceptance_rate"] = [float(a / p) if p else 0.0 for p, a in zip(proposed, accepted)]
    rows.append(row)
  del llm
  gc.collect()
  return rows


def summarize(rows: list[dict]) -> list[dict]:
  """Each row against the row without speculation at its batch size: `speedup` (tok/s over
  none's), `same_tokens_as_without` (the greedy ids equal none's), `ms_per_step` and
  `step_cost_vs_none`. speedup = tokens per step x (none's step time / this step time): the two
  columns after it say which of the two held it back."""
  for r in rows:
    base = next(b for b in rows if b["batch"] == r["batch"] and b["k"] == 0)
    r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
    r["same_tokens_as_without"] = r["ids"] == base["ids"]
    r["ms_per_step"] = 1000 * r["seconds"] / r["steps"]
    r["step_cost_vs_none"] = r["ms_per_step"] / (1000 * base["seconds"] / base["steps"])
  return rows


def table(rows: list[dict]) -> str:
  lines = ["| batch | method | k | tok/s | speedup | steps | ms / step | step cost vs none | mean acceptance length "
           "| acceptance by position | same tokens |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    acc = " / ".join(f"{a:.2f}" for a in r.get("acceptance_rate", [])) or "-"
    mal = f"{r['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in r else "-"
    lines.append(f"| {r['batch']} | {r['method']} | {r['k']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                 f"{r['steps']} | {r['ms_per_step']:.1f} | {r['step_cost_vs_none']:.2f}x | {mal} | {acc} | "
                 f"{r['same_tokens_as_without']} |")
  return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--max-tokens", type=int, default=128)
  ap.add_argument("--ks", default="1,2,3")
  ap.add_argument("--batches", default="1,16")
  ap.add_argument("--methods", default="ngram,mtp")
  ap.add_argument("--max-batched-tokens", type=int, default=256, help="step bucket (fewer compiles when smaller)")
  ap.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
  env = environment(args.command)
  rows = []
  batches = [int(b) for b in args.batches.split(",")]
  methods = args.methods.split(",")
  load = [load_average()]
  configs = [None] + [{"method": m, "num_speculative_tokens": int(k)} for m in methods for k in args.ks.split(",")]
  for spec in configs:
    print(f"== {spec}", file=sys.stderr, flush=True)
    rows += run_config(args.dtype, spec, args.max_tokens, batches, args.max_batched_tokens)
    load.append(load_average())
  order = ["none"] + methods
  rows.sort(key=lambda r: (r["batch"], order.index(r["method"]), r["k"]))
  summarize(rows)
  print(f"\nDecode with speculation, default model, {args.dtype}, greedy, {args.max_tokens} tokens per prompt")
  print(table(rows))
  for r in rows:
    del r["ids"]
  print(f"load average (1, 5, 15 min) before and after each configuration: {load}")
  out = write_results("spec", dict(dtype=args.dtype, max_tokens=args.max_tokens, rows=rows,
                                   load_average=load), args.out, env=env)
  print(f"wrote {out}")
  return 0
