"""Structured output's per-step costs: host masks (llguidance) and the device-side mask.

  jaxinfer bench structured [--model checkpoints/smollm2-135m-instruct] [--iters 20]
                            [--batches 1,16,64] [--xgrammar-python PY] [--out FILE]

Host: B matchers of one JSON schema, each advanced into the output by a
different number of tokens (a schema-valid document, tokenized), then the
time of one `fill_bitmasks` call for all B rows (what `pack` pays per step),
median of --iters; also a json_object and a regex grammar at B = 64. With
--xgrammar-python (a venv holding torch and xgrammar; jaxinfer cannot depend
on them), the same cases through xgrammar's GrammarMatcher, one
fill_next_token_bitmask per row (_xgrammar_mask_worker.py beside this file).

Device: `sample()` alone on [64, V] greedy logits (no mask argument; a mask
with no row constrained, where the lax.cond skips it; all rows constrained;
and masking unconditionally, the alternative the cond replaced), then the
jitted 64-sequence greedy decode step (one token each, KV length 64) on one
packed batch with 0 and with 64 rows constrained (masks already filled, so
only the device side differs), the two interleaved.

Prints a table and writes benchmarks/results/structured-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from jaxinfer.bench.harness import ROOT, environment, write_results
from jaxinfer.engine.grammar import fill_bitmasks, mask_words
from jaxinfer.structured import StructuredOutput

XGRAMMAR_WORKER = Path(__file__).resolve().parent / "_xgrammar_mask_worker.py"  # run by the xgrammar venv's Python

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.(com|org)$"},
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "email", "tags", "address"],
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@analytical.org", "tags": ["admin", "user"],
            "address": {"city": "London", "zip": "W1"}}


def median_ms(fn, iters: int) -> tuple[float, float]:
  fn()
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    fn()
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times), min(times)


def advanced(engine, structured: StructuredOutput, text: str, B: int):
  """B matchers, the i-th having consumed the first i * n / B tokens of `text`."""
  ids = engine.tokenizer.encode(text, add_special_tokens=False)
  out = []
  for i in range(B):
    g = engine.grammars.matcher(structured)
    for t in ids[:i * (len(ids) - 1) // max(B, 1)]:
      g.consume(t)
    out.append(g)
  return out


TEXT = json.dumps(DOCUMENT, separators=(", ", ": "))
REGEX = r"[a-z]+@[a-z]+\.(com|org)"
CASES = [("json_schema", StructuredOutput(json_schema=SCHEMA), TEXT),
         ("json_object", StructuredOutput(json_object=True), TEXT),
         ("regex", StructuredOutput(regex=REGEX), "ada@analytical.org")]


def case_batches(name, batches):
  return batches if name == "json_schema" else [max(batches)]


def host_masks(engine, batches, iters):
  V = engine.config.vocab_size
  rows = []
  t0 = time.perf_counter()
  engine.grammars.ll_tokenizer  # built once per engine, on the first structured request
  tokenizer_ms = (time.perf_counter() - t0) * 1e3
  for name, structured, text in CASES:
    t0 = time.perf_counter()
    engine.grammars.check(structured)
    compile_ms = (time.perf_counter() - t0) * 1e3
    for B in case_batches(name, batches):
      matchers = advanced(engine, structured, text, B)
      allowed = np.full((B, mask_words(V)), -1, np.int32)
      ms, ms_min = median_ms(lambda: fill_bitmasks([(g, i, []) for i, g in enumerate(matchers)], allowed), iters)
      rows.append(dict(grammar=name, batch=B, ms=ms, min_ms=ms_min, per_row_us=ms / B * 1e3,
                       compile_ms=compile_ms))
      print(f"  host {name} B={B}: {ms:.3f} ms", file=sys.stderr, flush=True)
  return rows, tokenizer_ms


def xgrammar_masks(engine, python, batches, iters):
  """The same cases through xgrammar, in another interpreter (it needs torch)."""
  import subprocess
  import tempfile
  tok = engine.tokenizer
  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    f.write(tok.backend.to_str())
  cases = [dict(grammar=name, schema=SCHEMA, regex=REGEX, batch=B,
                text_ids=tok.encode(text, add_special_tokens=False))
           for name, _, text in CASES for B in case_batches(name, batches)]
  spec = dict(tokenizer_json=f.name, vocab_size=engine.config.vocab_size, eos_ids=list(tok.eos_ids),
              cases=cases, iters=iters)
  out = subprocess.run([python, str(XGRAMMAR_WORKER)], input=json.dumps(spec),
                       capture_output=True, text=True)
  Path(f.name).unlink()
  if out.returncode:
    print(f"xgrammar worker failed:\n{out.stderr[-2000:]}", file=sys.stderr)
    return None
  rows = json.loads(out.stdout.strip().splitlines()[-1])
  for r in rows:
    r["per_row_us"] = r["ms"] / r["batch"] * 1e3
    print(f"  xgrammar {r['grammar']} B={r['batch']}: {r['ms']:.3f} ms", file=sys.stderr, flush=True)
  return rows


def sampler(engine, iters, B=64):
  """sample() alone on [B, V] float32 logits, greedy: no mask argument, an all-free mask
  (the cond is not taken), every row constrained, and masking unconditionally (the
  alternative the cond replaced)."""
  import jax
  import jax.numpy as jnp

  from jaxinfer.sampling import SamplingBatch, SamplingParams, apply_token_bitmask, sample
  V = engine.config.vocab_size
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(B, V)).astype(np.float32))
  sp = SamplingBatch.from_params([SamplingParams(temperature=0)] * B, [0] * B, [0] * B)
  hist = (jnp.zeros((B + 1, V), jnp.int32), jnp.zeros((B + 1, V), jnp.bool_), jnp.arange(B))
  free = jnp.full((B, mask_words(V)), -1, jnp.int32)
  some = jnp.asarray(rng.integers(-2**31, 2**31, size=(B, mask_words(V)), dtype=np.int64).astype(np.int32))
  ids = lambda *a: sample(*a)[0]
  variants = {
      "no mask argument": (jax.jit(lambda l, sp, c, p, r, m: ids(l, sp, c, p, r)), free),
      "mask, no row constrained (cond skips it)": (jax.jit(ids), free),
      "mask, all rows constrained": (jax.jit(ids), some),
      "unconditional mask, no row constrained": (
          jax.jit(lambda l, sp, c, p, r, m: ids(apply_token_bitmask(l, m), sp, c, p, r)), free),
  }
  times = {name: [] for name in variants}
  for fn, mask in variants.values():
    jax.block_until_ready(fn(logits, sp, *hist, mask))  # compile
  for _ in range(iters * 5):  # interleaved: drifting load hits every variant alike
    for name, (fn, mask) in variants.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(logits, sp, *hist, mask))
      times[name].append((time.perf_counter() - t0) * 1e3)
  out = {name: dict(ms=statistics.median(t), min_ms=min(t)) for name, t in times.items()}
  for name, d in out.items():
    print(f"  sample() {name}: {d['ms']:.2f} ms", file=sys.stderr, flush=True)
  return out


def device_step(engine, iters, B=64, kv_len=64):
  """ms of the jitted step alone on one packed batch (masks already filled), free and
  constrained interleaved so that drifting load hits both alike."""
  import jax

  from jaxinfer.engine.runner import ScheduledSeq, bucket, pack
  from jaxinfer.sampling import SamplingParams
  r = engine.runner
  per_seq = kv_len // r.page_size + 1
  structured = StructuredOutput(json_object=True)
  batches = {}
  for name in ("free", "constrained"):
    params = SamplingParams(temperature=0, max_tokens=8,
                            structured=structured if name == "constrained" else None)
    seqs = [ScheduledSeq(row=i, token_ids=[5] * (kv_len + 1), start=kv_len, num_new=1,
                         pages=list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)), params=params, seed=0,
                         grammar=engine.grammars.matcher(structured) if params.structured else None)
            for i in range(B)]
    T = bucket(B, r.token_buckets)
    batches[name] = pack(seqs, T, r.num_seqs_bucket(T), r.num_speculative_tokens, r.pages_per_seq,
                         r.page_size, r.scratch_row, engine.config.vocab_size)

  def step(batch):
    t0 = time.perf_counter()
    r.cache, r.history, res = r._step(r.params, r.cache, r.history, batch, prompt_logprobs=False)
    jax.block_until_ready(res)
    return (time.perf_counter() - t0) * 1e3

  times = {name: [] for name in batches}
  for name, batch in batches.items():
    step(batch)  # compile / warm
  for _ in range(iters):
    for name, batch in batches.items():
      times[name].append(step(batch))
  out = {name: dict(step_ms=statistics.median(t), step_min_ms=min(t)) for name, t in times.items()}
  for name, d in out.items():
    print(f"  step, {name}: {d['step_ms']:.1f} ms", file=sys.stderr, flush=True)
  return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("--model", default=str(ROOT / "checkpoints" / "smollm2-135m-instruct"))
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--batches", default="1,16,64")
  ap.add_argument("--out", default=None)
  ap.add_argument("--xgrammar-python", default=None,
                  help="an interpreter with torch + xgrammar: also time xgrammar's masks")


def run(args: argparse.Namespace) -> int:
  env = environment(args.command)
  from jaxinfer.engine.engine import EngineConfig, LLMEngine
  engine = LLMEngine.from_model(args.model, engine_config=EngineConfig(max_num_seqs=64, warmup=False,
                                                                       max_model_len=512))
  batches = [int(b) for b in args.batches.split(",")]
  host, tokenizer_ms = host_masks(engine, batches, args.iters)
  xgr = xgrammar_masks(engine, args.xgrammar_python, batches, args.iters) if args.xgrammar_python else None
  samp = sampler(engine, args.iters)
  device = device_step(engine, args.iters)
  V = engine.config.vocab_size
  print(f"\nHost: fill_bitmasks for B constrained rows (V = {V}), median of {args.iters}; "
        f"llguidance's tokenizer built in {tokenizer_ms:.0f} ms (once per engine; xgrammar's first "
        f"compile includes its own)\n")
  xg = {(r["grammar"], r["batch"]): r for r in xgr or []}
  print("| grammar | B | llguidance ms per step | us per row | compile ms | xgrammar ms per step | compile ms |")
  print("|---|---|---|---|---|---|---|")
  for r in host:
    x = xg.get((r["grammar"], r["batch"]))
    other = f"{x['ms']:.3f} | {x['compile_ms']:.1f}" if x else "- | -"
    print(f"| {r['grammar']} | {r['batch']} | {r['ms']:.3f} | {r['per_row_us']:.1f} | {r['compile_ms']:.1f} | {other} |")
  print(f"\nDevice: sample() on [64, {V}] greedy, median of {args.iters * 5}\n")
  print("| variant | ms (min) |\n|---|---|")
  for name, d in samp.items():
    print(f"| {name} | {d['ms']:.2f} ({d['min_ms']:.2f}) |")
  print(f"\nDevice: the jitted 64-sequence greedy decode step (KV length 64), interleaved, median of {args.iters}\n")
  print("| rows constrained | step ms (min) |\n|---|---|")
  for name, label in (("free", "0 of 64"), ("constrained", "64 of 64")):
    d = device[name]
    print(f"| {label} | {d['step_ms']:.1f} ({d['step_min_ms']:.1f}) |")
  path = write_results("structured", dict(model=args.model, vocab=V, iters=args.iters, host=host,
                                          llguidance_tokenizer_ms=tokenizer_ms,
                                          sampler=samp, device_step=device, xgrammar=xgr),
                       args.out, env=env)
  print(f"\nwrote {path}")
  return 0
