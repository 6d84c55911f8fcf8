#!/usr/bin/env python
"""Attention data parallelism: per-rank tokens per step, with and without balancing.

No model runs: the engine's real Scheduler and KVManager (a pool split into
--ranks data shards) schedule a seeded trace, and each step does what
LLMEngine does with its output (the scheduled tokens count as computed; a
request caught up with its tokens samples one; computed blocks go into the
prefix cache; a request with max_tokens outputs finishes). Under attention
DP the ranks run each step in lockstep, each padded to the busiest rank's
tokens, so a step costs --ranks x its busiest rank's tokens: the figure
of merit is the per-step imbalance, max / mean scheduled tokens over the
ranks (1.0: no rank waits for another).

Policies, on the same trace:

  least_loaded  the rule before balancing: the longest prefix hit first, then
                the fewest running tokens (KVManager.rank_shards); one token
                budget for the whole step, taken by requests oldest first
  split         least_loaded's assignment, the step budget split per rank
  balanced      the lowest predicted load (scheduler.rank_by_load, prefix hits
                subtracted) and the budget split per rank
                (scheduler.split_budget); the hold off
  held          the scheduler as it is: balanced, and the hold on
                (DPBalanceConfig, --timeout): each rank's prefill cut to the
                level the least busy rank runs (or the busiest decode rows),
                for at most --timeout steps a request

Trace: --requests requests, prompt lengths log-uniform in [16, 2048]
tokens; a --shared-fraction of them start with one of --prefixes shared
prefixes (64-512 tokens, so prefix hits count); outputs uniform in [16,
256] tokens. Arrivals are Poisson over steps at --loads times the rate the
step budget can serve (prompt + output tokens per request, on average):
above 1 a queue builds up (an offline batch, a saturated server), below 1
the ranks idle between arrivals. Per step, max / mean scheduled tokens over
the ranks, in three windows: `saturated` (steps after which a request still
waits: there was work for every rank, so how evenly it went is the
scheduler's doing), `arrivals` (every step up to the last arrival, idle ones
excluded) and `all` (to the end: the drain too, where the last long prompt
sets the pace, whoever got it). Each window gives the mean, p50 and p95 of
the per-step ratio and the step-weighted figure sum(max) / sum(mean), the
padded work over the useful work (what lockstep ranks cost).

What balance costs, per policy: the steps to drain the trace, the padded work
(ranks x the busiest rank's tokens, summed over steps), the useful tokens
(fewer where prefix hits saved some), and each request's time to first token:
in steps (its arrival step and the step that samples it both count) and in
busiest-rank tokens over those steps (the lockstep time if a step took time
in proportion to its busiest rank: a held step is a cheap one). Steps are the
clock: arrivals come per step whatever a step costs, so the sim shows what a
hold does to the schedule, not to seconds.

  jaxinfer bench adp-sim                    # 4 ranks, 600 requests, loads 1.2, 1.0, 0.9
  jaxinfer bench adp-sim --policies balanced,held --timeout 8
  jaxinfer bench adp-sim --ranks 8 --requests 2000 --loads 1.5 --out /tmp/adp.json

Writes benchmarks/results/adp-sim-<date>.json (or --out; commit, CPU, command,
load average) and a PNG beside it: per-rank tokens over steps, per policy, at
the lowest load (where the ranks idle most between arrivals).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

from jaxinfer.engine.kv_manager import KVManager
from jaxinfer.engine.scheduler import DPBalanceConfig, Request, Scheduler, StepBudget, imbalance
from jaxinfer.sampling import SamplingParams
from jaxinfer.bench.harness import UsageError

POLICIES = ("least_loaded", "split", "balanced", "held")
MIN_PROMPT, MAX_PROMPT = 16, 2048


class SharedBudget(StepBudget):
  """One token budget for every rank (the rule before balancing)."""

  def of(self, rank: int) -> int:
    return self.left[0]

  def take(self, rank: int, n: int) -> None:
    self.left[0] -= n


class LeastLoadedScheduler(Scheduler):
  """The assignment before balancing: the longest prefix hit, then the fewest running
  tokens (prompt + output so far) on the rank; `split` keeps the per-rank budgets."""

  def __init__(self, *args, split: bool, **kwargs):
    super().__init__(*args, **kwargs)
    self.split = split

  def shard_loads(self) -> list[int]:
    loads = [0] * self.kv.num_shards
    for req in self.running + list(self.waiting_for_kv.values()):
      loads[self.kv.request_shard(req.request_id)] += len(req.token_ids)
    return loads

  def rank_shards(self, req: Request, use_cache: bool) -> list[int]:
    return self.kv.rank_shards(req.token_ids, self.shard_loads(), use_cache)

  def step_budget(self) -> StepBudget:
    return super().step_budget() if self.split else SharedBudget([self.max_num_batched_tokens])


def make_trace(args, load: float) -> list[tuple[int, list[int], int]]:
  """[(arrival step, prompt ids, max_tokens)], arrival order; the same for every policy."""
  rng = np.random.default_rng(args.seed)
  prefixes = [rng.integers(1, 30000, int(rng.integers(64, 513))).tolist() for _ in range(args.prefixes)]
  lengths = np.exp(rng.uniform(np.log(MIN_PROMPT), np.log(MAX_PROMPT + 1), args.requests)).astype(int)
  lengths = np.clip(lengths, MIN_PROMPT, MAX_PROMPT)
  outputs = rng.integers(16, 257, args.requests)
  shared = rng.random(args.requests) < args.shared_fraction
  which = rng.integers(0, args.prefixes, args.requests)
  # Poisson arrivals at `load` x the step budget's rate in requests per step.
  per_request = float(lengths.mean() + outputs.mean())
  rate = load * args.budget / per_request
  arrivals = np.floor(np.cumsum(rng.exponential(1 / rate, args.requests))).astype(int)
  trace = []
  for i in range(args.requests):
    n = int(lengths[i])
    head = prefixes[which[i]][:n - 1] if shared[i] else []
    prompt = head + rng.integers(1, 30000, n - len(head)).tolist()
    trace.append((int(arrivals[i]), prompt, int(outputs[i])))
  return trace


def simulate(args, policy: str, trace) -> dict[str, Any]:
  """Runs the trace to the end; per-step tokens per rank and whether the step was busy."""
  kv = KVManager(args.pages_per_rank * args.ranks, args.page_size, True, num_shards=args.ranks)
  off = DPBalanceConfig(hold_prefill=False)
  if policy in ("balanced", "held"):
    held = DPBalanceConfig(timeout=args.timeout)
    s = Scheduler(kv, args.max_num_seqs, args.budget, dp_balance=held if policy == "held" else off)
  else:
    s = LeastLoadedScheduler(kv, args.max_num_seqs, args.budget, split=policy == "split", dp_balance=off)
  pending = list(reversed(trace))
  steps, saturated, first_tokens, reqs, arrivals = [], [], [], [], {}
  step = 0
  while pending or s.has_unfinished():
    while pending and pending[-1][0] <= step:
      arrival, prompt, max_tokens = pending.pop()
      req = Request(f"r{len(trace) - len(pending) - 1}", prompt,
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=0)
      reqs.append(req)
      arrivals[req.request_id] = arrival
      s.add(req)
    out = s.schedule()
    first_tokens += [(arrivals[req.request_id], step) for (req, _), sampled in zip(out.scheduled, out.samples)
                     if sampled and not req.output_token_ids]
    # Saturated: a request still waits after this step's admission, so there was work
    # to give every rank (whether the ranks got it is the scheduler's doing).
    saturated.append(bool(s.waiting))
    # The step's sampled tokens, settled as the engine settles them (update_from_output).
    ids = np.array([[1 + len(req.token_ids) % 30000] for req, _ in out.scheduled], np.int32).reshape(-1, 1)
    s.update_from_output(out, ids, np.array(out.samples, np.int32))
    for (req, _), sampled, row in zip(out.scheduled, out.samples, ids):
      if sampled:
        req.token_ids.append(int(row[0]))
      if len(req.output_token_ids) >= req.params.max_tokens:
        s.finish(req, "length")
    steps.append(list(s.rank_tokens))
    step += 1
    if step > 100 * len(trace) + 10_000:
      raise RuntimeError(f"{policy}: the trace did not finish in {step} steps")
  return {"tokens": steps, "saturated": saturated, "preemptions": s.num_preemptions,
          "first_tokens": first_tokens, "max_held_steps": max(r.num_held_steps for r in reqs)}


def summarize(tokens: list[list[int]], saturated: list[bool], last_arrival: int,
              first_tokens: list[tuple[int, int]] = ()) -> dict[str, Any]:
  """Per-step max / mean over ranks in the three windows of the module doc; the cost: steps,
  padded work and, from each request's (arrival step, first-token step), its time to first
  token in steps and in busiest-rank tokens."""
  def stats(rows):
    rows = [r for r in rows if sum(r)]
    if not rows:
      return {"steps": 0}
    ratios = np.array([imbalance(r) for r in rows])
    arr = np.array(rows)
    return {"steps": len(rows), "mean": round(float(ratios.mean()), 4),
            "p50": round(float(np.percentile(ratios, 50)), 4), "p95": round(float(np.percentile(ratios, 95)), 4),
            "step_weighted": round(float(arr.max(axis=1).sum() / arr.mean(axis=1).sum()), 4)}
  return {"saturated": stats([t for t, b in zip(tokens, saturated) if b]),
          "arrivals": stats(tokens[:last_arrival + 1]), "all": stats(tokens),
          "total_steps": len(tokens), "tokens": int(np.sum(tokens)),
          # What lockstep ranks compute, padding included: ranks x the busiest rank, summed over steps.
          "padded_tokens": int(len(tokens[0]) * sum(max(t) for t in tokens)),
          **ttft(tokens, first_tokens)}


def ttft(tokens: list[list[int]], first_tokens: list[tuple[int, int]]) -> dict[str, Any]:
  """Time to first token, p50 / p99 / max over requests: in steps (the arrival step and the
  sampling step both count) and in busiest-rank tokens over those steps (the lockstep time if
  a step took time in proportion to its busiest rank's tokens: a held step is cheaper)."""
  if not first_tokens:
    return {}
  busiest = np.concatenate([[0], np.cumsum([max(t) for t in tokens])])
  steps = np.array([last - first + 1 for first, last in first_tokens])
  work = np.array([busiest[last + 1] - busiest[first] for first, last in first_tokens])
  pct = lambda a: {"p50": round(float(np.percentile(a, 50)), 2), "p99": round(float(np.percentile(a, 99)), 2),
                   "max": int(a.max())}
  return {"ttft_steps": {**pct(steps), "mean": round(float(steps.mean()), 3)}, "ttft_busiest_tokens": pct(work)}


def plot(results: dict[str, dict], path: Path, ranks: int, load: float) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.9 * len(results)), sharex=True, sharey=True)
  for ax, (policy, r) in zip(np.atleast_1d(axes), results.items()):
    t = np.array(r["tokens"])
    for rank in range(ranks):
      ax.plot(t[:, rank], lw=0.6, label=f"rank {rank}")
    s = r["summary"]["arrivals"]
    t = r["summary"]["ttft_steps"]
    ax.set_title(f"{policy}: max/mean tokens over ranks up to the last arrival: mean {s['mean']:.3f}, "
                 f"step-weighted {s['step_weighted']:.3f}\n{r['summary']['total_steps']} steps, padded work "
                 f"{r['summary']['padded_tokens']:,} tokens, first token p50 {t['p50']:g} / p99 {t['p99']:g} steps",
                 fontsize=9)
    ax.set_ylabel("tokens / step")
  np.atleast_1d(axes)[0].legend(loc="upper right", fontsize=7, ncol=ranks)
  np.atleast_1d(axes)[-1].set_xlabel(f"step (arrivals at {load:g} x the budget's rate)")
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--ranks", type=int, default=4)
  p.add_argument("--requests", type=int, default=600)
  p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (all ranks together)")
  p.add_argument("--max-num-seqs", type=int, default=512)
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--pages-per-rank", type=int, default=4096)
  p.add_argument("--prefixes", type=int, default=8)
  p.add_argument("--shared-fraction", type=float, default=0.3)
  p.add_argument("--loads", default="1.2,1.0,0.9", help="arrival rates / the rate the budget serves")
  p.add_argument("--policies", default=",".join(POLICIES))
  p.add_argument("--timeout", type=int, default=DPBalanceConfig.timeout,
                 help="held: steps a request's prefill may be held back, in all (DPBalanceConfig.timeout)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None)
  p.add_argument("--no-plot", action="store_true")


def run(args: argparse.Namespace) -> int:
  policies = [x.strip() for x in args.policies.split(",") if x.strip()]
  for pol in policies:
    if pol not in POLICIES:
      raise UsageError(f"--policies: unknown policy {pol!r} (known: {', '.join(POLICIES)})")
  if args.ranks < 1 or args.requests < 1 or args.budget < args.ranks:
    raise UsageError("--ranks and --requests must be >= 1 and --budget >= --ranks")
  if args.timeout < 0:
    raise UsageError(f"--timeout must be >= 0 steps, got {args.timeout}")

  from jaxinfer.bench.harness import environment, write_results

  try:
    loads = [float(x) for x in args.loads.split(",")]
  except ValueError as e:
    raise UsageError(f"--loads: {e}")
  if min(loads) <= 0:
    raise UsageError("--loads must be > 0")

  env = environment(getattr(args, "command", None))  # (the load average before the run, too)
  runs, lowest = [], None
  for load in loads:
    trace = make_trace(args, load)
    results = {}
    for pol in policies:
      r = simulate(args, pol, trace)
      r["summary"] = summarize(r["tokens"], r["saturated"], trace[-1][0], r["first_tokens"])
      results[pol] = r
      s = r["summary"]
      line = " | ".join(f"{w} {s[w]['steps']:4d} steps mean {s[w]['mean']:.3f} p95 {s[w]['p95']:.3f} "
                        f"weighted {s[w]['step_weighted']:.3f}" for w in ("saturated", "arrivals", "all")
                        if s[w]["steps"])
      t = s["ttft_steps"]
      print(f"load {load:g} {pol:>12}: {line} | {s['total_steps']} steps, padded {s['padded_tokens']} "
            f"of {s['tokens']} tokens, ttft p50 {t['p50']:g} p99 {t['p99']:g} steps", file=sys.stderr)
    runs.append({"load": load, "last_arrival_step": trace[-1][0],
                 # The PNG has every step; the seeded script remakes them.
                 "policies": {pol: {"summary": r["summary"], "preemptions": r["preemptions"],
                                    "max_held_steps": r["max_held_steps"],
                                    "first_steps_rank_tokens": r["tokens"][:8]} for pol, r in results.items()}})
    if load == min(loads):
      lowest = results
  # One row per (load, policy): the figures docs/performance.md shows (at most 13 columns; the
  # runs keep every window's mean, p50 and p95).
  rows = [{"load": run["load"], "policy": pol, "saturated_max_over_mean": s["saturated"].get("mean"),
           "arrivals_max_over_mean": s["arrivals"]["mean"], "arrivals_step_weighted": s["arrivals"]["step_weighted"],
           "all_step_weighted": s["all"]["step_weighted"], "steps": s["total_steps"],
           "padded_tokens": s["padded_tokens"], "padded_over_useful_tokens": round(s["padded_tokens"] / s["tokens"], 4),
           "ttft_steps_p50": s["ttft_steps"]["p50"], "ttft_steps_p99": s["ttft_steps"]["p99"],
           "ttft_busiest_tokens_p50": s["ttft_busiest_tokens"]["p50"],
           "ttft_busiest_tokens_p99": s["ttft_busiest_tokens"]["p99"]}
          for run in runs for pol, r in run["policies"].items() for s in [r["summary"]]]
  payload = {"settings": {k: v for k, v in vars(args).items() if k not in ("out", "no_plot", "command")},
             "rows": rows, "runs": runs}
  path = write_results("adp-sim", payload, args.out, env=env)
  print(f"wrote {path}", file=sys.stderr)
  if not args.no_plot:
    png = path.with_suffix(".png")
    plot(lowest, png, args.ranks, min(loads))
    print(f"wrote {png}", file=sys.stderr)
  return 0
