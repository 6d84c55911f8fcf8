"""Where a decode step's device time goes, per XLA operation kind, from a jax.profiler trace.

  jaxinfer bench trace [--quantization int4] [--kv-cache-dtype int8] [--dtype bfloat16]
                       [--steps 40] [--batch 1] [--prompt-len N] [--out FILE.json]

Runs the default model on --batch copies of one short prompt (or, with --prompt-len, of N
random token ids: a long context; the second run's prefill is then served by the prefix
cache but its last page) (greedy, EOS ignored), warms it up, then traces --steps decode steps (and the one prefill step before them) with jax.profiler and sums the XLA CPU runtime's
per-operation events by kind (the HLO instruction name without its number:
`ffi_call` = the cpu_kernels matmuls and, on one CPU device, decode attention
(cpu_kernels.decode_attention); `while` = XLA's attention loops
(prefill blocks, and decode where the kernel does not apply) with everything inside
them; `*_fusion` = XLA's fused element-wise work). Only
top-level operations count (an operation inside a while loop is part of the
loop's time), so the kinds add up to the device time of a step. Times are
under the profiler, which adds a little per operation: read them as shares.

Prints a table (ms per step, operations per step) and writes
benchmarks/results/trace-step-<format>-<date>.json (with the commit and CPU).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

from jaxinfer.bench.harness import environment, write_results


def top_level_ops(events: list[dict]) -> list[dict]:
  """XLA operation events not nested in another operation on the same thread."""
  ops = [e for e in events if e.get("ph") == "X" and re.fullmatch(r"[\w.-]+", e.get("name", ""))
         and not e["name"].startswith("$")]
  out, end = [], collections.defaultdict(float)  # per thread: where the enclosing operation ends
  for e in sorted(ops, key=lambda e: (e["tid"], e["ts"], -e.get("dur", 0))):
    if e["ts"] >= end[e["tid"]]:
      out.append(e)
      end[e["tid"]] = e["ts"] + e.get("dur", 0)
  return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("--quantization", choices=["int8", "fp8", "int4"], default=None)
  ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8", "fp8"])
  ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  ap.add_argument("--steps", type=int, default=40)
  ap.add_argument("--batch", type=int, default=1, help="sequences decoded together")
  ap.add_argument("--prompt-len", type=int, default=None, help="random prompt ids of this length (default: a short text)")
  ap.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
  env = environment(args.command)
  import jax
  from jaxinfer import LLM, SamplingParams
  llm = LLM(None, dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
            max_num_seqs=args.batch, max_num_batched_tokens=256,
            max_model_len=max(4096, (args.prompt_len or 0) + args.steps + 1))
  sp = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
  prompt = llm.tokenizer.encode("The capital of France is")
  if args.prompt_len:
    import numpy as np
    prompt = np.random.default_rng(0).integers(0, llm.config.vocab_size, args.prompt_len).tolist()
  prompts = [prompt] * args.batch
  llm.generate(prompts, sp)  # compiles the programs this decode runs
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d, create_perfetto_trace=True)
    llm.generate(prompts, sp)
    jax.profiler.stop_trace()
    trace = json.load(gzip.open(sorted(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True))[-1]))
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  ms, count = collections.Counter(), collections.Counter()
  for e in top_level_ops(events):
    kind = re.sub(r"\.\d+$", "", e["name"])
    ms[kind] += e.get("dur", 0) / 1000 / args.steps
    count[kind] += 1
  total = sum(ms.values())
  rows = [{"kind": k, "ms_per_step": round(v, 3), "share": round(v / total, 3),
           "ops_per_step": round(count[k] / args.steps, 1)} for k, v in ms.most_common()]
  fmt = args.quantization or args.dtype
  kv = llm.engine.kv_cache_dtype
  print(f"device time per decode step ({fmt}, KV cache {kv}, batch {args.batch}, prompt "
        f"{args.prompt_len or len(prompt)}, {args.steps} steps): {total:.2f} ms")
  print("| kind | ms / step | share | ops / step |\n|---|---:|---:|---:|")
  for r in rows[:15]:
    print(f"| {r['kind']} | {r['ms_per_step']:.3f} | {r['share']:.1%} | {r['ops_per_step']:g} |")
  out = write_results(f"trace-step-{fmt}", dict(format=fmt, kv_cache_dtype=kv, batch=args.batch,
                                                prompt_len=args.prompt_len or len(prompt), steps=args.steps,
                                                jax=jax.__version__,
                                                device_ms_per_step=round(total, 3), kinds=rows), args.out, env=env)
  print(f"wrote {out}")
  return 0
