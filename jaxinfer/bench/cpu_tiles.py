"""The one-token int8 and int4 kernel blocks on one thread: weights in cache against from DRAM.

  jaxinfer bench cpu-tiles [--passes 15] [--dram-layers 150] [--out FILE.json]

Why: at batch 1 each quantized matmul is one token against the whole weight, and the
question is what bounds it, the instructions or the memory stream. This compiles a small
C++ program that includes cpu_kernels/int8_matmul.cc itself (the machine's g++ and the
library's own flags, the VNNI build where the CPU has it) and calls the kernels' row
blocks directly, on one thread, with no XLA and no thread pool around them:

  int8   Block at R = 1: Row, one sequential stream per weight row       (int8 [O, I])
  int4   Int4Block at R = 1: Int4Tile<8, 1>, eight rows x groups of 32     (int4 [O, I / 2]
         packed, float16 scales and mins [G, O])

  int4 x int8-act  a prototype kept here, not in the library: the same tile over int8
         activations with a scale per 32-input group, one u8 x s8 vpdpbusd per row and
         group (VNNI builds only): what int8 block activations would buy at one token;
         and the same with every layer reading one layer's scales and mins (in cache):
         what the [G, O] scale stream costs

over L distinct random weights per SmolLM2-135M shape, L = 2 (they stay in L2 / L3: the
instructions' rate) and L = --dram-layers (they come from DRAM each pass, as a model's 30
layers do), the best of --passes passes. Reported per matmul: microseconds, GB/s of the
weight's bytes (int4: values, scales and mins) and multiply-adds per ns.

Writes benchmarks/results/cpu-tiles-<date>.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from jaxinfer.bench.harness import environment, write_results

SHAPES = [("wq/wo D->D", 576, 576), ("gate/up D->F", 576, 1536), ("down F->D", 1536, 576)]

SOURCE = r"""
#include "int8_matmul.cc"
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>

// A prototype that is not in the library: the one-token int4 tile over int8 activations with
// one scale per 32-input group (xa[g] = max|x_g| / 127, as GGUF's Q8 blocks), so a row's 32
// weights of a group are one u8 x s8 vpdpbusd (weights as v + 8 in [0, 15], the even entries
// then the odd ones, as Unpack32 orders them), where the library's int16 activations need a
// widening and two vpdpwssd. Per eight rows and group: S (exact int32) -> float, times the
// rows' scales times xa[g], plus min' times the group's activation sum, as the cells do.
#ifdef JAXINFER_VNNI
inline __m256i Unpack32U8(const uint8_t* p) {
  const __m128i b = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), _mm_set1_epi8(static_cast<char>(0x88)));
  const __m128i nib = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), nib), _mm_and_si128(b, nib));
}

void Int4BlockU8(const uint8_t* q, const int8_t* x8, const float* xa, const float* xs, const uint16_t* scale,
                 const uint16_t* mins, float* y, int64_t I, int64_t O) {
  const int64_t G = I / 32, bytes = I / 2;
  for (int64_t o0 = 0; o0 + 8 <= O; o0 += 8) {
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x8 + g * 32));
      __m256i v[8];
      // The tile's 8 rows stream kInt4Ahead bytes ahead, as the library's Int4Tile does.
      const char* ahead = reinterpret_cast<const char*>(q + o0 * bytes) + kInt4Ahead;
      const int64_t per = (8 * bytes + 64 * G - 1) / (64 * G);  // lines per group to cover the block
      for (int64_t k = 0; k < per; ++k) _mm_prefetch(ahead + (g * per + k) * 64, _MM_HINT_T0);
      for (int a = 0; a < 8; ++a)
        v[a] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), Unpack32U8(q + (o0 + a) * bytes + g * 16), xv);
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + g * O + o0)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + g * O + o0)));
      _mm_prefetch(reinterpret_cast<const char*>(scale + g * O + o0 + kScalePrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(mins + g * O + o0 + kScalePrefetch), _MM_HINT_T0);
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Reduce8(v)), _mm256_mul_ps(s, _mm256_broadcast_ss(xa + g)), acc);
      accm = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xs + g), accm);
    }
    _mm256_storeu_ps(y + o0, _mm256_add_ps(acc, accm));
  }
}
#endif

int main(int argc, char** argv) {
  const int64_t I = atol(argv[1]), O = atol(argv[2]), L = atol(argv[3]), passes = atol(argv[4]);
  const int64_t G = I / 32;
  std::mt19937 rng(1);
  std::vector<std::vector<uint8_t>> q4(L), q8(L);
  std::vector<std::vector<uint16_t>> sc(L), mn(L);  // float16, as the library holds them
  for (int64_t l = 0; l < L; ++l) {
    q4[l].resize(O * I / 2);
    for (auto& b : q4[l]) b = rng();
    q8[l].resize(O * I);
    for (auto& b : q8[l]) b = rng();
    sc[l].resize(G * O);
    mn[l].resize(G * O);
    for (auto& f : sc[l]) f = _cvtss_sh((rng() % 1000) * 1e-5f, 0);
    for (auto& f : mn[l]) f = _cvtss_sh((rng() % 1000) * 1e-5f - 5e-3f, 0);
  }
  std::vector<int16_t> x16(I);
  for (auto& v : x16) v = static_cast<int16_t>(static_cast<int>(rng() % 65535) - 32767);
  std::vector<float> xsum(G, 3.0f), y(O), a(1, 1.0f);
  std::vector<int8_t> x8(I);
  for (auto& v : x8) v = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
  std::vector<float> xa(G), xs(G);  // xs[g]: the group's activation sum, xa[g] * sum(x8 of g)
  for (int64_t g = 0; g < G; ++g) {
    xa[g] = (1 + rng() % 100) * 1e-4f;
    int sum = 0;
    for (int64_t k = 0; k < 32; ++k) sum += x8[g * 32 + k];
    xs[g] = xa[g] * static_cast<float>(sum);
  }
#ifdef JAXINFER_VNNI
  {  // The prototype against float64: x8's 32-blocks hold the even inputs, then the odd ones.
    Int4BlockU8(q4[0].data(), x8.data(), xa.data(), xs.data(), sc[0].data(), mn[0].data(), y.data(), I, O);
    double worst = 0, norm = 0;
    for (int64_t o = 0; o < O; ++o) {
      double ref = 0;
      for (int64_t i = 0; i < I; ++i) {
        const int64_t g = i / 32, k = i % 32, pos = g * 32 + (k % 2 ? 16 + k / 2 : k / 2);
        const uint8_t byte = q4[0][o * (I / 2) + i / 2];
        const int nib = (i % 2 ? byte >> 4 : byte) & 0x0F, q = nib >= 8 ? nib - 16 : nib;
        ref += double(xa[g]) * x8[pos] * (double(_cvtsh_ss(sc[0][g * O + o])) * (q + 8) + _cvtsh_ss(mn[0][g * O + o]));
      }
      worst = std::max(worst, std::abs(ref - y[o]));
      norm = std::max(norm, std::abs(ref));
    }
    fprintf(stderr, "prototype max |error| / max |y| = %.2e\n", worst / norm);
    if (worst > 1e-4 * norm) return 1;
  }
#endif
  double best4 = 1e9, best8 = 1e9, best4u8 = -1, bestc = -1, check = 0;
  using clock = std::chrono::steady_clock;
  for (int64_t p = 0; p < passes; ++p) {  // the two kernels alternate, so drift hits both
    auto t = clock::now();
    for (int64_t l = 0; l < L; ++l) {
      const Int4Args args{x16.data(), a.data(), q4[l].data(), sc[l].data(), mn[l].data(), xsum.data(),
                          y.data(), 1, I, O, G};
      Int4Block(args, 0, O);
      check += y[O / 2];
    }
    best4 = std::min(best4, std::chrono::duration<double>(clock::now() - t).count() / L);
    t = clock::now();
    for (int64_t l = 0; l < L; ++l) {
      Block(x16.data(), a.data(), reinterpret_cast<const int8_t*>(q8[l].data()), y.data(), 1, I, O, 0, O);
      check += y[O / 2];
    }
    best8 = std::min(best8, std::chrono::duration<double>(clock::now() - t).count() / L);
#ifdef JAXINFER_VNNI
    t = clock::now();
    for (int64_t l = 0; l < L; ++l) {
      Int4BlockU8(q4[l].data(), x8.data(), xa.data(), xs.data(), sc[l].data(), mn[l].data(), y.data(), I, O);
      check += y[O / 2];
    }
    const double t4u8 = std::chrono::duration<double>(clock::now() - t).count() / L;
    best4u8 = best4u8 < 0 ? t4u8 : std::min(best4u8, t4u8);
    {  // the same, every layer reading layer 0's scales and mins: what their stream costs
      t = clock::now();
      for (int64_t l = 0; l < L; ++l) {
        Int4BlockU8(q4[l].data(), x8.data(), xa.data(), xs.data(), sc[0].data(), mn[0].data(), y.data(), I, O);
        check += y[O / 2];
      }
      const double tc = std::chrono::duration<double>(clock::now() - t).count() / L;
      bestc = bestc < 0 ? tc : std::min(bestc, tc);
    }
#endif
  }
  printf("%.9f %.9f %.9f %g %.9f\n", best8, best4, best4u8, check, bestc);  // (check: the results are used)
}
"""


def build(workdir: Path) -> tuple[Path, str]:
  """The harness, compiled with cpu_kernels' flags (VNNI where the CPU has it); (binary, isa)."""
  import importlib

  import jax
  km = importlib.import_module("cpu_kernels.int8_matmul")  # (the package re-exports a function of that name)
  compiler = shutil.which("g++") or shutil.which("c++")
  if compiler is None:
    raise SystemExit("jaxinfer bench cpu-tiles needs a C++ compiler (g++)")
  isa = "avx512vnni" if km.has_avx512_vnni() else "avx2"
  flags = [f for f in km.FLAGS if f not in ("-shared", "-fPIC")] + (list(km.VNNI_FLAGS) if isa == "avx512vnni" else [])
  src, exe = workdir / "tiles.cc", workdir / "tiles"
  src.write_text(SOURCE)
  subprocess.run([compiler, *flags, "-I", jax.ffi.include_dir(), "-I", str(Path(km.__file__).parent), str(src),
                  "-o", str(exe), "-lpthread"], check=True, capture_output=True, text=True)
  return exe, isa


def add_arguments(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("--passes", type=int, default=15, help="timed passes over the weights (best kept)")
  ap.add_argument("--cache-passes", type=int, default=300, help="passes for the in-cache (L = 2) rows")
  ap.add_argument("--dram-layers", type=int, default=150, help="distinct weights for the DRAM rows")
  ap.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
  env = environment(args.command)
  rows = []
  with tempfile.TemporaryDirectory() as d:
    exe, isa = build(Path(d))
    for name, I, O in SHAPES:
      for where, L, passes in (("cache", 2, args.cache_passes), ("DRAM", args.dram_layers, args.passes)):
        out = subprocess.run([str(exe), str(I), str(O), str(L), str(passes)], check=True, capture_output=True,
                             text=True).stdout.split()
        t8, t4, t4u8, t4c = float(out[0]), float(out[1]), float(out[2]), float(out[4])
        b8, b4 = O * I, O * I // 2 + 2 * (I // 32) * O * 2
        row = {"shape": name, "in": I, "out": O, "weights": where, "layers": L,
               "int8_us": t8 * 1e6, "int8_gb_s": b8 / t8 / 1e9, "int8_mac_per_ns": O * I / t8 / 1e9,
               "int4_us": t4 * 1e6, "int4_gb_s": b4 / t4 / 1e9, "int4_mac_per_ns": O * I / t4 / 1e9}
        if t4u8 > 0:  # the int8-activation prototype (VNNI builds only)
          row.update(int4_u8_us=t4u8 * 1e6, int4_u8_gb_s=b4 / t4u8 / 1e9, int4_u8_mac_per_ns=O * I / t4u8 / 1e9,
                     int4_u8_scales_cached_us=t4c * 1e6)
        rows.append(row)
  lines = ["| shape | weights | int8 us | int8 GB/s | int8 MAC/ns | int4 us | int4 GB/s | int4 MAC/ns | int4 / int8 time "
           "| int4 x int8-act us | MAC/ns | vs int4 | same, scales cached us |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    u8 = (f"{r['int4_u8_us']:.1f} | {r['int4_u8_mac_per_ns']:.1f} | {r['int4_us'] / r['int4_u8_us']:.2f}x | "
          f"{r['int4_u8_scales_cached_us']:.1f}" if "int4_u8_us" in r else "- | - | - | -")
    lines.append(f"| {r['shape']} ({r['in']} x {r['out']}) | {r['weights']} | {r['int8_us']:.1f} | "
                 f"{r['int8_gb_s']:.1f} | {r['int8_mac_per_ns']:.1f} | {r['int4_us']:.1f} | {r['int4_gb_s']:.1f} | "
                 f"{r['int4_mac_per_ns']:.1f} | {r['int4_us'] / r['int8_us']:.2f}x | {u8} |")
  out = write_results("cpu-tiles", {"isa": isa, "threads": 1, "platform": platform.platform(),
                                    "rows": rows}, args.out, env=env)
  print("\n".join(lines))
  print(f"wrote {out}")
  return 0

