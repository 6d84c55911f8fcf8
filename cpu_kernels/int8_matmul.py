"""float32 activations, as int16, x int8 (and group-wise int4) weights, and float32 x fp8
weights on XLA CPU: XLA FFI custom calls (int8_matmul.cc), their build, and their references.

    int8_matmul(x float32 [R, I], q int8 [O, I]) -> float32 [R, O] = float32(exact sum_i x16 q) * a
    int4_matmul(x, q int4 [O, I], scales, mins float16 [G, O]) -> float32 [R, O], exact per group
    int8_group_matmul(x, q int8 [O, I], scales, mins float32 [G, O]) -> float32 [R, O], exact per group
    fp8_matmul(x, q float8_e4m3fn [O, I], scale [O]) -> float32 [R, O], fixed order; x rounded to
        bfloat16 where the CPU has AVX512-BF16 (fp8_activations())

x16 and a are x's rows as int16 (int16_rows_reference: a = max|x| / 32767 per row, x16 =
round(x / a)), which the kernel forms itself: in XLA those were ~6 small operations per
linear (~2.5 us each call at one token), as much as a 576 x 192 product.

Why a hand-written kernel: XLA CPU widens a one-row int8 weight to a float32 copy, and
its int8 dot of a few rows (jaxinfer.quant.split_int8_matmul) streams the weight at about
half the rate of its float32 matrix-vector kernel, so int8 decode was far from the 4x fewer
bytes it reads. This kernel reads the int8 weight once per call at
every row count and does 16 int16 x int8 products per vpmaddwd (AVX2):
`jaxinfer bench quant` and benchmarks/results/quant-matmul-*.json measure it
beside XLA's forms.

The sums are exact integers (int32 lanes, flushed to int64 before they can overflow),
rounded once to float32 and scaled by the row's a: each element is the same number for any
row count, tiling or thread split, which is what greedy batch invariance needs.

The library is compiled on first use with the C++ compiler on PATH ($CXX, g++, c++ or
clang++) against jax's own FFI headers, into $JAXINFER_CACHE/cpu_kernels (default
~/.cache/jaxinfer), keyed by the source, jaxlib version and flags, and registered with
XLA once per process. `available()` says whether it could be (x86-64 with AVX2 and FMA,
a compiler that builds it, JAXINFER_CPU_KERNELS not set to 0); when not, the caller
falls back to XLA and `unavailable_reason()` says why (logged once).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int8_matmul.cc")
# One library from these (attention.cc: cpu_kernels.attention), and the header they share.
SOURCES = (SOURCE, Path(__file__).with_name("attention.cc"))
HEADERS = (Path(__file__).with_name("parallel.h"), Path(__file__).with_name("convert.h"))
TARGET = "jaxinfer_int8_matmul"
INT4_TARGET = "jaxinfer_int4_matmul"
INT8_GROUP_TARGET = "jaxinfer_int8_group_matmul"
FP8_TARGET = "jaxinfer_fp8_matmul"
DECODE_ATTENTION_TARGET = "jaxinfer_decode_attention"
INT4_MAX_GROUP = 4096  # inputs per group: the kernel's int32 group sums cannot overflow (kMaxGroup)
INT8_MAX_GROUP = 512  # inputs per int8 group: 512 * 32767 * 128 < 2^31 (kInt8MaxGroup)
INT4_PANEL_ROWS = 16  # from this many rows of x on, int4_matmul repacks the weight into panels (kPanelRows)
# -ffp-contract=off: the compiler must not fuse a * b + c into one FMA in some tiles and
# not others (int4's float32 terms); the kernel's own FMAs are written out.
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w")
# Where the CPU has AVX512-VNNI (Zen 4, Ice Lake and later), the library is built a second way:
# the int16 multiply-adds become vpdpwssd (DotAdd in the source), the same integer sums at
# 1.9x float32 FMA's rate there (vpmaddwd + vpaddd: 1.5x; `jaxinfer bench simd-peak`). JAXINFER_CPU_KERNELS_ISA=avx2 keeps the AVX2 build.
VNNI_FLAGS = ("-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni", "-DJAXINFER_VNNI")
VNNI_CPU_FLAGS = frozenset({"avx512f", "avx512vl", "avx512bw", "avx512_vnni"})  # /proc/cpuinfo names
# And where it also has AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids), fp8 runs on
# vdpbf16ps with its activations rounded to bfloat16: about twice the float32-activation
# tile's rate at many tokens (int8_matmul.cc, "fp8 with bfloat16 activations").
BF16_FLAGS = ("-mavx512bf16", "-DJAXINFER_BF16")
BF16_CPU_FLAG = "avx512_bf16"


def int8_matmul(x: jax.Array, q: jax.Array) -> jax.Array:
  """x float32 [R, I], q int8 [O, I] -> float32 [R, O]: each element the exact integer
  sum_i x16[r, i] q[o, i] rounded to float32, times a[r] (x16, a = int16_rows_reference(x)).
  Traced into the caller's XLA CPU program as a custom call; raises RuntimeError when the
  kernel is not available()."""
  if x.ndim != 2 or q.ndim != 2 or x.shape[1] != q.shape[1] or x.dtype != jnp.float32 or q.dtype != jnp.int8:
    raise ValueError(f"int8_matmul: want x float32 [R, I] and q int8 [O, I], got x {x.dtype}{list(x.shape)}, "
                     f"q {q.dtype}{list(q.shape)}")
  if not available():
    raise RuntimeError(f"the CPU kernels are not available: {unavailable_reason()}")
  out = jax.ShapeDtypeStruct((x.shape[0], q.shape[0]), jnp.float32)
  return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, q)


def int4_groups_fit(in_size: int, groups: int) -> bool:
  """Whether int4_matmul takes `groups` groups over `in_size` inputs: groups of a multiple of
  32 inputs (whole nibble blocks), at most INT4_MAX_GROUP."""
  return groups > 0 and in_size % (32 * groups) == 0 and in_size // groups <= INT4_MAX_GROUP


def int4_matmul(x: jax.Array, q: jax.Array, scales: jax.Array, mins: jax.Array | None = None) -> jax.Array:
  """x float32 [R, I], q int4 [O, I], scales (mins) float16 [G, O] -> float32 [R, O]:

      y[r, o] = a[r] sum_g scales[g, o] S[r, g, o] + mins'[g, o] xsum[r, g]

  with x16, a = int16_rows_reference(x), S the exact integer sum of x16 (q + 8) over group g's
  I / G inputs (a multiple of 32, at most INT4_MAX_GROUP), xsum[r, g] the sum of x16 over the
  group and mins' = mins, or -8 scales without mins: x @ ((q + 8) scale + min)^T, or
  x @ (q scale)^T, group by group (GGUF Q4_1's and Q4_0's blocks). Each element is the same
  fixed sequence of float32 operations at any row count.
  Raises RuntimeError when the kernel is not available()."""
  _check_groups("int4_matmul", x, q, scales, mins, jnp.int4, jnp.float16, int4_groups_fit, INT4_MAX_GROUP)
  return _group_call(INT4_TARGET, x, q, scales, mins)


def _check_groups(name, x, q, scales, mins, q_dtype, scale_dtype, fits, max_group) -> None:
  """ValueError unless x float32 [R, I], q q_dtype [O, I], scales (and mins) scale_dtype [G, O]
  with `fits(I, G)` (groups of a multiple of 32 inputs, at most max_group)."""
  G = scales.shape[0]
  if (x.ndim != 2 or q.ndim != 2 or x.shape[1] != q.shape[1] or x.dtype != jnp.float32 or q.dtype != q_dtype
      or scales.shape != (G, q.shape[0]) or scales.dtype != scale_dtype
      or (mins is not None and (mins.shape != scales.shape or mins.dtype != scale_dtype))
      or not fits(q.shape[1], G)):
    q_name, s_name = jnp.dtype(q_dtype).name, jnp.dtype(scale_dtype).name
    raise ValueError(f"{name}: want x float32 [R, I], q {q_name} [O, I], {s_name} scales and mins [G, O] with "
                     f"I / G a multiple of 32 up to {max_group}, got x {x.dtype}{list(x.shape)}, "
                     f"q {q.dtype}{list(q.shape)}, scales {scales.dtype}{list(scales.shape)}, "
                     f"mins {None if mins is None else f'{mins.dtype}{list(mins.shape)}'}")


def _group_call(target: str, x: jax.Array, q: jax.Array, scales: jax.Array, mins: jax.Array | None) -> jax.Array:
  """The group-wise kernels' FFI call (operands already checked): float32 [R, O]."""
  if not available():
    raise RuntimeError(f"the CPU kernels are not available: {unavailable_reason()}")
  out = jax.ShapeDtypeStruct((x.shape[0], q.shape[0]), jnp.float32)
  # Without mins the scales stand in for them (not read): no zeros written per call.
  return jax.ffi.ffi_call(target, out, vmap_method="sequential")(
      x, q, scales, scales if mins is None else mins, has_mins=np.int32(mins is not None))


def int8_groups_fit(in_size: int, groups: int) -> bool:
  """Whether int8_group_matmul takes `groups` groups over `in_size` inputs: groups of a
  multiple of 32 inputs, at most INT8_MAX_GROUP."""
  return groups > 0 and in_size % (32 * groups) == 0 and in_size // groups <= INT8_MAX_GROUP


def int8_group_matmul(x: jax.Array, q: jax.Array, scales: jax.Array, mins: jax.Array | None = None) -> jax.Array:
  """x float32 [R, I], q int8 [O, I], scales (mins) float32 [G, O] -> float32 [R, O]:

      y[r, o] = a[r] sum_g scales[g, o] S[r, g, o] (+ mins[g, o] xsum[r, g])

  with x16, a = int16_rows_reference(x), S the exact integer sum of x16 q over group g's
  I / G inputs (a multiple of 32, at most INT8_MAX_GROUP) and xsum[r, g] the sum of x16 over
  the group: x @ (q scale + min)^T group by group (jaxinfer.quant's group-wise int8; GGUF
  Q8_0's blocks without mins). Each element is the same fixed sequence of float32 operations
  at any row count. Raises RuntimeError when the kernel is not available()."""
  _check_groups("int8_group_matmul", x, q, scales, mins, jnp.int8, jnp.float32, int8_groups_fit, INT8_MAX_GROUP)
  return _group_call(INT8_GROUP_TARGET, x, q, scales, mins)


def int8_group_matmul_reference(x: np.ndarray, q: np.ndarray, scales: np.ndarray,
                                mins: np.ndarray | None = None) -> np.ndarray:
  """The same product in float64 over int16_rows_reference(x) (int64 group sums): what
  int8_group_matmul rounds."""
  x16, a = int16_rows_reference(x)
  x, q = np.asarray(x16, np.int64), np.asarray(q, np.int64)
  G, (R, I) = scales.shape[0], x.shape
  S = np.einsum("rgi,ogi->rgo", x.reshape(R, G, I // G), q.reshape(-1, G, I // G))
  y = np.einsum("rgo,go->ro", S.astype(np.float64), np.asarray(scales, np.float64))
  if mins is not None:  # w = q scale + min
    y += x.reshape(R, G, I // G).sum(-1).astype(np.float64) @ np.asarray(mins, np.float64)
  return y * a


def fp8_matmul(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
  """x float32 [R, I], q float8_e4m3fn [O, I], scale float32 [O] -> float32 [R, O] = (x @ float(q)^T) * scale.

  Each e4m3 value converts exactly. x stays float32 (fp8_activations() == "float32": 8 or 16
  lanes over i, a fixed tree) or, where the CPU has AVX512-BF16, is rounded to bfloat16 first
  ("bfloat16": one float32 lane per element, bfloat16 pairs in order). Either way each element
  is summed in one fixed order at any row count, so rows do not depend on the batch.
  Raises RuntimeError when the kernel is not available()."""
  if (x.ndim != 2 or q.ndim != 2 or x.shape[1] != q.shape[1] or x.dtype != jnp.float32
      or q.dtype != jnp.float8_e4m3fn or scale.shape != (q.shape[0],)):
    raise ValueError(f"fp8_matmul: want x float32 [R, I], q float8_e4m3fn [O, I], scale [O], got x "
                     f"{x.dtype}{list(x.shape)}, q {q.dtype}{list(q.shape)}, scale {list(scale.shape)}")
  if not available():
    raise RuntimeError(f"the CPU kernels are not available: {unavailable_reason()}")
  out = jax.ShapeDtypeStruct((x.shape[0], q.shape[0]), jnp.float32)
  return jax.ffi.ffi_call(FP8_TARGET, out, vmap_method="sequential")(x, q, scale.astype(jnp.float32))


def fp8_matmul_reference(x: np.ndarray, q: np.ndarray, scale: np.ndarray, activations: str = "float32") -> np.ndarray:
  """The same product in float64 (q's e4m3 values exactly), x first rounded to bfloat16 with
  activations="bfloat16" (as fp8_matmul does where fp8_activations() says so): what it rounds."""
  if activations not in ("float32", "bfloat16"):
    raise ValueError(f"activations must be float32 or bfloat16, got {activations!r}")
  import ml_dtypes
  x = np.asarray(x, np.float32)
  if activations == "bfloat16":
    x = x.astype(ml_dtypes.bfloat16)
  return (x.astype(np.float64) @ np.asarray(q, np.float64).T) * np.asarray(scale, np.float64)


def fp8_activations() -> str | None:
  """What fp8_matmul rounds x to: "bfloat16" (AVX512-BF16 build) or "float32" (None when not available())."""
  return ("bfloat16" if _bf16() else "float32") if available() else None


def int16_rows_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """x float32 [R, I] -> (x16 int16 [R, I], a float32 [R, 1]), the kernels' float32
  arithmetic: a = max|x| / 32767 per row (1 for a row of zeros, NaN for a row with a NaN),
  x16 = round-half-even(x / a) clamped to +-32767, so x = a x16 to within a / 2."""
  x = np.asarray(x, np.float32)
  with np.errstate(invalid="ignore"):
    amax = np.abs(x).max(axis=1, keepdims=True, initial=np.float32(0))
    a = np.where(amax > 0, amax / np.float32(32767), np.float32(1)).astype(np.float32)
    a[np.isnan(x).any(axis=1)] = np.nan
    x16 = np.clip(np.rint(x / a), -32767, 32767)
  return np.nan_to_num(x16).astype(np.int16), a


def int4_matmul_reference(x: np.ndarray, q: np.ndarray, scales: np.ndarray,
                          mins: np.ndarray | None = None) -> np.ndarray:
  """The same product in float64 over int16_rows_reference(x) (int64 group sums): what
  int4_matmul rounds: the group-wise int8 reference with w = (q + 8) scale + min = q scale + min'."""
  if mins is not None:
    mins = 8 * np.asarray(scales, np.float64) + np.asarray(mins, np.float64)
  return int8_group_matmul_reference(x, q, scales, mins)


def int8_matmul_reference(x: np.ndarray, q: np.ndarray) -> np.ndarray:
  """The same product over int16_rows_reference(x) in numpy int64, rounded to float32 and
  scaled: what int8_matmul gives, bit for bit."""
  x16, a = int16_rows_reference(x)
  return (np.asarray(x16, np.int64) @ np.asarray(q, np.int64).T).astype(np.float32) * a


def isa() -> str | None:
  """Which build the kernels run ("avx512vnni" or "avx2"; None when not available())."""
  return _isa() if available() else None


def _isa() -> str:
  choice = os.environ.get("JAXINFER_CPU_KERNELS_ISA", "auto")
  if choice not in ("auto", "avx2", "avx512vnni"):
    raise ValueError(f"JAXINFER_CPU_KERNELS_ISA must be auto, avx2 or avx512vnni, got {choice!r}")
  has_vnni = has_avx512_vnni()
  if choice == "avx512vnni" and not has_vnni:
    raise ValueError("JAXINFER_CPU_KERNELS_ISA=avx512vnni, but this CPU lacks AVX512-VNNI")
  return "avx512vnni" if has_vnni and choice != "avx2" else "avx2"


def _bf16() -> bool:
  """Whether the build adds BF16_FLAGS: the VNNI build, on a CPU with AVX512-BF16."""
  return _isa() == "avx512vnni" and BF16_CPU_FLAG in (_cpu_flags() or set())


def has_avx512_vnni() -> bool:
  """Whether this CPU has what the VNNI build needs (VNNI_CPU_FLAGS)."""
  return VNNI_CPU_FLAGS <= (_cpu_flags() or set())


def available() -> bool:
  """Whether the kernels can run in this process (builds and registers them on first call)."""
  return _load()[0]


def unavailable_reason() -> str | None:
  """Why the kernels are not available (None when they are)."""
  return _load()[1]


@functools.cache
def _load() -> tuple[bool, str | None]:
  reason = _why_not()
  if reason is None:
    try:
      lib = ctypes.CDLL(str(_build()))
      jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.jaxinfer_int8_matmul), platform="cpu")
      jax.ffi.register_ffi_target(INT4_TARGET, jax.ffi.pycapsule(lib.jaxinfer_int4_matmul), platform="cpu")
      jax.ffi.register_ffi_target(INT8_GROUP_TARGET, jax.ffi.pycapsule(lib.jaxinfer_int8_group_matmul),
                                  platform="cpu")
      jax.ffi.register_ffi_target(FP8_TARGET, jax.ffi.pycapsule(lib.jaxinfer_fp8_matmul), platform="cpu")
      jax.ffi.register_ffi_target(DECODE_ATTENTION_TARGET, jax.ffi.pycapsule(lib.jaxinfer_decode_attention),
                                  platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
      reason = f"building {', '.join(p.name for p in SOURCES)} failed: {e}"
  if reason is not None:
    log.warning("int8, int4 and fp8 weights and decode attention on CPU run through XLA (slower): %s", reason)
  return reason is None, reason


def _why_not() -> str | None:
  if os.environ.get("JAXINFER_CPU_KERNELS", "1") == "0":
    return "JAXINFER_CPU_KERNELS=0"
  if platform.machine().lower() not in ("x86_64", "amd64"):
    return f"it is written for x86-64 (AVX2), this machine is {platform.machine()}"
  flags = _cpu_flags()
  if flags is not None and not {"avx2", "fma", "f16c"} <= flags:
    return "this CPU lacks AVX2, FMA or F16C"
  if _compiler() is None:
    return "no C++ compiler on PATH ($CXX, g++, c++, clang++)"
  return None


def _cpu_flags() -> set[str] | None:
  """The CPU's feature flags from /proc/cpuinfo (None where there is none to read)."""
  try:
    text = Path("/proc/cpuinfo").read_text()
  except OSError:
    return None
  for line in text.splitlines():
    if line.startswith("flags"):
      return set(line.split(":", 1)[1].split())
  return None


def _compiler() -> str | None:
  for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
    if name and (path := shutil.which(name)):
      return path
  return None


def _build() -> Path:
  """The compiled library, built once per source / jaxlib / compiler / flags into the cache."""
  import jaxlib
  compiler = _compiler()
  variant = _isa()
  flags = FLAGS + (VNNI_FLAGS if variant == "avx512vnni" else ()) + (BF16_FLAGS if _bf16() else ())
  key = hashlib.sha256(b"\0".join([*(p.read_bytes() for p in SOURCES + HEADERS), jaxlib.__version__.encode(),
                                   compiler.encode(), " ".join(flags).encode()])).hexdigest()[:16]
  out = _cache_dir() / f"int8_matmul-{variant}-{key}.so"
  if out.exists():
    return out
  out.parent.mkdir(parents=True, exist_ok=True)
  log.info("compiling %s for %s with %s (once per machine)", ", ".join(p.name for p in SOURCES), variant, compiler)
  # Build beside, then rename: another process (a pytest-xdist worker, a server replica)
  # may be building or loading the same file.
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
  os.close(fd)
  try:
    done = subprocess.run([compiler, *flags, "-I", jax.ffi.include_dir(), *map(str, SOURCES), "-o", tmp],
                          capture_output=True, text=True, timeout=300)
    if done.returncode:
      raise RuntimeError(f"{compiler} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return out


def _cache_dir() -> Path:
  from jaxinfer.default_model import cache_dir
  return cache_dir() / "cpu_kernels"
