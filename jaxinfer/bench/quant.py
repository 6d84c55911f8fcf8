"""Quantized matmul forms (int8, fp8, int4) against float32 at SmolLM2-135M's decode shapes, then the model end to end.

Why a chain of 30 layers' weights and not one matrix: a single 576 x 1536
weight (3.5 MB in float32) stays in cache between timed calls, which hides
exactly what int8 is for (bytes of weights read per token). Each row times
one jitted program that runs x through L distinct weights, as the model's
layers do (x = x + mean(tanh(x @ W_l)): each matmul waits on the one before,
at the cost of a row reduction), and reports the time per matmul.

Forms (T = tokens in the step: 1 = batch-1 decode, 64 = a 64-sequence decode):
  float32           x @ W
  (Q: the quantized values as jaxinfer stores them, [out, in]; "@ Q" contracts their minor axis)
  int8 kernel       cpu_kernels.int8_matmul(x, Q) * s  what jaxinfer.quant.linear runs on CPU
                                              (one device): x to int16 per token, the hand-written
                                              AVX2 kernel reads Q once, exact integer sums
  int8 split [in,out]  the same dot over values stored [in, out] (jaxinfer's older
                    layout): why values are stored [out, in], XLA CPU's int8 dot reads it slower
  int8 split        ([hi; lo] @ Q, int32) * a * s  what quant.linear runs without the kernel: x in two
                                              int8 limbs per token (x = a (hi + lo / 254)), one
                                              int8 x int8 dot of 2T rows that reads Q as int8
  int8 weight-only  (x @ float(Q)) * s        the GPU path; XLA CPU materializes float(Q) per call
  int8 x int8       (q(x) @ Q, int32) * a * s  one int8 limb per token (not used: accuracy, and
                                              at T = 1 XLA CPU widens Q to s32 per call)
  bf16 einsum       x @ W in bfloat16       bf16 result: XLA CPU writes a float32 copy of W per call
  bf16 linear       x @ W in bfloat16       jaxinfer.quant.float_linear: float32 accumulation (and
                                              one row run as two), which XLA CPU's YNNPACK runs on W
  q8_0 groups       int8 x int8 with one scale per 32 inputs (GGUF Q8_0 as loaded): one
                    int32 dot per group (a batch dimension), scaled, summed (not used)
  q8_0 dequant      x @ (Q * group scales)     what linear runs for Q8_0 weights
  fp8               quant.linear's fp8 (e4m3 values, per-channel scales): on one CPU device
                    cpu_kernels.fp8_matmul (weight-only, rows converted into a small float32
                    panel), where XLA ran (x @ float(F8)) * s, a float32 copy per call
  int4 g32          quant.linear's int4 (values, scales and mins per 32 inputs; GGUF Q4_0 / Q4_1
                    as loaded): cpu_kernels.int4_matmul (cells below 16 tokens, repacked panels
                    from 16 on); without the kernel x @ (Q4 * s + m), dequantized whole

--accuracy: float32 vs int8 next-token logits of the default model over chat
prompts (teacher-forced): the library's split form, weight-only and one-limb
int8 activations ('int8 x int8') patched in, the measurement that chose the split.

--e2e also times LLM.generate on the default model, float32, bfloat16, int8, fp8 and int4
weights, and float32 weights over an int8 / fp8 KV cache (kv-int8, kv-fp8; --e2e-formats
picks some), each in
its own process (`jaxinfer bench offline`'s worker, token budget 512 as there): batch 1 and 64 prompts,
128 new tokens, EOS ignored.

  jaxinfer bench quant              # matmuls only
  jaxinfer bench quant --e2e        # and the end-to-end decode rows
  jaxinfer bench quant --accuracy   # and float32 vs int8 logits of the default model

Writes benchmarks/results/quant-matmul-<date>.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import time

from jaxinfer.bench.harness import UsageError, environment, load_average, prompts_token_ids, write_results

D, F = 576, 1536  # SmolLM2-135M hidden and MLP widths
SHAPES = {"gate/up D->F": (D, F), "down F->D": (F, D), "wq/wo D->D": (D, D)}


def _time(fn, *args, repeats: int) -> float:
  fn(*args).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    fn(*args).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return best


def matmul_rows(layers: int, repeats: int, only: list[str] | None = None, tokens=(1, 16, 64)) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxinfer.quant import (float_linear, quantize_fp8, quantize_int4, quantize_int8, quantized_matmul,
                              split_int8_matmul)

  rng = np.random.default_rng(0)
  forms = {
      "float32": lambda x, w: x @ w["f"],
      "int8 kernel": lambda x, w: _kernel(x, w["q"], w["s"][0]),
      "int8 split [in,out]": lambda x, w: _split_in_out(x, w["qio"], w["s"][0]),
      "int8 split": lambda x, w: split_int8_matmul(x, w["q"], w["s"][0]),
      "int8 weight-only": lambda x, w: _weight_only(x, w["q"], w["s"]),
      "int8 x int8": lambda x, w: _int8_dot(x, w["q"], w["s"]),
      "bf16 einsum": lambda x, w: jnp.einsum("TD,DF->TF", x.astype(jnp.bfloat16), w["b"]).astype(x.dtype),
      "bf16 linear": lambda x, w: float_linear("TD,DF->TF", x.astype(jnp.bfloat16), w["b"]).astype(x.dtype),
      "q8_0 groups": lambda x, w: _grouped_int8(x, w["q"], w["g"]),
      "q8_0 dequant": lambda x, w: quantized_matmul(x, w["q"], w["g"]),  # what quant.linear runs for G > 1
      "fp8": lambda x, w: quantized_matmul(x, w["f8"], w["s8"]),
      "int4 g32": lambda x, w: quantized_matmul(x, w["i4"], w["s4"], w["m4"]),
  }
  if only:
    unknown = set(only) - set(forms)
    if unknown:
      raise UsageError(f"--forms: unknown {sorted(unknown)}; known: {', '.join(forms)}")
    forms = {k: v for k, v in forms.items() if k in only}
  rows = []
  for name, (I, O) in SHAPES.items():
    weights = []
    for _ in range(layers):
      f = rng.standard_normal((I, O)).astype(np.float32) / np.sqrt(I)
      q = quantize_int8(f, 1)
      groups = np.repeat(q.scales, I // 32, axis=0)  # same numbers, the Q8_0 layout of scales
      f8, i4 = quantize_fp8(f, 1), quantize_int4(f, 1)
      weights.append({"f": jnp.asarray(f), "b": jnp.asarray(f, jnp.bfloat16), "q": jnp.asarray(q.values), "s": jnp.asarray(q.scales),
                      "qio": jnp.asarray(np.ascontiguousarray(q.values.T)),
                      "g": jnp.asarray(groups), "f8": jnp.asarray(f8.values), "s8": jnp.asarray(f8.scales),
                      "i4": jnp.asarray(i4.values), "s4": jnp.asarray(i4.scales), "m4": jnp.asarray(i4.mins)})
    for T in tokens:
      x = jnp.asarray(rng.standard_normal((T, I)).astype(np.float32))
      row = {"shape": name, "in": I, "out": O, "tokens": T, "layers": layers}
      for form, mm in forms.items():
        chain = jax.jit(lambda x, ws, mm=mm: _chain(mm, x, ws))
        row[form + " us"] = _time(chain, x, weights, repeats=repeats) / layers * 1e6
      rows.append(row)
      print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
            flush=True)
  return rows


def _kernel(x, q, s):
  """quant.int8_matmul's kernel path, required here: a row that silently fell back to the
  split dot would be mislabelled."""
  import cpu_kernels

  if not cpu_kernels.available():
    raise SystemExit(f"the int8 CPU kernel is not available: {cpu_kernels.unavailable_reason()}")
  return cpu_kernels.int8_matmul(x, q) * s


def _quantize_activations(x):
  """x [M, I] -> (int8 [M, I], float32 scale [M, 1]), symmetric per token."""
  import jax.numpy as jnp
  from jaxinfer.quant import token_scales
  a = token_scales(x)
  return jnp.clip(jnp.round(x.astype(jnp.float32) / a), -127, 127).astype(jnp.int8), a


def _split_in_out(x, q_in_out, scale):
  """quant.split_int8_matmul over values stored [in, out]."""
  import jax
  import jax.numpy as jnp
  from jaxinfer.quant import SPLIT_INT8_LO, split_activations
  M = x.shape[0]
  limbs, a = split_activations(x)
  acc = jax.lax.dot_general(limbs, q_in_out, (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.int32).astype(jnp.float32)
  return (acc[:M] + acc[M:] * (1.0 / SPLIT_INT8_LO)) * a * scale


def _weight_only(x, q, scales):
  """Float activations x the int8 weight [out, in] converted for the dot, per-channel scales after it."""
  import jax
  import jax.numpy as jnp
  return jax.lax.dot_general(x.astype(jnp.float32), q.astype(jnp.float32), (((1,), (1,)), ((), ()))) * scales[0]


def _int8_dot(x, q, scales):
  """Per-token int8 activations x per-channel int8 weights, int32 accumulation, then both scales."""
  import jax
  import jax.numpy as jnp
  xq, a = _quantize_activations(x)
  acc = jax.lax.dot_general(xq, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
  return acc.astype(jnp.float32) * scales[0] * a


def _grouped_int8(x, q, scales):
  """Q8_0 kept integer: per-token int8 activations, one int32 dot per group of 32 inputs (a
  batch dimension), each scaled by its group's scales, summed over groups."""
  import jax
  import jax.numpy as jnp
  xq, a = _quantize_activations(x)
  M, G, (O, I) = xq.shape[0], scales.shape[0], q.shape
  acc = jax.lax.dot_general(xq.reshape(M, G, I // G), q.reshape(O, G, I // G),
                            (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.int32)  # [G, M, O]
  return jnp.sum(acc.astype(jnp.float32) * scales[:, None, :], axis=0) * a


def _chain(mm, x, ws):
  import jax.numpy as jnp
  for w in ws:
    x = x + jnp.mean(jnp.tanh(mm(x, w)), axis=-1, keepdims=True)
  return x


# kv-int8 / kv-fp8: float32 weights over an int8 / fp8 KV cache.
E2E_FORMATS = ("float32", "bfloat16", "int8", "fp8", "int4", "kv-int8", "kv-fp8")


def e2e_rows(max_tokens: int, num_prompts: int, timeout_s: float, formats=E2E_FORMATS) -> list[dict]:
  from jaxinfer.bench import offline as bench_offline
  prompts = prompts_token_ids(num_prompts)
  rows = []
  for n in (1, num_prompts):
    for fmt in formats:
      kv = fmt[3:] if fmt.startswith("kv-") else "auto"
      dtype = "bfloat16" if fmt == "bfloat16" else "float32"
      quantization = None if fmt in ("float32", "bfloat16") or kv != "auto" else fmt
      r = bench_offline.run_jaxinfer(dtype, prompts[:n], max_tokens, 512, timeout_s,
                                     quantization=quantization, kv_cache_dtype=kv)
      r["format"] = fmt
      rows.append(r)
      print(f"{n} prompts {fmt}: {r['tokens_per_s']:.1f} tok/s "
            f"(rss {r['peak_rss_mb']:.0f} MB)", flush=True)
  return rows


def accuracy_rows(num_prompts: int) -> list[dict]:
  """float32 vs int8 next-token logits of the default model over chat prompts (teacher-forced):
  the split form (jaxinfer.quant as it is), then weight-only and one-limb int8 activations
  patched in."""
  import numpy as np

  import jaxinfer.quant as quant
  from jaxinfer import LLM
  prompts = prompts_token_ids(num_prompts)
  ref = LLM(None, max_model_len=512, warmup=False)
  ref_logits = [ref.logits(p) for p in prompts]
  del ref
  rows = []
  library = quant.quantized_matmul
  for form, mm in (("int8 split", library),
                   ("int8 weight-only", lambda x, q, s, m=None: library(x, q, s, m) if s.shape[0] > 1 else _weight_only(x, q, s)),
                   ("int8 x int8", lambda x, q, s, m=None: library(x, q, s, m) if s.shape[0] > 1 else _int8_dot(x, q, s))):
    quant.quantized_matmul = mm  # linear() looks it up at trace time; a fresh LLM traces anew
    try:
      q = LLM(None, max_model_len=512, warmup=False, quantization="int8")
      diffs, agree, n = [], 0, 0
      for p, a in zip(prompts, ref_logits):
        b = q.logits(p)
        diffs.append(np.abs(a - b))
        agree += int(np.sum(a.argmax(-1) == b.argmax(-1)))
        n += len(p)
    finally:
      quant.quantized_matmul = library
    d = np.concatenate([x.ravel() for x in diffs])
    row = {"form": form, "prompts": num_prompts, "positions": n, "top1_agreement": agree / n,
           "max_abs_logit_diff": float(d.max()), "mean_abs_logit_diff": float(d.mean()),
           "mean_abs_logit": float(np.mean([np.abs(a).mean() for a in ref_logits]))}
    print(row, flush=True)
    rows.append(row)
  return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--layers", type=int, default=30, help="distinct weights per chain (SmolLM2: 30 layers)")
  p.add_argument("--repeats", type=int, default=20, help="timed calls per form (best is kept)")
  p.add_argument("--e2e", action="store_true", help="also LLM.generate float32 vs the other formats on the default model")
  p.add_argument("--e2e-formats", default=",".join(E2E_FORMATS), help="comma-separated, of " + ", ".join(E2E_FORMATS))
  p.add_argument("--accuracy", action="store_true",
                 help="also float32 vs int8 logits of the default model over --accuracy-prompts chat prompts")
  p.add_argument("--accuracy-prompts", type=int, default=16)
  p.add_argument("--skip-matmuls", action="store_true")
  p.add_argument("--forms", default=None, help="comma-separated matmul forms to time (default: all)")
  p.add_argument("--tokens", default="1,16,64", help="comma-separated token counts T per matmul")
  p.add_argument("--max-tokens", type=int, default=128)
  p.add_argument("--num-prompts", type=int, default=64)
  p.add_argument("--timeout", type=float, default=1800)
  p.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
  formats = tuple(f for f in args.e2e_formats.split(",") if f)
  if unknown := set(formats) - set(E2E_FORMATS):
    raise UsageError(f"--e2e-formats: unknown {sorted(unknown)} (choose from {', '.join(E2E_FORMATS)})")
  env = environment(args.command)
  load_before = load_average()
  only = args.forms.split(",") if args.forms else None
  tokens = tuple(int(t) for t in args.tokens.split(","))
  rows = [] if args.skip_matmuls else matmul_rows(args.layers, args.repeats, only, tokens)
  forms = [k for k in rows[0] if k.endswith(" us")] if rows else []
  if rows:
    print("\n| shape | T | " + " | ".join(forms) + " |")
    print("|---|---|" + "---|" * len(forms))
  for r in rows:
    print(f"| {r['shape']} | {r['tokens']} | " + " | ".join(f"{r[f]:.1f}" for f in forms) + " |")
  accuracy = accuracy_rows(args.accuracy_prompts) if args.accuracy else None
  e2e = e2e_rows(args.max_tokens, args.num_prompts, args.timeout, formats) if args.e2e else []
  if e2e:
    print("\n| prompts | format | weights | KV cache | tok/s | peak RSS MB |\n|---|---|---|---|---|---|")
    for r in e2e:
      print(f"| {r['num_prompts']} | {r['format']} | {r['precision']} | {r['kv_cache_dtype']} | "
            f"{r['tokens_per_s']:.1f} | {r['peak_rss_mb']:.0f} |")
  load_after = load_average()
  print(f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after (2 cores, shared)")
  path = write_results("quant-matmul", dict(matmuls=rows, e2e=e2e, accuracy=accuracy,
                                            load_average_before=load_before, load_average_after=load_after,
                                            notes="best of --repeats; time per matmul (a chain of "
                                                  "--layers distinct weights). On one CPU device int8, "
                                                  "int4 g32 and (since 2026-11-27) fp8 run cpu_kernels' "
                                                  "custom calls. Bottleneck of every other "
                                                  "weight-only form: the loop fusion that converts "
                                                  "(int4: and scales and offsets) the whole weight into an "
                                                  "f32 [in, out] buffer before the dot (compiled HLO, "
                                                  "tests/test_quant.py); fp8 and int4 converts are software "
                                                  "conversions on this CPU, slower than int8's. int8 split "
                                                  "escapes it: an s8 x s8 dot of >= 2 rows runs in XLA "
                                                  "CPU's YNNPACK fusion over the int8 weight"),
                       args.out, env=env)
  print(f"wrote {path}")
  return 0
