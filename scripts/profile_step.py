#!/usr/bin/env python
"""Where a decode step's time goes: the full step against the same step with
attention or sampling replaced by trivial stand-ins, each in a fresh process.

  python scripts/profile_step.py [--dtype float32] [--batches 64,1] [--kv-len 100]

Prints a table and writes benchmarks/results/profile-step-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def worker(variant: str, dtype: str, batch: int, kv_len: int, iters: int) -> float:
  """ms per step of `variant` (full | no-attention | no-sampling)."""
  import jax.numpy as jnp

  import jaxinfer.engine.runner as runner_mod
  import jaxinfer.ops as ops
  if variant == "no-attention":
    ops.ragged_paged_attention = lambda q, *a, **k: q
  if variant == "no-sampling":
    def argmax_only(logits, sp, counts, prompt, rows):
      B = logits.shape[0]
      return (jnp.argmax(logits, -1).astype(jnp.int32), logits[:, 0],
              jnp.zeros((B, 20), jnp.int32), jnp.zeros((B, 20)))
    runner_mod.sample = argmax_only
  from jaxinfer import LLM, SamplingParams
  from jaxinfer.engine.runner import ScheduledSeq
  llm = LLM(None, dtype=dtype, max_num_seqs=max(batch, 1), warmup=False, kv_cache_bytes=600_000_000)
  sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
  per_seq = kv_len // 16 + 2
  seqs = [ScheduledSeq(row=i, token_ids=[5] * (kv_len + 1), start=kv_len, num_new=1,
                       pages=list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)), params=sp, seed=0)
          for i in range(batch)]
  llm.runner.execute(seqs)
  t0 = time.perf_counter()
  for _ in range(iters):
    llm.runner.execute(seqs)
  return (time.perf_counter() - t0) / iters * 1000


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--batches", default="64,1")
  ap.add_argument("--kv-len", type=int, default=100)
  ap.add_argument("--iters", type=int, default=10)
  args = ap.parse_args()
  if args.worker:
    spec = json.loads(args.worker)
    print("RESULT", worker(**spec))
    return 0
  rows = []
  for batch in map(int, args.batches.split(",")):
    ms = {}
    for variant in ("full", "no-attention", "no-sampling"):
      spec = dict(variant=variant, dtype=args.dtype, batch=batch, kv_len=args.kv_len, iters=args.iters)
      out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True,
                           text=True, check=True).stdout
      ms[variant] = float(out.split("RESULT")[-1])
    rows.append(dict(batch=batch, kv_len=args.kv_len, dtype=args.dtype, step_ms=ms["full"],
                     attention_ms=ms["full"] - ms["no-attention"], sampling_ms=ms["full"] - ms["no-sampling"],
                     tokens_per_s=batch / ms["full"] * 1000,
                     tokens_per_s_without_attention=batch / ms["no-attention"] * 1000))
  print("| batch | kv len | dtype | step ms | attention ms | sampling ms | tok/s | tok/s w/o attention |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['batch']} | {r['kv_len']} | {r['dtype']} | {r['step_ms']:.1f} | {r['attention_ms']:.1f} | "
          f"{r['sampling_ms']:.1f} | {r['tokens_per_s']:.0f} | {r['tokens_per_s_without_attention']:.0f} |")
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
  out = ROOT / "benchmarks" / "results" / f"profile-step-{datetime.date.today().isoformat()}.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(dict(benchmark="profile_step", commit=commit, rows=rows), indent=1))
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
