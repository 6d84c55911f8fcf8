"""Pallas attention kernels against the machine's ceilings and against XLA / cuDNN, in one run.

Measured in the same process, in this order:
  1. ceilings: HBM bandwidth of a large device-to-device copy (x + 1 over a
     big bf16 array: bytes read + written / time) and bf16 matmul TFLOP/s
     (square 8192 matmul);
  2. decode (q_len 1): B sequences of kv_len keys, Hq 32, Hkv 8, D 128, bf16,
     pages shuffled, per page size. Achieved bandwidth = bytes of K + V read /
     time, as % of the copy bandwidth (target >= 80%), for the Pallas kernel,
     the XLA reference (jaxinfer.ops.ragged_paged_attention_xla) and
     jax.nn.dot_product_attention on the same K/V laid out densely (cuDNN
     where it runs, else XLA);
  3. mixed batches (decode + MTP verify + chunked prefill in one call): Pallas
     vs the XLA reference, time and ratio;
  4. prefill: flash_attention (causal, Hq 32, Hkv 8, D 128, bf16) for B in
     {1, 4} x T in {2048, 4096}: TFLOP/s (causal FLOPs = 2 * B * Hq * D * T
     * (T + 1), both matmuls), % of the matmul ceiling, and the ratio of
     dot_product_attention's time to ours (target >= 1.0x vs cuDNN).
  5. accept (speculative decoding): pallas_kernels.spec_accept on S
     sequences x (k + 1) float32 logit rows of a 49152-token vocab (SmolLM2),
     k = 3, for greedy, sampled point-mass and sampled full-q drafts: the
     kernel, its jnp reference, and (point-mass) what the engine runs today
     (jaxinfer.sampling.sample on every row + spec_decode.accept). Achieved
     bandwidth = logit (and q) bytes read once / time, as % of the copy
     bandwidth; the integer outputs are checked equal to the reference's.

Each case: compiled and checked against its baseline first (max |error|
recorded), warm-up runs, then the median of --reps timed runs, each run a
burst of --burst back-to-back calls ended by jax.block_until_ready (so
Python dispatch does not count for short kernels).

  jaxinfer bench kernels              # GPU: full shapes
  jaxinfer bench kernels --smoke      # tiny shapes, Pallas in interpret mode
  jaxinfer bench kernels --gpu        # fail unless a GPU is present

Without a GPU it runs --smoke by itself: it exercises every code path
on CPU, and its numbers mean nothing, so its JSON goes to a temporary file
unless --out is given. On a GPU the JSON goes to
benchmarks/results/kernels-<device-kind>-<date>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import re
import statistics
import tempfile
import time
from pathlib import Path


import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.bench.harness import RESULTS, UsageError, environment, load_average
from jaxinfer.engine.spec_decode import accept
from jaxinfer.ops import ragged_paged_attention_xla
from jaxinfer.sampling import SamplingBatch, sample
from pallas_kernels import flash_attention, ragged_paged_attention
from pallas_kernels.spec_accept import BlockSizes as AcceptBlockSizes
from pallas_kernels.spec_accept import spec_accept, spec_accept_reference


@dataclasses.dataclass(frozen=True)
class Shapes:
  """Every size the run uses; FULL on a GPU, SMOKE on CPU."""
  copy_mib: int
  matmul_n: int
  decode_batch: int
  decode_kv_len: int
  page_sizes: tuple[int, ...]
  heads: tuple[int, int, int]  # Hq, Hkv, D
  # mixed batch: (count, q_len, kv_len) groups
  mixed: tuple[tuple[int, int, int], ...]
  prefill: tuple[tuple[int, int], ...]  # (B, T)
  accept: tuple[tuple[int, int, int], ...]  # (S, k, V)
  accept_block_v: int | None  # None: the kernel's default
  accept_modes: tuple[str, ...]  # of greedy, point_mass, full_q
  reps: int
  warmup: int
  burst: int


FULL = Shapes(copy_mib=1024, matmul_n=8192, decode_batch=64, decode_kv_len=2048,
              page_sizes=(16, 32, 64), heads=(32, 8, 128),
              mixed=((48, 1, 2048), (8, 4, 2048), (2, 512, 1536)),
              prefill=((1, 2048), (1, 4096), (4, 2048), (4, 4096)),
              accept=((1, 3, 49152), (16, 3, 49152), (64, 3, 49152)), accept_block_v=None,
              accept_modes=("greedy", "point_mass", "full_q"),
              reps=20, warmup=3, burst=5)
SMOKE = Shapes(copy_mib=4, matmul_n=256, decode_batch=3, decode_kv_len=40, page_sizes=(16,),
               heads=(4, 2, 64), mixed=((2, 1, 40), (1, 4, 30), (1, 24, 24)),
               prefill=((1, 48),), accept=((3, 2, 300),), accept_block_v=128,
               accept_modes=("point_mass", "full_q"), reps=2, warmup=1, burst=1)


def has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def time_us(fn, *args, shapes: Shapes) -> float:
  """Median microseconds per call (fn already compiled)."""
  for _ in range(shapes.warmup):
    jax.block_until_ready(fn(*args))
  runs = []
  for _ in range(shapes.reps):
    start = time.perf_counter()
    outs = [fn(*args) for _ in range(shapes.burst)]
    jax.block_until_ready(outs)
    runs.append((time.perf_counter() - start) / shapes.burst)
  return statistics.median(runs) * 1e6


def max_err(a, b) -> float:
  return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


# ---------------------------------------------------------------- ceilings


def ceilings(shapes: Shapes) -> dict:
  n = shapes.copy_mib * 2**20 // 2
  x = jnp.ones((n,), jnp.bfloat16)
  copy = jax.jit(lambda x: x + 1)  # reads and writes every byte; cannot be elided
  jax.block_until_ready(copy(x))
  copy_us = time_us(copy, x, shapes=shapes)
  m = shapes.matmul_n
  a = jnp.ones((m, m), jnp.bfloat16)
  matmul = jax.jit(lambda a, b: a @ b)
  jax.block_until_ready(matmul(a, a))
  matmul_us = time_us(matmul, a, a, shapes=shapes)
  return {"copy_bytes": 2 * 2 * n, "copy_us": copy_us, "hbm_gb_s": 2 * 2 * n / copy_us / 1e3,
          "matmul_n": m, "matmul_us": matmul_us, "matmul_tflop_s": 2 * m**3 / matmul_us / 1e6}


# ---------------------------------------------------------------- paged batches


def paged_batch(rng, groups, page_size, Hq, Hkv, D, dtype=jnp.bfloat16):
  """A ragged batch: groups of (count, q_len, kv_len), pages shuffled over the pool."""
  seqs = [(q, kv) for count, q, kv in groups for _ in range(count)]
  S = len(seqs)
  P = max(-(-kv // page_size) for _, kv in seqs)
  N = S * P + 1
  page_indices = rng.permutation(N)[:S * P].reshape(S, P).astype(np.int32)
  cu = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)
  key = jax.random.key(int(rng.integers(2**31)))
  kq, kk, kv_ = jax.random.split(key, 3)
  T = int(cu[-1])
  return {
      "q": jax.random.normal(kq, (T, Hq, D), dtype),
      "k_pages": jax.random.normal(kk, (N, page_size, Hkv, D), dtype),
      "v_pages": jax.random.normal(kv_, (N, page_size, Hkv, D), dtype),
      "kv_lens": jnp.asarray([kv for _, kv in seqs], jnp.int32),
      "page_indices": jnp.asarray(page_indices),
      "cu_q_lens": jnp.asarray(cu),
      "num_seqs": jnp.int32(S),
  }


def kv_bytes(batch) -> int:
  """Bytes of K and V a perfect kernel reads: each sequence's kv_len keys, once per kv head."""
  _, _, Hkv, D = batch["k_pages"].shape
  return 2 * int(np.sum(np.asarray(batch["kv_lens"]))) * Hkv * D * batch["k_pages"].dtype.itemsize


def dense_from_pages(batch):
  """The decode batch's K/V as dense [B, kv_len, Hkv, D] (all sequences equally long)."""
  kv_len = int(batch["kv_lens"][0])
  B = batch["kv_lens"].shape[0]
  _, _, Hkv, D = batch["k_pages"].shape
  gather = lambda pages: pages[batch["page_indices"]].reshape(B, -1, Hkv, D)[:, :kv_len]
  return gather(batch["k_pages"]), gather(batch["v_pages"])


def sdpa(impl):
  return jax.jit(functools.partial(jax.nn.dot_product_attention, implementation=impl),
                 static_argnames=("is_causal",))


def best_sdpa(q, k, v, *, is_causal, want):
  """cuDNN's dot_product_attention when it compiles for these shapes, else XLA's."""
  notes = []
  for impl in ("cudnn", "xla"):
    fn = functools.partial(sdpa(impl), is_causal=is_causal)
    try:
      out = jax.block_until_ready(fn(q, k, v))
    # cuDNN refuses platforms (RuntimeError), shapes and dtypes (ValueError, NotImplementedError)
    # that it does not cover.
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as e:
      notes.append(f"{impl}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
      continue
    return impl, fn, max_err(out, want), notes
  raise RuntimeError("; ".join(notes))


def decode_cases(shapes: Shapes, ceil: dict, interpret: bool, rng) -> list[dict]:
  Hq, Hkv, D = shapes.heads
  rows = []
  pallas = jax.jit(functools.partial(ragged_paged_attention, interpret=interpret))
  xla = jax.jit(ragged_paged_attention_xla)
  for page_size in shapes.page_sizes:
    batch = paged_batch(rng, ((shapes.decode_batch, 1, shapes.decode_kv_len),), page_size, Hq, Hkv, D)
    nbytes = kv_bytes(batch)
    want = jax.block_until_ready(xla(**batch))
    got = jax.block_until_ready(pallas(**batch))
    case = {"section": "decode", "B": shapes.decode_batch, "kv_len": shapes.decode_kv_len,
            "page_size": page_size, "Hq": Hq, "Hkv": Hkv, "D": D, "dtype": "bfloat16",
            "kv_bytes": nbytes}
    timings = {"pallas": time_us(pallas, *batch.values(), shapes=shapes),
               "xla_reference": time_us(xla, *batch.values(), shapes=shapes)}
    errors = {"pallas": max_err(got, want)}
    # The same attention on densely stored K/V: what a non-paged kernel achieves.
    B = shapes.decode_batch
    k, v = dense_from_pages(batch)
    q = batch["q"].reshape(B, 1, Hq, D)
    impl, fn, err, notes = best_sdpa(q, k, v, is_causal=False, want=want.reshape(B, 1, Hq, D))
    timings[f"sdpa_{impl}_dense"] = time_us(fn, q, k, v, shapes=shapes)
    errors[f"sdpa_{impl}_dense"] = err
    for name, us in timings.items():
      gb_s = nbytes / us / 1e3
      rows.append({**case, "impl": name, "us": us, "gb_s": gb_s,
                   "pct_of_copy_bw": 100 * gb_s / ceil["hbm_gb_s"],
                   "speedup_of_pallas": us / timings["pallas"],
                   "max_abs_err_vs_xla_reference": errors.get(name),
                   "notes": notes if name.startswith("sdpa") else []})
  return rows


def mixed_cases(shapes: Shapes, ceil: dict, interpret: bool, rng) -> list[dict]:
  Hq, Hkv, D = shapes.heads
  page_size = shapes.page_sizes[0]
  batch = paged_batch(rng, shapes.mixed, page_size, Hq, Hkv, D)
  pallas = jax.jit(functools.partial(ragged_paged_attention, interpret=interpret))
  xla = jax.jit(ragged_paged_attention_xla)
  want = jax.block_until_ready(xla(**batch))
  err = max_err(jax.block_until_ready(pallas(**batch)), want)
  timings = {"pallas": time_us(pallas, *batch.values(), shapes=shapes),
             "xla_reference": time_us(xla, *batch.values(), shapes=shapes)}
  nbytes = kv_bytes(batch)
  case = {"section": "mixed", "groups": [list(g) for g in shapes.mixed],
          "groups_legend": "[count, q_len, kv_len]",
          "T": int(batch["q"].shape[0]), "page_size": page_size, "Hq": Hq, "Hkv": Hkv, "D": D,
          "dtype": "bfloat16", "kv_bytes": nbytes}
  return [{**case, "impl": name, "us": us, "gb_s": nbytes / us / 1e3,
           "pct_of_copy_bw": 100 * nbytes / us / 1e3 / ceil["hbm_gb_s"],
           "speedup_of_pallas": us / timings["pallas"],
           "max_abs_err_vs_xla_reference": err if name == "pallas" else None}
          for name, us in timings.items()]


def prefill_cases(shapes: Shapes, ceil: dict, interpret: bool, rng) -> list[dict]:
  Hq, Hkv, D = shapes.heads
  rows = []
  pallas = jax.jit(functools.partial(flash_attention, causal=True, interpret=interpret))
  for B, T in shapes.prefill:
    kq, kk, kv = jax.random.split(jax.random.key(int(rng.integers(2**31))), 3)
    q = jax.random.normal(kq, (B, T, Hq, D), jnp.bfloat16)
    k = jax.random.normal(kk, (B, T, Hkv, D), jnp.bfloat16)
    v = jax.random.normal(kv, (B, T, Hkv, D), jnp.bfloat16)
    ours = jax.block_until_ready(pallas(q, k, v))
    impl, fn, err, notes = best_sdpa(q, k, v, is_causal=True, want=ours)
    flops = 2 * B * Hq * D * T * (T + 1)  # QK^T and PV over the causal triangle
    timings = {"pallas": time_us(pallas, q, k, v, shapes=shapes),
               f"sdpa_{impl}": time_us(fn, q, k, v, shapes=shapes)}
    case = {"section": "prefill", "B": B, "T": T, "Hq": Hq, "Hkv": Hkv, "D": D, "causal": True,
            "dtype": "bfloat16", "flops": flops}
    for name, us in timings.items():
      tflop_s = flops / us / 1e6
      rows.append({**case, "impl": name, "us": us, "tflop_s": tflop_s,
                   "pct_of_matmul": 100 * tflop_s / ceil["matmul_tflop_s"],
                   "speedup_of_pallas": us / timings["pallas"],
                   "max_abs_err_pallas_vs_sdpa": err,
                   "notes": notes if name.startswith("sdpa") else []})
  return rows


# ---------------------------------------------------------------- speculative accept


def accept_batch(rng, S, k, V, mode):
  """Logits, drafts (half of them the rows' own draws, so acceptance runs deep), per-row controls."""
  K1 = k + 1
  logits = jnp.asarray(rng.normal(size=(S, K1, V)) * 3, jnp.float32)
  temperature = jnp.full((S, K1), 0.0 if mode == "greedy" else 1.0, jnp.float32)
  seeds = jnp.asarray(np.repeat(rng.integers(0, 2**31, (S, 1)), K1, 1), jnp.uint32)
  positions = jnp.asarray(rng.integers(0, 4096, (S, 1)) + np.arange(K1), jnp.int32)
  keys = jax.vmap(jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p)))(seeds, positions)
  num_drafts = jnp.full((S,), k, jnp.int32)
  own = spec_accept_reference(logits, jnp.zeros((S, k), jnp.int32), jnp.zeros((S,), jnp.int32),
                              temperature, keys)[1]
  wrong = jnp.asarray(rng.integers(0, V, (S, k)), jnp.int32)
  drafts = jnp.where(jnp.asarray(rng.random((S, 1)) < 0.5), own[:, :k], wrong)
  extra = {}
  if mode == "full_q":
    q = jax.nn.softmax(logits[:, :k] + jnp.asarray(rng.normal(size=(S, k, V)), jnp.float32), axis=-1)
    extra = {"draft_probs": q, "uniforms": jnp.asarray(rng.random((S, k)), jnp.float32)}
  return (logits, drafts, num_drafts, temperature, keys), extra, (seeds, positions)


def engine_accept(logits, drafts, num_drafts, temperature, seeds, positions):
  """Today's runner: sample() every verify row with its (seed, position) key, then accept()."""
  S, K1, V = logits.shape
  L = S * K1
  sp = SamplingBatch(temperature.reshape(L), jnp.zeros(L, jnp.int32), jnp.ones(L), jnp.zeros(L),
                     jnp.ones(L), jnp.zeros(L), jnp.zeros(L), seeds.reshape(L), positions.reshape(L),
                     jnp.zeros(L, bool))
  ids = sample(logits.reshape(L, V), sp, jnp.zeros((1, V), jnp.int32), jnp.zeros((1, V), bool),
               jnp.zeros(L, jnp.int32))[0].reshape(S, K1)
  return accept(ids, drafts, num_drafts), ids


def accept_cases(shapes: Shapes, ceil: dict, interpret: bool, rng) -> list[dict]:
  rows = []
  bs = AcceptBlockSizes(block_v=shapes.accept_block_v)
  for S, k, V in shapes.accept:
    for mode in shapes.accept_modes:
      args, extra, (seeds, positions) = accept_batch(rng, S, k, V, mode)
      pallas = functools.partial(spec_accept, block_sizes=bs, interpret=interpret)
      reference = jax.jit(spec_accept_reference)
      want = jax.block_until_ready(reference(*args, **extra))
      got = jax.block_until_ready(pallas(*args, **extra))
      mismatches = int(jnp.sum(got[0] != want[0]) + jnp.sum(got[1] != want[1]))
      timed = {"pallas": functools.partial(pallas, *args, **extra),
               "jnp_reference": functools.partial(reference, *args, **extra)}
      if mode != "full_q":  # the engine has no full-q acceptance
        engine = jax.jit(engine_accept)
        eng_a, eng_ids = jax.block_until_ready(engine(*args[:4], seeds, positions))
        mismatches += int(jnp.sum(eng_a != want[0]) + jnp.sum(eng_ids != want[1]))
        timed["engine_sample_accept"] = functools.partial(engine, *args[:4], seeds, positions)
      nbytes = 4 * S * (k + 1) * V + (4 * S * k * V if mode == "full_q" else 0)
      timings = {name: time_us(fn, shapes=shapes) for name, fn in timed.items()}
      case = {"section": "accept", "S": S, "k": k, "V": V, "mode": mode, "logits_dtype": "float32",
              "block_v": bs.resolve(k + 1), "bytes_read_once": nbytes,
              "integer_mismatches_vs_reference": mismatches}
      for name, us in timings.items():
        gb_s = nbytes / us / 1e3
        rows.append({**case, "impl": name, "us": us, "gb_s": gb_s,
                     "pct_of_copy_bw": 100 * gb_s / ceil["hbm_gb_s"],
                     "speedup_of_pallas": us / timings["pallas"]})
  return rows


# ---------------------------------------------------------------- report


def print_table(ceil: dict, rows: list[dict]) -> None:
  print(f"ceilings: copy {ceil['hbm_gb_s']:.0f} GB/s ({ceil['copy_bytes'] / 2**20:.0f} MiB moved), "
        f"bf16 matmul {ceil['matmul_tflop_s']:.1f} TFLOP/s (n={ceil['matmul_n']})")
  print(f"{'section':8} {'case':34} {'impl':18} {'us':>10} {'GB/s':>8} {'TFLOP/s':>8} "
        f"{'% ceil':>7} {'pallas x':>8}")
  for r in rows:
    if r["section"] == "decode":
      case = f"B={r['B']} kv={r['kv_len']} p={r['page_size']}"
    elif r["section"] == "accept":
      case = f"S={r['S']} k={r['k']} V={r['V']} {r['mode']}"
    elif r["section"] == "mixed":
      case = f"T={r['T']} p={r['page_size']} " + "+".join(
          f"{c}x{q}" for c, q, _ in r["groups"])
    else:
      case = f"B={r['B']} T={r['T']} causal"
    pct = r.get("pct_of_copy_bw", r.get("pct_of_matmul"))
    gb = f"{r['gb_s']:.0f}" if "gb_s" in r else ""
    tf = f"{r['tflop_s']:.1f}" if "tflop_s" in r else ""
    print(f"{r['section']:8} {case:34} {r['impl']:18} {r['us']:10.1f} {gb:>8} {tf:>8} "
          f"{pct:6.1f}% {r['speedup_of_pallas']:7.2f}x")
  print("'pallas x' = this row's time / the Pallas kernel's time (> 1: Pallas is faster).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.epilog = ("Without a GPU it falls back to --smoke (numbers meaningless, JSON to a "
                   "temporary file unless --out).")
  mode = parser.add_mutually_exclusive_group()
  mode.add_argument("--smoke", action="store_true",
                    help="tiny shapes, Pallas kernels in interpret mode, 2 reps: checks that every "
                         "code path runs (automatic without a GPU)")
  mode.add_argument("--gpu", action="store_true", help="full shapes; exit with an error if no GPU")
  parser.add_argument("--out", type=Path, help="JSON path (default: benchmarks/results/"
                      "kernels-<device-kind>-<date>.json on GPU, a temporary file in smoke mode)")
  parser.add_argument("--reps", type=int, help="timed runs per case (median reported)")
  parser.add_argument("--sections", default="decode,mixed,prefill,accept",
                      help="comma-separated subset of decode,mixed,prefill,accept (ceilings always run)")


def run(args: argparse.Namespace) -> int:
  gpu = has_gpu()
  if args.gpu and not gpu:
    raise UsageError(f"--gpu asked for, but JAX sees no GPU (devices: {jax.devices()}); "
                 "install jax[cuda12] on a machine with an NVIDIA GPU, or use --smoke")
  smoke = args.smoke or not gpu
  if smoke and not args.smoke:
    print("no GPU: running --smoke (tiny shapes, interpret mode; the numbers mean nothing)")
  shapes = SMOKE if smoke else FULL
  if args.reps:
    shapes = dataclasses.replace(shapes, reps=args.reps)
  sections = [s.strip() for s in args.sections.split(",") if s.strip()]
  unknown = set(sections) - {"decode", "mixed", "prefill", "accept"}
  if unknown:
    raise UsageError(f"unknown --sections {sorted(unknown)}")

  env = environment(args.command, device=jax.devices()[0].device_kind)
  rng = np.random.default_rng(0)
  ceil = ceilings(shapes)
  rows = []
  runners = {"decode": decode_cases, "mixed": mixed_cases, "prefill": prefill_cases,
             "accept": accept_cases}
  for section in sections:
    rows += runners[section](shapes, ceil, smoke, rng)

  device = jax.devices()[0]
  today = datetime.date.today().isoformat()
  report = {
      "benchmark": "kernels",
      **env,
      "platform": device.platform,
      "smoke": smoke,
      "jax_version": jax.__version__,
      "shapes": dataclasses.asdict(shapes),
      "ceilings": ceil,
      "results": rows,
  }
  print_table(ceil, rows)
  out = args.out
  if out is None:
    if smoke:
      out = Path(tempfile.mkstemp(prefix="kernels-smoke-", suffix=".json")[1])
    else:
      kind = re.sub(r"[^a-z0-9]+", "-", device.device_kind.lower()).strip("-")
      out = RESULTS / f"kernels-{kind}-{today}.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({**report, "load_average_after": load_average()}, indent=1) + "\n")
  print(f"wrote {out}")
  return 0
