"""Decode-step A/B of the decoder's layer layout, in one process, side by side.

  fuse: the checkpoint layout (q, k, v and gate, up as seven matmuls a layer) against the fused
        one the engine runs (params.FUSED: four), the same weights, per format and batch.
  scan: layers unrolled (a Python loop in the traced step) against scanned (stacked weights, one
        pool of L x N pages, lax.scan: models/transformer.py), the same weights: step and compile
        time of the default model, and of a Llama-3-8B-shaped model with random weights (step time
        at --llama-layers layers; compile time, from shapes alone, at each of --compile-layers).
  warmup: the engine's warm-up (every step program compiled, the persistent compilation cache
        off) of the default model, EngineConfig.scan_layers False vs True, alternating.

Each variant's decode step (forward over B sequences of one new token each, `ctx` tokens of
context in the paged cache, plus the LM head) is compiled, then the variants are timed in
interleaved rounds (rounds x steps each, the order reversed every other round) and the median step reported with its spread, so a
change in the machine's load hits both alike. The load average is recorded before and after.

  jaxinfer bench layers fuse --batch 1 64 --quantization none int8 \
      --out benchmarks/results/layers-fuse-2026-11-28.json
  jaxinfer bench layers scan --batch 1 64 --out benchmarks/results/layers-scan-2026-11-28.json
  jaxinfer bench layers warmup --rounds 2 --out benchmarks/results/layers-scan-warmup-2026-11-28.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def git_commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
  except OSError:
    return "unknown"


def cpu_info() -> dict:
  from jaxinfer.bench.harness import cpu_info
  return cpu_info()


def decode_inputs(cfg, batch: int, ctx: int, page: int = 16):
  """B decode tokens at position ctx, each sequence in its own pages (page 0 unused)."""
  from jaxinfer.models.cache import init_cache
  from jaxinfer.models.transformer import PagedBatch
  P = -(-(ctx + 1) // page)
  pages = 1 + np.arange(batch * P, dtype=np.int32).reshape(batch, P)
  slots = pages[:, ctx // page] * page + ctx % page
  paged = PagedBatch(jnp.asarray(slots, jnp.int32), jnp.full((batch,), ctx + 1, jnp.int32), jnp.asarray(pages),
                     jnp.arange(batch + 1, dtype=jnp.int32), jnp.int32(batch))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, batch), jnp.int32)
  positions = jnp.full((batch,), ctx, jnp.int32)
  return tokens, positions, paged, lambda dtype: init_cache(cfg, batch * P + 1, page, dtype)


def make_step(cfg):
  from jaxinfer.models.transformer import compute_logits, forward

  def step(params, cache, tokens, positions, paged):
    hidden, cache = forward(params, cfg, tokens, positions, cache, paged)
    return cache, compute_logits(params, cfg, hidden)

  return jax.jit(step, donate_argnums=(1,))


def time_variants(variants: dict, cfg, batch: int, ctx: int, rounds: int, steps: int) -> dict:
  """{name: params} -> {name: {compile_s, median_ms, p10_ms, p90_ms}}, timed interleaved. Stacked
  params (transformer.is_stacked) get the stacked pool."""
  from jaxinfer.models.transformer import is_stacked, stack_cache
  from jaxinfer.params import model_dtype
  tokens, positions, paged, new_cache = decode_inputs(cfg, batch, ctx)
  out, caches, steps_fn = {}, {}, {}
  for name, params in variants.items():
    step = make_step(cfg)
    cache = new_cache(model_dtype(params))
    if is_stacked(params["layers"]):
      cache = stack_cache(cache)
    t = time.perf_counter()
    compiled = step.lower(params, cache, tokens, positions, paged).compile()
    out[name] = {"compile_s": round(time.perf_counter() - t, 3)}
    cache, logits = compiled(params, cache, tokens, positions, paged)
    out[name]["logits"] = np.asarray(logits)
    caches[name], steps_fn[name] = cache, compiled
  times = {name: [] for name in variants}
  order = list(variants)
  for r in range(rounds):
    for name in (order if r % 2 == 0 else order[::-1]):  # ABBA: neither variant always runs first
      params = variants[name]
      cache, fn = caches[name], steps_fn[name]
      for _ in range(steps):
        t = time.perf_counter()
        cache, logits = fn(params, cache, tokens, positions, paged)
        logits.block_until_ready()
        times[name].append(time.perf_counter() - t)
      caches[name] = cache
  for name, ts in times.items():
    ms = np.array(ts) * 1e3
    out[name].update(median_ms=round(float(np.median(ms)), 3), p10_ms=round(float(np.percentile(ms, 10)), 3),
                     p90_ms=round(float(np.percentile(ms, 90)), 3), samples=len(ms))
  return out


def run_fuse(args) -> dict:
  from jaxinfer.checkpoint import load_model
  from jaxinfer.default_model import default_checkpoint
  from jaxinfer.params import fuse_params
  rows = []
  for quantization in args.quantization:
    q = None if quantization == "none" else quantization
    loaded = load_model(default_checkpoint(), quantization=q)
    cfg, unfused = loaded.config, loaded.params
    fused = fuse_params(cfg, unfused)
    for batch in args.batch:
      print(f"== {quantization}, batch {batch}", file=sys.stderr, flush=True)
      r = time_variants({"unfused": unfused, "fused": fused}, cfg, batch, args.ctx, args.rounds, args.steps)
      same = bool(np.array_equal(r["unfused"].pop("logits"), r["fused"].pop("logits")))
      row = {"quantization": quantization, "batch": batch, "ctx": args.ctx, **{f"{k}": v for k, v in r.items()},
             "ratio_fused_vs_unfused": round(r["fused"]["median_ms"] / r["unfused"]["median_ms"], 3),
             "logits_identical": same, "load_average": os.getloadavg()}
      print(json.dumps(row), file=sys.stderr, flush=True)
      rows.append(row)
  return {"model": "SmolLM2-135M-Instruct (the default model), float32 activations",
          "what": "decode step (forward + LM head) time, checkpoint-layout q/k/v and gate/up (7 matmuls a "
                  "layer) vs fused (4), same weights; median of interleaved rounds", "rows": rows}


def compile_seconds(cfg, params, batch: int, ctx: int, dtype) -> float:
  """Lowering + compiling the decode step from shapes alone (nothing allocated)."""
  from jaxinfer.models.cache import CacheSpec
  from jaxinfer.models.transformer import is_stacked
  tokens, positions, paged, _ = decode_inputs(cfg, batch, ctx)
  P = -(-(ctx + 1) // 16)
  cache = CacheSpec.from_config(cfg, dtype).abstract(batch * P + 1, 16)
  if is_stacked(params["layers"]):
    cache = [jax.tree.map(lambda *xs: jax.ShapeDtypeStruct((sum(x.shape[0] for x in xs),) + xs[0].shape[1:],
                                                           xs[0].dtype), *cache)]
  t = time.perf_counter()
  make_step(cfg).lower(params, cache, tokens, positions, paged).compile()
  return round(time.perf_counter() - t, 3)


def llama3_8b(layers: int, vocab: int | None = None):
  """Llama-3-8B's shapes (jaxinfer bench offline's) with `layers` layers (and `vocab` entries)."""
  import dataclasses
  from jaxinfer.bench.offline import LLAMA3_8B
  from jaxinfer.config import ModelConfig
  cfg = dataclasses.replace(ModelConfig.from_hf(LLAMA3_8B), num_layers=layers)
  return dataclasses.replace(cfg, vocab_size=vocab) if vocab else cfg


def run_scan(args) -> dict:
  from jaxinfer.checkpoint import load_model
  from jaxinfer.default_model import default_checkpoint
  from jaxinfer.models.transformer import stack_layers
  from jaxinfer.params import abstract_params, fuse_layers, fuse_params, init_params
  rows = []
  loaded = load_model(default_checkpoint())
  cfg = loaded.config
  unrolled = fuse_params(cfg, loaded.params)
  scanned = stack_layers(cfg, unrolled)
  for batch in args.batch:
    print(f"== default model, batch {batch}", file=sys.stderr, flush=True)
    r = time_variants({"unrolled": unrolled, "scanned": scanned}, cfg, batch, args.ctx, args.rounds, args.steps)
    same = bool(np.array_equal(r["unrolled"].pop("logits"), r["scanned"].pop("logits")))
    rows.append({"case": "default (SmolLM2-135M, 30 layers, float32)", "batch": batch, "ctx": args.ctx, **r,
                 "ratio_scanned_vs_unrolled": round(r["scanned"]["median_ms"] / r["unrolled"]["median_ms"], 3),
                 "logits_identical": same, "load_average": os.getloadavg()})
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
  del unrolled, scanned, loaded
  # float32 (the CPU's dtype) and a 32k vocab, so that two copies of the layers fit beside the
  # other processes of a shared machine; the layers have 8B's shapes, the head is the same in both.
  cfg = llama3_8b(args.llama_layers, vocab=32000)
  unrolled = fuse_params(cfg, init_params(cfg, jax.random.key(0), jnp.float32))
  scanned = stack_layers(cfg, unrolled)
  for batch in args.llama_batch:
    print(f"== llama3-8b shape, {args.llama_layers} layers, batch {batch}", file=sys.stderr, flush=True)
    r = time_variants({"unrolled": unrolled, "scanned": scanned}, cfg, batch, args.ctx, args.rounds,
                      max(2, args.steps // 4))
    same = bool(np.array_equal(r["unrolled"].pop("logits"), r["scanned"].pop("logits")))
    rows.append({"case": f"Llama-3-8B layers x{args.llama_layers}, vocab 32000, float32 random",
                 "batch": batch,
                 "ctx": args.ctx, **r,
                 "ratio_scanned_vs_unrolled": round(r["scanned"]["median_ms"] / r["unrolled"]["median_ms"], 3),
                 "logits_identical": same, "load_average": os.getloadavg()})
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
  del unrolled, scanned
  compile_rows = []
  dtype = jnp.float32  # shapes only: nothing is allocated
  for layers in args.compile_layers:
    cfg = llama3_8b(layers)
    unrolled = jax.eval_shape(lambda p: fuse_layers(cfg, p), abstract_params(cfg, dtype))
    scanned = jax.eval_shape(lambda p: stack_layers(cfg, p), unrolled)
    row = {"case": "Llama-3-8B shape, float32", "layers": layers, "batch": args.compile_batch,
           "unrolled_compile_s": compile_seconds(cfg, unrolled, args.compile_batch, args.ctx, dtype),
           "scanned_compile_s": compile_seconds(cfg, scanned, args.compile_batch, args.ctx, dtype),
           "load_average": os.getloadavg()}
    print(json.dumps(row), file=sys.stderr, flush=True)
    compile_rows.append(row)
  return {"what": "decode step (forward + LM head) time and its compile time, layers unrolled vs scanned "
                  "(same weights); step medians of interleaved rounds",
          "rows": rows, "compile_vs_depth": compile_rows}


def run_warmup(args) -> dict:
  from jaxinfer import LLM
  from jaxinfer.default_model import default_checkpoint
  opts = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, compilation_cache_dir="")
  times = {False: [], True: []}
  for r in range(args.rounds):
    for scan in ((False, True) if r % 2 == 0 else (True, False)):
      t = time.perf_counter()
      llm = LLM(default_checkpoint(), scan_layers=scan, **opts)
      times[scan].append(round(time.perf_counter() - t, 2))
      print(f"== scan_layers={scan}: {times[scan][-1]} s", file=sys.stderr, flush=True)
      del llm
      jax.clear_caches()
  return {"what": "LLM(default model, warmup=True) construction time, load + every step program compiled, "
                  "no persistent compilation cache; the test suite's LLMs compile these programs lazily",
          "engine_options": opts,
          "rows": [{"scan_layers": scan, "seconds": ts, "median_s": float(np.median(ts))} for scan, ts in times.items()],
          "load_average": os.getloadavg()}


def add_arguments(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("what", choices=["fuse", "scan", "warmup"])
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
  ap.add_argument("--quantization", nargs="+", default=["none", "int8"])
  ap.add_argument("--ctx", type=int, default=128, help="tokens of context each sequence has in the cache")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--steps", type=int, default=20, help="steps per variant per round")
  ap.add_argument("--llama-layers", type=int, default=4, help="scan: layers of the Llama-3-8B shape timed")
  ap.add_argument("--llama-batch", type=int, nargs="+", default=[1, 16])
  ap.add_argument("--compile-layers", type=int, nargs="+", default=[4, 8, 16, 32])
  ap.add_argument("--compile-batch", type=int, default=1)
  ap.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
  load_before = os.getloadavg()
  body = {"fuse": run_fuse, "scan": run_scan, "warmup": run_warmup}[args.what](args)
  result = {"benchmark": f"layers-{args.what}", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "commit": git_commit(), "command": args.command,
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
                        **cpu_info()},
            "load_average_before": load_before, "load_average_after": os.getloadavg(), **body}
  text = json.dumps(result, indent=1)
  if args.out:
    Path(args.out).write_text(text + "\n")
  print(text)
  return 0
