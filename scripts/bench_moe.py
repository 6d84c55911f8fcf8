#!/usr/bin/env python
"""A mixture-of-experts model on CPU: jaxinfer vs Hugging Face transformers, and where
jaxinfer's step time goes.

  python scripts/bench_moe.py [--layers 6] [--hidden 1024] [--expert-width 2816]
                              [--batch 16] [--new-tokens 8] [--prefill 2x128] [--out PATH]

The model: Mixtral-shaped, random weights (8 experts, top-2, hidden 1024,
expert width 2816, 16 query / 4 KV heads, vocab 32000; 6 layers by default,
~496M parameters, ~2 GB in float32). transformers (in the ref venv,
`.peers/ref/bin/python`, see jaxinfer/bench/peers.py) writes it once as a
Hugging Face dir under .peers/bench-moe/ (gitignored), so both engines load
the same safetensors. Prompts are random token ids, the same for both.

Measured, float32, greedy, in one run (each engine loads once):
  decode tok/s at batch 1 and at --batch: batch * (new tokens - 1) / (time from
    every sequence's first token to the last token), i.e. without the prefill;
  prefill tok/s: --prefill prompts (NxL) with max_tokens=1, prompt tokens / wall;
  greedy agreement: each prompt's ids from jaxinfer vs transformers (a cross-check:
    random weights, float32 on both sides, so they should agree).
jaxinfer runs through `jaxinfer.LLM` (prefix caching off, so a repeat is never
cheaper); transformers through `model.generate` (min_new_tokens = max_new_tokens).

The step's time split (jaxinfer only): the step itself is timed through the
engine's runner at the decode shapes (and the prefill shape), then its parts are
jitted and timed *in isolation* at the same shapes, on layer 0's weights and
times the number of layers: router (logits + top-k), token sort/dispatch +
combine (argsort, bincount, gather, scatter-back, weighted sum), expert matmuls
(the three `jax.lax.ragged_dot`s and the SwiGLU), attention (q/k/v/o
projections, RoPE, KV write, paged attention) and the LM head; the rest is the
step minus their sum (norms, residuals, embedding, sampling, host packing and
transfer). Where `moe.grouped_swiglu` does not use ragged_dot at a shape (the
jaxpr says; models/moe.py gathers each token copy's expert weights when there
are fewer copies than experts), the expert matmuls are that whole function and
sort/dispatch is 0. Beside it, the same expert product computed as a masked
dense matmul per expert over separate per-expert weight arrays, to show what
ragged_dot's XLA:CPU lowering costs. Method: timing jitted sub-functions, in
turns with the step itself (so that each median comes from the same stretch of
a shared machine's load), median of --reps rounds after a warm-up; not a
profiler trace. The largest part
is named in the output and the JSON ("bottleneck").

The machine may be shared: `/proc/loadavg` is recorded before and after, and
the JSON says when the load was above the core count. Writes
benchmarks/results/moe-<date>.json (commit, CPU, command).

This file also runs inside the ref venv as the transformers worker
(`<ref python> bench_moe.py --worker make|run SPEC.json`): only the standard
library is imported at module level, torch/transformers inside the worker,
jaxinfer only on the parent's side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULT_PREFIX = "BENCH_MOE_RESULT "
SEED = 0


# --------------------------------------------------------------------------- the model


def hf_config(args: argparse.Namespace) -> dict[str, Any]:
  """transformers.MixtralConfig kwargs of the benchmark model."""
  return dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.expert_width,
              num_hidden_layers=args.layers, num_attention_heads=args.heads,
              num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
              num_local_experts=args.experts, num_experts_per_tok=args.top_k,
              max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=1e6,
              tie_word_embeddings=False, sliding_window=None)


def num_params(c: dict[str, Any]) -> int:
  D, F, E, V = c["hidden_size"], c["intermediate_size"], c["num_local_experts"], c["vocab_size"]
  H, K, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
  layer = D * (H * d) * 2 + D * (K * d) * 2 + D * E + E * 3 * D * F + 2 * D
  return c["num_hidden_layers"] * layer + 2 * V * D + D


def model_dir(c: dict[str, Any]) -> Path:
  name = (f"mixtral-d{c['hidden_size']}-f{c['intermediate_size']}-l{c['num_hidden_layers']}-"
          f"e{c['num_local_experts']}x{c['num_experts_per_tok']}-h{c['num_attention_heads']}"
          f"k{c['num_key_value_heads']}-v{c['vocab_size']}-seed{SEED}")
  return ROOT / ".peers" / "bench-moe" / name


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
  import random
  rng = random.Random(seed)
  return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def load_average() -> str:
  try:
    return Path("/proc/loadavg").read_text().strip()
  except OSError:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# --------------------------------------------------------------------------- ref venv side


def worker_make(spec: dict[str, Any]) -> dict[str, Any]:
  """Random Mixtral weights saved as a Hugging Face dir: norms near 1, matrices normal / sqrt(fan_in)
  (the distribution scripts/make_goldens.py uses, so routing is not degenerate)."""
  import torch
  import transformers
  torch.manual_seed(SEED)
  cfg = transformers.MixtralConfig(**spec["config"])
  model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
  g = torch.Generator().manual_seed(SEED)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g)
      p.copy_(1.0 + 0.1 * noise if "norm" in name else noise / p.shape[-1] ** 0.5)
  out = Path(spec["dir"])
  model.save_pretrained(out, safe_serialization=True, max_shard_size="1GB")
  (out / "generation_config.json").unlink(missing_ok=True)
  return {"params": sum(p.numel() for p in model.parameters())}


def worker_run(spec: dict[str, Any]) -> dict[str, Any]:
  """transformers: decode at each batch, then prefill; greedy ids of the decode runs."""
  import torch
  import transformers
  torch.set_num_threads(spec["threads"])
  model = transformers.AutoModelForCausalLM.from_pretrained(spec["dir"], dtype=torch.float32).eval()

  class FirstCall(transformers.LogitsProcessor):
    """generate calls it first right after the prefill forward: the time to first token."""
    t: float | None = None

    def __call__(self, input_ids, scores):
      if self.t is None:
        self.t = time.perf_counter()
      return scores

  def generate(ps: list[list[int]], n_new: int) -> tuple[list[list[int]], float, float]:
    ids = torch.tensor(ps, dtype=torch.long)  # equal lengths: no padding
    first = FirstCall()
    with torch.inference_mode():
      t0 = time.perf_counter()
      out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                           min_new_tokens=n_new, do_sample=False, pad_token_id=0,
                           logits_processor=transformers.LogitsProcessorList([first]),
                           temperature=None, top_p=None, top_k=None)
      wall = time.perf_counter() - t0
    return out[:, ids.shape[1]:].tolist(), first.t - t0, wall

  result: dict[str, Any] = {"version": transformers.__version__, "torch_version": torch.__version__,
                            "threads": torch.get_num_threads(),
                            "experts_implementation": str(getattr(model.config, "_experts_implementation",
                                                                  None)),
                            "decode": [], "prefill": None}
  for batch_prompts in spec["decode_prompts"]:
    generate(batch_prompts, 2)  # warm-up at this batch
    outputs, ttft, wall = generate(batch_prompts, spec["new_tokens"])
    result["decode"].append({"batch": len(batch_prompts), "ttft_s": ttft, "wall_s": wall,
                             "outputs": outputs})
  generate(spec["prefill_warmup"], 1)
  runs = [generate(spec["prefill_prompts"], 1)[2] for _ in range(spec["reps_prefill"])]
  result["prefill"] = {"wall_s": min(runs), "runs_s": runs}
  return result


def worker_main(command: str, spec_path: str) -> int:
  spec = json.loads(Path(spec_path).read_text())
  result = {"make": worker_make, "run": worker_run}[command](spec)
  sys.stdout.flush()
  print(RESULT_PREFIX + json.dumps(result), flush=True)
  return 0


def ref_python() -> str:
  from jaxinfer.bench import peers
  return peers.ref_python()


def run_worker(command: str, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
  import tempfile
  python = ref_python()
  if not Path(python).is_file():
    raise SystemExit(f"bench_moe: no transformers venv at {python} (scripts/setup_peers.sh makes it)")
  with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="bench-moe-", delete=False) as f:
    json.dump(spec, f)
  try:
    proc = subprocess.run([python, __file__, "--worker", command, f.name], capture_output=True, text=True,
                          check=False, timeout=timeout_s,
                          env={**os.environ, "OMP_NUM_THREADS": str(spec.get("threads", 2))})
  finally:
    os.unlink(f.name)
  for line in proc.stdout.splitlines():
    if line.startswith(RESULT_PREFIX):
      return json.loads(line[len(RESULT_PREFIX):])
  raise RuntimeError(f"transformers worker {command!r} failed (exit {proc.returncode}):\n"
                     + (proc.stdout + proc.stderr)[-4000:])


def ensure_model(c: dict[str, Any]) -> Path:
  d = model_dir(c)
  if (d / "config.json").is_file() and any(d.glob("*.safetensors")) and (d / "done").is_file():
    return d
  print(f"bench_moe: writing the model ({num_params(c) / 1e6:.0f}M params) to {d}", file=sys.stderr, flush=True)
  d.mkdir(parents=True, exist_ok=True)
  made = run_worker("make", {"config": c, "dir": str(d)}, 1800)
  assert made["params"] == num_params(c), (made, num_params(c))
  (d / "done").write_text(json.dumps(made))
  return d


# --------------------------------------------------------------------------- jaxinfer side


def interleaved(fns: dict[str, Any], reps: int) -> dict[str, float]:
  """Median seconds of each of `fns` (no-argument callables, blocked on), after one warm-up call
  each, timed in turns (round r times every fn once), so that on a shared machine each one's
  median comes from the same stretch of time as the others'."""
  import jax
  for fn in fns.values():
    jax.block_until_ready(fn())
  runs: dict[str, list[float]] = {k: [] for k in fns}
  for _ in range(reps):
    for k, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      runs[k].append(time.perf_counter() - t0)
  return {k: statistics.median(v) for k, v in runs.items()}


def decode_rate(batch: int, new_tokens: int, first_s: float, wall_s: float) -> float:
  """Decode tokens/s without the prefill: the n-1 tokens after each sequence's first."""
  return batch * (new_tokens - 1) / (wall_s - first_s)


def jaxinfer_generate(llm, ps: list[list[int]], n_new: int) -> tuple[list[list[int]], float, float]:
  """(ids per prompt, seconds until every prompt has its first token, wall seconds)."""
  from jaxinfer import SamplingParams
  sp = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
  ids: list[list[int]] = [[] for _ in ps]
  first = None
  t0 = time.perf_counter()
  for out in llm.stream(ps, sp):
    ids[out.index] += out.new_token_ids
    if first is None and all(ids):
      first = time.perf_counter() - t0
  return ids, first, time.perf_counter() - t0


def time_split(llm, T_seqs: list[tuple[str, int, int, int]], reps: int, ablate: bool = True
               ) -> list[dict[str, Any]]:
  """Per shape (name, sequences, new tokens each, kv length): the runner's step and its parts.

  Every part is jitted alone at the step's shapes on layer 0's weights (all layers
  have the same shapes) and multiplied by the number of layers that have it. With
  `ablate`, also the step program with the routed experts replaced by a stand-in
  (one more compile per shape): the experts' cost inside the real program.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxinfer import SamplingParams
  from jaxinfer.engine.runner import ScheduledSeq
  from jaxinfer.models import moe as moe_mod
  from jaxinfer.models.layers import rms_norm
  from jaxinfer.models.transformer import attention_block, compute_logits

  r = llm.runner
  cfg = r.cfg
  params = r.params
  p0 = params["layers"][0]
  moe = p0["moe"]
  L = cfg.num_layers
  n_moe = sum(cfg.is_moe_layer(i) for i in range(L))
  A, E = cfg.num_experts_per_token, cfg.num_experts

  def dispatch_combine(x, ids, weights, ys):
    # grouped_swiglu (jaxinfer/models/moe.py) without its ragged_dots: sort the copies by expert,
    # gather their rows, and put the expert outputs back and sum them with their weights.
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    xs = jnp.take(x, order // A, axis=0)
    y = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True).reshape(x.shape[0], A, -1)
    return xs, group_sizes, jnp.einsum("TAD,TA->TD", y, weights).astype(x.dtype)

  def grouped_matmul(xs, group_sizes, w_gate, w_up, w_down):
    gate = jax.lax.ragged_dot(xs, w_gate, group_sizes)
    up = jax.lax.ragged_dot(xs, w_up, group_sizes)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, group_sizes)

  def per_expert_loop(xs, group_sizes, w_gate, w_up, w_down):
    # The same product with each expert's weights as its own array and a dense matmul per
    # expert over all rows, masked: all E experts computed, but no copy of a stacked weight.
    ends = jnp.cumsum(group_sizes)
    row = jnp.arange(xs.shape[0])
    out = jnp.zeros((xs.shape[0], w_down[0].shape[1]), xs.dtype)
    for e in range(len(w_gate)):
      mine = ((row >= ends[e] - group_sizes[e]) & (row < ends[e]))[:, None]
      h = jax.nn.silu(xs @ w_gate[e]) * (xs @ w_up[e])
      out = out + jnp.where(mine, h @ w_down[e], 0)
    return out

  def attend(p, x, positions, layer_cache, paged):
    return attention_block(p, cfg, rms_norm(x, p["attn_norm"], cfg.rms_norm_eps), positions,
                           layer_cache, paged, attention_impl=r.attention_impl)

  router_j = jax.jit(lambda p, x: moe_mod.route(p, cfg, x))
  # What the step runs for the routed experts (moe.py picks ragged_dot or another path by shape).
  experts_j = jax.jit(lambda x, ids, w, p: moe_mod.grouped_swiglu(x, ids, w, p["w_gate"], p["w_up"], p["w_down"]))
  dispatch_j = jax.jit(dispatch_combine)
  gmm_j = jax.jit(grouped_matmul)
  loop_j = jax.jit(per_expert_loop)
  split_w = [[moe[k][e] for e in range(E)] for k in ("w_gate", "w_up", "w_down")]  # separate arrays
  # The layer cache is donated, as in the real step (else each call copies it).
  attend_j = jax.jit(attend, donate_argnums=(3,))
  head_j = jax.jit(lambda p, h: compute_logits(p, cfg, h))

  sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
  pages_per = r.pages_per_seq

  def ablated_step(seqs) -> tuple[Any, dict[str, int]]:
    """A no-argument callable running the runner's step program with every layer's routed-expert
    product (moe.grouped_swiglu) replaced by x scaled by its routing weights' sum (so the router
    stays in the program): the step minus this is what the experts cost inside the real program,
    where XLA fuses and schedules them with the rest. Also the dot counts of both programs'
    StableHLO, which show that the stand-in is what got compiled."""
    def stand_in(x, ids, weights, *w):
      return x * jnp.sum(weights, axis=-1, keepdims=True).astype(x.dtype)

    from jaxinfer.engine.runner import SamplerInputs, to_buffers
    base = r._step.__wrapped__  # the forward program (the sampler is a program of its own)

    def stubbed(layout, params, cache, history, ints, floats, *, prompt_logprobs):  # traced anew
      return base(layout, params, cache, history, ints, floats, prompt_logprobs=prompt_logprobs)

    step = jax.jit(stubbed, static_argnums=(0,), static_argnames=("prompt_logprobs",), donate_argnums=(2,))
    T, lp, batch = r.pack_step(seqs)
    ints, floats, layout = to_buffers(batch)
    mode, fused = r.sampler_mode(batch)

    def dots(fn) -> int:
      text = fn.lower(layout, r.params, r.cache, r.history, ints, floats, prompt_logprobs=lp).as_text()
      return text.count("dot_general") + text.count("ragged_dot")

    def run():  # the stubbed forward, then the step's own sampler: what r.execute runs, less the experts
      r.cache, logits, expert_tokens, _ = step(layout, r.params, r.cache, r.history, ints, floats,
                                               prompt_logprobs=lp)
      results, _, _ = r._run_sampler(SamplerInputs.of(batch), mode, fused, logits, expert_tokens)
      return jax.device_get(results)

    counts = {"dots_in_step": dots(r._step)}
    real = moe_mod.grouped_swiglu
    moe_mod.grouped_swiglu = stand_in  # read when the step is traced, i.e. on the first call
    try:
      counts["dots_without_experts"] = dots(step)
      run()
    finally:
      moe_mod.grouped_swiglu = real
    if counts["dots_without_experts"] >= counts["dots_in_step"]:
      raise RuntimeError(f"stubbing moe.grouped_swiglu did not change the step program: {counts}")
    return run, counts

  def split_one(name: str, S: int, new: int, kv_len: int) -> dict[str, Any]:
    total = kv_len + new
    seqs = [ScheduledSeq(row=i, token_ids=list(range(100, 100 + total)), start=kv_len, num_new=new,
                         pages=list(range(1 + i * pages_per, 1 + i * pages_per + -(-total // r.page_size))),
                         params=sp, seed=0) for i in range(S)]
    T, _, batch = r.pack_step(seqs)
    x = jax.random.normal(jax.random.key(1), (T, cfg.hidden_size), r.dtype)
    weights, ids = router_j(moe, x)
    xs, gs, _ = dispatch_j(x, ids, weights, jnp.zeros((T * A, cfg.hidden_size), r.dtype))
    ys = gmm_j(xs, gs, moe["w_gate"], moe["w_up"], moe["w_down"])
    ys_loop = loop_j(xs, gs, *split_w)
    cache = {k: jnp.array(v, copy=True) for k, v in r.cache[0].items()}
    positions, paged = jnp.asarray(batch.positions), jax.tree.map(jnp.asarray, batch.paged)
    hidden = x[:int(np.asarray(batch.logits_indices).shape[0])]  # the rows the LM head reads

    def attend_once():
      nonlocal cache
      out, cache = attend_j(p0, x, positions, cache, paged)
      return out

    # Whether the step's grouped_swiglu goes through ragged_dot at this shape; if it does not
    # (moe.py's per-copy gather for fewer copies than experts), that path is the matmul part
    # and there is no sort/dispatch.
    uses_ragged_dot = "ragged_dot" in str(jax.make_jaxpr(experts_j)(x, ids, weights, moe))
    fns = {"step": lambda: r.execute(seqs),
           "router": lambda: router_j(moe, x),
           "experts": lambda: experts_j(x, ids, weights, moe),
           "attention": attend_once,
           "lm_head": lambda: head_j(params, hidden),
           "alternative": lambda: loop_j(xs, gs, *split_w)}
    if uses_ragged_dot:
      fns["dispatch"] = lambda: dispatch_j(x, ids, weights, ys)
      fns["grouped_matmul"] = lambda: gmm_j(xs, gs, moe["w_gate"], moe["w_up"], moe["w_down"])
    if ablate:
      fns["step_without_experts"], dot_counts = ablated_step(seqs)
    t = interleaved(fns, reps)
    del cache
    step_s, experts_s = t["step"], t["experts"]
    per_layer = {"router": t["router"], "dispatch": t.get("dispatch", 0.0),
                 "grouped_matmul": t.get("grouped_matmul", experts_s), "attention": t["attention"]}
    alternative = {
        "method": "each expert's weights as a separate array, a masked dense matmul per expert "
                  "(all E experts computed): what the grouped matmul costs without ragged_dot's lowering",
        "per_layer_ms": t["alternative"] * 1e3,
        "max_abs_diff_vs_ragged_dot": float(jnp.max(jnp.abs(ys_loop - ys)))}
    parts = {k: v * (n_moe if k != "attention" else L) for k, v in per_layer.items()}
    parts["lm_head"] = t["lm_head"]
    parts["rest"] = step_s - sum(parts.values())
    in_step = None
    if ablate:
      in_step = {"step_without_experts_ms": t["step_without_experts"] * 1e3,
                 "experts_ms": (step_s - t["step_without_experts"]) * 1e3,
                 "experts_share": (step_s - t["step_without_experts"]) / step_s, **dot_counts}
    return dict(shape=name, sequences=S, tokens=T, new_tokens_per_seq=new, kv_len=kv_len,
                uses_ragged_dot=uses_ragged_dot, experts_in_step=in_step,
                routed_experts_path="ragged_dot" if uses_ragged_dot else "moe.py's non-ragged path",
                routed_experts_ms_per_layer=experts_s * 1e3, step_ms=step_s * 1e3,
                per_layer_ms={k: v * 1e3 for k, v in per_layer.items()},
                parts_ms={k: v * 1e3 for k, v in parts.items()},
                share={k: v / step_s for k, v in parts.items()},
                grouped_matmul_alternative=alternative)

  return [split_one(*shape) for shape in T_seqs]


def ragged_dot_lowering(cfg, dtype) -> str:
  """What XLA made of one ragged_dot at decode size (the HLO's dot shapes), for the JSON."""
  import re

  import jax
  import jax.numpy as jnp
  E, D, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
  hlo = jax.jit(jax.lax.ragged_dot).lower(
      jax.ShapeDtypeStruct((2, D), dtype), jax.ShapeDtypeStruct((E, D, F), dtype),
      jax.ShapeDtypeStruct((E,), jnp.int32)).compile().as_text()
  dots = sorted(set(re.findall(r"= (\w+\[[\d,]+\])\S* dot\(", hlo)))
  transposes = sorted(set(re.findall(r"= (\w+\[[\d,]+\])\S* transpose\(", hlo)))
  return (f"{jax.default_backend()}: ragged_dot x[2,{D}] . w[{E},{D},{F}] compiles to dot(s) {dots}, "
          f"transpose(s) {transposes}")


def run_jaxinfer(d: Path, args, decode_prompts: list[list[list[int]]], prefill_prompts, prefill_warmup,
                 ) -> dict[str, Any]:
  from jaxinfer import LLM
  t0 = time.perf_counter()
  llm = LLM(str(d), dtype="float32", max_num_seqs=max(len(b) for b in decode_prompts),
            max_num_batched_tokens=args.max_batched_tokens, max_model_len=1024, warmup=False,
            enable_prefix_caching=False, kv_cache_bytes=256 << 20)
  result: dict[str, Any] = {"load_s": time.perf_counter() - t0, "decode": []}
  print(f"bench_moe: jaxinfer loaded in {result['load_s']:.1f}s", file=sys.stderr, flush=True)
  for ps in decode_prompts:
    jaxinfer_generate(llm, ps, 2)  # compiles this batch's prefill and decode buckets
    outputs, first, wall = jaxinfer_generate(llm, ps, args.new_tokens)
    result["decode"].append({"batch": len(ps), "ttft_s": first, "wall_s": wall, "outputs": outputs})
    print(f"bench_moe: jaxinfer decode batch {len(ps)}: {wall:.1f}s", file=sys.stderr, flush=True)
  jaxinfer_generate(llm, prefill_warmup, 1)
  runs = [jaxinfer_generate(llm, prefill_prompts, 1)[2] for _ in range(args.reps_prefill)]
  result["prefill"] = {"wall_s": min(runs), "runs_s": runs}
  print(f"bench_moe: jaxinfer prefill {runs}", file=sys.stderr, flush=True)
  kv = args.prompt_len + args.new_tokens // 2  # a decode step in the middle of the timed ones
  result["split"] = time_split(llm, [(f"decode b={len(ps)}", len(ps), 1, kv) for ps in decode_prompts], args.reps)
  if not args.no_prefill_split:  # ~9 s a step: fewer rounds
    result["split"] += time_split(llm, [(f"prefill {len(prefill_prompts)}x{len(prefill_prompts[0])}",
                                         len(prefill_prompts), len(prefill_prompts[0]), 0)],
                                  max(2, (args.reps + 1) // 2))
  result["ragged_dot_lowering"] = ragged_dot_lowering(llm.config, llm.runner.dtype)
  return result


# --------------------------------------------------------------------------- report


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
  """How far two engines' greedy ids agree: same sequences, and the common prefix of each."""
  prefix = []
  for x, y in zip(a, b):
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
      n += 1
    prefix.append(n)
  return {"identical": sum(x == y for x, y in zip(a, b)), "sequences": len(a),
          "common_prefix": prefix, "tokens_agreeing": sum(prefix), "tokens": sum(len(x) for x in a)}


SPLIT_PARTS = ("router", "dispatch", "grouped_matmul", "attention", "lm_head", "rest")
PART_NAMES = {"router": "router", "dispatch": "token sort/dispatch/combine",
              "grouped_matmul": "expert matmuls", "attention": "attention",
              "lm_head": "LM head", "rest": "rest"}


def bottleneck(split_row: dict[str, Any], backend: str = "XLA:CPU") -> dict[str, Any]:
  """The largest part of one step, by the parts timed alone (the remainder 'rest' is not a
  candidate). For the expert matmuls, the share quoted first is the in-program one (the step
  minus the step without the routed experts) where that was measured."""
  part = max((k for k in SPLIT_PARTS if k != "rest"), key=lambda k: split_row["parts_ms"][k])
  share, ms = split_row["share"][part], split_row["parts_ms"][part]
  what = PART_NAMES[part]
  in_step = split_row.get("experts_in_step") if part == "grouped_matmul" else None
  if part == "grouped_matmul":
    what = ("ragged_dot" if split_row.get("uses_ragged_dot", True)
            else "the routed experts' matmuls (moe.py's non-ragged path)")
  if in_step:
    share, ms = in_step["experts_share"], in_step["experts_ms"]
    text = (f"{what} on {backend} is {100 * share:.0f}% of the {split_row['shape']} step "
            f"(step {split_row['step_ms']:.0f} ms, {in_step['step_without_experts_ms']:.0f} ms with the routed "
            f"experts stubbed out; timed alone {split_row['parts_ms'][part]:.0f} ms)")
  else:
    text = (f"{what} on {backend} is {100 * share:.0f}% of the {split_row['shape']} step "
            f"({ms:.0f} of {split_row['step_ms']:.0f} ms, timed alone)")
  alt = split_row.get("grouped_matmul_alternative")
  if part == "grouped_matmul" and alt:
    text += (f"; per layer {split_row['per_layer_ms']['grouped_matmul']:.1f} ms, vs "
             f"{alt['per_layer_ms']:.1f} ms for a masked matmul per expert over per-expert weight arrays")
  return {"part": part, "shape": split_row["shape"], "share": share, "ms": ms,
          "step_ms": split_row["step_ms"], "text": text}


def summarize(jx: dict[str, Any], hf: dict[str, Any], new_tokens: int, prefill_tokens: int) -> list[dict]:
  rows = []
  for name, res in (("jaxinfer", jx), ("transformers", hf)):
    row: dict[str, Any] = {"engine": name}
    for dec in res["decode"]:
      row[f"decode_b{dec['batch']}_tok_s"] = decode_rate(dec["batch"], new_tokens, dec["ttft_s"], dec["wall_s"])
    row["prefill_tok_s"] = prefill_tokens / res["prefill"]["wall_s"]
    rows.append(row)
  return rows


def print_tables(rows, batches, prefill_desc, agree, split, model_desc) -> None:
  print(f"\nMoE on CPU, {model_desc}, float32, greedy")
  cols = [f"decode_b{b}_tok_s" for b in batches] + ["prefill_tok_s"]
  heads = [f"decode tok/s (batch {b})" for b in batches] + [f"prefill tok/s ({prefill_desc})"]
  print("| engine | " + " | ".join(heads) + " |")
  print("|---" * (len(cols) + 1) + "|")
  for r in rows:
    print(f"| {r['engine']} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + " |")
  print("greedy agreement jaxinfer vs transformers: " + "; ".join(
      f"batch {b}: {a['identical']}/{a['sequences']} sequences identical, "
      f"{a['tokens_agreeing']}/{a['tokens']} tokens before the first difference" for b, a in zip(batches, agree)))
  print("\njaxinfer step time split (jitted parts timed alone at the step's shapes; rest = step - parts), ms (share)")
  print("| step | step ms | " + " | ".join(PART_NAMES[k] for k in SPLIT_PARTS) + " |")
  print("|---" * (len(SPLIT_PARTS) + 2) + "|")
  for s in split:
    path = "ragged_dot" if s["uses_ragged_dot"] else "non-ragged path"
    print(f"| {s['shape']} ({path}) | {s['step_ms']:.0f} | " + " | ".join(
        f"{s['parts_ms'][k]:.1f} ({100 * s['share'][k]:.0f}%)" for k in SPLIT_PARTS) + " |")
  if any(s.get("experts_in_step") for s in split):
    print("routed experts inside the step program (step - the step with moe.grouped_swiglu stubbed out): " + "; ".join(
        f"{s['shape']}: {s['experts_in_step']['experts_ms']:.0f} ms ({100 * s['experts_in_step']['experts_share']:.0f}%)"
        for s in split if s.get("experts_in_step")))
  if any(s["parts_ms"]["rest"] < 0 for s in split):
    print("(a negative rest: the parts, timed alone, summed past the step; on a shared machine a part's "
          "median and the step's come from different moments)")


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--worker", nargs=2, metavar=("COMMAND", "SPEC"), help=argparse.SUPPRESS)
  ap.add_argument("--layers", type=int, default=6)
  ap.add_argument("--hidden", type=int, default=1024)
  ap.add_argument("--expert-width", type=int, default=2816)
  ap.add_argument("--experts", type=int, default=8)
  ap.add_argument("--top-k", type=int, default=2)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--kv-heads", type=int, default=4)
  ap.add_argument("--vocab", type=int, default=32000)
  ap.add_argument("--batch", type=int, default=16, help="the larger decode batch (besides 1)")
  ap.add_argument("--prompt-len", type=int, default=16, help="decode prompts' length")
  ap.add_argument("--new-tokens", type=int, default=8, help="greedy tokens per decode prompt")
  ap.add_argument("--prefill", default="2x128", help="prefill prompts, NUMxLEN")
  ap.add_argument("--max-batched-tokens", type=int, default=512)
  ap.add_argument("--reps", type=int, default=5, help="timed rounds of the step and its parts")
  ap.add_argument("--reps-prefill", type=int, default=2)
  ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="torch threads")
  ap.add_argument("--no-prefill-split", action="store_true", help="split the decode steps only")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  if args.worker:
    return worker_main(*args.worker)
  if args.new_tokens < 2:
    ap.error("--new-tokens must be >= 2 (decode rate counts the tokens after the first)")
  n_pre, len_pre = (int(v) for v in args.prefill.lower().split("x"))
  if n_pre * len_pre > args.max_batched_tokens:
    ap.error(f"--prefill {args.prefill} must fit one step of --max-batched-tokens {args.max_batched_tokens}")

  load_before = load_average()
  t_start = time.perf_counter()
  c = hf_config(args)
  d = ensure_model(c)
  batches = [1, args.batch]
  decode_prompts = [prompts(b, args.prompt_len, args.vocab, seed=b) for b in batches]
  prefill_prompts = prompts(n_pre, len_pre, args.vocab, seed=1000)
  prefill_warmup = prompts(n_pre, len_pre, args.vocab, seed=2000)
  spec = dict(dir=str(d), threads=args.threads, new_tokens=args.new_tokens, decode_prompts=decode_prompts,
              prefill_prompts=prefill_prompts, prefill_warmup=prefill_warmup, reps_prefill=args.reps_prefill)
  print("bench_moe: transformers ...", file=sys.stderr, flush=True)
  t0 = time.perf_counter()
  hf = run_worker("run", spec, 1800)
  hf["process_s"] = time.perf_counter() - t0
  print(f"bench_moe: transformers done in {hf['process_s']:.0f}s; jaxinfer ...", file=sys.stderr, flush=True)
  t0 = time.perf_counter()
  jx = run_jaxinfer(d, args, decode_prompts, prefill_prompts, prefill_warmup)
  jx["process_s"] = time.perf_counter() - t0
  load_after = load_average()

  rows = summarize(jx, hf, args.new_tokens, n_pre * len_pre)
  agree = [agreement(a["outputs"], b["outputs"]) for a, b in zip(jx["decode"], hf["decode"])]
  neck = bottleneck(jx["split"][0])
  model_desc = (f"Mixtral-shaped random weights: {args.layers} layers, hidden {args.hidden}, "
                f"{args.experts} experts top-{args.top_k} of width {args.expert_width}, "
                f"{args.heads}/{args.kv_heads} heads, vocab {args.vocab}, {num_params(c) / 1e6:.0f}M params "
                f"({num_params(c) * 4 / 1e9:.2f} GB float32)")
  print_tables(rows, batches, args.prefill, agree, jx["split"], model_desc)
  print(f"\nbottleneck: {neck['text']}")
  for s in jx["split"][1:]:
    print(f"            {bottleneck(s)['text']}")
  print(f"ragged_dot lowering: {jx['ragged_dot_lowering']}")
  cores = os.cpu_count() or 1
  loads = [float(load_before.split()[0]), float(load_after.split()[0])]
  shared = max(loads) > 0.5 * cores
  print(f"load average before: {load_before}; after: {load_after}"
        + (f" (the {cores} cores were shared with other work: numbers are noisy)" if shared else ""))
  for res in (jx, hf):
    for dec in res["decode"]:
      del dec["outputs"]
  from jaxinfer.bench.harness import write_results
  payload = dict(
      model=dict(hf_config=c, dir=str(d.relative_to(ROOT)), params=num_params(c),
                 float32_bytes=num_params(c) * 4, description=model_desc),
      settings=dict(dtype="float32", batches=batches, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                    prefill=args.prefill, torch_threads=args.threads,
                    decode_rate="batch * (new_tokens - 1) / (wall - time to every first token)",
                    prefill_rate="prompt tokens / wall of max_tokens=1 (best of reps)"),
      rows=rows, greedy_agreement=dict(zip((f"batch_{b}" for b in batches), agree)),
      split=dict(method="jitted sub-functions of models/moe.py and models/transformer.py timed in isolation "
                        "at the step's shapes (layer 0's weights, x number of layers), median of "
                        f"{args.reps} rounds after a warm-up, the step (ModelRunner.execute) and its parts timed in turns; "
                        "rest = step - sum of parts (norms, residuals, embedding, sampling, host pack)",
                 rows=jx["split"]),
      bottleneck=neck, bottlenecks=[bottleneck(s) for s in jx["split"]],
      ragged_dot_lowering=jx["ragged_dot_lowering"],
      jaxinfer=dict(load_s=jx["load_s"], process_s=jx["process_s"], decode=jx["decode"], prefill=jx["prefill"]),
      transformers=hf,
      load_average=dict(before=load_before, after=load_after, cores=cores, shared=shared, niceness=os.nice(0),
                        note=("other processes were using the cores during the run" if shared else "")),
      total_s=time.perf_counter() - t_start,
  )
  out = write_results("moe", payload, args.out)
  print(f"wrote {out} ({payload['total_s']:.0f}s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
