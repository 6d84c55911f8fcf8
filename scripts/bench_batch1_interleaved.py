#!/usr/bin/env python
"""Batch-1 decode (python scripts/bench_batch1_interleaved.py [ROUNDS [OUT.json]]): float32 and each format loaded in one process, timed in interleaved rounds
(median of rounds): a ratio that load from other jobs on shared CPUs moves less than one
process per format run one after another."""
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "scripts"))
from jaxinfer import LLM, SamplingParams
from jaxinfer.default_model import default_checkpoint
from bench_offline import prompts_token_ids
import bench_peers
formats = [None, "int8", "int8-channel", "int4", "fp8"]
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
ck = default_checkpoint()
prompt = prompts_token_ids(1)
sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
llms = {f: LLM(ck, "float32", quantization=f, max_model_len=512, max_num_seqs=1) for f in formats}
for l in llms.values(): l.generate(prompt, sp)  # compile
load_before = os.getloadavg()
times = {f: [] for f in formats}
for r in range(rounds):
  for f in formats:
    t = time.perf_counter(); out = llms[f].generate(prompt, sp); dt = time.perf_counter() - t
    times[f].append(len(out[0].token_ids) / dt)
rows = []
f32 = statistics.median(times[None])
for f in formats:
  m = statistics.median(times[f])
  rows.append(dict(format=f or "float32", tokens_per_s_median=m, tokens_per_s_rounds=times[f], ratio_to_float32=m / f32))
  print(f"{f or 'float32':14s} {m:7.1f} tok/s  {m / f32:.2f}x  rounds {[round(x, 1) for x in times[f]]}")
commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
res = dict(benchmark="offline-quant-interleaved", commit=commit, command="python " + " ".join(sys.argv),
           cpu=bench_peers.cpu_info(), workload="1 prompt x 128 new tokens, EOS ignored; tokens/s includes the prefill of a ~30-token prompt",
           rounds=rounds, rows=rows, load_average_before=load_before, load_average_after=os.getloadavg(),
           notes="every format loaded in one process and timed round-robin; median of rounds")
out = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "benchmarks" / "results" / "offline-quant-interleaved.json"
out.write_text(json.dumps(res, indent=1)); print("wrote", out, res["load_average_before"], res["load_average_after"])
