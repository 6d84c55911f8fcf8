"""KV-aware routing vs round-robin vs disaggregated prefill/decode, through
`jaxinfer route`, on a multi-turn shared-prefix workload.

Setups (--policies), each with a `jaxinfer route` of its own in front:
  kv, round_robin: two `jaxinfer serve` workers (--role both), that policy;
  disagg: one `serve --role prefill` and one `serve --role decode` worker
          (`route --prefill-workers P --decode-workers D`): the same two
          processes' worth of engines, split by phase instead of by request.
Every worker runs in its own process, all of them for the whole invocation
(an idle one only holds memory). The workload: --systems
system prompts of --system-len tokens, --conversations conversations each
with one of them, --turns turns each. Turn k's prompt is the system prompt,
then every earlier user message and answer, then a new user message of
--user-len tokens; answers are --output-len tokens (EOS ignored), so a
conversation's prompts grow and each one starts with the previous one plus
its answer. --concurrency conversations run at once, their turns in order.

A worker reuses the KV of a prompt prefix only if it computed it: the KV
policy sends a turn where its conversation (or at least its system prompt)
already is; round-robin spreads turns evenly and mostly recomputes. Both
policies run in one invocation against the same two workers, in ABBA order
(--rounds times each, so neither always goes first on a machine whose load
drifts); every run gets its own random prompts (the same shapes), so no run
reuses another's cache. A policy's numbers pool its runs' requests.

Measured on the client: TTFT p50 / p99 (send to first token), output
tokens/s and requests/s over the run, and the fraction of prompt tokens the
workers served from their prefix caches (usage.cached_tokens). Disaggregated,
that is the decode worker's own cache (it keeps imported pages, and asks the
prefill worker only for the pages after its hits); the prefill worker's,
which decides how much prompt is computed, is `prefill_cached_fraction`
(usage.prefill_cached_tokens).

What 2 shared CPU cores can show: whether the disaggregated path costs or
saves time end to end on this workload (the KV transfer over loopback gRPC,
the extra hop, one engine doing all prompts and one all decode steps).
What they cannot: the point of disaggregation on accelerators, where prefill
and decode run on separate devices and stop interfering; here the four
processes share two cores, so the prefill worker's compute still slows the
decode worker's steps, and the other engineer's jobs on the same machine
add noise.

  jaxinfer bench router                                    # embedded default model
  jaxinfer bench router --model tests/data/tiny/llama3 --system-len 96 --user-len 16
  jaxinfer bench router --policies kv,disagg --rounds 1     # the disaggregated column vs kv

Writes benchmarks/results/router-<date>.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time

import numpy as np

from jaxinfer.bench.harness import ROOT, UsageError, environment, write_results
from jaxinfer.serving.process import JaxinferProcess

SETUPS = {
    "kv": "2 x serve --role both; route --workers --policy kv",
    "round_robin": "2 x serve --role both; route --workers --policy round_robin",
    "disagg": "serve --role prefill + serve --role decode; route --prefill-workers --decode-workers (kv policy)",
}


def spawn(args: list[str]) -> JaxinferProcess:
  """`jaxinfer <command>` on a free port, in its own process (call .wait() for SERVING)."""
  return JaxinferProcess(*args, "--port", "0", cwd=ROOT)


def workload(args, vocab: int, seed: int) -> list[tuple[list[int], list[list[int]]]]:
  """Per conversation: (its system prompt, its user messages), random ids away
  from the special tokens at the bottom of most vocabularies."""
  rng = np.random.default_rng(seed)
  lo = min(100, vocab // 4)
  systems = [rng.integers(lo, vocab, args.system_len).tolist() for _ in range(args.systems)]
  return [(systems[c % args.systems], [rng.integers(lo, vocab, args.user_len).tolist() for _ in range(args.turns)])
          for c in range(args.conversations)]


async def run_policy(address: str, conversations, args) -> tuple[list[dict], float]:
  """Per-request records and the run's wall time."""
  from jaxinfer.serving import Client

  results = []

  async def turn(client, prompt: list[int]) -> list[int]:
    sent = time.perf_counter()
    first, ids, usage = None, [], None
    async for r in client.astream(prompt, temperature=0, max_tokens=args.output_len, ignore_eos=True):
      if r.token_ids and first is None:
        first = time.perf_counter()
      ids += r.token_ids
      if r.finish_reason:
        usage = r.usage
    results.append(dict(ttft=first - sent, done=time.perf_counter(), prompt_tokens=usage.prompt_tokens,
                        cached_tokens=usage.cached_tokens, prefill_cached_tokens=usage.prefill_cached_tokens,
                        output_tokens=len(ids)))
    return ids

  async def conversation(client, system, users, gate):
    async with gate:
      history = list(system)
      for user in users:
        history += user
        history += await turn(client, history)

  async with Client(address, timeout=600) as client:
    # Untimed: the first requests through a fresh router open its channels to the workers.
    rng = np.random.default_rng(12345)
    await asyncio.gather(*(client.agenerate(rng.integers(100, 200, 8).tolist(), max_tokens=2)
                           for _ in range(4)))
    gate = asyncio.Semaphore(args.concurrency)
    start = time.perf_counter()
    await asyncio.gather(*(conversation(client, s, u, gate) for s, u in conversations))
    seconds = time.perf_counter() - start
  return results, seconds


def router_stats(router: JaxinferProcess) -> dict:
  """The router's own view: mean decision time, predicted vs reported cached tokens."""
  import urllib.request
  text = urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/metrics", timeout=10).read().decode()

  def total(name):
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))
  return dict(decision_mean_us=total("jaxinfer_router_decision_seconds_sum")
              / max(total("jaxinfer_router_decision_seconds_count"), 1) * 1e6,
              predicted_cached_tokens=total("jaxinfer_router_predicted_cached_tokens_total"),
              actual_cached_tokens=total("jaxinfer_router_actual_cached_tokens_total"))


def summarize(results: list[dict], seconds: float) -> dict:
  ttft = np.array([r["ttft"] for r in results])
  prompt = sum(r["prompt_tokens"] for r in results)
  return dict(requests=len(results), seconds=seconds,
              ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p99_s=float(np.percentile(ttft, 99)),
              ttft_mean_s=float(ttft.mean()),
              output_tokens_per_s=sum(r["output_tokens"] for r in results) / seconds,
              requests_per_s=len(results) / seconds, prompt_tokens=prompt,
              cached_tokens=sum(r["cached_tokens"] for r in results),
              cached_fraction=sum(r["cached_tokens"] for r in results) / prompt,
              prefill_cached_fraction=sum(r["prefill_cached_tokens"] for r in results) / prompt)


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default=None, help="HF dir / .gguf / checkpoint (default: the embedded model)")
  p.add_argument("--systems", type=int, default=4, help="distinct system prompts")
  p.add_argument("--system-len", type=int, default=128, help="tokens per system prompt")
  p.add_argument("--conversations", type=int, default=12)
  p.add_argument("--turns", type=int, default=5)
  p.add_argument("--user-len", type=int, default=64, help="tokens per user message")
  p.add_argument("--output-len", type=int, default=32, help="tokens per answer (EOS ignored)")
  p.add_argument("--concurrency", type=int, default=5,
                  help="conversations in flight (not a multiple of 2, so round-robin does not keep "
                       "a conversation on one worker by accident)")
  p.add_argument("--policies", default="kv,round_robin,disagg",
                 help="setups to compare: kv, round_robin (2 --role both workers), disagg (1 prefill + "
                      "1 decode worker, kv policy over the prefill worker)")
  p.add_argument("--rounds", type=int, default=1, help="ABBA rounds: each policy runs 2 x rounds times")
  p.add_argument("--overlap-weight", type=float, default=1.0,
                 help="the kv policy's cost of an uncached prompt block (jaxinfer route --overlap-weight)")
  p.add_argument("--max-num-seqs", type=int, default=16)
  p.add_argument("--max-num-batched-tokens", type=int, default=256)
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None)



def run(args: argparse.Namespace) -> int:
  from jaxinfer.frontend import Frontend

  vocab = Frontend.load(args.model).config.vocab_size
  model = ["--model", str(args.model)] if args.model else []
  engine = [*model, "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
            str(args.max_num_batched_tokens), "--page-size", str(args.page_size)]
  cores = os.cpu_count()
  policies = args.policies.split(",")
  for policy in policies:
    if policy not in SETUPS:
      raise UsageError(f"--policies: {policy!r} is not one of {sorted(SETUPS)}")
  env = environment(args.command)
  print(f"bench router: 2 workers per setup + router + client on {cores} CPU cores"
        f"{' (shared)' if cores <= 4 else ''}; on so few cores the workers compete with each other and the "
        "client, so the absolute numbers are small and noisy: compare the setups, not the machine",
        file=sys.stderr, flush=True)
  aggregated = [spawn(["serve", *engine]) for _ in range(2)] if set(policies) - {"disagg"} else []
  prefill = spawn(["serve", *engine, "--role", "prefill"]) if "disagg" in policies else None
  decode = None
  order = (policies + policies[::-1]) * args.rounds
  runs: dict[str, list[dict]] = {p: [] for p in policies}
  seconds: dict[str, float] = {p: 0.0 for p in policies}
  per_run = []
  try:
    for w in aggregated:
      w.wait()
    if prefill is not None:  # the decode worker needs the prefill worker's port
      decode = spawn(["serve", *engine, "--role", "decode", "--prefill-workers", prefill.wait().address]).wait()
    for i, policy in enumerate(order):
      if policy == "disagg":
        where = ["--prefill-workers", prefill.address, "--decode-workers", decode.address, "--policy", "kv"]
      else:
        where = ["--workers", ",".join(w.address for w in aggregated), "--policy", policy]
      router = spawn(["route", *model, *where, "--metrics-port", "0",
                     "--overlap-weight", str(args.overlap_weight)]).wait()
      try:
        records, s = asyncio.run(run_policy(router.address, workload(args, vocab, args.seed + 1 + i), args))
        stats = router_stats(router)
      finally:
        router.stop()
      runs[policy] += records
      seconds[policy] += s
      per_run.append(dict(policy=policy, **summarize(records, s), router=stats))
      print(f"bench router: run {i + 1}/{len(order)} {policy}: {per_run[-1]}", file=sys.stderr, flush=True)
  finally:
    for w in [*aggregated, decode, prefill]:
      if w is not None:
        w.stop()
  results = {p: summarize(runs[p], seconds[p]) for p in policies}

  rows = [("setup", "TTFT p50 ms", "TTFT p99 ms", "out tok/s", "req/s", "prefix-cached", "prefill-cached")]
  for policy, r in results.items():
    rows.append((policy, f"{r['ttft_p50_s'] * 1e3:.0f}", f"{r['ttft_p99_s'] * 1e3:.0f}",
                 f"{r['output_tokens_per_s']:.1f}", f"{r['requests_per_s']:.2f}", f"{r['cached_fraction']:.0%}",
                 f"{r['prefill_cached_fraction']:.0%}" if policy == "disagg" else "-"))
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  for row in rows:
    print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
  print(f"(2 workers per setup, {cores} CPU cores shared by every process, router and client; disagg = "
        "1 prefill + 1 decode worker, prefix-cached = the decode worker's own cache there)")
  path = write_results("router", dict(
      workload=dict(systems=args.systems, system_len=args.system_len, conversations=args.conversations,
                    turns=args.turns, user_len=args.user_len, output_len=args.output_len,
                    concurrency=args.concurrency),
      overlap_weight=args.overlap_weight, engine=dict(model=args.model or "default", max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size),
      workers=2, setups={p: SETUPS[p] for p in policies}, cpu_cores=cores, order=order, results=results,
      runs=per_run), args.out, env=env)
  print(f"wrote {path}")
  return 0
