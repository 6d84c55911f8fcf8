// int16 activations x int8 weights -> exact integer sums, for XLA CPU (an XLA FFI handler).
//
//   y[r, o] = float32( sum_i x[r, i] * q[o, i] )     x int16 [R, I], q int8 [O, I], y float32 [R, O]
//
// The sum is exact (int32 lanes, flushed to int64 every FLUSH inputs, before they can
// overflow), then rounded once to float32. So every element is the same number whatever
// R is and however the rows are tiled or split over threads: greedy batch invariance
// holds by construction. Why a hand-written kernel: XLA CPU reads an int8 weight of one
// or a few rows through a widened copy or at ~10 GB/s (cpu_kernels/int8_matmul.py).
//
// AVX2: q's 16 int8 -> 16 int16 (vpmovsxbw), vpmaddwd with 16 int16 activations -> 8
// int32 pair sums. A tile is RO weight rows x RR activation rows of such accumulators;
// the output rows are cut into chunks taken by the calling thread and XLA's intra-op
// thread pool.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Software prefetch distance along a weight row: without it one thread streams q from
// DRAM at ~8-13 GB/s of the ~18 it can read (the hardware prefetcher follows the short
// rows poorly); 1-2 KiB ahead measured best (scripts/bench_quant_matmul.py).
constexpr int64_t kPrefetch = 2048;

// |x| <= 32767, |q| <= 127: one vpmaddwd lane adds at most 2 * 32767 * 127 < 2^23.1, so
// 256 of them (4096 inputs over 16 lanes) stay below 2^31.
constexpr int64_t kFlush = 4096;

// The eight int32 lanes (each up to 2^31 after kFlush inputs) summed in int64.
inline int64_t HSum(__m256i v) {
  const __m256i s = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(v)),
                                     _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1)));
  const __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  return _mm_cvtsi128_si64(t) + _mm_extract_epi64(t, 1);
}

template <int RO, int RR>
void Tile(const int16_t* x, const int8_t* q, float* y, int64_t I, int64_t O, int64_t o0, int64_t r0) {
  int64_t sum[RO][RR] = {};
  const int64_t I16 = I / 16 * 16;
  for (int64_t i0 = 0; i0 < I16; i0 += kFlush) {
    const int64_t i1 = std::min(I16, i0 + kFlush);
    __m256i acc[RO][RR];
    for (int a = 0; a < RO; ++a)
      for (int b = 0; b < RR; ++b) acc[a][b] = _mm256_setzero_si256();
    for (int64_t i = i0; i < i1; i += 16) {
      __m256i xv[RR];
      for (int b = 0; b < RR; ++b)
        xv[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + (r0 + b) * I + i));
      if (i % 64 == 0)
        for (int a = 0; a < RO; ++a)
          _mm_prefetch(reinterpret_cast<const char*>(q + (o0 + a) * I + i + kPrefetch), _MM_HINT_T0);
      for (int a = 0; a < RO; ++a) {
        const __m256i w = _mm256_cvtepi8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (o0 + a) * I + i)));
        for (int b = 0; b < RR; ++b) acc[a][b] = _mm256_add_epi32(acc[a][b], _mm256_madd_epi16(w, xv[b]));
      }
    }
    for (int a = 0; a < RO; ++a)
      for (int b = 0; b < RR; ++b) sum[a][b] += HSum(acc[a][b]);
  }
  for (int64_t i = I16; i < I; ++i)  // the inputs past the last multiple of 16
    for (int a = 0; a < RO; ++a)
      for (int b = 0; b < RR; ++b) sum[a][b] += int64_t{x[(r0 + b) * I + i]} * q[(o0 + a) * I + i];
  for (int a = 0; a < RO; ++a)
    for (int b = 0; b < RR; ++b) y[(r0 + b) * O + o0 + a] = static_cast<float>(sum[a][b]);
}

// One activation row against weight row o: one sequential stream through q, four
// accumulators over i. Sums the same integers as Tile, so gives the same float.
void Row(const int16_t* x, const int8_t* q, float* y, int64_t I, int64_t o) {
  const int8_t* qo = q + o * I;
  const auto madd = [&](int64_t i) {
    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qo + i)));
    return _mm256_madd_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)));
  };
  int64_t sum = 0;
  const int64_t I64 = I / 64 * 64;
  for (int64_t i0 = 0; i0 < I64; i0 += kFlush) {
    const int64_t i1 = std::min(I64, i0 + kFlush);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = i0; i < i1; i += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(qo + i + kPrefetch), _MM_HINT_T0);
      a0 = _mm256_add_epi32(a0, madd(i));
      a1 = _mm256_add_epi32(a1, madd(i + 16));
      a2 = _mm256_add_epi32(a2, madd(i + 32));
      a3 = _mm256_add_epi32(a3, madd(i + 48));
    }
    sum += HSum(a0) + HSum(a1) + HSum(a2) + HSum(a3);
  }
  for (int64_t i = I64; i < I; ++i) sum += int64_t{x[i]} * qo[i];
  y[o] = static_cast<float>(sum);
}

// Output rows [ob, oe) for all R activation rows.
void Block(const int16_t* x, const int8_t* q, float* y, int64_t R, int64_t I, int64_t O, int64_t ob, int64_t oe) {
  if (R == 1) {  // one token: read q as one stream (a tile's interleaved rows read it slower)
    for (int64_t o = ob; o < oe; ++o) Row(x, q, y, I, o);
    return;
  }
  int64_t o = ob;
  for (; o + 2 <= oe; o += 2) {
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) Tile<2, 4>(x, q, y, I, O, o, r);
    for (; r < R; ++r) Tile<2, 1>(x, q, y, I, O, o, r);
  }
  for (; o < oe; ++o)
    for (int64_t r = 0; r < R; ++r) Tile<1, 1>(x, q, y, I, O, o, r);
}

// Chunks of output rows, claimed by whichever thread asks next. The caller works too and
// then waits only for chunks already claimed by running threads, so it cannot wait on a
// task the pool has not started (a task that starts late finds nothing left and returns).
struct Work {
  const int16_t* x;
  const int8_t* q;
  float* y;
  int64_t R, I, O, chunk, chunks;
  std::atomic<int64_t> next{0}, done{0};

  void Run() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      Block(x, q, y, R, I, O, c * chunk, std::min(O, (c + 1) * chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::S16> x, ffi::Buffer<ffi::S8> q,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), qd = q.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || qd.size() != 2 || yd.size() != 2 || xd[1] != qd[1] || yd[0] != xd[0] ||
      yd[1] != qd[0])
    return ffi::Error::InvalidArgument("int8_matmul: want x [R, I], q [O, I] -> y [R, O]");
  auto w = std::make_shared<Work>();
  w->x = x.typed_data();
  w->q = q.typed_data();
  w->y = y->typed_data();
  w->R = xd[0];
  w->I = xd[1];
  w->O = qd[0];
  if (w->R == 0 || w->O == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // ~4 chunks per thread (balance), each a multiple of 4 rows (whole tiles), and at least
  // ~64 KiB of weight so a chunk outweighs its scheduling.
  const int64_t min_rows = std::max<int64_t>(4, (65536 / std::max<int64_t>(1, w->I)) / 4 * 4);
  w->chunk = std::max(min_rows, ((w->O + 4 * threads - 1) / (4 * threads) + 3) / 4 * 4);
  w->chunks = (w->O + w->chunk - 1) / w->chunk;
  for (int64_t k = 1; k < threads && k < w->chunks; ++k) pool.Schedule([w] { w->Run(); });
  w->Run();
  while (w->done.load(std::memory_order_acquire) < w->chunks) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_int8_matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S16>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
