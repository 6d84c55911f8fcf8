#!/usr/bin/env python
"""One prepared GPU run that answers what limits the GPU decode step (issue 38, item 4).

  python scripts/gpu_diag.py --out $OUT/gpu-diag.json      # a lent GPU: <= ~7 min, <= 8 files
  python scripts/gpu_diag.py --smoke                       # CPU: every phase, tiny shapes, < 1 min

Phases, in this order (a run cut short keeps what finished: the JSON is rewritten
after every phase and every case, and a watchdog writes it and exits the process
at --budget-s + 30 s whatever is running). Each names what it measures and,
before any GPU run, what it is expected to show on the lent H200 (jax 0.11.2;
the numbers it starts from are benchmarks/results/offline-gpu-nvidia-h200-2026-11-28.json,
kernels-nvidia-h200-2026-11-27.json and kernels-mosaic-nvidia-h200-2026-11-28.json).

 1. env: Python, jax / jaxlib / plugin versions, XLA_FLAGS and the other XLA / CUDA
    environment variables, the device (kind, compute capability, SM count), nvidia-smi's
    driver and clocks. Expected: jax 0.11.2 with the cuda12 plugin, sm_90, 132 SMs,
    XLA_FLAGS unset.
 2. ceilings (jaxinfer.bench.kernels.ceilings, plus a read-only pass): copy bandwidth
    (bytes read + written / time of x + 1 over 1 GiB), a read-only reduction (sum of a 2 GiB
    bf16 array: bytes read / time), the bf16 8192^3 GEMM (cuBLAS). Expected: copy 2.8-3.0
    TB/s (as measured before), read-only 3.8-4.4 TB/s (an H200's HBM3e is 4.8 TB/s nominal;
    a copy's interleaved writes cost more than its bytes), GEMM 750-850 TFLOP/s.
 3. step: the Llama-3-8B-shaped model (random bf16 weights, 16.1 GB), its forward program
    (LLMEngine's runner._step, as shipped: unrolled layers, attention_impl 'auto' = the
    Triton ragged kernel) for B decode sequences of KV_LEN keys, B in {1, 256}, compiled
    ahead of time in variants through compiler_options: 'shipped' (no options),
    'no_cmd_buffers' (xla_gpu_enable_command_buffer empty: every kernel launched one by
    one), and, only where the optimized HLO still has while / conditional ops,
    'cmd_buffers_control_flow' (command buffers that take WHILE and CONDITIONAL too). Per
    variant: compile seconds, ms per step over back-to-back steps (the cache threaded
    through, as the engine does), and the host time inside the launching call (median and
    max: how long the Python thread is blocked enqueuing the step). Then the whole engine
    step as shipped (runner.launch + collect with the 'shipped' executable: packing, the
    sampler, the ids back to the host): launch ms, collect ms, ms per step. The shipped
    step's optimized HLO is written beside the JSON (one file per B).
    Expected: B = 1: 6.5-7 ms per step (6.7 ms in the 11-28 run, the GPU busy 99% of it:
    the step is bound by its kernels, not the host), weights alone 16.1 GB / ~4 TB/s =
    4 ms, so 2.5-3 ms go to kernels that read little; launching call 0.2-1 ms shipped and
    1-3 ms without command buffers (~600 kernels), step time the same within 5% since the
    launch overlaps the device (async dispatch). No while / conditional left at B = 1
    (the Triton attention is one custom call), so no third variant. B = 256: 20-30 ms per
    step (weights 4 ms + KV 256 x 512 x 128 KiB = 17 GB at ~66% of copy bandwidth ~9 ms +
    GEMMs 4.1 TFLOP ~6 ms); the launching call the same as at B = 1.
 4. trace: jax.profiler over --trace-steps engine steps per B (shipped), summarized per
    step: kernel count, GPU busy (union of kernel intervals) vs wall time, the top kernels
    by time, device -> host copies (count, time), gaps over 20 us between GPU activity
    (count, total, largest). Expected: B = 1: ~500-700 kernels, busy >= 95% of wall,
    gemm_fusion_dot ~70% of busy time (4.9 of 6.6 ms before), one or two device -> host
    copies (the sampled ids), <= 3 gaps over 20 us (at the step's host round trip). B =
    256: busy >= 95%, attention and GEMMs on top.
 5. gemv: pallas_kernels.gemv_mgpu (Mosaic GPU, wgmma from registers; and 'mosaic_staged',
    the converted tile through shared memory) against XLA's per-channel path (the dot over
    the converted weight: what quant.linear ran before) and a bf16 weight, at the model's
    shapes (wq, wk, w_gate, w_down) x fp8 / int8 x 1 and 16 tokens, each checked against
    gemv_reference first. Weight bytes / time as % of the copy and read-only bandwidths.
    Expected: XLA's fp8 about as fast as the bf16 weight at one token although it reads half
    the bytes (w_gate 58 vs 57 us in the 11-27 run: 34% and 70% of copy bandwidth); the
    Mosaic GEMV, untuned, at 50-80% of the read-only bandwidth: 1.5-2.5x both, wgmma from
    registers 5-15% ahead of staged, 16 tokens within 15% of one token, int8 as fp8. Skipped,
    with the reason, under jax < 0.11.
 6. attention: decode at the model's shapes (B x KV_LEN, B in {1, 256}) and the issue's 64 x
    2048: the Triton ragged kernel ('pallas'), the Mosaic one ('mosaic', 'mosaic_ws'), and
    jax.nn.dot_product_attention over the same K/V laid out densely (cuDNN where it runs),
    each checked against the XLA reference (jaxinfer.bench.mosaic.decode_row). Expected as
    in kernels-mosaic-nvidia-h200-2026-11-28.json at 64 x 2048 (Triton 68%, Mosaic 55%,
    cuDNN 105% of copy bandwidth); at 256 x 512 similar; at 1 x 512 (1 MB of KV) every
    kernel 10-30 us, launch-bound (<10% of bandwidth).

--smoke runs all six on the CPU with a 2-layer tiny Llama (jaxinfer.bench.offline.SMOKE),
the Pallas kernels in interpret mode (the Mosaic ones where jax >= 0.11, else those cases
say "skipped: ..."); its numbers mean nothing, its JSON goes to a temporary file unless
--out is given. Output files: the JSON and one HLO text per batch size.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import gc
import glob
import gzip
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.bench.harness import environment
from jaxinfer.bench.kernels import (FULL, SMOKE, best_sdpa, ceilings, dense_from_pages, has_gpu, kv_bytes,
                                    paged_batch, time_us)
from jaxinfer.bench.mosaic import decode_row
from jaxinfer.bench.offline import LLAMA3_8B
from jaxinfer.bench.offline import SMOKE as SMOKE_MODEL
from jaxinfer.bench.trace import top_level_ops
from pallas_kernels.gemv_mgpu import MOSAIC_AVAILABLE

PHASES = ("env", "ceilings", "step", "trace", "gemv", "attention")
# Lines of a GPU process in a jax.profiler trace that are not device activity.
NOT_ACTIVITY = re.compile(r"XLA Modules|XLA Ops|Steps|Framework|Source|TraceContext|Launch Stats", re.I)
GAP_US = 20.0  # a gap between GPU activity longer than this is host time the device waited for

# compiler_options per variant of the step (XLA DebugOptions, parsed as XLA_FLAGS would be).
NO_CMD_BUFFERS = {"xla_gpu_enable_command_buffer": ""}
CMD_BUFFERS_CONTROL_FLOW = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE",
    "xla_gpu_graph_min_graph_size": "1"}


@dataclasses.dataclass(frozen=True)
class Plan:
  """Every size the run uses: GPU on a lent GPU, SMOKE_PLAN on the CPU."""
  model: dict  # HF config of the model
  batches: tuple[int, ...]  # decode sequences per step
  kv_len: int  # keys per sequence in the step and the attention cases
  steps: int  # timed steps per variant
  trace_steps: int
  kv_cache_gb: float
  gemv_shapes: tuple[tuple[str, int, int], ...]  # (name, O, I)
  gemv_tokens: tuple[int, ...]
  gemv_formats: tuple[str, ...]
  attention: tuple[tuple[int, int], ...]  # (B, kv_len) decode cases
  mosaic_attention: tuple[str, ...]  # of 'mosaic', 'mosaic_ws' (with a producer warpgroup)
  page_size: int
  shapes: object  # jaxinfer.bench.kernels.Shapes: ceilings and timing reps
  reduce_mib: int


D, F, KV = LLAMA3_8B["hidden_size"], LLAMA3_8B["intermediate_size"], 8 * 128
GPU = Plan(model=LLAMA3_8B, batches=(1, 256), kv_len=512, steps=20, trace_steps=8, kv_cache_gb=24.0,
           gemv_shapes=(("wq", D, D), ("wk", KV, D), ("w_gate", F, D), ("w_down", D, F)),
           gemv_tokens=(1, 16), gemv_formats=("fp8", "int8"),
           attention=((1, 512), (256, 512), (64, 2048)), mosaic_attention=("mosaic", "mosaic_ws"), page_size=16,
           shapes=dataclasses.replace(FULL, reps=10, warmup=2, burst=4), reduce_mib=2048)
# The smoke model's head dim is 64, the Mosaic attention kernel's smallest.
SMOKE_PLAN = Plan(model=dict(SMOKE_MODEL, hidden_size=256), batches=(1, 4), kv_len=40, steps=2, trace_steps=2, kv_cache_gb=0.01,
                  gemv_shapes=(("w", 128, 256),), gemv_tokens=(1,), gemv_formats=("fp8", "int8"),
                  attention=((3, 40),), mosaic_attention=("mosaic",), page_size=16, shapes=dataclasses.replace(SMOKE, reps=1, warmup=0),
                  reduce_mib=4)


# ---- 1. env ---------------------------------------------------------------------------------

def env_phase() -> dict:
  packages = {}
  for dist in importlib.metadata.distributions():
    name = (dist.metadata["Name"] or "").lower()
    if name.startswith(("jax", "nvidia-cuda", "nvidia-cudnn", "nvidia-cublas", "nvidia-nccl", "libtpu")):
      packages[name] = dist.version
  dev = jax.devices()[0]
  out = {"python": platform.python_version(), "jax": jax.__version__, "packages": dict(sorted(packages.items())),
         "env": {k: v for k, v in sorted(os.environ.items())
                 if k.startswith(("XLA_", "JAX_", "TF_", "CUDA_", "NCCL_", "NVIDIA_"))},
         "backend": jax.default_backend(), "device_kind": dev.device_kind, "device_count": jax.device_count(),
         "compute_capability": getattr(dev, "compute_capability", None),
         "core_count": getattr(dev, "core_count", None)}
  try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,"
                          "power.limit,memory.total", "--format=csv"], capture_output=True, text=True, timeout=20)
    out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()[:300]
  except (OSError, subprocess.TimeoutExpired) as e:
    out["nvidia_smi"] = f"unavailable: {type(e).__name__}: {e}"[:300]
  return out


# ---- 2. ceilings ----------------------------------------------------------------------------

def ceilings_phase(plan: Plan) -> dict:
  out = ceilings(plan.shapes)
  x = jnp.ones((plan.reduce_mib * 2**20 // 2,), jnp.bfloat16)
  total = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))  # reads every byte once, writes 4
  jax.block_until_ready(total(x))
  us = time_us(total, x, shapes=plan.shapes)
  out.update(read_bytes=x.nbytes, read_us=us, read_gb_s=x.nbytes / us / 1e3)
  return out


# ---- 3. step --------------------------------------------------------------------------------

def build_engine(plan: Plan):
  from jaxinfer.config import ModelConfig
  from jaxinfer.engine.engine import EngineConfig, LLMEngine
  from jaxinfer.params import init_params
  cfg = ModelConfig.from_hf(plan.model)
  params = init_params(cfg, jax.random.key(0), jnp.bfloat16)
  ec = EngineConfig(max_model_len=plan.kv_len + 16, max_num_seqs=max(plan.batches),
                    max_num_batched_tokens=max(plan.batches), kv_cache_bytes=int(plan.kv_cache_gb * 2**30),
                    enable_prefix_caching=False, warmup=False, compilation_cache_dir="")
  return LLMEngine(cfg, params, None, ec)


def decode_seqs(runner, B: int, kv_len: int) -> list:
  """B sequences decoding their token kv_len (kv_len - 1 keys in the cache, on disjoint pages)."""
  from jaxinfer.engine.runner import ScheduledSeq
  from jaxinfer.sampling import SamplingParams
  sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
  per_seq = -(-kv_len // runner.page_size)
  if 1 + B * per_seq > runner.num_pages:
    raise ValueError(f"{B} x {kv_len} keys need {1 + B * per_seq} pages, the pool has {runner.num_pages}")
  return [ScheduledSeq(row=i, token_ids=[5] * kv_len, start=kv_len - 1, num_new=1,
                       pages=list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)), params=sp, seed=0)
          for i in range(B)]


def control_flow_ops(hlo: str) -> dict:
  """while / conditional instructions in an optimized HLO module's text."""
  return {op: len(re.findall(rf"= [^=]*\b{op}\(", hlo)) for op in ("while", "conditional")}


def time_steps(call, runner, args, steps: int) -> dict:
  """Back-to-back calls of a compiled forward, the cache threaded through (donated):
  ms per step, and the host time inside each launching call."""
  params, history, ints, floats = args
  launch = []
  out = None
  jax.block_until_ready(runner.cache)
  t0 = time.perf_counter()
  for _ in range(steps):
    t = time.perf_counter()
    out = call(params, runner.cache, history, ints, floats)
    launch.append(time.perf_counter() - t)
    runner.cache = out[0]
  jax.block_until_ready(out)
  wall = time.perf_counter() - t0
  return {"ms_per_step": 1e3 * wall / steps, "launch_ms_median": 1e3 * statistics.median(launch),
          "launch_ms_max": 1e3 * max(launch), "steps": steps}


def step_phase(plan: Plan, engine, hlo_path, record) -> dict:
  """record(key, value) stores each finished case. Returns the shipped executable per B."""
  from jaxinfer.engine.runner import _model_inputs, to_buffers
  runner = engine.runner
  executables = {}
  for B in plan.batches:
    seqs = decode_seqs(runner, B, plan.kv_len)
    T, lp, batch = runner.pack_step(seqs)
    ints, floats, layout = to_buffers(_model_inputs(batch))
    lowered = runner._step.lower(layout, runner.params, runner.cache, runner.history, ints, floats,
                                 prompt_logprobs=lp)
    args = (runner.params, runner.history, ints, floats)
    case = {"B": B, "kv_len": plan.kv_len, "token_bucket": T, "variants": {}}
    shipped = None
    for name, options in (("shipped", None), ("no_cmd_buffers", NO_CMD_BUFFERS),
                          ("cmd_buffers_control_flow", CMD_BUFFERS_CONTROL_FLOW)):
      if name == "cmd_buffers_control_flow" and not any(case["control_flow"].values()):
        case["variants"][name] = {"skipped": "the shipped step has no while / conditional op"}
        continue
      try:
        t = time.perf_counter()
        compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
        row = {"compiler_options": options or {}, "compile_s": time.perf_counter() - t}
        if name == "shipped":
          shipped = compiled
          hlo = compiled.as_text()
          case["control_flow"] = control_flow_ops(hlo)
          Path(hlo_path(B)).write_text(hlo)
          case["hlo_file"] = Path(hlo_path(B)).name
        # Warm: the first call loads the executable. The cache is donated: each call's new
        # cache is the next call's.
        runner.cache = jax.block_until_ready(compiled(args[0], runner.cache, *args[1:]))[0]
        row.update(time_steps(compiled, runner, args, plan.steps))
      except Exception as e:  # a variant that does not compile or run is a result
        row = {"compiler_options": options or {}, "error": f"{type(e).__name__}: {str(e)[:1500]}"}
      case["variants"][name] = row
      record(f"B{B}", case)
      print(f"step B={B} {name}: {row.get('ms_per_step', row.get('error', ''))}", flush=True)
    if shipped is not None:
      executables[B] = shipped
      try:
        case["engine_step"] = engine_step(runner, shipped, seqs, plan.steps)
      except Exception as e:
        case["engine_step"] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
      record(f"B{B}", case)
  return executables


@contextlib.contextmanager
def use_executable(runner, compiled):
  """The runner's forward replaced by an ahead-of-time compiled executable of it (the same
  program: no second compile for the engine-level timings and the trace), then put back."""
  jitted = runner._step

  def step(layout, params, cache, history, ints, floats, prompt_logprobs=False):
    return compiled(params, cache, history, ints, floats)
  runner._step = step
  try:
    yield
  finally:
    runner._step = jitted


def engine_step(runner, compiled, seqs, steps: int) -> dict:
  """runner.launch (pack, forward, sampler enqueued) + runner.collect (ids to the host), timed."""
  launch, collect = [], []
  with use_executable(runner, compiled):
    runner.collect(runner.launch(seqs))  # the sampler compiles here
    t0 = time.perf_counter()
    for _ in range(steps):
      t = time.perf_counter()
      handle = runner.launch(seqs)
      t1 = time.perf_counter()
      runner.collect(handle)
      launch.append(t1 - t)
      collect.append(time.perf_counter() - t1)
    wall = time.perf_counter() - t0
  return {"ms_per_step": 1e3 * wall / steps,
          "launch_ms_median": 1e3 * statistics.median(launch), "launch_ms_max": 1e3 * max(launch),
          "collect_ms_median": 1e3 * statistics.median(collect), "steps": steps}


# ---- 4. trace -------------------------------------------------------------------------------

def summarize_trace(events: list[dict], steps: int, wall_s: float) -> dict:
  """Per step: kernels, busy vs wall, top kernels, device -> host copies, gaps > GAP_US.

  GPU activity is the complete ('X') events of the trace's GPU processes; without any (a
  CPU run) the XLA CPU runtime's top-level operations stand in, so the summary's code runs
  everywhere and says which it read."""
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  gpu = {pid for pid, n in names.items() if re.search(r"gpu|GPU", n)}
  if gpu:
    # The GPU's streams; its other lines (XLA modules and ops, steps) span the kernels they
    # launch and would count a whole program as one busy "kernel".
    acts = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and e.get("dur")
            and not NOT_ACTIVITY.search(threads.get((e["pid"], e.get("tid")), ""))]
    source = "gpu: " + "; ".join(sorted(names[p] for p in gpu))[:300]
  else:
    acts = [e for e in top_level_ops(events) if e.get("dur")]
    source = "no GPU process in the trace: XLA CPU operations"
  d2h = [e for e in acts if re.search(r"DtoH|D2H|[Dd]evice ?(to|->) ?([Hh]ost|[Pp]inned|[Pp]ageable)", e["name"])]
  kernels = [e for e in acts if not re.search(r"[Mm]emcpy|[Mm]emset|DtoH|HtoD|D2H|H2D", e["name"])]
  busy, end, gaps = 0.0, None, []
  for e in sorted(acts, key=lambda e: e["ts"]):
    start, stop = e["ts"], e["ts"] + e["dur"]
    if end is not None and start - end > GAP_US:
      gaps.append(start - end)
    busy += max(0.0, stop - max(start, end if end is not None else start))
    end = stop if end is None else max(end, stop)
  by = collections.Counter()
  for e in kernels:
    by[re.sub(r"[._]?\d+$", "", e["name"])[:80]] += e["dur"]
  wall_us = 1e6 * wall_s
  return {"source": source, "steps": steps, "wall_ms_per_step": wall_us / 1e3 / steps,
          "busy_ms_per_step": busy / 1e3 / steps, "busy_share_of_wall": busy / wall_us if wall_us else None,
          "kernels_per_step": len(kernels) / steps,
          "top_kernels_ms_per_step": [[k, round(v / 1e3 / steps, 4)] for k, v in by.most_common(12)],
          "d2h_copies_per_step": len(d2h) / steps, "d2h_ms_per_step": sum(e["dur"] for e in d2h) / 1e3 / steps,
          "gaps_over_20us_per_step": len(gaps) / steps, "gap_ms_per_step": sum(gaps) / 1e3 / steps,
          "largest_gaps_us": [round(g, 1) for g in sorted(gaps)[-5:][::-1]]}


def trace_phase(plan: Plan, engine, executables: dict, record) -> None:
  runner = engine.runner
  for B in plan.batches:
    if B not in executables:
      record(f"B{B}", {"skipped": "no shipped executable for this batch (the step phase did not finish it)"})
      continue
    seqs = decode_seqs(runner, B, plan.kv_len)
    with use_executable(runner, executables[B]), tempfile.TemporaryDirectory() as d:
      runner.collect(runner.launch(seqs))
      jax.profiler.start_trace(d)
      t = time.perf_counter()
      for _ in range(plan.trace_steps):
        runner.collect(runner.launch(seqs))
      wall = time.perf_counter() - t
      jax.profiler.stop_trace()
      files = sorted(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True))
      if not files:
        record(f"B{B}", {"error": "jax.profiler wrote no *.trace.json.gz"})
        continue
      trace = json.load(gzip.open(files[-1]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    record(f"B{B}", summarize_trace(events, plan.trace_steps, wall))


# ---- 5. gemv --------------------------------------------------------------------------------

def gemv_phase(plan: Plan, ceil: dict, smoke: bool, record) -> None:
  from jaxinfer.quant import quantize_fp8, quantize_int8
  from pallas_kernels.gemv_mgpu import BlockSizes, gemv_mgpu, gemv_reference
  if not MOSAIC_AVAILABLE:
    record("skipped", f"Mosaic GPU needs jax >= 0.11 (this is jax {jax.__version__})")
    return
  rotate = 1 if smoke else 4  # distinct weights, rotated, so timed reads come from HBM, not L2
  xla = jax.jit(gemv_reference)
  bf16 = jax.jit(lambda x, w: jnp.einsum("MI,OI->MO", x, w, preferred_element_type=jnp.float32))
  impls = {"mosaic": functools.partial(gemv_mgpu, interpret=smoke),
           "xla": xla}
  if not smoke:  # interpret mode always stages the tile (its wgmma reads shared memory only)
    impls["mosaic_staged"] = functools.partial(gemv_mgpu, block_sizes=BlockSizes(stage_in_smem=True))
  impls = {k: jax.jit(v) if k.startswith("mosaic") else v for k, v in impls.items()}
  for name, O, I in plan.gemv_shapes:
    for fmt in plan.gemv_formats:
      quantize = quantize_fp8 if fmt == "fp8" else quantize_int8  # per output channel, values [O, I]
      ws = [quantize(jax.random.normal(jax.random.key(i), (I, O), jnp.float32) / I ** 0.5, 1)
            for i in range(rotate)]
      wb = [jax.random.normal(jax.random.key(i), (O, I), jnp.bfloat16) for i in range(rotate)]
      for M in plan.gemv_tokens:
        x = jax.random.normal(jax.random.key(99), (M, I), jnp.bfloat16)
        want = xla(x, ws[0].values, ws[0].scales)
        case = {"weight": name, "O": O, "I": I, "format": fmt, "tokens": M, "weight_bytes": O * I}
        rows = {}
        for impl, fn in {**impls, "bf16_weight": None}.items():
          try:
            if impl == "bf16_weight":
              call = lambda i=0: bf16(x, wb[i % rotate])
              nbytes = 2 * O * I
            else:
              call = lambda i=0, fn=fn: fn(x, ws[i % rotate].values, ws[i % rotate].scales)
              nbytes = O * I
            got = jax.block_until_ready(call())  # compiles
            err = (None if impl == "bf16_weight"
                   else float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))))
            us = time_us(lambda: [call(i) for i in range(rotate)], shapes=plan.shapes) / rotate
            rows[impl] = {"us": us, "gb_s": nbytes / us / 1e3, "max_rel_err_vs_reference": err,
                          "pct_of_copy_bw": 100 * nbytes / us / 1e3 / ceil["hbm_gb_s"],
                          "pct_of_read_bw": 100 * nbytes / us / 1e3 / ceil["read_gb_s"]}
          except Exception as e:  # a kernel that does not compile is a result; the run goes on
            rows[impl] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
        for impl, row in rows.items():
          if "us" in row and "us" in rows.get("xla", {}):
            row["speedup_vs_xla"] = rows["xla"]["us"] / row["us"]
          if "us" in row and "us" in rows.get("bf16_weight", {}):
            row["speedup_vs_bf16_weight"] = rows["bf16_weight"]["us"] / row["us"]
        record(f"{name}-{fmt}-T{M}", {**case, "impls": rows})
        print(f"gemv {name} {fmt} T={M}: " + ", ".join(
            f"{k} {v['us']:.1f} us" if "us" in v else f"{k} error" for k, v in rows.items()), flush=True)


# ---- 6. attention ---------------------------------------------------------------------------

def attention_phase(plan: Plan, ceil: dict, smoke: bool, record) -> None:
  from jaxinfer.ops import ragged_paged_attention_xla
  from pallas_kernels import ragged_paged_attention
  from pallas_kernels.ragged_paged_attention_mgpu import BlockSizes, ragged_paged_attention_mgpu
  cfg = plan.model
  Hq, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
  Dh = cfg["hidden_size"] // Hq
  rng = np.random.default_rng(0)
  triton = jax.jit(functools.partial(ragged_paged_attention, interpret=smoke))
  xla = jax.jit(ragged_paged_attention_xla)
  impls = [("pallas", triton)]
  if MOSAIC_AVAILABLE:
    block_sizes = {"mosaic": None, "mosaic_ws": BlockSizes(warp_specialized=True)}
    impls += [(name, jax.jit(functools.partial(ragged_paged_attention_mgpu, interpret=smoke,
                                               block_sizes=block_sizes[name])))
              for name in plan.mosaic_attention]
  for B, kv_len in plan.attention:
    batch = paged_batch(rng, ((B, 1, kv_len),), plan.page_size, Hq, Hkv, Dh)
    nbytes = kv_bytes(batch)
    want = jax.block_until_ready(xla(**batch))
    case = {"B": B, "kv_len": kv_len, "page_size": plan.page_size, "Hq": Hq, "Hkv": Hkv, "D": Dh,
            "kv_bytes": nbytes, "impls": []}
    for name, fn in impls:
      case["impls"].append(decode_row(name, functools.partial(fn, **batch), want, nbytes, ceil, plan.shapes, {}))
    if not MOSAIC_AVAILABLE:
      case["impls"].append({"impl": "mosaic", "skipped": f"Mosaic GPU needs jax >= 0.11 (this is jax "
                                                         f"{jax.__version__})"})
    k, v = dense_from_pages(batch)
    q = batch["q"].reshape(B, 1, Hq, Dh)
    try:
      impl, fn, _, notes = best_sdpa(q, k, v, is_causal=False, want=want.reshape(q.shape))
      case["impls"].append(decode_row(f"sdpa_{impl}_dense", functools.partial(fn, q, k, v),
                                      want.reshape(q.shape), nbytes, ceil, plan.shapes, {"notes": notes}))
    except RuntimeError as e:  # neither cuDNN nor XLA ran it
      case["impls"].append({"impl": "sdpa", "error": str(e)[:1500]})
    record(f"B{B}-kv{kv_len}", case)
    print(f"attention B={B} kv={kv_len}: " + ", ".join(
        f"{r['impl']} {r['pct_of_copy_bw']:.0f}%" if "us" in r else f"{r['impl']} -" for r in case["impls"]),
        flush=True)


# ---- the run --------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--smoke", action="store_true", help="CPU: every phase on a 2-layer tiny model")
  ap.add_argument("--out", type=Path, help="JSON path (default: benchmarks/results/gpu-diag-<device>-<date>.json "
                                           "on a GPU, a temporary file with --smoke)")
  ap.add_argument("--budget-s", type=float, default=390.0,
                  help="phases not started by then are skipped; at budget + 30 s the process writes its "
                       "JSON and exits (code 3)")
  ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
  args = ap.parse_args(argv)
  phases = [p for p in args.phases.split(",") if p]
  if unknown := sorted(set(phases) - set(PHASES)):
    ap.error(f"unknown phases {unknown}; choose from {', '.join(PHASES)}")
  if not args.smoke and not has_gpu():
    print("gpu_diag: no GPU here (jax backend: "
          f"{jax.default_backend()}); use --smoke to run every phase on the CPU", file=sys.stderr)
    return 2
  plan = SMOKE_PLAN if args.smoke else GPU
  device = jax.devices()[0]
  if args.out:
    out = args.out
  elif args.smoke:
    out = Path(tempfile.mkdtemp(prefix="gpu-diag-")) / "gpu-diag-smoke.json"
  else:
    slug = re.sub(r"[^a-z0-9]+", "-", device.device_kind.lower()).strip("-")
    out = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / f"gpu-diag-{slug}-{time.strftime('%Y-%m-%d')}.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  report = {"benchmark": "gpu-diag", **environment(" ".join(["scripts/gpu_diag.py", *(argv or sys.argv[1:])]),
                                                   device=device.device_kind),
            "smoke": args.smoke, "plan": dataclasses.asdict(plan) | {"shapes": dataclasses.asdict(plan.shapes)},
            "phases": {}}
  lock = threading.Lock()

  def save():
    with lock:
      out.write_text(json.dumps(report, indent=1, default=str) + "\n")

  start = time.perf_counter()

  def watchdog():
    report["stopped"] = f"the watchdog at {args.budget_s + 30:.0f} s: the phase running was cut"
    report["wall_s"] = time.perf_counter() - start
    save()
    print(f"gpu_diag: stopped at {args.budget_s + 30:.0f} s; wrote {out}", file=sys.stderr, flush=True)
    os._exit(3)

  timer = threading.Timer(args.budget_s + 30, watchdog)
  timer.daemon = True
  timer.start()
  engine = None
  executables = {}
  ceil = None
  try:
    for phase in PHASES:
      if phase not in phases:
        continue
      if time.perf_counter() - start > args.budget_s:
        report["phases"][phase] = {"skipped": f"time budget ({args.budget_s:.0f} s) spent"}
        save()
        continue
      result = report["phases"][phase] = {}

      def record(key, value, result=result):
        result[key] = value
        save()

      t = time.perf_counter()
      print(f"== {phase} [{t - start:.0f} s]", flush=True)
      try:
        if phase == "env":
          result.update(env_phase())
        elif phase == "ceilings":
          result.update(ceil := ceilings_phase(plan))
        elif phase in ("step", "trace"):
          if engine is None:
            engine = build_engine(plan)
          if phase == "step":
            executables = step_phase(plan, engine, lambda B: out.with_name(f"{out.stem}-step-b{B}.hlo.txt"),
                                     record)
          else:
            trace_phase(plan, engine, executables, record)
        elif phase in ("gemv", "attention"):
          if engine is not None:  # its KV pool and weights would crowd the kernels' operands
            engine = None
            gc.collect()
          ceil = ceil or ceilings_phase(plan)
          (gemv_phase if phase == "gemv" else attention_phase)(plan, ceil, args.smoke, record)
      except Exception as e:  # a phase that fails is recorded; the next one runs
        result["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
      result["phase_s"] = time.perf_counter() - t
      save()
  finally:
    timer.cancel()
  report["wall_s"] = time.perf_counter() - start
  save()
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
