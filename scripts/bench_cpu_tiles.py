#!/usr/bin/env python
"""The one-token int8 and int4 kernel blocks on one thread: weights in cache against from DRAM.

  python scripts/bench_cpu_tiles.py [--passes 15] [--dram-layers 150] [--out FILE.json]

Why: at batch 1 each quantized matmul is one token against the whole weight, and the
question is what bounds it, the instructions or the memory stream. This compiles a small
C++ program that includes cpu_kernels/int8_matmul.cc itself (the machine's g++ and the
library's own flags, the VNNI build where the CPU has it) and calls the kernels' row
blocks directly, on one thread, with no XLA and no thread pool around them:

  int8   Block at R = 1: Row, one sequential stream per weight row       (int8 [O, I])
  int4   Int4Block at R = 1: Int4Tile<8, 1>, eight rows x groups of 32     (int4 [O, I / 2]
         packed, float32 scales and mins [G, O])

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
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

SHAPES = [("wq/wo D->D", 576, 576), ("gate/up D->F", 576, 1536), ("down F->D", 1536, 576)]

SOURCE = r"""
#include "int8_matmul.cc"
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>

int main(int argc, char** argv) {
  const int64_t I = atol(argv[1]), O = atol(argv[2]), L = atol(argv[3]), passes = atol(argv[4]);
  const int64_t G = I / 32;
  std::mt19937 rng(1);
  std::vector<std::vector<uint8_t>> q4(L), q8(L);
  std::vector<std::vector<float>> sc(L), mn(L);
  for (int64_t l = 0; l < L; ++l) {
    q4[l].resize(O * I / 2);
    for (auto& b : q4[l]) b = rng();
    q8[l].resize(O * I);
    for (auto& b : q8[l]) b = rng();
    sc[l].resize(G * O);
    mn[l].resize(G * O);
    for (auto& f : sc[l]) f = (rng() % 1000) * 1e-5f;
    for (auto& f : mn[l]) f = (rng() % 1000) * 1e-5f - 5e-3f;
  }
  std::vector<int16_t> x16(I);
  for (auto& v : x16) v = static_cast<int16_t>(static_cast<int>(rng() % 65535) - 32767);
  std::vector<float> xsum(G, 3.0f), y(O), a(1, 1.0f);
  double best4 = 1e9, best8 = 1e9, check = 0;
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
  }
  printf("%.9f %.9f %g\n", best8, best4, check);  // (check: the results are used)
}
"""


def build(workdir: Path) -> tuple[Path, str]:
  """The harness, compiled with cpu_kernels' flags (VNNI where the CPU has it); (binary, isa)."""
  import importlib

  import jax
  km = importlib.import_module("cpu_kernels.int8_matmul")  # (the package re-exports a function of that name)
  compiler = shutil.which("g++") or shutil.which("c++")
  if compiler is None:
    raise SystemExit("bench_cpu_tiles needs a C++ compiler (g++)")
  isa = "avx512vnni" if km.has_avx512_vnni() else "avx2"
  flags = [f for f in km.FLAGS if f not in ("-shared", "-fPIC")] + (list(km.VNNI_FLAGS) if isa == "avx512vnni" else [])
  src, exe = workdir / "tiles.cc", workdir / "tiles"
  src.write_text(SOURCE)
  subprocess.run([compiler, *flags, "-I", jax.ffi.include_dir(), "-I", str(ROOT / "cpu_kernels"), str(src),
                  "-o", str(exe), "-lpthread"], check=True, capture_output=True, text=True)
  return exe, isa


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--passes", type=int, default=15, help="timed passes over the weights (best kept)")
  ap.add_argument("--cache-passes", type=int, default=300, help="passes for the in-cache (L = 2) rows")
  ap.add_argument("--dram-layers", type=int, default=150, help="distinct weights for the DRAM rows")
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  import bench_peers
  rows = []
  with tempfile.TemporaryDirectory() as d:
    exe, isa = build(Path(d))
    for name, I, O in SHAPES:
      for where, L, passes in (("cache", 2, args.cache_passes), ("DRAM", args.dram_layers, args.passes)):
        out = subprocess.run([str(exe), str(I), str(O), str(L), str(passes)], check=True, capture_output=True,
                             text=True).stdout.split()
        t8, t4 = float(out[0]), float(out[1])
        b8, b4 = O * I, O * I // 2 + 2 * (I // 32) * O * 4
        rows.append({"shape": name, "in": I, "out": O, "weights": where, "layers": L,
                     "int8_us": t8 * 1e6, "int8_gb_s": b8 / t8 / 1e9, "int8_mac_per_ns": O * I / t8 / 1e9,
                     "int4_us": t4 * 1e6, "int4_gb_s": b4 / t4 / 1e9, "int4_mac_per_ns": O * I / t4 / 1e9})
  lines = ["| shape | weights | int8 us | int8 GB/s | int8 MAC/ns | int4 us | int4 GB/s | int4 MAC/ns | int4 / int8 time |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['shape']} ({r['in']} x {r['out']}) | {r['weights']} | {r['int8_us']:.1f} | "
                 f"{r['int8_gb_s']:.1f} | {r['int8_mac_per_ns']:.1f} | {r['int4_us']:.1f} | {r['int4_gb_s']:.1f} | "
                 f"{r['int4_mac_per_ns']:.1f} | {r['int4_us'] / r['int8_us']:.2f}x |")
  out = bench_peers.write_results("cpu-tiles", {"isa": isa, "threads": 1, "platform": platform.platform(),
                                                "rows": rows}, args.out)
  print("\n".join(lines))
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
