#!/usr/bin/env python
"""Compile the Pallas kernels through the real Triton compiler to GPU code, without a GPU.

tests/pallas_kernels/test_triton_lowering.py stops at Triton IR (TTIR). This
goes the rest of the way on a CPU-only machine: it lowers each kernel
configuration for CUDA with jax, captures the TTIR module that the Pallas
Triton lowering emits, and compiles it with the `triton` package
(TTIR -> TTGIR -> LLVM -> PTX -> cubin) for the given compute capabilities,
reporting shared memory per program against the per-block limits of common
GPUs. Layout, dot-shape and shared-memory problems that only the Triton
compiler sees show up here.

The `triton` package need not share jax's environment (it pins its own
LLVM; keep it out of the dev venv):
  python -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install triton
  python scripts/check_triton_compile.py --triton-python /tmp/tvenv/bin/python
  python scripts/check_triton_compile.py --sm 80,86,90 --keep /tmp/ttir

The TTIR is captured by wrapping jax's private
`jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module` (checked with
jax 0.10.2); the version of Triton that XLA bundles differs from the pip
package's, so a pass here is strong evidence, not proof, that the kernels
compile inside XLA.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Shared memory one thread block may use, bytes (CUDA programming guide, opt-in maximum).
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

COMPILE = r"""
import json, sys, triton
from triton.backends.compiler import GPUTarget
path, cc, num_warps, num_stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
try:
  k = triton.compile(path, target=GPUTarget("cuda", cc, 32),
                     options={"num_warps": num_warps, "num_stages": num_stages})
  print(json.dumps({"ok": True, "shared": k.metadata.shared, "cubin": "cubin" in k.asm}))
except Exception as e:
  print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}))
"""


def configs():
  """(name, kernel, avals, num_warps, num_stages) for the shapes the engine and benchmark use."""
  import jax
  import jax.numpy as jnp

  from pallas_kernels import flash_attention, ragged_paged_attention
  from pallas_kernels.flash_attention import BlockSizes as FlashBlockSizes
  from pallas_kernels.ragged_paged_attention import BlockSizes

  def ragged(name, T, S, page_size, Hq, Hkv, D, dtype=jnp.bfloat16, **options):
    i32 = jnp.int32
    avals = (jax.ShapeDtypeStruct((T, Hq, D), dtype),
             jax.ShapeDtypeStruct((4096, page_size, Hkv, D), dtype),
             jax.ShapeDtypeStruct((4096, page_size, Hkv, D), dtype),
             jax.ShapeDtypeStruct((S,), i32), jax.ShapeDtypeStruct((S, 128), i32),
             jax.ShapeDtypeStruct((S + 1,), i32), jax.ShapeDtypeStruct((), i32))
    bs = (options.get("block_sizes") or BlockSizes()).resolve(
        T=T, S=S, G=Hq // Hkv, page_size=page_size, D=D, itemsize=jnp.dtype(dtype).itemsize)
    return name, functools.partial(ragged_paged_attention, **options), avals, bs.num_warps, bs.num_stages

  def flash(name, B, T, Hq, Hkv, D, dtype=jnp.bfloat16, **options):
    avals = (jax.ShapeDtypeStruct((B, T, Hq, D), dtype),
             jax.ShapeDtypeStruct((B, T, Hkv, D), dtype), jax.ShapeDtypeStruct((B, T, Hkv, D), dtype))
    bs = (options.get("block_sizes") or FlashBlockSizes()).resolve(
        T=T, S=T, D=D, itemsize=jnp.dtype(dtype).itemsize)
    return name, functools.partial(flash_attention, **options), avals, bs.num_warps, bs.num_stages

  return [
      ragged("ragged decode p16 G4 D128", 64, 64, 16, 32, 8, 128),
      ragged("ragged decode p64 G4 D128", 64, 64, 64, 32, 8, 128),
      ragged("ragged mixed p16 G4 D128 window+cap", 1024, 64, 16, 32, 8, 128,
             sliding_window=512, soft_cap=50.0),
      ragged("ragged prefill p32 G8 D64 f16", 2048, 4, 32, 16, 2, 64, jnp.float16),
      ragged("ragged mixed p16 G7 D64", 512, 32, 16, 14, 2, 64),
      ragged("ragged decode p16 G1 D128 f32", 64, 64, 16, 8, 8, 128, jnp.float32),
      flash("flash causal D128", 1, 4096, 32, 8, 128),
      flash("flash causal D64", 1, 4096, 16, 4, 64),
      flash("flash full D128 f16", 1, 1000, 8, 8, 128, jnp.float16, causal=False),
      flash("flash causal D128 f32", 1, 1024, 8, 2, 128, jnp.float32),
  ]


def capture_ttir(fn, avals) -> list[str]:
  import jax
  from jax._src.pallas.triton import pallas_call_registration

  lowering = pallas_call_registration.lowering
  original = lowering.lower_jaxpr_to_triton_module
  modules = []

  def capture(*args, **kwargs):
    result = original(*args, **kwargs)
    modules.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  lowering.lower_jaxpr_to_triton_module = capture
  try:
    jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",))
  finally:
    lowering.lower_jaxpr_to_triton_module = original
  return modules


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--sm", default="80,90",
                      help="comma-separated compute capabilities (80 = A100, 86/89 = RTX, 90 = H100)")
  parser.add_argument("--triton-python", default=sys.executable,
                      help="a Python with the `triton` package (default: this one)")
  parser.add_argument("--keep", type=Path, help="write the TTIR files here")
  args = parser.parse_args(argv)
  check = subprocess.run([args.triton_python, "-c", "import triton"], capture_output=True, check=False)
  if check.returncode:
    parser.error(f"{args.triton_python} cannot import triton; see --help for a separate venv")
  ccs = [int(c) for c in args.sm.split(",")]
  workdir = args.keep or Path(tempfile.mkdtemp(prefix="ttir-"))
  workdir.mkdir(parents=True, exist_ok=True)
  failures = 0
  for name, fn, avals, num_warps, num_stages in configs():
    [ttir] = capture_ttir(fn, avals)
    path = workdir / (name.replace(" ", "_").replace("+", "_") + ".ttir")
    path.write_text(ttir)
    for cc in ccs:
      proc = subprocess.run([args.triton_python, "-c", COMPILE, str(path), str(cc), str(num_warps),
                             str(num_stages)], capture_output=True, text=True, check=False,
                            env={"TRITON_DEFAULT_FP_FUSION": "1", "PATH": "/usr/bin:/bin"})
      lines = proc.stdout.strip().splitlines()
      result = json.loads(lines[-1]) if lines else {"ok": False, "error": proc.stderr[-2000:]}
      if result["ok"]:
        limit = SMEM_LIMIT.get(cc)
        fits = "" if limit is None else (" fits" if result["shared"] <= limit else " EXCEEDS")
        print(f"OK   sm_{cc} {name:40s} warps={num_warps} stages={num_stages} "
              f"shared={result['shared'] / 1024:.0f} KiB{fits}")
        failures += limit is not None and result["shared"] > limit
      else:
        failures += 1
        print(f"FAIL sm_{cc} {name:40s} {result['error']}")
  print(f"TTIR in {workdir}")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
