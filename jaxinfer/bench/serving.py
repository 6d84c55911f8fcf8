"""Load test of the gRPC server, and its overhead against the in-process engine.

One run, three phases, each system in its own fresh process, the same
prompts (token ids, EOS ignored so every request makes exactly
--output-len tokens):

  1. engine:     LLM.generate on every prompt at once, in a worker process
                 (no gRPC): generated tokens/s.
  2. saturation: `jaxinfer serve` with the same engine options; every
                 prompt sent at once as a stream: generated tokens/s.
                 overhead ratio = saturation / engine (target >= 0.9).
  3. load:       the same server under Poisson arrivals (--rate req/s;
                 default: half the request rate phase 2 reached) or a fixed
                 number of requests in flight (--concurrency), with new
                 synthetic prompts (phase 2's are in the prefix cache).

Per-request latencies are taken on the client: TTFT (send to first token),
TPOT = (latency - TTFT) / (output tokens - 1), ITL (gaps between streamed
messages, split evenly over the tokens a message carries); reported as
mean / p50 / p90 / p99, with request and token throughput. Warm-up and
start-up are excluded (the server is timed only once it reports SERVING).
On a small CPU machine the client shares the cores with the server, so the
ratio includes the client's own cost.

  jaxinfer bench serving                                # default model, 64 prompts
  jaxinfer bench serving --rate 2 --num-prompts 32      # Poisson arrivals
  jaxinfer bench serving --prompts-file prompts.jsonl   # {"prompt": "..."} per line
  jaxinfer bench serving --model tests/data/tiny/llama3 --input-len 32 --out /tmp/x.json

Writes benchmarks/results/serving-<date>.json (or --out) and prints tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from jaxinfer.bench.harness import ROOT, environment, results_path, subcommand_argv, write_results
from jaxinfer.serving.process import JaxinferProcess


# ---- workload ------------------------------------------------------------------------------


def load_prompts(args, seed: int) -> list[list[int]]:
  """Token ids: from --prompts-file (JSONL {"prompt": text} or plain lines) or synthetic."""
  from jaxinfer.checkpoint import load_model
  from jaxinfer.default_model import default_checkpoint

  loaded = load_model(args.model or default_checkpoint())  # for its tokenizer and vocab size
  tok, vocab = loaded.tokenizer, loaded.config.vocab_size
  del loaded
  if args.prompts_file:
    if tok is None:
      raise SystemExit(f"{args.model} has no tokenizer: --prompts-file needs one")
    prompts = []
    for line in Path(args.prompts_file).read_text().splitlines():
      if line.strip():
        text = json.loads(line)["prompt"] if line.lstrip().startswith("{") else line
        prompts.append(tok.encode(text))
    return prompts[:args.num_prompts]
  # Synthetic: random ids away from the special tokens at the bottom of most vocabularies.
  rng = np.random.default_rng(seed)
  lo = min(100, vocab // 4)
  return [rng.integers(lo, vocab, args.input_len).tolist() for _ in range(args.num_prompts)]


def engine_options(args) -> list[str]:
  opts = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
          str(args.max_num_batched_tokens), "--dtype", args.dtype]
  if args.model:
    opts = ["--model", str(args.model)] + opts
  opts.append("--async-scheduling" if args.async_scheduling else "--no-async-scheduling")
  return opts


# ---- phase 1: the engine in-process -------------------------------------------------------


def worker(args) -> None:
  """Runs in its own process: LLM.generate on every prompt, prints a JSON line."""
  from jaxinfer import LLM, SamplingParams

  prompts = json.loads(Path(args.worker).read_text())
  llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, async_scheduling=args.async_scheduling)
  sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
  t = time.perf_counter()
  outs = llm.generate(prompts, sp)
  seconds = time.perf_counter() - t
  tokens = sum(len(o.token_ids) for o in outs)
  print(json.dumps({"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds}))


def run_engine(args, prompts_path: Path) -> dict:
  cmd = [*subcommand_argv("serving"), "--worker", str(prompts_path), *engine_options(args),
         "--output-len", str(args.output_len)]
  out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
  if out.returncode != 0:
    raise SystemExit(f"engine worker failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


# ---- phases 2 and 3: the server ---------------------------------------------------------------


def start_server(options: list[str], max_waiting_requests: int = 256) -> JaxinferProcess:
  """`jaxinfer serve` with engine flags `options` on a free port, in its own process,
  returned once SERVING (warm-up excluded from every timing)."""
  return JaxinferProcess("serve", "--port", "0", *options, "--max-waiting-requests",
                         str(max_waiting_requests), "--max-waiting-tokens", str(10**9), cwd=ROOT).wait()


async def one_request(client, prompt, output_len) -> dict:
  sent = time.perf_counter()
  stamps, counts = [], []
  async for r in client.astream(prompt, temperature=0, max_tokens=output_len, ignore_eos=True):
    if r.token_ids:
      stamps.append(time.perf_counter())
      counts.append(len(r.token_ids))
  n = sum(counts)
  ttft = stamps[0] - sent
  latency = stamps[-1] - sent
  itl = []
  for i in range(1, len(stamps)):
    gap = (stamps[i] - stamps[i - 1]) / counts[i]
    itl += [gap] * counts[i]
  return {"ttft": ttft, "latency": latency, "tokens": n, "itl": itl,
          "tpot": (latency - ttft) / (n - 1) if n > 1 else None, "sent": sent, "done": stamps[-1]}


async def drive(port: int, prompts, output_len: int, *, rate: float | None, concurrency: int | None,
                seed: int) -> tuple[list[dict], float]:
  from jaxinfer.serving import Client

  async with Client(f"127.0.0.1:{port}") as client:
    start = time.perf_counter()
    if rate is not None:  # open loop: Poisson arrivals, whatever is in flight
      gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(prompts))
      tasks = []
      for p, gap in zip(prompts, gaps):
        await asyncio.sleep(gap)
        tasks.append(asyncio.ensure_future(one_request(client, p, output_len)))
      results = await asyncio.gather(*tasks)
    else:  # closed loop: `concurrency` requests in flight
      sem = asyncio.Semaphore(concurrency or len(prompts))

      async def bounded(p):
        async with sem:
          return await one_request(client, p, output_len)
      results = await asyncio.gather(*(bounded(p) for p in prompts))
    return list(results), time.perf_counter() - start


def summarize(results: list[dict], seconds: float) -> dict:
  def stats(xs):
    xs = np.asarray([x for x in xs if x is not None], float) * 1000.0
    if not xs.size:  # e.g. TPOT and ITL of one-token outputs
      return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"mean": float(xs.mean()), "p50": float(np.percentile(xs, 50)),
            "p90": float(np.percentile(xs, 90)), "p99": float(np.percentile(xs, 99))}
  tokens = sum(r["tokens"] for r in results)
  return {
      "requests": len(results), "seconds": seconds, "output_tokens": tokens,
      "request_throughput_per_s": len(results) / seconds, "tokens_per_s": tokens / seconds,
      "ttft_ms": stats([r["ttft"] for r in results]), "tpot_ms": stats([r["tpot"] for r in results]),
      "itl_ms": stats([x for r in results for x in r["itl"]]),
      "latency_ms": stats([r["latency"] for r in results]),
  }


def print_tables(report: dict) -> None:
  o = report["overhead"]
  print("\n| system | generated tok/s | seconds | ratio |\n|---|---:|---:|---:|")
  print(f"| engine in-process (LLM.generate) | {o['engine_tokens_per_s']:.1f} | {o['engine_seconds']:.1f} | 1.00 |")
  print(f"| gRPC server, all prompts at once | {o['server_tokens_per_s']:.1f} | {o['server_seconds']:.1f} "
        f"| {o['ratio']:.2f} |")
  for name in ("saturation", "load"):
    r = report.get(name)
    if not r:
      continue
    print(f"\n{name}: {r['requests']} requests in {r['seconds']:.1f} s, "
          f"{r['request_throughput_per_s']:.2f} req/s, {r['tokens_per_s']:.1f} tok/s")
    print("| ms | mean | p50 | p90 | p99 |\n|---|---:|---:|---:|---:|")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "latency_ms"):
      cells = " | ".join("-" if v is None else f"{v:.1f}" for v in r[key].values())
      print(f"| {key[:-3].upper()} | {cells} |")


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--num-prompts", type=int, default=64)
  p.add_argument("--input-len", type=int, default=128, help="synthetic prompt length (tokens)")
  p.add_argument("--output-len", type=int, default=64, help="generated tokens per request (EOS ignored)")
  p.add_argument("--prompts-file", default=None, help='JSONL with {"prompt": text} or plain text lines')
  load = p.add_mutually_exclusive_group()
  load.add_argument("--rate", type=float, default=None,
                    help="phase 3: Poisson arrivals, requests/s (default: half of phase 2's rate)")
  load.add_argument("--concurrency", type=int, default=None, help="phase 3: requests in flight")
  p.add_argument("--max-num-seqs", type=int, default=64)
  p.add_argument("--max-num-batched-tokens", type=int, default=512)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                 help="engine and server schedule one step ahead (the default; --no-async-scheduling: not)")
  p.add_argument("--no-load", action="store_true", help="skip phase 3")
  p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serving-<date>.json)")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
  if args.worker:
    worker(args)
    return 0
  env = environment(args.command)

  prompts = load_prompts(args, args.seed)
  # Phase 3 gets fresh prompts: the server's prefix cache still holds phase 2's.
  # (A prompts file is reused as is: expect prefix-cache hits there.)
  load_prompts_ = load_prompts(args, args.seed + 1)
  if not prompts:
    raise SystemExit("no prompts")
  out = results_path("serving", args.out)
  prompts_path = out.with_suffix(".prompts.tmp.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  prompts_path.write_text(json.dumps(prompts))
  try:
    print(f"phase 1/3: engine in-process, {len(prompts)} prompts x {args.output_len} tokens", file=sys.stderr)
    engine = run_engine(args, prompts_path)
  finally:
    prompts_path.unlink(missing_ok=True)
  print("phase 2/3: gRPC server at saturation (starting the server, warm-up excluded)", file=sys.stderr)
  server = start_server(engine_options(args), max(256, args.num_prompts))
  try:
    results, seconds = asyncio.run(drive(server.port, prompts, args.output_len, rate=None,
                                         concurrency=None, seed=args.seed))
    saturation = summarize(results, seconds)
    load = None
    if not args.no_load:
      rate = args.rate
      if rate is None and args.concurrency is None:
        rate = round(saturation["request_throughput_per_s"] / 2, 3)
      mode = f"Poisson {rate} req/s" if rate else f"concurrency {args.concurrency}"
      print(f"phase 3/3: load, {mode}", file=sys.stderr)
      results, seconds = asyncio.run(drive(server.port, load_prompts_, args.output_len, rate=rate,
                                           concurrency=args.concurrency, seed=args.seed))
      load = summarize(results, seconds) | {"mode": mode}
  finally:
    server.stop()
  report = {
      "workload": {"model": args.model or "default (SmolLM2-135M-Instruct)", "dtype": args.dtype,
                   "prompts": len(prompts), "mean_input_len": float(np.mean([len(x) for x in prompts])),
                   "output_len": args.output_len, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   "async_scheduling": args.async_scheduling},
      "overhead": {"engine_tokens_per_s": engine["tokens_per_s"], "engine_seconds": engine["seconds"],
                   "server_tokens_per_s": saturation["tokens_per_s"], "server_seconds": saturation["seconds"],
                   "ratio": saturation["tokens_per_s"] / engine["tokens_per_s"], "target": 0.9},
      "saturation": saturation, "load": load,
  }
  write_results("serving", report, out, env=env)
  print_tables(report)
  print(f"\nwrote {out}")
  return 0
