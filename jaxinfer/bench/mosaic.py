"""Decode attention: the Mosaic GPU ragged kernel against the Triton one, as K/V read bandwidth.

Measured in one process, side by side (`jaxinfer bench kernels`' helpers: the same
paged batches, timing and copy ceiling):
  1. ceiling: HBM bandwidth of a large device-to-device copy (bytes read +
     written / time);
  2. decode, Llama-3-8B heads (Hq 32, Hkv 8, D 128, bf16), q_len 1, pages
     shuffled over the pool: for each (B sequences, kv_len keys, page size),
     pallas_kernels.ragged_paged_attention (Triton, 'pallas') and
     ragged_paged_attention_mgpu (Mosaic GPU, default tiles: 'mosaic' one
     warpgroup, 'mosaic_ws' with a producer warpgroup), each checked against
     the XLA reference first. Achieved bandwidth = bytes of K and V the
     sequences own (each key once per kv head) / time, and its % of the copy
     bandwidth. At the first page size of each shape also
     jax.nn.dot_product_attention over the same K/V laid out densely (cuDNN
     where it runs), the issue's other yardstick;
  3. few long sequences (4 x 16k keys): the kernels without and with split-KV
     (kv_splits 8: 4 x 8 kv heads = 32 programs become 256);
  4. an fp8 KV cache (float8_e4m3fn values, a float32 scale per token and kv
     head, quantized as jaxinfer.models.cache does) on the first decode
     shape at the first page size: both kernels, bytes = the 8-bit K and V
     plus their scales;
  5. the Mosaic kernel's tile sizes (pages per step, pipeline stages, warp
     specialization) on one decode shape;
  6. MLA decode at DeepSeek-V3's widths under TP 8 (H 16, R 512, E 64; 64
     sequences x 2,048 keys, 64-token pages), bf16 and fp8 latents (a scale
     per 64 values): pallas_kernels.ragged_paged_mla (Triton, 'pallas') and
     ragged_paged_mla_mgpu ('mosaic', 'mosaic_ws' with a producer warpgroup),
     checked against ops.ragged_paged_mla's
     XLA path; bytes = the latent rows the sequences own (576 values a key,
     read once for all heads), plus their scales.
The JSON is rewritten after every case, so a run cut short by its time limit
keeps what it measured. A case that fails (say the Mosaic kernel does not
compile) is recorded with its error and the run goes on.

Expected on an H200 (before any run; no GPU was available when the kernel was
written): the Triton kernel as in benchmarks/results/kernels-nvidia-h200-2026-11-27.json
(~66% of copy bandwidth at 16-token pages, 46-50% at 64). The Mosaic kernel:
55-75% at 16-token pages (one 4 KiB TMA copy per page and kv head, small for
TMA) and 65-85% at 64-token pages (16 KiB copies), with 2-3 stages best;
below the 85% target because one warpgroup both computes and issues copies,
so only num_stages - 1 steps are in flight while it computes, and p goes
through shared memory; 'mosaic_ws' (all stages in flight, page-id loads off
the compute path) 5-15 points above 'mosaic'. At 4 x 16k keys without
splits (32 programs on 132 SMs) every kernel reads at <= 30%; split 8 ways,
the Mosaic kernel 55-80%. B = 64 x 8 kv heads = 512 programs fill 132 SMs ~4
times over; at B = 256 the tail matters less.
fp8 cache (written before any run of it): the kernels read (D + 4) / 2D of
bf16's bytes (0.52 at D = 128), so at equal bandwidth ~1.9x faster. Expected:
the Mosaic kernel 1.5-1.8x its bf16 time (GB/s 15-30% below its bf16 figure:
each step converts K and V in registers and stores them to shared memory
again, and the wrapper transposes the scale pool, an extra 8 / D of the pool's
bytes and one more launch per call); Triton 1.2-1.6x (its tiles convert
after the load too, with no TMA).

MLA (written before any run of either MLA kernel on a GPU): the Mosaic kernel
35-60% of copy bandwidth: R = 512 is cut over two programs per sequence that
each read the whole 1,152-byte row of every key (the second mostly from L2)
and recompute the scores, a program's 224 KiB of tiles leave one program per
SM and 2 stages (one step in flight while it computes); the fp8 latent at
0.55x the bytes 1.3-1.7x faster (each 64-value group converted twice, its
wgmmas one at a time). The Triton MLA kernel: no figure to anchor a guess.

  jaxinfer bench mosaic --smoke     # CPU: tiny shapes, both kernels in interpret mode
  jaxinfer bench mosaic --out $OUT/mosaic.json   # GPU (sm_90)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import tempfile
import time
from pathlib import Path


import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.bench.harness import environment
from jaxinfer.bench.kernels import (FULL, SMOKE, best_sdpa, ceilings, dense_from_pages, has_gpu, kv_bytes,
                                    max_err, paged_batch, time_us)
from jaxinfer.models.cache import quantize_tokens
from jaxinfer.ops import ragged_paged_attention_xla, ragged_paged_mla
from pallas_kernels import ragged_paged_attention
from pallas_kernels import ragged_paged_mla as ragged_paged_mla_triton
from pallas_kernels.ragged_paged_attention_mgpu import BlockSizes, ragged_paged_attention_mgpu
from pallas_kernels.ragged_paged_mla_mgpu import BlockSizes as MlaBlockSizes
from pallas_kernels.ragged_paged_mla_mgpu import ragged_paged_mla_mgpu


@dataclasses.dataclass(frozen=True)
class Cases:
  heads: tuple[int, int, int]  # Hq, Hkv, D
  decode: tuple[tuple[int, int], ...]  # (B, kv_len)
  page_sizes: tuple[int, ...]
  sweep_shape: tuple[int, int, int]  # (B, kv_len, page_size)
  sweep: tuple[BlockSizes, ...]
  long: tuple[int, int, int]  # (B, kv_len, page_size): few long sequences, split-KV
  long_splits: int
  mla: tuple[int, int, int]  # H, R, E
  mla_decode: tuple[int, int, int]  # (B, kv_len, page_size)


GPU_CASES = Cases(heads=(32, 8, 128), decode=((64, 2048), (256, 1024), (128, 4096)),
                  page_sizes=(16, 64), sweep_shape=(64, 2048, 16),
                  sweep=(BlockSizes(num_stages=3), BlockSizes(num_stages=3, warp_specialized=True),
                         BlockSizes(num_stages=4, warp_specialized=True),
                         BlockSizes(pages_per_block=8, num_stages=2, warp_specialized=True)),
                  long=(4, 16384, 16), long_splits=8, mla=(16, 512, 64), mla_decode=(64, 2048, 64))
SMOKE_CASES = Cases(heads=(8, 2, 64), decode=((3, 40),), page_sizes=(16,), sweep_shape=(2, 70, 16),
                    sweep=(BlockSizes(num_stages=3, warp_specialized=True),), long=(1, 300, 16),
                    long_splits=3, mla=(8, 64, 64), mla_decode=(3, 40, 16))


def decode_row(name, call, want, nbytes, ceil, shapes, extra) -> dict:
  """Check call() against the reference, then time it; an exception becomes the row's error."""
  row = {"impl": name, **extra}
  try:
    row["max_abs_err_vs_xla_reference"] = max_err(jax.block_until_ready(call()), want)
    us = time_us(call, shapes=shapes)
  except Exception as e:  # a kernel that fails to compile or run is a result, not the end of the run
    row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
    return row
  gb_s = nbytes / us / 1e3
  return {**row, "us": us, "gb_s": gb_s, "pct_of_copy_bw": 100 * gb_s / ceil["hbm_gb_s"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
  parser.add_argument("--out", type=Path, help="JSON path (default: a temporary file)")
  parser.add_argument("--reps", type=int, default=None, help="timed runs per case (median)")


def run(args: argparse.Namespace) -> int:
  smoke = args.smoke or not has_gpu()
  shapes = SMOKE if smoke else dataclasses.replace(FULL, copy_mib=512)
  if args.reps:
    shapes = dataclasses.replace(shapes, reps=args.reps)
  cases = SMOKE_CASES if smoke else GPU_CASES
  out = args.out or Path(tempfile.mkstemp(prefix="mosaic-", suffix=".json")[1])
  out.parent.mkdir(parents=True, exist_ok=True)
  device = jax.devices()[0]
  report = {"benchmark": "mosaic_decode", **environment(args.command, device=device.device_kind),
            "platform": device.platform, "smoke": smoke, "jax_version": jax.__version__,
            "cases": dataclasses.asdict(cases), "results": []}

  def save():
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")

  start = time.perf_counter()

  def emit(row: dict, label: str) -> None:
    """Records a decode row (saved at once: a run cut short keeps it) and prints it."""
    report["results"].append(row)
    save()
    shown = (f"{row['us']:9.1f} us {row['gb_s']:6.0f} GB/s {row['pct_of_copy_bw']:5.1f}%"
             if "us" in row else row["error"][:300])
    print(f"{label} {shown} [{time.perf_counter() - start:.0f} s]", flush=True)
  report["ceilings"] = ceil = ceilings(dataclasses.replace(shapes, matmul_n=256))
  print(f"copy {ceil['hbm_gb_s']:.0f} GB/s", flush=True)
  save()
  rng = np.random.default_rng(0)
  Hq, Hkv, D = cases.heads
  triton = jax.jit(functools.partial(ragged_paged_attention, interpret=smoke))
  xla = jax.jit(ragged_paged_attention_xla)

  def mosaic(block_sizes=None):
    return jax.jit(functools.partial(ragged_paged_attention_mgpu, interpret=smoke,
                                     block_sizes=block_sizes))

  def run_case(B, kv_len, page_size, impls, dense=False, kv_dtype=None):
    batch = paged_batch(rng, ((B, 1, kv_len),), page_size, Hq, Hkv, D)
    nbytes = kv_bytes(batch)
    if kv_dtype is not None:  # a quantized cache: 1-byte values + a float32 scale per token and head
      for name in ("k", "v"):
        batch[f"{name}_pages"], batch[f"{name}_scale"] = quantize_tokens(batch[f"{name}_pages"], kv_dtype)
      nbytes = nbytes // 2 * (D + 4) // D
    want = jax.block_until_ready(xla(**batch))
    calls = [(name, functools.partial(fn, **batch), want, extra) for name, fn, extra in impls]
    if dense:
      k, v = dense_from_pages(batch)
      q = batch["q"].reshape(B, 1, Hq, D)
      try:
        impl, fn, _, notes = best_sdpa(q, k, v, is_causal=False, want=want.reshape(B, 1, Hq, D))
        calls.append((f"sdpa_{impl}_dense", functools.partial(fn, q, k, v), want.reshape(q.shape),
                      {"notes": notes}))
      except RuntimeError as e:  # neither cuDNN nor XLA: recorded in the log, the run goes on
        print(f"dense attention: {e}")
    case = {"section": "decode", "B": B, "kv_len": kv_len, "page_size": page_size, "Hq": Hq,
            "Hkv": Hkv, "D": D, "dtype": "bfloat16", "kv_bytes": nbytes,
            "kv_dtype": jnp.dtype(kv_dtype or jnp.bfloat16).name}
    for name, call, want_of_call, extra in calls:
      emit({**case, **decode_row(name, call, want_of_call, nbytes, ceil, shapes, extra)},
           f"B={B:4d} kv={kv_len:5d} p={page_size:3d} {case['kv_dtype'][:6]:6} {name:8} {extra or ''}")

  def decode_shape(B, kv_len):
    for i, page_size in enumerate(cases.page_sizes):
      run_case(B, kv_len, page_size, [("pallas", triton, {}), ("mosaic", mosaic(), {}),
                                      ("mosaic_ws", mosaic(BlockSizes(warp_specialized=True)), {})],
               dense=i == 0)

  # Most telling first (a time limit cuts the tail): the decode shape, then split-KV.
  decode_shape(*cases.decode[0])
  B, kv_len, page_size = cases.long
  C = cases.long_splits
  run_case(B, kv_len, page_size, [
      ("pallas", triton, {}), ("mosaic_ws", mosaic(BlockSizes(warp_specialized=True)), {}),
      (f"mosaic_split{C}", mosaic(BlockSizes(kv_splits=C)), {}),
      (f"mosaic_ws_split{C}", mosaic(BlockSizes(kv_splits=C, warp_specialized=True)), {})],
      dense=True)
  run_case(*cases.decode[0], cases.page_sizes[0],
           [("pallas", triton, {}), ("mosaic", mosaic(), {}),
            ("mosaic_ws", mosaic(BlockSizes(warp_specialized=True)), {})], kv_dtype=jnp.float8_e4m3fn)
  for B, kv_len in cases.decode[1:]:
    decode_shape(B, kv_len)
  B, kv_len, page_size = cases.sweep_shape
  run_case(B, kv_len, page_size, [("mosaic", mosaic(bs), {"block_sizes": dataclasses.asdict(bs)})
                                  for bs in cases.sweep])

  def mla_case(B, kv_len, page_size, kv_dtype=None):
    H, R, E = cases.mla
    # The latent pool as one kv head of width R + E (its v_pages go unused).
    g = paged_batch(rng, ((B, 1, kv_len),), page_size, H, 1, R + E)
    batch = {"q_latent": g["q"][..., :R], "q_rope": g["q"][..., R:], "latent_pages": g["k_pages"][:, :, 0],
             **{k: g[k] for k in ("kv_lens", "page_indices", "cu_q_lens", "num_seqs")}}
    keys = int(np.sum(np.asarray(batch["kv_lens"])))
    nbytes = keys * (R + E) * 2
    if kv_dtype is not None:  # 1-byte values + a float32 scale per gcd(R, E) values, as the cache stores them
      groups = (R + E) // math.gcd(R, E)
      batch["latent_pages"], batch["latent_scale"] = quantize_tokens(batch["latent_pages"], kv_dtype, groups)
      nbytes = keys * ((R + E) + 4 * groups)
    sm_scale = 192 ** -0.5  # DeepSeek-V3's 1 / sqrt(qk_nope 128 + qk_rope 64)
    want = jax.block_until_ready(mla_xla(**batch, sm_scale=sm_scale))
    case = {"section": "mla_decode", "B": B, "kv_len": kv_len, "page_size": page_size, "H": H, "R": R,
            "E": E, "dtype": "bfloat16", "kv_bytes": nbytes, "kv_dtype": jnp.dtype(kv_dtype or jnp.bfloat16).name}
    for name, fn in (("pallas", mla_triton), ("mosaic", mla_mosaic()),
                     ("mosaic_ws", mla_mosaic(MlaBlockSizes(warp_specialized=True)))):
      emit({**case, **decode_row(name, functools.partial(fn, **batch, sm_scale=sm_scale), want, nbytes,
                                 ceil, shapes, {})},
           f"MLA B={B:4d} kv={kv_len:5d} p={page_size:3d} {case['kv_dtype'][:6]:6} {name:8}")

  mla_xla = jax.jit(functools.partial(ragged_paged_mla, impl="xla"), static_argnames=("sm_scale",))
  mla_triton = jax.jit(functools.partial(ragged_paged_mla_triton, interpret=smoke), static_argnames=("sm_scale",))

  def mla_mosaic(block_sizes=None):
    return jax.jit(functools.partial(ragged_paged_mla_mgpu, interpret=smoke, block_sizes=block_sizes),
                   static_argnames=("sm_scale",))

  mla_case(*cases.mla_decode)
  mla_case(*cases.mla_decode, kv_dtype=jnp.float8_e4m3fn)
  report["wall_s"] = time.perf_counter() - start
  save()
  print(f"wrote {out}")
  return 0

