#!/usr/bin/env python
"""`sample()` alone, jitted, before and after top-k pre-selection, side by side.

  python scripts/bench_sampling.py [--batch 64] [--vocab 49152] [--iters 5] [--widths 64,128,256,512,1024]
                                   [--cases 'greedy,top_p=0.9,...'] [--out FILE]

"before" is the full-sort sampler, kept as `reference_sample` in
tests/test_sampling.py (the exactness tests compare against it); "after" is
jaxinfer.sampling.sample. Each case runs both on the same logits and
controls; the time is the median of --iters calls after one warm-up call.
Then the new sampler is timed at several candidate widths.

Logits are random but shaped like a language model's: each row ranks the
vocabulary in a random order and gives rank r the logit -s * log(r) plus
N(0, 0.3) noise, s drawn per row from [1.1, 2.4] (SmolLM2-135M's rows have
the same spread: ~19 between the top and the median logit). `flat` cases use
N(0, 1) logits, where no nucleus fits in the candidates: every row falls back.

Prints a table and writes benchmarks/results/sampling-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxinfer.sampling import (CANDIDATES, SamplingBatch, apply_penalties,  # noqa: E402
                               candidate_thresholds, sample)
from test_sampling import reference_sample  # noqa: E402

T = 0.8  # the temperature of the sampled cases
CASES = {  # name -> (logits kind, per-row controls cycled over the batch)
    "greedy": ("lm", [dict(temperature=0.0)]),
    "temperature 0.8": ("lm", [dict()]),
    "top_k=50": ("lm", [dict(top_k=50)]),
    "top_p=0.9": ("lm", [dict(top_p=0.9)]),
    "min_p=0.05": ("lm", [dict(min_p=0.05)]),
    "mixed": ("lm", [dict(temperature=0.0), dict(top_k=50), dict(top_p=0.9), dict(min_p=0.05)]),
    "greedy + logprobs": ("lm", [dict(temperature=0.0, want_logprobs=True)]),
    "greedy + penalties": ("lm", [dict(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.2)]),
    "top_p=0.95 t=1.0": ("lm", [dict(top_p=0.95, temperature=1.0)]),
    "top_p=0.9 flat": ("flat", [dict(top_p=0.9)]),
}
SWEEP = ("top_p=0.9", "top_p=0.95 t=1.0", "mixed")


def make_logits(kind: str, B: int, V: int, rng: np.random.Generator) -> np.ndarray:
  if kind == "flat":
    return rng.normal(size=(B, V)).astype(np.float32)
  rank = np.argsort(rng.random((B, V)), axis=-1) + 1  # a random permutation per row
  s = rng.uniform(1.1, 2.4, (B, 1))
  return (-s * np.log(rank) + rng.normal(size=(B, V)) * 0.3).astype(np.float32)


def make_batch(controls: list[dict], B: int) -> SamplingBatch:
  rows = [controls[b % len(controls)] for b in range(B)]
  col = lambda name, default, dtype: jnp.asarray([r.get(name, default) for r in rows], dtype)
  return SamplingBatch(col("temperature", T, jnp.float32), col("top_k", 0, jnp.int32),
                       col("top_p", 1.0, jnp.float32), col("min_p", 0.0, jnp.float32),
                       col("repetition_penalty", 1.0, jnp.float32), col("presence_penalty", 0.0, jnp.float32),
                       col("frequency_penalty", 0.0, jnp.float32), jnp.arange(B, dtype=jnp.uint32),
                       jnp.full((B,), 100, jnp.int32), col("want_logprobs", False, jnp.bool_))


def time_ms(fn, args, iters: int) -> tuple[float, float]:
  """(median, min) ms of `iters` calls after a warm-up (the CPU may be shared: min is the floor)."""
  jax.block_until_ready(fn(*args))  # compile + warm up
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1000)
  return statistics.median(times), min(times)


def fallback_rows(logits, sp, counts, prompt, rows, width: int) -> int:
  """How many sampled rows sort their whole row (threshold beyond the candidates)."""
  V = logits.shape[-1]
  scores = apply_penalties(logits, sp, counts[rows], prompt[rows])
  t = jnp.where(sp.temperature > 0, sp.temperature, 1.0)[:, None]
  top_k = jnp.where(sp.top_k < V, sp.top_k, 0)
  truncated = (sp.temperature > 0) & ((top_k > 0) | (sp.top_p < 1) | (sp.min_p > 0))
  decided = candidate_thresholds(scores, t, top_k, sp.top_p, sp.min_p, width)[-1]
  return int(jnp.sum(truncated & ~decided))


def cpu_model() -> str:
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
  except OSError:
    return "unknown"
  return next((line.split(":", 1)[1].strip() for line in out.splitlines()
               if line.startswith("Model name")), "unknown")


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--vocab", type=int, default=49152)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--widths", default="64,128,256,512,1024", help="candidate widths to sweep ('' skips)")
  ap.add_argument("--cases", default=",".join(CASES), help="comma list of the cases to run")
  ap.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/sampling-<date>.json)")
  args = ap.parse_args(argv)
  B, V = args.batch, args.vocab
  load = [round(x, 2) for x in os.getloadavg()]  # the CPU may be shared: record how busy it was
  rng = np.random.default_rng(0)
  logits = {kind: jnp.asarray(make_logits(kind, B, V, rng)) for kind in ("lm", "flat")}
  R = B + 1  # history rows, as the runner's max_num_seqs + 1
  counts = jnp.asarray(rng.integers(0, 3, (R, V)) * (rng.random((R, V)) < 0.01), jnp.int32)
  prompt = jnp.asarray(rng.random((R, V)) < 0.01)
  rows = jnp.arange(B, dtype=jnp.int32)
  before = jax.jit(reference_sample)
  after = jax.jit(sample)

  results = []
  for name in args.cases.split(","):
    kind, controls = CASES[name]
    call = (logits[kind], make_batch(controls, B), counts, prompt, rows)
    (ms_before, min_before), (ms_after, min_after) = (time_ms(fn, call, args.iters) for fn in (before, after))
    results.append(dict(case=name, before_ms=ms_before, after_ms=ms_after, speedup=ms_before / ms_after,
                        before_min_ms=min_before, after_min_ms=min_after,
                        fallback_rows=fallback_rows(*call, CANDIDATES)))
    print(f"  {name}: {ms_before:.1f} -> {ms_after:.1f} ms", file=sys.stderr, flush=True)

  sweep = []
  for width in [int(w) for w in args.widths.split(",") if w]:
    fn = jax.jit(functools.partial(sample, candidates=width))
    for name in [c for c in SWEEP if c in args.cases.split(",")]:
      kind, controls = CASES[name]
      call = (logits[kind], make_batch(controls, B), counts, prompt, rows)
      ms, ms_min = time_ms(fn, call, args.iters)
      sweep.append(dict(width=width, case=name, ms=ms, min_ms=ms_min, fallback_rows=fallback_rows(*call, width)))

  print(f"\nsample() on [{B}, {V}] float32, median of {args.iters}, candidate width {CANDIDATES}\n")
  print("| case | before ms | after ms (min) | speedup | rows falling back |")
  print("|---|---|---|---|---|")
  for r in results:
    print(f"| {r['case']} | {r['before_ms']:.1f} | {r['after_ms']:.1f} ({r['after_min_ms']:.1f}) | "
          f"{r['speedup']:.1f}x | {r['fallback_rows']} |")
  if sweep:
    swept = list(dict.fromkeys(r["case"] for r in sweep))
    print("\n| width | " + " | ".join(f"{c} ms (rows falling back)" for c in swept) + " |")
    print("|---|" + "---|" * len(swept))
    for width in dict.fromkeys(r["width"] for r in sweep):
      cells = [f"{r['ms']:.1f} ({r['fallback_rows']})" for r in sweep if r["width"] == width]
      print(f"| {width} | " + " | ".join(cells) + " |")

  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
  out = args.out or ROOT / "benchmarks" / "results" / f"sampling-{datetime.date.today().isoformat()}.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(dict(benchmark="sampling", commit=commit, cpu_model=cpu_model(),
                                 load_average_at_start=load, jax=jax.__version__, batch=B, vocab=V,
                                 iters=args.iters,
                                 candidates=CANDIDATES, rows=results, width_sweep=sweep), indent=1))
  print(f"\nwrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
