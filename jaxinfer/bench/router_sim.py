"""The KV-aware router past one machine: its real index and cost function over simulated workers.

No model runs. A synthetic multi-turn chat trace with shared system prompts
is routed to W simulated workers by three policies, on the same trace:

  kv           jaxinfer.serving.kv_router.KVRouter (Dynamo's cost, temperature 0)
  round_robin  the next worker in turn
  random       a uniformly random worker

Each simulated worker keeps an LRU prefix cache of block hashes (the same
chained hashes as KVManager, `hash_blocks`) with --cache-blocks blocks and
publishes stored/removed events, numbered, which reach the router's index
--event-lag seconds later (so its predictions can be stale, as in a real
cluster). A request's time on its worker is its uncached prefill at
--prefill-rate tokens/s plus its output at --decode-rate tokens/s; workers
run any number of requests at once, so load shows up as active requests,
not queueing.

Trace: --system-prompts shared system prompts (200-1500 tokens, Zipf
popularity, a=1.1); conversations of 1-10 turns (mean ~3.3) pick one; a turn
adds a 16-256-token user message and a 32-512-token answer, and the next
turn (prompt = everything so far) arrives after a think time (mean 10 s).
Conversations start at a Poisson rate that keeps ~16 requests active per
worker.

Reported per (workers, policy): prefix hit rate (cached prompt tokens /
prompt tokens), the router's predicted hits against the workers' actual
ones, load imbalance (max / mean active requests over workers, sampled at
each arrival: mean and p99) and work imbalance (coefficient of variation of
tokens computed per worker), and the decision time per request: `select`
(index walk + cost + argmin) and, separately, hashing the prompt's blocks
(`hash_blocks`, measured on every 50th request). `select` is timed twice:
wall clock, and this thread's CPU time (what the call costs without
waiting for a core, which a shared machine inflates). A garbage collection
that starts inside `select` (an allocation there crossing the threshold the
simulation's own objects brought close) is counted, and the p99 is also
given without those calls, so a GC pause is not mistaken for the index's
cost. The load average is read before and after each run.

  jaxinfer bench router-sim                          # 8, 64, 512 workers x 1e5 requests
  jaxinfer bench router-sim --workers 64 --requests 1000000 --policies kv
  jaxinfer bench router-sim --workers 4 --requests 2000 --out /tmp/sim.json

Writes benchmarks/results/router-sim-<date>.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import collections
import gc
import heapq
import os
import sys
import time
from typing import Any

import numpy as np

from jaxinfer.bench.harness import UsageError, environment, write_results
from jaxinfer.engine.kv_manager import KVEvent, hash_blocks
from jaxinfer.serving.kv_router import KVRouter, RouterConfig

POLICIES = ("kv", "round_robin", "random")


class Worker:
  """An LRU prefix cache of block hashes that numbers its event batches."""

  def __init__(self, capacity: int):
    self.capacity = capacity
    self.cache: collections.OrderedDict[int, None] = collections.OrderedDict()
    self.seq = 0
    self.active = 0
    self.work_tokens = 0

  def cached_prefix(self, hashes: list[int]) -> int:
    n = 0
    for h in hashes:
      if h not in self.cache:
        break
      n += 1
    return n

  def store(self, hashes: list[int]) -> list[KVEvent]:
    """Touches (or inserts) the blocks, evicting least recently used ones; the events."""
    events = []
    cache = self.cache
    # Tail first, so the prefix is the most recent and outlives it (as in KVManager.free).
    for h in reversed(hashes):
      if h in cache:
        cache.move_to_end(h)
      else:
        cache[h] = None
        events.append(KVEvent("stored", h))
    while len(cache) > self.capacity:
      old, _ = cache.popitem(last=False)
      events.append(KVEvent("removed", old))
    return events


class Conversation:
  __slots__ = ("tokens", "hashes", "turns_left")

  def __init__(self, tokens: list[int], hashes: list[int], turns: int):
    self.tokens, self.hashes, self.turns_left = tokens, hashes, turns


def extend(conv: Conversation, new_tokens: list[int], block_size: int) -> None:
  """Appends tokens and the hashes of the blocks they complete (the chain continues)."""
  conv.tokens = conv.tokens + new_tokens
  done = len(conv.hashes) * block_size
  parent = conv.hashes[-1] if conv.hashes else None
  conv.hashes = conv.hashes + hash_blocks(conv.tokens[done:], block_size, parent)


def simulate(args, workers: int, policy: str) -> dict[str, Any]:
  rng = np.random.default_rng(args.seed)  # the same trace for every policy
  policy_rng = np.random.default_rng(args.seed + 1)
  bs = args.block_size
  systems = []
  for _ in range(args.system_prompts):
    toks = [int(t) for t in rng.integers(0, 50_000, int(rng.integers(200, 1501)))]
    systems.append((toks, hash_blocks(toks, bs)))
  popularity = 1.0 / np.arange(1, args.system_prompts + 1) ** 1.1
  popularity /= popularity.sum()

  pool = [Worker(args.cache_blocks) for _ in range(workers)]
  router = KVRouter(RouterConfig(block_size=bs), seed=args.seed) if policy == "kv" else None
  if router is not None:
    for w in range(workers):
      router.add_worker(str(w))

  mean_turns = 3.3
  mean_request_s = 272 / args.decode_rate + 500 / args.prefill_rate
  request_rate = args.active_per_worker * workers / mean_request_s
  conv_rate = request_rate / mean_turns

  heap: list[tuple] = []
  order = 0

  def push(t, kind, payload):
    nonlocal order
    order += 1
    heapq.heappush(heap, (t, order, kind, payload))

  def new_conversation(t):
    s = int(rng.choice(args.system_prompts, p=popularity))
    turns = min(10, int(rng.geometric(0.3)))  # 1, 2, ... with mean ~3.3
    conv = Conversation(list(systems[s][0]), list(systems[s][1]), turns)
    push(t, "turn", conv)

  t_next_conv = rng.exponential(1 / conv_rate)
  push(t_next_conv, "new", None)
  issued = 0
  rr = 0
  prompt_tokens = hit_tokens = predicted_tokens = 0
  select_ns: list[int] = []
  select_cpu_ns: list[int] = []  # this thread's CPU time: what the call costs, without waiting for a core
  hash_ns: list[int] = []
  imbalance: list[float] = []
  in_select = [False]
  gc_in_select: list[int] = []  # indices of the selects during which a collection ran

  def on_gc(phase, info):
    if phase == "start" and in_select[0]:
      gc_in_select.append(len(select_ns))

  gc.callbacks.append(on_gc)
  load_before = os.getloadavg()
  started = time.perf_counter()
  while heap and issued < args.requests:
    t, _, kind, payload = heapq.heappop(heap)
    if kind == "new":
      new_conversation(t)
      push(t + rng.exponential(1 / conv_rate), "new", None)
    elif kind == "turn":
      conv: Conversation = payload
      extend(conv, [int(x) for x in rng.integers(0, 50_000, int(rng.integers(16, 257)))], bs)
      out_len = int(rng.integers(32, 513))
      n_prompt = len(conv.tokens)
      lookup = conv.hashes[:(n_prompt - 1) // bs]  # one token is always computed
      if router is not None:
        in_select[0] = True
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        choice = router.select(lookup, num_blocks=-(-n_prompt // bs))
        select_ns.append(time.perf_counter_ns() - t0)
        select_cpu_ns.append(time.thread_time_ns() - c0)
        in_select[0] = False
        w = choice.slot
        predicted = choice.overlap_blocks
      else:
        t0 = time.perf_counter_ns()
        if policy == "round_robin":
          w, rr = rr, (rr + 1) % workers
        else:
          w = int(policy_rng.integers(0, workers))
        select_ns.append(time.perf_counter_ns() - t0)
        predicted = 0
      if issued % 50 == 0:
        t0 = time.perf_counter_ns()
        hash_blocks(conv.tokens, bs)
        hash_ns.append(time.perf_counter_ns() - t0)
      actives = np.fromiter((p.active for p in pool), np.int64, workers)
      if actives.sum():
        imbalance.append(actives.max() / actives.mean())
      worker = pool[w]
      hit = worker.cached_prefix(lookup) * bs
      prompt_tokens += n_prompt
      hit_tokens += hit
      predicted_tokens += predicted * bs
      worker.active += 1
      worker.work_tokens += n_prompt - hit + out_len
      events = worker.store(conv.hashes)
      duration = (n_prompt - hit) / args.prefill_rate + out_len / args.decode_rate
      blocks = -(-(n_prompt + out_len) // bs)
      if router is not None:
        router.started(str(w), blocks)
        worker.seq += 1
        push(t + args.event_lag, "events", (w, worker.seq, events))
      push(t + duration, "done", (w, conv, out_len, blocks))
      issued += 1
    elif kind == "events":
      w, seq, events = payload
      router.index.apply(str(w), seq, events)
    elif kind == "done":
      w, conv, out_len, blocks = payload
      worker = pool[w]
      worker.active -= 1
      extend(conv, [int(x) for x in rng.integers(0, 50_000, out_len)], bs)
      events = worker.store(conv.hashes)
      if router is not None:
        router.finished(str(w), blocks)
        worker.seq += 1
        push(t + args.event_lag, "events", (w, worker.seq, events))
      conv.turns_left -= 1
      if conv.turns_left > 0:
        push(t + rng.exponential(args.think_time), "turn", conv)
  wall = time.perf_counter() - started
  gc.callbacks.remove(on_gc)
  load_after = os.getloadavg()
  work = np.array([p.work_tokens for p in pool], np.float64)
  sel = np.array(select_ns) / 1e3
  cpu = np.array(select_cpu_ns) / 1e3
  hsh = np.array(hash_ns) / 1e3
  no_gc = np.delete(sel, np.unique(np.array(gc_in_select, np.intp)))
  return {
      "workers": workers, "policy": policy, "requests": issued, "sim_wall_s": round(wall, 1),
      "prefix_hit_rate": hit_tokens / prompt_tokens,
      "predicted_hit_rate": predicted_tokens / prompt_tokens if router is not None else None,
      "mean_prompt_tokens": prompt_tokens / issued,
      "load_imbalance_mean": float(np.mean(imbalance)), "load_imbalance_p99": float(np.percentile(imbalance, 99)),
      "work_cv": float(work.std() / work.mean()),
      "select_us_p50": float(np.percentile(sel, 50)), "select_us_p99": float(np.percentile(sel, 99)),
      "select_cpu_us_p50": float(np.percentile(cpu, 50)) if len(cpu) else None,
      "select_cpu_us_p99": float(np.percentile(cpu, 99)) if len(cpu) else None,
      "select_calls_with_gc": len(set(gc_in_select)),
      "select_us_p99_without_gc": float(np.percentile(no_gc, 99)) if len(no_gc) else None,
      "load_average_before": [round(x, 2) for x in load_before],
      "load_average_after": [round(x, 2) for x in load_after],
      "load_average_1m": round(load_after[0], 2),
      "hash_us_p50": float(np.percentile(hsh, 50)), "hash_us_p99": float(np.percentile(hsh, 99)),
  }


def print_table(rows: list[dict[str, Any]]) -> None:
  print("| workers | policy | requests | prefix hit rate | predicted | load max/mean (mean, p99) | "
        "work CV | select µs p50 / p99 (wall) | (CPU) | p99 w/o GC (calls with GC) | hash µs p50 / p99 | load 1m before/after |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    pred = "-" if r["predicted_hit_rate"] is None else f"{r['predicted_hit_rate']:.1%}"
    print(f"| {r['workers']} | {r['policy']} | {r['requests']} | {r['prefix_hit_rate']:.1%} | {pred} | "
          f"{r['load_imbalance_mean']:.2f}, {r['load_imbalance_p99']:.2f} | {r['work_cv']:.3f} | "
          f"{r['select_us_p50']:.1f} / {r['select_us_p99']:.1f} | "
          + ("-" if r["select_cpu_us_p50"] is None else
             f"{r['select_cpu_us_p50']:.1f} / {r['select_cpu_us_p99']:.1f}")
          + f" | {r['select_us_p99_without_gc']:.1f} ({r['select_calls_with_gc']})"
          + f" | {r['hash_us_p50']:.0f} / {r['hash_us_p99']:.0f}"
          + f" | {r['load_average_before'][0]:.2f} / {r['load_average_after'][0]:.2f} |")


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--workers", default="8,64,512", help="comma-separated worker counts")
  p.add_argument("--policies", default=",".join(POLICIES))
  p.add_argument("--requests", type=int, default=100_000)
  p.add_argument("--block-size", type=int, default=16)
  p.add_argument("--cache-blocks", type=int, default=4096, help="prefix cache per worker, in blocks")
  p.add_argument("--system-prompts", type=int, default=64)
  p.add_argument("--active-per-worker", type=float, default=16.0)
  p.add_argument("--prefill-rate", type=float, default=8000.0, help="tokens/s per worker")
  p.add_argument("--decode-rate", type=float, default=50.0, help="tokens/s per request")
  p.add_argument("--think-time", type=float, default=10.0, help="mean seconds between turns")
  p.add_argument("--event-lag", type=float, default=0.05, help="seconds before the router sees events")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
  policies = [x.strip() for x in args.policies.split(",") if x.strip()]
  for pol in policies:
    if pol not in POLICIES:
      raise UsageError(f"--policies: unknown policy {pol!r} (known: {', '.join(POLICIES)})")
  try:
    worker_counts = [int(w) for w in args.workers.split(",")]
  except ValueError as e:
    raise UsageError(f"--workers: {e}") from None
  if min(worker_counts) < 1 or args.requests < 1:
    raise UsageError("--workers and --requests must be >= 1")
  env = environment(args.command)

  rows = []
  for w in worker_counts:
    for pol in policies:
      print(f"simulating {w} workers, {pol}, {args.requests} requests", file=sys.stderr, flush=True)
      rows.append(simulate(args, w, pol))
  print_table(rows)
  path = write_results("router-sim", {"settings": {k: v for k, v in vars(args).items() if k not in ("out", "command")},
                                      "rows": rows}, args.out, env=env)
  print(f"wrote {path}", file=sys.stderr)
  return 0
