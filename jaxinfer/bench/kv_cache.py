"""Decode speed and pool capacity of each KV cache dtype on the default model, side by side.

Per kv_cache_dtype (auto = the model's float32, int8, fp8), in one process each: S sequences of
L random prompt tokens are prefilled, then N decode steps are timed (tokens/s of the decode
alone, prefill excluded). Long contexts are where the cache's bytes matter: at L = 2048 a
float32 SmolLM2 sequence holds 94 MB of KV, read whole every decode step, against 540 MB of
weights read once per step for the whole batch. Also reported: bytes per token and how many
tokens the same --kv-cache-gb budget holds (the pool itself is capped at what --seqs sequences
need, so its size is the same in every row).

  jaxinfer bench kv-cache                          # S=8, L=2048, N=32
  jaxinfer bench kv-cache --seqs 1 --prompt-len 512
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

from jaxinfer.bench.harness import environment, load_average, subcommand_argv, write_results

DTYPES = ("auto", "int8", "fp8")


def worker(spec: dict) -> dict:
  import numpy as np

  from jaxinfer import LLM, SamplingParams
  S, L, N = spec["seqs"], spec["prompt_len"], spec["new_tokens"]
  llm = LLM(None, kv_cache_dtype=spec["kv_cache_dtype"], max_num_seqs=S, max_model_len=L + N + 16,
            max_num_batched_tokens=512, kv_cache_bytes=int(spec["kv_cache_gb"] * 2**30))
  engine = llm.engine
  rng = np.random.default_rng(0)
  sp = SamplingParams(temperature=0, max_tokens=N + 1, ignore_eos=True)
  for i in range(S):
    engine.add_request(f"r{i}", rng.integers(100, 40000, L).tolist(), sp)
  t0 = time.perf_counter()
  while any(r.num_uncomputed > 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
    engine.step()
  prefill_s = time.perf_counter() - t0
  steps, t0 = 0, time.perf_counter()
  while engine.has_unfinished():
    engine.step()
    steps += 1
  decode_s = time.perf_counter() - t0
  spec_ = engine.runner.cache_spec
  tokens = (engine.kv.num_pages - engine.kv.num_shards) * engine.engine_config.page_size
  return dict(kv_cache_dtype=engine.kv_cache_dtype, seqs=S, prompt_len=L, new_tokens=N,
              prefill_s=prefill_s, decode_steps=steps, decode_s=decode_s,
              decode_tokens_per_s=S * N / decode_s, step_ms=1000 * decode_s / max(steps, 1),
              bytes_per_token=spec_.bytes_per_token(), pool_mb=engine.kv_cache_bytes / 2**20,
              pool_tokens=tokens, budget_tokens=int(spec["kv_cache_gb"] * 2**30) // spec_.bytes_per_token(),
              kv_mb_read_per_step=S * (L + N / 2) * spec_.bytes_per_token() / 2**20)


def add_arguments(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  ap.add_argument("--dtypes", default=",".join(DTYPES))
  ap.add_argument("--seqs", type=int, default=8)
  ap.add_argument("--prompt-len", type=int, default=2048)
  ap.add_argument("--new-tokens", type=int, default=32)
  ap.add_argument("--kv-cache-gb", type=float, default=2.0)
  ap.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
  if args.worker:
    print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
    return 0
  env = environment(args.command)
  load_before = load_average()
  rows = []
  for kv in args.dtypes.split(","):
    spec = dict(kv_cache_dtype=kv, seqs=args.seqs, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                kv_cache_gb=args.kv_cache_gb)
    proc = subprocess.run([*subcommand_argv("kv-cache"), "--worker", json.dumps(spec)], capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode or not lines:
      raise SystemExit(f"{kv} worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows.append(json.loads(lines[-1][len("RESULT "):]))
    print(f"{kv}: {rows[-1]['decode_tokens_per_s']:.1f} decode tok/s", flush=True)
  base = rows[0]["decode_tokens_per_s"]
  print(f"\n{args.seqs} sequences x {args.prompt_len} prompt tokens, {args.new_tokens} decode steps timed; "
        f"pool budget {args.kv_cache_gb} GiB")
  print("| KV cache | bytes / token | KV MB read / step | step ms | decode tok/s | vs first row | "
        "tokens the budget holds |")
  print("|---|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    budget = int(args.kv_cache_gb * 2**30) // r["bytes_per_token"]
    print(f"| {r['kv_cache_dtype']} | {r['bytes_per_token']} | {r['kv_mb_read_per_step']:.0f} | {r['step_ms']:.1f} | "
          f"{r['decode_tokens_per_s']:.1f} | {r['decode_tokens_per_s'] / base:.2f}x | {budget} |")
  load_after = load_average()
  print(f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
  path = write_results("kv-cache", dict(rows=rows, load_average_before=load_before,
                                        load_average_after=load_after), args.out, env=env)
  print(f"wrote {path}")
  return 0
