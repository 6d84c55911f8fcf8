#!/usr/bin/env python
"""Weight-only quality of candidate int8 layouts on the default model, each fake-quantized
(quantized, then dequantized to float32) into one float32 LLM whose params are swapped per
layout: the same text, windows, prompts and metrics as scripts/eval_quality.py (top-1
agreement with float32, first greedy divergence over its 8 prompts x 48 tokens and its 8
held-out prompts x 24), without the CPU kernels' int16 activations. How issue 42's int8
default was chosen (jaxinfer.quant.leaf_layout); eval_quality.py measures the real formats.

  python scripts/eval_int8_layouts.py f32:f32,pc:col,g32a:g32 [OUT.json]

Each item is LINEARS:HEAD. Linears: f32, pc (int8 per output channel), g32 / g64 / g128
(symmetric int8 groups along the inputs), g32a (asymmetric groups of 32), fp8 (per-channel
e4m3). Head (the tied table [V, D]): f32, bf16, col (int8 per D column), row (int8 per vocab
row), g32 / g128 (symmetric groups of 32 / 128 along D per vocab row), g32h (g32 with float16
scales)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path
import numpy as np, jax, ml_dtypes
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "scripts"))
from jaxinfer import LLM, SamplingParams
from jaxinfer.default_model import default_checkpoint
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.params import param_specs, is_spec
from jaxinfer.quant import num_in_axes
import eval_quality as eq

def pc(w, n):  # per output channel int8 over first n axes
  s = np.abs(w).max(axis=tuple(range(n)), keepdims=True) / 127; s[s == 0] = 1
  return np.clip(np.rint(w / s), -127, 127) * s

def grp(w, n, g, asym=False, f16=False):
  shp = w.shape; I = int(np.prod(shp[:n])); x = w.reshape(I // g, g, -1)
  if asym:
    lo, hi = x.min(1, keepdims=True), x.max(1, keepdims=True); s = (hi - lo) / 255; s[s == 0] = 1
    if f16: lo, s = lo.astype(np.float16).astype(np.float32), s.astype(np.float16).astype(np.float32)
    return (np.clip(np.rint((x - lo) / s), 0, 255) * s + lo).reshape(shp)
  s = np.abs(x).max(1, keepdims=True) / 127; s[s == 0] = 1
  if f16: s = s.astype(np.float16).astype(np.float32)
  return (np.clip(np.rint(x / s), -127, 127) * s).reshape(shp)

def fp8pc(w, n):
  s = np.abs(w).max(axis=tuple(range(n)), keepdims=True) / 448; s[s == 0] = 1
  return np.clip(w / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s

def bf16(w): return w.astype(ml_dtypes.bfloat16).astype(np.float32)

LIN = dict(f32=lambda w, n: w, pc=pc, g32=lambda w, n: grp(w, n, 32), g128=lambda w, n: grp(w, n, 128),
           g32a=lambda w, n: grp(w, n, 32, True), g64=lambda w, n: grp(w, n, 64), fp8=fp8pc)
# embed table [V, D]
HEAD = dict(f32=lambda t: t, bf16=bf16,
            col=lambda t: pc(t, 1),  # per D column (today)
            row=lambda t: pc(t.T, 1).T,  # per vocab row
            g32=lambda t: grp(t.T, 1, 32).T,  # 32-groups along D per row (Q8_0)
            g32h=lambda t: grp(t.T, 1, 32, f16=True).T,
            g128=lambda t: grp(t.T, 1, 128).T)

HELD_OUT = eq.HELD_OUT

def main():
  combos = [c.split(":") for c in sys.argv[1].split(",")]
  ckpt = default_checkpoint(); tok = Tokenizer.load(Path(ckpt) / "tokenizer")
  ids = tok.encode(eq.TEXT.read_text())
  P = [tok.encode_chat([{"role": "user", "content": q}]) for q in eq.PROMPTS]
  H = [tok.encode_chat([{"role": "user", "content": q}]) for q in HELD_OUT]
  llm = LLM(ckpt, "float32", max_model_len=512, max_num_seqs=8, warmup=False)
  base = jax.device_get(llm.runner.params)
  specs = param_specs(llm.runner.cfg)
  windows = [ids[i:i + 512] for i in range(0, len(ids), 512)]; windows = [w for w in windows if len(w) > 1]
  ref = [llm.logits(w) for w in windows]
  sp48 = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
  sp24 = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
  refP = [o.token_ids for o in llm.generate(P, sp48)]; refH = [o.token_ids for o in llm.generate(H, sp24)]
  leaves_s = jax.tree.leaves(specs, is_leaf=is_spec)
  flat_w, tdef = jax.tree.flatten(base)
  assert len(leaves_s) == len(flat_w)
  rows = []
  for lin, head in combos:
    t = time.time()
    new = []
    for s, w in zip(leaves_s, flat_w):
      w = np.asarray(w, np.float32)
      if s.head: w = HEAD[head](w)
      elif s.linear and "vocab" not in s.axes: w = LIN[lin](w, num_in_axes(s))
      new.append(jax.numpy.asarray(w))
    llm.runner.params = jax.tree.unflatten(tdef, new)
    nll = n = agree = tot = 0
    for w, r in zip(windows, ref):
      lg = llm.logits(w)
      nll += eq.log_softmax_nll(lg[:-1], np.asarray(w[1:])); n += len(w) - 1
      agree += int((lg.argmax(-1) == r.argmax(-1)).sum()); tot += len(w)
    fd = lambda outs, refs: [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(outs, refs)]
    dP = fd([o.token_ids for o in llm.generate(P, sp48)], refP)
    dH = fd([o.token_ids for o in llm.generate(H, sp24)], refH)
    row = dict(lin=lin, head=head, ppl=float(np.exp(nll / n)), top1=agree / tot, P48=dP, P_id24=sum(x >= 24 for x in dP),
               H24=dH, H_id24=sum(x >= 24 for x in dH))
    print(json.dumps(row), f"{time.time()-t:.0f}s", flush=True)
    rows.append(row)
  if len(sys.argv) > 2:
    from jaxinfer.bench import harness as bench_peers
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    Path(sys.argv[2]).write_text(json.dumps(dict(
        benchmark="int8-layouts", commit=commit, command="python " + " ".join(sys.argv), cpu=bench_peers.cpu_info(),
        model=str(ckpt), rows=rows, notes="weight-only fake quantization (float32 activations); top1 over the "
        "eval_quality text; P48 first greedy divergence on eval_quality.PROMPTS x 48, H24 on HELD_OUT x 24"), indent=1))


if __name__ == "__main__":
  main()
