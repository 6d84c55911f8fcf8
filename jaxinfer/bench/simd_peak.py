"""The multiply-add ceilings of this CPU's AVX2 core, per instruction form, measured.

  jaxinfer bench simd-peak [--out FILE.json]

Why: on a CPU the quantized matmuls at many tokens (64-sequence decode, prefill) are
compute-bound, so what a format can gain over float32 there is bounded by how many
multiply-adds per cycle its inner instruction does. This compiles a small C++ program
(the machine's g++, like cpu_kernels) that runs each form back to back with enough
independent accumulators to hide latency, on one thread, and prints multiply-adds per
nanosecond and each form's ratio to float32 FMA:

  fp32 fma          vfmadd231ps: 8 float32 multiply-adds          (XLA's float32 GEMM)
  int16 madd+add    vpmaddwd + vpaddd: 16 int16 products into int32 (cpu_kernels' int8 / int4)
  int8 maddubs+...  vpmaddubsw + vpmaddwd(ones) + vpaddd: 32 u8 x s8 products into int32
                    (what int8 activations, as llama.cpp's Q8 blocks, would allow)
  int8 maddubs x2   two vpmaddubsw summed in int16 before one widening (64 products)
  int16 vnni        vpdpwssd: 16 int16 products added into int32 in one instruction (AVX512-VNNI;
                    cpu_kernels' VNNI build), only where the CPU has it
  int8 vnni         vpdpbusd: 32 u8 x s8 products into int32 (AVX512-VNNI)

Writes benchmarks/results/simd-peak-<date>.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

from jaxinfer.bench.harness import environment, write_results

# Each form runs enough independent accumulators to hide its latency (twelve FMA chains: 4-cycle
# latency, 2 a cycle); the operands are loop-invariant registers, so only the instructions count.
SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>

template <typename F>
double Rate(F body, long n, double macs_per_iter) {
  body(n / 10);  // warm up (and let the clock settle)
  auto t0 = std::chrono::steady_clock::now();
  body(n);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return macs_per_iter * n / s / 1e9;  // multiply-adds per ns
}

int main() {
  const long N = 50000000;
  __m256 f[8];
  __m256i a[4];
  for (int i = 0; i < 8; ++i) f[i] = _mm256_set1_ps(1.0f);
  for (int i = 0; i < 4; ++i) a[i] = _mm256_set1_epi32(0);
  const __m256 fw = _mm256_set1_ps(1.0001f), fx = _mm256_set1_ps(0.9999f);
  const __m256i w = _mm256_set1_epi16(3), x = _mm256_set1_epi16(5), ones = _mm256_set1_epi16(1);
  double best[4] = {0, 0, 0, 0};
  for (int round = 0; round < 3; ++round) {
    double r;
    r = Rate([&](long n) {
      __m256 f0 = f[0], f1 = f[1], f2 = f[2], f3 = f[3], f4 = f[4], f5 = f[5], f6 = f[6], f7 = f[7], f8 = f0, f9 = f1,
             f10 = f2, f11 = f3;
      for (long i = 0; i < n; ++i) asm volatile(
          "vfmadd231ps %[w], %[x], %[f0]\n\tvfmadd231ps %[w], %[x], %[f1]\n\tvfmadd231ps %[w], %[x], %[f2]\n\t"
          "vfmadd231ps %[w], %[x], %[f3]\n\tvfmadd231ps %[w], %[x], %[f4]\n\tvfmadd231ps %[w], %[x], %[f5]\n\t"
          "vfmadd231ps %[w], %[x], %[f6]\n\tvfmadd231ps %[w], %[x], %[f7]\n\tvfmadd231ps %[w], %[x], %[f8]\n\t"
          "vfmadd231ps %[w], %[x], %[f9]\n\tvfmadd231ps %[w], %[x], %[f10]\n\tvfmadd231ps %[w], %[x], %[f11]\n\t"
          : [f0]"+x"(f0), [f1]"+x"(f1), [f2]"+x"(f2), [f3]"+x"(f3), [f4]"+x"(f4), [f5]"+x"(f5), [f6]"+x"(f6),
            [f7]"+x"(f7), [f8]"+x"(f8), [f9]"+x"(f9), [f10]"+x"(f10), [f11]"+x"(f11) : [w]"x"(fw), [x]"x"(fx));
      f[0] = _mm256_add_ps(_mm256_add_ps(f0, f1), _mm256_add_ps(_mm256_add_ps(f2, f3), _mm256_add_ps(f4, f5)));
      f[1] = _mm256_add_ps(_mm256_add_ps(f6, f7), _mm256_add_ps(_mm256_add_ps(f8, f9), _mm256_add_ps(f10, f11)));
    }, N, 12 * 8);
    if (r > best[0]) best[0] = r;
    r = Rate([&](long n) {
      __m256i a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
      for (long i = 0; i < n; ++i) asm volatile(
          "vpmaddwd %[w], %[x], %%ymm12\n\tvpaddd %%ymm12, %[a0], %[a0]\n\t"
          "vpmaddwd %[w], %[x], %%ymm13\n\tvpaddd %%ymm13, %[a1], %[a1]\n\t"
          "vpmaddwd %[w], %[x], %%ymm14\n\tvpaddd %%ymm14, %[a2], %[a2]\n\t"
          "vpmaddwd %[w], %[x], %%ymm15\n\tvpaddd %%ymm15, %[a3], %[a3]\n\t"
          : [a0]"+x"(a0), [a1]"+x"(a1), [a2]"+x"(a2), [a3]"+x"(a3) : [w]"x"(w), [x]"x"(x)
          : "xmm12", "xmm13", "xmm14", "xmm15");
      a[0] = _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3));
    }, N, 4 * 16);
    if (r > best[1]) best[1] = r;
    r = Rate([&](long n) {
      __m256i a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
      for (long i = 0; i < n; ++i) asm volatile(
          "vpmaddubsw %[x], %[w], %%ymm12\n\tvpmaddwd %[o], %%ymm12, %%ymm12\n\tvpaddd %%ymm12, %[a0], %[a0]\n\t"
          "vpmaddubsw %[x], %[w], %%ymm13\n\tvpmaddwd %[o], %%ymm13, %%ymm13\n\tvpaddd %%ymm13, %[a1], %[a1]\n\t"
          "vpmaddubsw %[x], %[w], %%ymm14\n\tvpmaddwd %[o], %%ymm14, %%ymm14\n\tvpaddd %%ymm14, %[a2], %[a2]\n\t"
          "vpmaddubsw %[x], %[w], %%ymm15\n\tvpmaddwd %[o], %%ymm15, %%ymm15\n\tvpaddd %%ymm15, %[a3], %[a3]\n\t"
          : [a0]"+x"(a0), [a1]"+x"(a1), [a2]"+x"(a2), [a3]"+x"(a3) : [w]"x"(w), [x]"x"(x), [o]"x"(ones)
          : "xmm12", "xmm13", "xmm14", "xmm15");
      a[1] = _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3));
    }, N, 4 * 32);
    if (r > best[2]) best[2] = r;
    r = Rate([&](long n) {
      __m256i a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
      for (long i = 0; i < n; ++i) asm volatile(
          "vpmaddubsw %[x], %[w], %%ymm12\n\tvpmaddubsw %[x], %[w], %%ymm13\n\tvpaddw %%ymm13, %%ymm12, %%ymm12\n\t"
          "vpmaddwd %[o], %%ymm12, %%ymm12\n\tvpaddd %%ymm12, %[a0], %[a0]\n\t"
          "vpmaddubsw %[x], %[w], %%ymm14\n\tvpmaddubsw %[x], %[w], %%ymm15\n\tvpaddw %%ymm15, %%ymm14, %%ymm14\n\t"
          "vpmaddwd %[o], %%ymm14, %%ymm14\n\tvpaddd %%ymm14, %[a1], %[a1]\n\t"
          : [a0]"+x"(a0), [a1]"+x"(a1) : [w]"x"(w), [x]"x"(x), [o]"x"(ones)
          : "xmm12", "xmm13", "xmm14", "xmm15");
      a[2] = _mm256_add_epi32(a0, a1);
    }, N, 2 * 64);
    if (r > best[3]) best[3] = r;
  }
  double vnni[2] = {0, 0};
#ifdef JAXINFER_VNNI
  // Eight accumulators: a vpdpwssd / vpdpbusd waits on its own accumulator (~4 cycles), so
  // four chains measured 1.0x FMA where eight reach 2x.
  __m256i b[8];
  for (int i = 0; i < 8; ++i) b[i] = _mm256_set1_epi32(0);
  // Eight chains of one instruction OP (its mnemonic spliced into the asm), summed into b[OUT].
#define EIGHT_CHAINS(OP, OUT)                                                                           \
  [&](long n) {                                                                                         \
    __m256i b0 = b[0], b1 = b[1], b2 = b[2], b3 = b[3], b4 = b[4], b5 = b[5], b6 = b[6], b7 = b[7];     \
    for (long i = 0; i < n; ++i) asm volatile(                                                          \
        #OP " %[w], %[x], %[b0]\n\t" #OP " %[w], %[x], %[b1]\n\t" #OP " %[w], %[x], %[b2]\n\t"          \
        #OP " %[w], %[x], %[b3]\n\t" #OP " %[w], %[x], %[b4]\n\t" #OP " %[w], %[x], %[b5]\n\t"          \
        #OP " %[w], %[x], %[b6]\n\t" #OP " %[w], %[x], %[b7]\n\t"                                         \
        : [b0]"+v"(b0), [b1]"+v"(b1), [b2]"+v"(b2), [b3]"+v"(b3), [b4]"+v"(b4), [b5]"+v"(b5),            \
          [b6]"+v"(b6), [b7]"+v"(b7) : [w]"v"(w), [x]"v"(x));                                             \
    b[OUT] = _mm256_add_epi32(_mm256_add_epi32(b0, b1), _mm256_add_epi32(_mm256_add_epi32(b2, b3),      \
        _mm256_add_epi32(_mm256_add_epi32(b4, b5), _mm256_add_epi32(b6, b7))));                         \
  }
  for (int round = 0; round < 3; ++round) {
    double r = Rate(EIGHT_CHAINS(vpdpwssd, 0), N, 8 * 16);
    if (r > vnni[0]) vnni[0] = r;
    r = Rate(EIGHT_CHAINS(vpdpbusd, 1), N, 8 * 32);
    if (r > vnni[1]) vnni[1] = r;
  }
  a[0] = _mm256_add_epi32(a[0], _mm256_add_epi32(b[0], b[7]));
#endif
  float sink = _mm256_cvtss_f32(f[0]) + _mm256_extract_epi32(a[0], 0) + _mm256_extract_epi32(a[3], 0);
  std::printf("%.3f %.3f %.3f %.3f %.3f %.3f %g\n", best[0], best[1], best[2], best[3], vnni[0], vnni[1],
              sink > 0 ? 0.0 : 1.0);
}
"""

FORMS = [
    ("fp32 fma", "vfmadd231ps", 8, "XLA's float32 GEMM"),
    ("int16 madd+add", "vpmaddwd + vpaddd", 16, "cpu_kernels' int8 and int4 (int16 activations)"),
    ("int8 maddubs+madd+add", "vpmaddubsw + vpmaddwd(ones) + vpaddd", 32, "int8 activations (not used)"),
    ("int8 maddubs x2", "2 vpmaddubsw + vpaddw + vpmaddwd(ones) + vpaddd", 64, "int8 activations, int16 pair sums (not used)"),
    ("int16 vnni", "vpdpwssd (AVX512-VNNI, ymm)", 16, "cpu_kernels' int8 and int4, VNNI build"),
    ("int8 vnni", "vpdpbusd (AVX512-VNNI, ymm)", 32, "int8 activations (not used)"),
]


def measure() -> list[float]:
  compiler = shutil.which("g++") or shutil.which("c++")
  if compiler is None:
    raise SystemExit("jaxinfer bench simd-peak: needs a C++ compiler (g++ or c++) on PATH")
  with tempfile.TemporaryDirectory() as d:
    src, exe = Path(d) / "peak.cc", Path(d) / "peak"
    src.write_text(SOURCE)
    from cpu_kernels.int8_matmul import VNNI_FLAGS, has_avx512_vnni
    vnni = has_avx512_vnni()
    extra = list(VNNI_FLAGS) if vnni else []
    subprocess.run([compiler, "-O2", "-mavx2", "-mfma", *extra, "-std=c++17", str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
  rates = [float(v) for v in out[:6]]
  return rates if vnni else rates[:4]  # no VNNI rows where the CPU has none


def add_arguments(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
  env = environment(args.command)
  rates = measure()
  rows = [dict(form=name, instructions=ins, products_per_instruction=k, use=use, macs_per_ns=round(r, 2),
               vs_fp32_fma=round(r / rates[0], 2)) for (name, ins, k, use), r in zip(FORMS, rates)]
  print("| form | instructions | multiply-adds / ns (one thread) | vs fp32 FMA | where |\n|---|---|---:|---:|---|")
  for r in rows:
    print(f"| {r['form']} | {r['instructions']} | {r['macs_per_ns']:.1f} | {r['vs_fp32_fma']:.2f}x | {r['use']} |")
  print(f"wrote {write_results('simd-peak', dict(rows=rows), args.out, env=env)}")
  return 0
