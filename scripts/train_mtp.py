#!/usr/bin/env python
"""Trains an MTP head (jaxinfer.models.mtp) for a model that ships none, by self-distillation.

  python scripts/train_mtp.py --model PATH [--minutes 20] [--max-tokens 96] [--ship]

1. The model answers every prompt of jaxinfer/data/mtp_prompts.txt (as a chat), once
   greedily and `--samples` times sampled (`--temperature`): its own continuations.
2. The frozen model runs once over each sequence: its final hidden states h_i and the
   top `--top-k` of its next-token distribution at each position are kept in memory.
3. The head learns, with optax AdamW, to predict from (h_i, t_{i+1}) the target's
   distribution for t_{i+2} (cross-entropy to the target's top-k probabilities), and,
   weighted `--chain-weight`, the same one step further from its own output g in place of
   h (how the engine chains drafts, MTP-Eagle). The block starts as a copy of the model's
   last decoder layer, eh_proj as [0; I] (x = hnorm(h)), the head norm as the final norm.
4. Every `--eval-every` steps: on held-out sequences, how often the head's argmax equals the
   target's (step 1, and step 2 through the chain): the acceptance curve.

The head is saved beside the checkpoint (mtp_head.safetensors, bfloat16, + mtp_head.json),
where LLM(..., speculative={"method": "mtp"}) finds it; `--ship` also writes it to
jaxinfer/data/mtp/<model name>.* (the head shipped for the default model). The run's
settings, wall time and curve go to benchmarks/results/mtp-train-<date>.json.

Attention: training uses a dense causal attention over each padded sequence (the engine's
paged attention loops are not reverse-differentiable); at start the script checks that it
computes what the engine's paged path does. GQA models (Llama family, Mistral, Qwen) only:
DeepSeek-V3/R1 (MLA) ship their own MTP layer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROMPTS = ROOT / "jaxinfer" / "data" / "mtp_prompts.txt"


def read_prompts(path: Path) -> list[str]:
  try:
    lines = path.read_text().splitlines()
  except OSError as e:
    sys.exit(f"train_mtp: cannot read the prompt file {path}: {e.strerror}")
  prompts = [l.strip() for l in lines if l.strip() and not l.lstrip().startswith("#")]
  if len(prompts) < 4:
    sys.exit(f"train_mtp: {path} holds {len(prompts)} prompts; need at least 4 (one per line)")
  return prompts


# ---- the data: the model's own continuations, and its hidden states -------------------------

def generate(llm, prompts: list[str], max_tokens: int, samples: int, temperature: float, seed: int):
  """Token ids of prompt + continuation for each prompt: greedy, then `samples` sampled ones."""
  from jaxinfer import SamplingParams
  chats = [[{"role": "user", "content": p}] for p in prompts]
  params = [SamplingParams(temperature=0, max_tokens=max_tokens)] * len(chats)
  for s in range(samples):
    params += [SamplingParams(temperature=temperature, top_p=0.95, max_tokens=max_tokens, seed=seed + s * 100003 + i)
               for i in range(len(chats))]
  outs = llm.generate(chats * (1 + samples), params, use_tqdm=True)
  return [o.prompt_token_ids + o.token_ids for o in outs]


def target_pass(cfg, params, seqs: list[list[int]], L: int, top_k: int, page_size: int = 16):
  """The frozen model over each sequence (padded to L, run at a multiple of 64 of its own
  length): hidden [N, L, D] and the top-k of its
  next-token distribution [N, L, top_k] (probabilities and ids)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from tqdm.auto import tqdm

  from jaxinfer.models.cache import CacheSpec
  from jaxinfer.models.transformer import PagedBatch, compute_logits, forward
  from jaxinfer.params import model_dtype

  spec = CacheSpec.from_config(cfg, model_dtype(params))

  @jax.jit
  def run(params, tokens, length):
    L = tokens.shape[0]  # a multiple of 64: one program per bucket
    num_pages = L // page_size + 2
    cache = spec.zeros(num_pages, page_size)
    pos = jnp.arange(L, dtype=jnp.int32)
    slots = jnp.where(pos < length, pos + page_size, 0)
    pages = jnp.arange(1, num_pages, dtype=jnp.int32)[None, :]
    batch = PagedBatch(slots, length[None], pages, jnp.stack([0, length]).astype(jnp.int32), jnp.int32(1))
    hidden, _ = forward(params, cfg, tokens, pos, cache, batch, attention_impl="xla")
    lp = jax.nn.log_softmax(compute_logits(params, cfg, hidden), axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, top_k)
    return hidden, jnp.exp(top_lp), top_ids

  N, D = len(seqs), cfg.hidden_size
  hidden = np.zeros((N, L, D), np.float32)
  probs = np.zeros((N, L, top_k), np.float32)
  ids = np.zeros((N, L, top_k), np.int32)
  for n, s in enumerate(tqdm(seqs, desc="target hidden states", unit="seq")):
    B = min(L, -(-len(s) // 64) * 64)
    tokens = np.zeros(B, np.int32)
    tokens[:len(s)] = s
    h, p, i = jax.device_get(run(params, tokens, np.int32(len(s))))
    hidden[n, :B], probs[n, :B], ids[n, :B] = h, p, i
  return hidden, probs, ids


# ---- the head: init, and a differentiable forward over padded sequences --------------------------

def init_head(cfg, params, seed: int):
  """Block = the model's last decoder layer; eh_proj = [0; I] (x = hnorm(h) to start);
  shared_head.norm = the model's final norm."""
  import jax
  import numpy as np
  D = cfg.hidden_size
  rng = np.random.default_rng(seed)
  eh = np.zeros((2 * D, D), np.float32)
  eh[:D] = rng.normal(size=(D, D)) * 0.02  # the embedding half: small, so the block sees h at first
  eh[D:] = np.eye(D)
  from jaxinfer.params import unfuse_layer
  # The engine runs on fused q/k/v and gate/up (jaxinfer.params.FUSED); the head is written
  # under the checkpoint's Hugging Face names, so its block takes the separate weights.
  last = unfuse_layer(cfg, jax.device_get(params["layers"][-1]), cfg.num_layers - 1)
  last = jax.tree.map(lambda a: np.array(a, np.float32), last)
  return {"enorm": np.ones(D, np.float32), "hnorm": np.ones(D, np.float32), "eh_proj": eh,
          "norm": np.array(params["final_norm"], np.float32), "block": last}


def dense_block(p, cfg, x, positions, length):
  """One GQA decoder layer over one padded sequence x [L, D] with plain causal attention:
  what models.transformer.decoder_layer computes through the paged cache."""
  import jax
  import jax.numpy as jnp
  from jaxinfer.models.layers import apply_rope, rms_norm, rope_attention_factor, rope_inv_freq
  from jaxinfer.models.transformer import dense_ffn

  h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
  q = jnp.einsum("TD,DHd->THd", h, p["wq"])
  k = jnp.einsum("TD,DKd->TKd", h, p["wk"])
  v = jnp.einsum("TD,DKd->TKd", h, p["wv"])
  if cfg.attention_bias:
    q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
  if cfg.qk_norm:
    q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
  inv_freq, f = rope_inv_freq(cfg), rope_attention_factor(cfg)
  q, k = apply_rope(q, positions, inv_freq, f), apply_rope(k, positions, inv_freq, f)
  G = cfg.num_heads // cfg.num_kv_heads
  q = q.reshape(q.shape[0], cfg.num_kv_heads, G, -1)  # [T, K, G, d]
  s = jnp.einsum("TKGd,SKd->KGTS", q, k) / math.sqrt(cfg.head_dim)
  i = jnp.arange(x.shape[0])
  mask = (i[None, :] <= i[:, None]) & (i[None, :] < length)
  window = cfg.layer_sliding_window(cfg.num_layers - 1)
  if window:
    mask &= i[None, :] > i[:, None] - window
  s = jnp.where(mask, s, -1e30)
  o = jnp.einsum("KGTS,SKd->TKGd", jax.nn.softmax(s, axis=-1), v).reshape(x.shape[0], cfg.num_heads, -1)
  out = jnp.einsum("THd,HdD->TD", o, p["wo"])
  if cfg.attention_out_bias:
    out = out + p["bo"]
  x = x + out
  return x + dense_ffn(p, rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps))


def head_forward(p, embed, cfg, h, next_tokens, positions, length):
  """models.mtp.mtp_hidden for one padded sequence, with dense attention: g [L, D]."""
  import jax.numpy as jnp
  from jaxinfer.models.layers import rms_norm
  e = jnp.where((positions == 0)[:, None], 0, embed[next_tokens])
  eh = jnp.concatenate([rms_norm(e, p["enorm"], cfg.rms_norm_eps), rms_norm(h, p["hnorm"], cfg.rms_norm_eps)], -1)
  return dense_block(p["block"], cfg, jnp.einsum("TE,ED->TD", eh, p["eh_proj"]), positions, length)


def check_against_engine(cfg, params, head, h, tokens, length, page_size=16):
  """The training forward equals the engine's paged mtp_hidden on one sequence."""
  import jax.numpy as jnp
  import numpy as np
  from jaxinfer.models.cache import CacheSpec
  from jaxinfer.models.mtp import mtp_hidden
  from jaxinfer.models.transformer import PagedBatch
  L = h.shape[0]
  pos = jnp.arange(L, dtype=jnp.int32)
  nxt = jnp.asarray(np.append(tokens[1:], 0), jnp.int32)
  dense = head_forward(head, params["embed"], cfg, jnp.asarray(h), nxt, pos, length)
  num_pages = L // page_size + 2
  cache = CacheSpec.from_config(cfg, jnp.float32, draft_layers=1).zeros(num_pages, page_size)[-1]
  slots = jnp.where(pos < length, pos + page_size, 0)
  batch = PagedBatch(slots, jnp.int32(length)[None], jnp.arange(1, num_pages, dtype=jnp.int32)[None],
                     jnp.array([0, length], jnp.int32), jnp.int32(1))
  paged, _ = mtp_hidden(head, params["embed"], cfg, jnp.asarray(h), nxt, pos, cache, batch, attention_impl="xla")
  err = float(jnp.max(jnp.abs(dense[:length] - paged[:length])))
  scale = float(jnp.max(jnp.abs(paged[:length])))
  if not err <= 1e-3 * max(scale, 1.0):
    sys.exit(f"train_mtp: the training forward differs from the engine's by {err:.3g} (scale {scale:.3g})")
  return err


# ---- training ------------------------------------------------------------------------------

def make_step(cfg, opt, chain_weight: float):
  """Jitted (step, evaluate); the frozen model's params are an argument (closed over, XLA
  would constant-fold the [V, D] embedding at compile time)."""
  import jax
  import jax.numpy as jnp
  import optax
  from jaxinfer.models.layers import rms_norm
  from jaxinfer.models.transformer import compute_logits

  def logits(p, params, g):
    return compute_logits(params, cfg, rms_norm(g, p["norm"], cfg.rms_norm_eps))

  def one(p, params, h, tokens, probs, ids, length):
    """Per sequence: losses and argmax hits of step 1 and the chained step 2."""
    L = tokens.shape[0]
    pos = jnp.arange(L, dtype=jnp.int32)
    nxt = jnp.append(tokens[1:], 0)
    # Position i predicts t_{i+2}: the target's distribution at row i + 1.
    t_probs, t_ids = jnp.roll(probs, -1, axis=0), jnp.roll(ids, -1, axis=0)
    valid1 = pos + 2 < length
    g = head_forward(p, params["embed"], cfg, h, nxt, pos, length)
    lq = jax.nn.log_softmax(logits(p, params, g), axis=-1)  # [L, V]
    ce1 = -(t_probs * jnp.take_along_axis(lq, t_ids, axis=-1)).sum(-1)
    hit1 = jnp.argmax(lq, -1) == t_ids[:, 0]
    out = [(ce1, hit1, valid1)]
    if chain_weight:
      # Step 2 at position i + 1 reads g_i in place of h_{i+1}, and t_{i+2}; it predicts t_{i+3}.
      g_prev = jnp.concatenate([h[:1], g[:-1]], axis=0)
      g2 = head_forward(p, params["embed"], cfg, g_prev, nxt, pos, length)
      lq2 = jax.nn.log_softmax(logits(p, params, g2), axis=-1)
      ce2 = -(t_probs * jnp.take_along_axis(lq2, t_ids, axis=-1)).sum(-1)
      hit2 = (jnp.argmax(lq2, -1) == t_ids[:, 0]) & jnp.roll(hit1, 1)  # draft 2 counts after draft 1
      out.append((ce2, hit2, valid1 & (pos >= 1)))
    return out

  def loss_fn(p, params, batch):
    per = jax.vmap(one, in_axes=(None, None, 0, 0, 0, 0, 0))(p, params, *batch)
    total, metrics = 0.0, []
    for j, (ce, hit, valid) in enumerate(per):
      n = jnp.maximum(valid.sum(), 1)
      l = (ce * valid).sum() / n
      total = total + (1.0 if j == 0 else chain_weight) * l
      metrics += [l, (hit & valid).sum() / n]
    return total, jnp.stack(metrics)

  @jax.jit
  def step(p, state, params, batch):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, params, batch)
    updates, state = opt.update(grads, state, p)
    return optax.apply_updates(p, updates), state, metrics

  @jax.jit
  def evaluate(p, params, batch):
    return loss_fn(p, params, batch)[1]

  return step, evaluate


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default=None, help="checkpoint (default: the default model)")
  ap.add_argument("--prompts", type=Path, default=PROMPTS)
  ap.add_argument("--max-tokens", type=int, default=96, help="continuation length per prompt")
  ap.add_argument("--samples", type=int, default=1, help="sampled continuations per prompt (plus one greedy)")
  ap.add_argument("--temperature", type=float, default=0.7)
  ap.add_argument("--top-k", type=int, default=8, help="target probabilities kept per position")
  ap.add_argument("--minutes", type=float, default=20.0, help="training time budget (after the data)")
  ap.add_argument("--max-steps", type=int, default=100000)
  ap.add_argument("--batch", type=int, default=4, help="sequences per step")
  ap.add_argument("--lr", type=float, default=1e-3)
  ap.add_argument("--chain-weight", type=float, default=0.5, help="weight of the chained step 2 (0: off)")
  ap.add_argument("--eval-every", type=int, default=25)
  ap.add_argument("--eval-frac", type=float, default=0.1)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--ship", action="store_true", help="also write it to jaxinfer/data/mtp/<model name>.*")
  ap.add_argument("--results", type=Path, default=None, help="the results JSON (default benchmarks/results/mtp-train-<date>.json)")
  args = ap.parse_args(argv)
  for name in ("max_tokens", "top_k", "batch", "eval_every"):
    if getattr(args, name) < 1:
      ap.error(f"--{name.replace('_', '-')} must be >= 1")
  if not 0 < args.eval_frac < 1:
    ap.error("--eval-frac must be in (0, 1)")
  try:
    import optax
  except ImportError:
    sys.exit("train_mtp: needs optax (pip install optax)")
  import jax
  import numpy as np
  from tqdm.auto import tqdm

  from jaxinfer import LLM
  from jaxinfer.checkpoint.mtp_head import save_mtp_head, shipped_paths

  t_start = time.time()
  prompts = read_prompts(args.prompts)
  model = args.model
  if model is None:
    from jaxinfer.default_model import default_checkpoint
    model = default_checkpoint()
  llm = LLM(model, max_num_seqs=32, max_num_batched_tokens=256, max_model_len=1024, warmup=False)
  cfg, params = llm.engine.config, llm.engine.runner.params
  if cfg.kv_lora_rank:
    sys.exit("train_mtp: MLA models (DeepSeek-V2/V3) are not supported; DeepSeek-V3/R1 checkpoints ship "
             "their own MTP layer, which speculative={'method': 'mtp'} loads")
  if cfg.num_experts or cfg.attention_sinks:
    sys.exit(f"train_mtp: {cfg.architecture}: only dense GQA models (Llama family, Mistral, Qwen2/3) are supported")

  t0 = time.time()
  seqs = generate(llm, prompts, args.max_tokens, args.samples, args.temperature, args.seed)
  t_gen = time.time() - t0
  L = -(-max(len(s) for s in seqs) // 64) * 64
  del llm
  t0 = time.time()
  hidden, probs, ids = target_pass(cfg, params, seqs, L, args.top_k)
  t_hidden = time.time() - t0
  N = len(seqs)
  tokens = np.zeros((N, L), np.int32)
  lengths = np.array([len(s) for s in seqs], np.int32)
  for n, s in enumerate(seqs):
    tokens[n, :len(s)] = s

  rng = np.random.default_rng(args.seed)
  # Held out by prompt, so no eval sequence shares a prompt with a training one.
  P = len(prompts)
  eval_prompts = set(rng.permutation(P)[:max(1, int(P * args.eval_frac))].tolist())
  is_eval = np.array([n % P in eval_prompts for n in range(N)])
  train_idx, eval_idx = np.flatnonzero(~is_eval), np.flatnonzero(is_eval)
  data = (hidden, tokens, probs, ids, lengths)

  head = init_head(cfg, params, args.seed)
  err = check_against_engine(cfg, params, head, hidden[0], tokens[0], int(lengths[0]))
  head = jax.device_put(head)
  total_steps = args.max_steps
  sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, 20, max(total_steps, 100), args.lr * 0.1)
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))
  state = opt.init(head)
  step, evaluate = make_step(cfg, opt, args.chain_weight)

  def eval_metrics(p):
    out = []
    for lo in range(0, len(eval_idx), args.batch):
      sel = eval_idx[lo:lo + args.batch]
      if len(sel) < args.batch:  # same shape: one program
        sel = np.concatenate([sel, eval_idx[:args.batch - len(sel)]])
      out.append(np.asarray(evaluate(p, params, tuple(a[sel] for a in data))))
    return np.mean(out, axis=0).tolist()

  def row(step_no, m, t):
    r = {"step": step_no, "seconds": round(t, 1), "loss_1": m[0], "acc_1": m[1]}
    if args.chain_weight:
      r.update(loss_2=m[2], acc_2_after_1=m[3])
    return r

  curve = [row(0, eval_metrics(head), 0.0)]
  print(f"eval at step 0: {curve[-1]}", flush=True)
  t_train0 = time.time()
  deadline = t_train0 + args.minutes * 60
  n_steps, train_log = 0, []
  bar = tqdm(total=int(args.minutes * 60), desc="training", unit="s", bar_format="{l_bar}{bar}| {n:.0f}/{total}s {postfix}")
  order = rng.permutation(train_idx)
  pos = 0
  while time.time() < deadline and n_steps < args.max_steps:
    if pos + args.batch > len(order):
      order, pos = rng.permutation(train_idx), 0
    sel = np.sort(order[pos:pos + args.batch])
    pos += args.batch
    head, state, m = step(head, state, params, tuple(a[sel] for a in data))
    n_steps += 1
    m = np.asarray(m).tolist()
    train_log.append(m)
    bar.n = min(int(time.time() - t_train0), bar.total)
    bar.set_postfix(step=n_steps, loss=f"{m[0]:.3f}", acc1=f"{m[1]:.2f}")
    bar.refresh()
    if n_steps % args.eval_every == 0:
      curve.append(row(n_steps, eval_metrics(head), time.time() - t_train0))
      tqdm.write(f"eval at step {n_steps}: {curve[-1]}")
  bar.close()
  t_train = time.time() - t_train0
  if curve[-1]["step"] != n_steps:
    curve.append(row(n_steps, eval_metrics(head), t_train))
  print(f"final eval: {curve[-1]}", flush=True)

  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
  settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
  settings.update(model=str(model), sequences=N, train_sequences=len(train_idx), eval_sequences=len(eval_idx),
                  padded_len=L, tokens=int(lengths.sum()), prompts=len(prompts))
  meta = {"trained_by": "scripts/train_mtp.py", "commit": commit, "settings": settings, "steps": n_steps,
          "final_eval": curve[-1]}
  head_host = jax.device_get(head)
  path = save_mtp_head(model, cfg, head_host, meta)
  print(f"saved {path} ({path.stat().st_size / 2**20:.1f} MiB)")
  if args.ship:
    shipped = save_mtp_head(model, cfg, head_host, meta, paths=shipped_paths(cfg))
    print(f"shipped {shipped}")
  wall = time.time() - t_start
  result = {
      "benchmark": "mtp-train", "commit": commit, "command": "scripts/train_mtp.py " + " ".join(argv or sys.argv[1:]),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "cpu": os.cpu_count(), "load_average_end": list(os.getloadavg()), "model": cfg.name,
      "settings": settings, "head_file": str(path), "head_bytes": path.stat().st_size,
      "head_params": int(sum(np.size(a) for a in jax.tree.leaves(head_host))),
      "engine_check_max_abs_err": err,
      "seconds": {"generate": round(t_gen, 1), "target_pass": round(t_hidden, 1), "train": round(t_train, 1),
                  "wall": round(wall, 1)},
      "steps": n_steps, "acceptance_curve": curve,
      "train_log_every_10": [dict(zip(("loss_1", "acc_1", "loss_2", "acc_2_after_1"), m)) for m in train_log[::10]],
      "note": ("acc_1: held-out positions where the head's argmax equals the target's next-next token "
               "(teacher-forced draft 1 acceptance); acc_2_after_1: draft 2 through the chain, counted only "
               "where draft 1 was also right"),
  }
  out = args.results or ROOT / "benchmarks" / "results" / f"mtp-train-{datetime.date.today().isoformat()}.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1) + "\n")
  print(f"wrote {out}; wall {wall / 60:.1f} min")
  return 0


if __name__ == "__main__":
  sys.exit(main())
