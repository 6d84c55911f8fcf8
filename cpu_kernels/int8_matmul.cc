// float32 activations as int16 x int8 (and group-wise int4, below) weights for XLA CPU: XLA FFI handlers.
//
//   y[r, o] = float32( sum_i x16[r, i] * q[o, i] ) * a[r]     x float32 [R, I], q int8 [O, I], y float32 [R, O]
//
// with x = a x16 per row (Int16Rows: a = max|x[r]| / 32767, x16 = round(x / a)). Each call
// quantizes its own activations: done in XLA, that was ~6 small operations (~2.5 us) per
// linear, more than the 576 x 192 products cost. The sum is exact (int32 lanes, flushed
// to int64 every kFlush inputs, before they can overflow), then rounded once to float32
// and scaled by a[r]. So every element is the same number whatever R is and however the
// rows are tiled or split over threads: greedy batch invariance holds by construction.
// Why a hand-written kernel: XLA CPU reads an int8 weight of one or a few rows through a
// widened copy or well below the DRAM bandwidth (cpu_kernels/int8_matmul.py).
//
// AVX2: q's 16 int8 -> 16 int16 (vpmovsxbw), vpmaddwd with 16 int16 activations -> 8
// int32 pair sums. A tile is RO weight rows x RR activation rows of such accumulators;
// the output rows are cut into chunks taken by the calling thread and helper threads
// (parallel.h).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "convert.h"
#include "parallel.h"

namespace ffi = xla::ffi;

namespace {

using jaxinfer_cpu::Fp8One;
using jaxinfer_cpu::Fp8x8;
#ifdef JAXINFER_BF16
using jaxinfer_cpu::Fp8Bf16One;
using jaxinfer_cpu::Fp8x32Bf16;
#endif

using jaxinfer_cpu::AlignedScratch;
using jaxinfer_cpu::ParallelRows;
using jaxinfer_cpu::Scratch;

// Software prefetch distance along a weight row: without it one thread streams q from
// DRAM well below what it can read (the hardware prefetcher follows the short rows
// poorly); 1-2 KiB ahead measured best (`jaxinfer bench quant`).
constexpr int64_t kPrefetch = 2048;

// |x| <= 32767, |q| <= 127: one vpmaddwd lane adds at most 2 * 32767 * 127 = 8322818, so
// 256 of them (4096 inputs over 16 lanes) stay below 2^31 - 1.
constexpr int64_t kFlush = 4096;

// The eight int32 lanes (each up to 2^31 after kFlush inputs) summed in int64.
inline int64_t HSum(__m256i v) {
  const __m256i s = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(v)),
                                     _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1)));
  const __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  return _mm_cvtsi128_si64(t) + _mm_extract_epi64(t, 1);
}

// a + the pair sums of w x x (16 int16 products -> 8 int32 lanes). Built for a CPU with
// AVX512-VNNI (int8_matmul.py builds a second library with JAXINFER_VNNI there), one vpdpwssd;
// else vpmaddwd then vpaddd. The same int32 lanes either way: every pair sum and running sum
// here fits int32 (kFlush, kMaxGroup), and both wrap alike past it. On the Zen 4 core this
// was measured on (`jaxinfer bench simd-peak`), with enough independent accumulators,
// vpdpwssd multiply-adds 1.9x as fast as float32 FMA, vpmaddwd + vpaddd 1.5x; vpdpwssd waits
// ~4 cycles on its accumulator, so tiles keep 8 or more of them in flight.
inline __m256i DotAdd(__m256i a, __m256i w, __m256i x) {
#ifdef JAXINFER_VNNI
  return _mm256_dpwssd_epi32(a, w, x);
#else
  return _mm256_add_epi32(a, _mm256_madd_epi16(w, x));
#endif
}

// ---- activations ----------------------------------------------------------------------------
//
// Row r of x to int16: a[r] = max|x[r]| / 32767 (1 for a row of zeros, NaN for a row with a
// NaN, so its outputs are NaN), x16 = round-half-even(x / a) clamped to [-32767, 32767]:
// x = a x16 to within a / 2. cpu_kernels.int16_rows_reference is the same float32 arithmetic.
constexpr float kInt16Max = 32767.0f;

float RowScale(const float* x, int64_t I) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    m = _mm256_max_ps(m, _mm256_and_ps(v, magnitude));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float amax = 0.0f;
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (float l : lanes) amax = std::max(amax, l);
  for (; i < I; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
    has_nan |= std::isnan(x[i]);
  }
  if (has_nan) return std::numeric_limits<float>::quiet_NaN();
  return amax > 0.0f ? amax / kInt16Max : 1.0f;
}

void QuantizeRow(const float* x, int64_t I, float a, int16_t* x16) {
  const __m256 av = _mm256_set1_ps(a), hi = _mm256_set1_ps(kInt16Max), lo = _mm256_set1_ps(-kInt16Max);
  const auto q8 = [&](const float* p) {
    const __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(p), av), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
  };
  int64_t i = 0;
  for (; i + 16 <= I; i += 16)  // packs interleaves the 128-bit halves; the permute puts them back in order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x16 + i),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(q8(x + i), q8(x + i + 8)), 0xD8));
  for (; i < I; ++i)
    x16[i] = static_cast<int16_t>(std::min(std::max(std::nearbyint(x[i] / a), -kInt16Max), kInt16Max));
}

// Rows [rb, re) of x [R, I]: scales a [R], values x16 [R, I].
void Int16Rows(const float* x, int64_t I, float* a, int16_t* x16, int64_t rb, int64_t re) {
  for (int64_t r = rb; r < re; ++r) {
    a[r] = RowScale(x + r * I, I);
    QuantizeRow(x + r * I, I, a[r], x16 + r * I);
  }
}

template <int RO, int RR>
void Tile(const int16_t* x, const float* as, const int8_t* q, float* y, int64_t I, int64_t O, int64_t o0, int64_t r0) {
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
        for (int b = 0; b < RR; ++b) acc[a][b] = DotAdd(acc[a][b], w, xv[b]);
      }
    }
    for (int a = 0; a < RO; ++a)
      for (int b = 0; b < RR; ++b) sum[a][b] += HSum(acc[a][b]);
  }
  for (int64_t i = I16; i < I; ++i)  // the inputs past the last multiple of 16
    for (int a = 0; a < RO; ++a)
      for (int b = 0; b < RR; ++b) sum[a][b] += int64_t{x[(r0 + b) * I + i]} * q[(o0 + a) * I + i];
  for (int a = 0; a < RO; ++a)
    for (int b = 0; b < RR; ++b) y[(r0 + b) * O + o0 + a] = static_cast<float>(sum[a][b]) * as[r0 + b];
}

// One activation row against weight row o: one sequential stream through q, four
// accumulators over i. Sums the same integers as Tile, so gives the same float.
void Row(const int16_t* x, float a, const int8_t* q, float* y, int64_t I, int64_t o) {
  const int8_t* qo = q + o * I;
  const auto dot = [&](__m256i acc, int64_t i) {
    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qo + i)));
    return DotAdd(acc, w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)));
  };
  int64_t sum = 0;
  const int64_t I64 = I / 64 * 64;
  for (int64_t i0 = 0; i0 < I64; i0 += kFlush) {
    const int64_t i1 = std::min(I64, i0 + kFlush);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = i0; i < i1; i += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(qo + i + kPrefetch), _MM_HINT_T0);
      a0 = dot(a0, i);
      a1 = dot(a1, i + 16);
      a2 = dot(a2, i + 32);
      a3 = dot(a3, i + 48);
    }
    sum += HSum(a0) + HSum(a1) + HSum(a2) + HSum(a3);
  }
  for (int64_t i = I64; i < I; ++i) sum += int64_t{x[i]} * qo[i];
  y[o] = static_cast<float>(sum) * a;
}

// Output rows [ob, oe) for all R activation rows.
void Block(const int16_t* x, const float* as, const int8_t* q, float* y, int64_t R, int64_t I, int64_t O, int64_t ob,
           int64_t oe) {
  if (R == 1) {  // one token: read q as one stream (a tile's interleaved rows read it slower)
    for (int64_t o = ob; o < oe; ++o) Row(x, as[0], q, y, I, o);
    return;
  }
  int64_t o = ob;
  for (; o + 2 <= oe; o += 2) {
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) Tile<2, 4>(x, as, q, y, I, O, o, r);
    for (; r < R; ++r) Tile<2, 1>(x, as, q, y, I, O, o, r);
  }
  for (; o < oe; ++o)
    for (int64_t r = 0; r < R; ++r) Tile<1, 1>(x, as, q, y, I, O, o, r);
}

#ifdef JAXINFER_VNNI
// Output rows [ob, oe) through repacked panels, from kPanelRows tokens on (int8 panels, below).
void Int8PanelBlock(const int16_t* x16, const float* as, const int8_t* q, float* y, int64_t R, int64_t I, int64_t O,
                    int64_t ob, int64_t oe);
bool Int8PanelFits(int64_t R, int64_t I);
#endif

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), qd = q.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || qd.size() != 2 || yd.size() != 2 || xd[1] != qd[1] || yd[0] != xd[0] ||
      yd[1] != qd[0])
    return ffi::Error::InvalidArgument("int8_matmul: want x [R, I], q [O, I] -> y [R, O]");
  const int64_t R = xd[0], I = xd[1], O = qd[0];
  if (R == 0) return ffi::Error::Success();
  thread_local std::vector<int16_t> x16_buf;
  thread_local std::vector<float> a_buf;
  int16_t* xp = Scratch(x16_buf, R * I);
  float* ap = Scratch(a_buf, R);
  const float* xf = x.typed_data();
  ParallelRows(pool, R, I * 4, 1, [=](int64_t rb, int64_t re) { Int16Rows(xf, I, ap, xp, rb, re); });
  const int8_t* qp = q.typed_data();
  float* yp = y->typed_data();
#ifdef JAXINFER_VNNI
  if (Int8PanelFits(R, I)) {
    ParallelRows(pool, O, I * R, 16, [=](int64_t ob, int64_t oe) { Int8PanelBlock(xp, ap, qp, yp, R, I, O, ob, oe); });
    return ffi::Error::Success();
  }
#endif
  ParallelRows(pool, O, I * R, 8, [=](int64_t ob, int64_t oe) { Block(xp, ap, qp, yp, R, I, O, ob, oe); });
  return ffi::Error::Success();
}

// ---- int4 groups ---------------------------------------------------------------------------
//
//   y[r, o] = ( sum_g ( scale[g, o] * S[r, g, o] + min'[g, o] * xsum[r, g] ) ) * a[r]
//   S[r, g, o] = sum_{i in group g} x16[r, i] * (q[o, i] + 8)   (exact, int32)
//
// with min' = min (y = x @ ((q + 8) scale + min)^T, GGUF Q4_1's w = d q' + m with q' = q + 8), or
// -8 scale without mins (y = x @ (q scale)^T, Q4_0's). scale and min are float16 [G, O], as
// GGUF stores d and m: 0.625 bytes a weight, llama.cpp's Q4_1 bytes (float32 scales and mins
// were 0.75; at one token the weight stream is the bound). Each converts exactly to float32. q int4
// [O, I] as XLA CPU holds it: packed two per byte, the lower-indexed value in the low nibble;
// x16 (Int4Activations) with the even entries of each 32-block first, then the odd ones;
// xsum[r, g] = float(sum of x16 over group g) (exact up to 512 inputs a group), stored [G, R] or [R, G].
// Groups of 32 to kMaxGroup inputs, a multiple of 32.
//
// Each (r, o) is one "cell" and runs the same float32 operations in every tile shape, so
// the result does not depend on the batch:
//   acc = fma(float(S[g]), scale[g], acc);  accm = fma(min'[g], xsum[g], accm)
// group after group, then y = (acc + accm) * a. S is an exact integer (|S| <= 32 * 32767 * 15 < 2^24
// for a group of 32, so float(S) is exact there too). A tile computes eight cells at once
// (8 weight rows x 1 token, or 2 x 4): each cell's eight int32 lanes are reduced to one
// lane of a vector (Reduce8), and one vector FMA then scales all eight cells, with the
// scales of eight adjacent rows read as the weight stores them ([G, O]). Per weight row and
// group of 32 that is ~10 instructions (unpack 5, two vpmaddwd and an add, the rest shared
// by the eight), where eight float lanes per cell (a convert, a broadcast and an FMA per row
// and group, and min' per row) cost ~14: faster at one token (`jaxinfer bench quant`),
// a little slower at 64 tokens, where the 2 x 4 tile shares each unpacked row between only
// four tokens either way (a 1 x 8 tile was slower still); many tokens take the panels below.
// Leftover cells (rows past a multiple of 8 or 2, tokens past a multiple of 4) run the same
// arithmetic one at a time.
// -ffp-contract=off keeps the compiler from fusing any other float expression differently
// in different paths.

// Rows ahead at which the int4 paths prefetch their [G, O] scales and mins (PrefetchScales).
constexpr int64_t kScalePrefetch = 32;

// How far ahead (bytes of q) a tile streams its weight rows (Int4Tile). A tile walks 16 bytes
// of each of eight rows in turn, which the hardware prefetcher does not follow, so at one token
// from DRAM the walk, not the instructions, bound int4; of 2, 4 and 8 KiB ahead (and one line
// per row one tile on, before), 4 KiB was fastest on every shape (`jaxinfer bench cpu-tiles`;
// docs/performance.md, "cpu-tiles").
constexpr int64_t kInt4Ahead = 4096;

constexpr int64_t kMaxGroup = 4096;  // |S| <= 4096 * 32767 * 15 < 2^31: the cell sum fits int32

// 32 int4 values (16 bytes) -> v + 8 in [0, 15] as int16: the even-indexed values (low
// nibbles) and the odd-indexed ones (high nibbles). A two's-complement nibble with its top
// bit flipped is v + 8, so four instructions; the activations come with each 32-block's
// even entries first to match: GGUF Q4_1's q' = v + 8 in [0, 15], whose min m is min'
// (without mins, Q4_0's, the + 8 is taken back through the group's activation sum: min' = -8 scale).
inline void Unpack32(const uint8_t* p, __m256i& even, __m256i& odd) {
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x88));  // both nibbles' top bits
  const __m256i v = _mm256_cvtepu8_epi16(_mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), flip));
  even = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
  odd = _mm256_srli_epi16(v, 4);
}

// acc + the eight int32 partial sums of x (even entries, then odd) times one unpacked 32-input chunk.
inline __m256i Chunk32(__m256i acc, const __m256i& even, const __m256i& odd, const int16_t* x) {
  acc = DotAdd(acc, even, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return DotAdd(acc, odd, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)));
}

// Lane k of the result = the sum of v[k]'s eight lanes (exact int32).
inline __m256i Reduce8(const __m256i* v) {
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

inline int32_t HSum32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// A 32-block of int16 in place: its 16 even-indexed entries, then its 16 odd ones. An
// (even, odd) pair read as one int32 lane is even + 65536 odd: shifts split it, and packs
// (per 128-bit half, so permuted back) joins two vectors' halves.
inline void EvenOdd32(int16_t* p) {
  const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  const auto even = [](__m256i v) { return _mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16); };
  const auto odd = [](__m256i v) { return _mm256_srai_epi32(v, 16); };
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm256_permute4x64_epi64(_mm256_packs_epi32(even(v0), even(v1)), 0xD8));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16),
                      _mm256_permute4x64_epi64(_mm256_packs_epi32(odd(v0), odd(v1)), 0xD8));
}

// Rows [rb, re) of x [R, I] -> a [R], x16 [R, I], xsum. For the cells x16 in each 32-block's
// even-odd order (their unpacked nibbles') and xsum [G, R] (a tile's tokens side by side); for
// the panel (`panel`) x16 in order and xsum [R, G] (a token's groups in the order it sums them).
void Int4Activations(const float* x, int64_t R, int64_t I, int64_t G, float* a, int16_t* x16, float* xsum,
                     bool panel, int64_t rb, int64_t re) {
  const int64_t gs = I / G;
  const __m256i ones = _mm256_set1_epi16(1);
  Int16Rows(x, I, a, x16, rb, re);
  for (int64_t r = rb; r < re; ++r) {
    int16_t* row = x16 + r * I;
    for (int64_t g = 0; g < G; ++g) {
      // |sum| <= 4096 * 32767 < 2^31; a lane adds at most 512 entries
      __m256i sum = _mm256_setzero_si256();
      for (int64_t i = g * gs; i < (g + 1) * gs; i += 16)
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i)), ones));
      xsum[panel ? r * G + g : g * R + r] = static_cast<float>(HSum32(sum));
    }
    if (!panel)
      for (int64_t b = 0; b < I; b += 32) EvenOdd32(row + b);
  }
}

struct Int4Args {
  const int16_t* x;     // [R, I]
  const float* a;       // [R]
  const uint8_t* q;     // [O, I / 2]
  const uint16_t* scale;  // float16 [G, O]
  const uint16_t* mins;   // float16 [G, O], or nullptr (Q4_0: min' = -8 scale)
  const float* xsum;   // [G, R] for the cells, [R, G] for the panel (Int4Activations)
  float* y;             // [R, O]
  int64_t R, I, O, G;
};

// A float16 scale or min, exactly as float32 (F16C).
inline float Half(uint16_t h) { return _cvtsh_ss(h); }

// Fetches group g's scales and mins kScalePrefetch rows past row o. They are [G, O]: a tile
// reads one line per group, G lines O floats apart, which the hardware prefetcher does not
// follow; fetching them 32 rows on made a one-token matmul several times faster on one
// thread (`jaxinfer bench quant`).
inline void PrefetchScales(const Int4Args& p, int64_t g, int64_t o) {
  _mm_prefetch(reinterpret_cast<const char*>(p.scale + g * p.O + o + kScalePrefetch), _MM_HINT_T0);
  if (p.mins) _mm_prefetch(reinterpret_cast<const char*>(p.mins + g * p.O + o + kScalePrefetch), _MM_HINT_T0);
}

// Adds x rows r0 .. r0 + RR times weight rows o0 .. o0 + RO over group g's inputs to the
// int32 lanes of cells v[a * RR + b]. kOneChunk: groups of exactly 32 (GGUF's), unrolled.
template <int RO, int RR, bool kOneChunk>
inline void GroupSums(const Int4Args& p, int64_t o0, int64_t r0, int64_t g, __m256i* v) {
  const int64_t gs = kOneChunk ? 32 : p.I / p.G;
  for (int64_t i = g * gs; i < (g + 1) * gs; i += 32)
    for (int a = 0; a < RO; ++a) {
      const uint8_t* row = p.q + (o0 + a) * (p.I / 2) + i / 2;
      __m256i even, odd;
      Unpack32(row, even, odd);
      for (int b = 0; b < RR; ++b)
        v[a * RR + b] = Chunk32(v[a * RR + b], even, odd, p.x + (r0 + b) * p.I + i);
    }
}

// Eight cells: RO x RR = 8 x 1 (one token) or 2 x 4; lane a * RR + b is (r0 + b, o0 + a).
template <int RO, int RR, bool kOneChunk>
void Int4Tile(const Int4Args& p, int64_t o0, int64_t r0) {
  static_assert(RO * RR == 8);
  const __m256 minus8 = _mm256_set1_ps(-8.0f);
  __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
  // The tile's RO rows are one contiguous block of q: each group prefetches its share of the
  // lines kInt4Ahead bytes past the block's start, so the block streams ahead as int8's Row
  // does (the cells' reads hop between RO rows 16 bytes at a time, which the hardware
  // prefetcher does not follow).
  const int64_t bytes = p.I / 2, per_group = (RO * bytes + 64 * p.G - 1) / (64 * p.G);
  const char* ahead = reinterpret_cast<const char*>(p.q + o0 * bytes) + kInt4Ahead;
  for (int64_t g = 0; g < p.G; ++g) {
    __m256i v[8];
    for (int k = 0; k < 8; ++k) v[k] = _mm256_setzero_si256();
    for (int64_t k = 0; k < per_group; ++k) _mm_prefetch(ahead + (g * per_group + k) * 64, _MM_HINT_T0);
    GroupSums<RO, RR, kOneChunk>(p, o0, r0, g, v);
    const uint16_t* sg = p.scale + g * p.O + o0;
    const uint16_t* mg = p.mins ? p.mins + g * p.O + o0 : nullptr;
    PrefetchScales(p, g, o0);
    __m256 s, m, xs;
    if constexpr (RO == 8) {
      s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg)));
      m = mg ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mg))) : _mm256_mul_ps(minus8, s);
      xs = _mm256_broadcast_ss(p.xsum + g * p.R + r0);
    } else {  // 2 x 4
      s = _mm256_set_m128(_mm_set1_ps(Half(sg[1])), _mm_set1_ps(Half(sg[0])));
      m = mg ? _mm256_set_m128(_mm_set1_ps(Half(mg[1])), _mm_set1_ps(Half(mg[0]))) : _mm256_mul_ps(minus8, s);
      xs = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(p.xsum + g * p.R + r0));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Reduce8(v)), s, acc);
    accm = _mm256_fmadd_ps(m, xs, accm);
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, _mm256_add_ps(acc, accm));
  for (int a = 0; a < RO; ++a)
    for (int b = 0; b < RR; ++b) p.y[(r0 + b) * p.O + o0 + a] = out[a * RR + b] * p.a[r0 + b];
}

// One cell, the same arithmetic as a lane of Int4Tile.
template <bool kOneChunk>
void Int4Cell(const Int4Args& p, int64_t o, int64_t r) {
  float acc = 0.0f, accm = 0.0f;
  for (int64_t g = 0; g < p.G; ++g) {
    __m256i v = _mm256_setzero_si256();
    GroupSums<1, 1, kOneChunk>(p, o, r, g, &v);
    const float s = Half(p.scale[g * p.O + o]), m = p.mins ? Half(p.mins[g * p.O + o]) : -8.0f * s;
    acc = std::fma(static_cast<float>(HSum32(v)), s, acc);
    accm = std::fma(m, p.xsum[g * p.R + r], accm);
  }
  p.y[r * p.O + o] = (acc + accm) * p.a[r];
}

template <bool kOneChunk>
void Int4Rows(const Int4Args& p, int64_t ob, int64_t oe) {
  int64_t o = ob;
  if (p.R == 1) {
    for (; o + 8 <= oe; o += 8) Int4Tile<8, 1, kOneChunk>(p, o, 0);
  } else {
    for (; o + 2 <= oe; o += 2) {
      int64_t r = 0;
      for (; r + 4 <= p.R; r += 4) Int4Tile<2, 4, kOneChunk>(p, o, r);
      for (; r < p.R; ++r) {
        Int4Cell<kOneChunk>(p, o, r);
        Int4Cell<kOneChunk>(p, o + 1, r);
      }
    }
  }
  for (; o < oe; ++o)
    for (int64_t r = 0; r < p.R; ++r) Int4Cell<kOneChunk>(p, o, r);
}

void Int4Block(const Int4Args& p, int64_t ob, int64_t oe) {
  if (p.I / p.G == 32)
    Int4Rows<true>(p, ob, oe);
  else
    Int4Rows<false>(p, ob, oe);
}

// ---- int4 at many tokens: a repacked panel -------------------------------------------------
//
// The cells above unpack each weight chunk once per tile of 2 x 4 and reduce every cell's
// eight lanes per group (Reduce8): per cell and group of 32 that is ~10 instructions, and at
// many tokens that left int4 slower than float32 end to end. From kPanelRows tokens on, each thread
// instead repacks 16-row blocks of its output rows once per call into a panel whose int32
// lanes are eight *output rows*: lane k of pair j holds (q[o0 + k, 2j] + 8) | (q[o0 + k,
// 2j + 1] + 8) << 16, exactly one packed byte of row o0 + k, so a broadcast of the token's
// activation pair (x16[2j], x16[2j + 1]) and one vpmaddwd give eight rows' pair sums with
// no reduction. Per cell and group: two vpmaddwd and two adds (~4), then one convert and
// FMA per eight cells. The repack (~1 instruction per weight byte, an 8 x 16 byte
// transpose) is shared by all R tokens. Tiles of 3 tokens x 16 rows (4 x 16 and 2 x 16
// measured slower with AVX2's 16 registers; 6 x 16 in the VNNI build). Panels beat the cells
// from kPanelRows tokens on and come near XLA's float32 GEMM (`jaxinfer bench quant`).
// The instructions allow more (vpmaddwd + vpaddd outrun float32 FMA, `jaxinfer bench simd-peak`):
// the broadcasts, panel loads and the activations' quantization take the rest. The VNNI build
// runs a 16-row block as one zmm, 6 tokens a tile (8 and 12 measured slower), faster than its
// two-ymm form.
//
// Same numbers as the cells: S[r, g, o] is the same exact int32, converted the same way,
// then acc = fma(float(S), scale, acc) group after group, accm = fma(min',
// xsum, accm), y = (acc + accm) * a, lane for lane. So which path a call takes (by R) does
// not change any element: batch invariance holds across it (tested).
constexpr int64_t kPanelRows = 16;
#ifdef JAXINFER_VNNI
constexpr int kPanelTokens = 6;  // 12 accumulators for vpdpwssd's latency; AVX-512 has the registers
#else
constexpr int kPanelTokens = 3;
#endif

// Eight rows (o0 ..) of one 32-input chunk (16 packed bytes at byte offset c of each row)
// -> 16 pairs of eight int32 lanes, written to panel[(j0 + j) * stride].
inline void RepackChunk(const uint8_t* rows[8], int64_t c, __m256i* out, int64_t stride) {
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x88));
  __m128i r[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[k] + c)), flip);
  // 8 rows x 16 bytes -> for each byte j, the eight rows' bytes side by side.
  __m128i a[8], b[8];
  for (int k = 0; k < 4; ++k) {
    a[2 * k] = _mm_unpacklo_epi8(r[2 * k], r[2 * k + 1]);      // bytes 0-7 of rows 2k, 2k+1
    a[2 * k + 1] = _mm_unpackhi_epi8(r[2 * k], r[2 * k + 1]);  // bytes 8-15
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3, then 4-7
    b[4 * h + 0] = _mm_unpacklo_epi16(a[4 * h + 0], a[4 * h + 2]);  // bytes 0-3 of four rows
    b[4 * h + 1] = _mm_unpackhi_epi16(a[4 * h + 0], a[4 * h + 2]);  // 4-7
    b[4 * h + 2] = _mm_unpacklo_epi16(a[4 * h + 1], a[4 * h + 3]);  // 8-11
    b[4 * h + 3] = _mm_unpackhi_epi16(a[4 * h + 1], a[4 * h + 3]);  // 12-15
  }
  const __m256i lo = _mm256_set1_epi32(0x0F), hi = _mm256_set1_epi32(0xF0);
  const auto lanes = [&](__m128i eight_bytes) {  // byte -> low nibble | high nibble << 16
    const __m256i e = _mm256_cvtepu8_epi32(eight_bytes);
    return _mm256_or_si256(_mm256_and_si256(e, lo), _mm256_slli_epi32(_mm256_and_si256(e, hi), 12));
  };
  for (int k = 0; k < 4; ++k) {
    const __m128i c0 = _mm_unpacklo_epi32(b[k], b[4 + k]);  // bytes 4k, 4k+1 of all eight rows
    const __m128i c1 = _mm_unpackhi_epi32(b[k], b[4 + k]);  // bytes 4k+2, 4k+3
    out[(4 * k + 0) * stride] = lanes(c0);
    out[(4 * k + 1) * stride] = lanes(_mm_unpackhi_epi64(c0, c0));
    out[(4 * k + 2) * stride] = lanes(c1);
    out[(4 * k + 3) * stride] = lanes(_mm_unpackhi_epi64(c1, c1));
  }
}

// Rows [o0, o0 + n) (n <= 8 NV) -> panel[j * NV + v], lane k of vector v = row o0 + 8 v + k
// (zero lanes past n).
void RepackPanel(const Int4Args& p, int64_t o0, int64_t n, int NV, __m256i* panel) {
  const int64_t bytes = p.I / 2;
  for (int v = 0; v < NV; ++v) {
    const int64_t nv = std::min<int64_t>(8, n - 8 * v);
    if (nv == 8) {
      const uint8_t* rows[8];
      for (int k = 0; k < 8; ++k) rows[k] = p.q + (o0 + 8 * v + k) * bytes;
      for (int64_t c = 0; c < bytes; c += 16) RepackChunk(rows, c, panel + c * NV + v, NV);
    } else {  // the last few rows of the matrix, one lane at a time
      for (int64_t j = 0; j < bytes; ++j) {
        alignas(32) int32_t l[8] = {};
        for (int64_t k = 0; k < nv; ++k) {
          const uint8_t b = p.q[(o0 + 8 * v + k) * bytes + j] ^ 0x88;
          l[k] = (b & 0x0F) | ((b >> 4) << 16);
        }
        panel[j * NV + v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(l));
      }
    }
  }
}

// One block of 8 NV output rows: the panel, and per group the rows' scales and min' (min, or
// -8 scale without mins; zero past the matrix's last row) in float32, as the cells form them.
struct PanelBlock {
  const __m256i* panel;  // [I / 2 pairs][NV] vectors
  const float* scale;    // [G][16]
  const float* minp;     // [G][16]
  float* acc;            // [R][16]: each cell's acc between blocks of groups
};

// Tokens r0 .. r0 + RR x the block's rows over groups [g0, g1): acc = fma(float(S), scale,
// acc) group after group, as Int4Tile / Int4Cell do, carried in b.acc between calls.
template <int RR, int NV, bool kOneChunk>
void PanelGroups(const Int4Args& p, const PanelBlock& b, int64_t r0, int64_t g0, int64_t g1) {
  const int64_t pairs = kOneChunk ? 16 : p.I / p.G / 2;
#ifdef JAXINFER_VNNI
  // A 16-row block's two vectors of a pair are one zmm (lanes 0-15 = rows 0-15: the same
  // cells, the same operations). GCC compiled the two-ymm form below with ~24 register copies
  // per pair in this build; Int4PanelBlock alone on one core, 512 tokens x the default
  // model's shapes: 38-41 -> 54-74 multiply-adds per ns (XLA's float32 GEMM there: 46-50).
  if constexpr (NV == 2) {
    __m512 acc[RR];
    for (int t = 0; t < RR; ++t) acc[t] = _mm512_loadu_ps(b.acc + (r0 + t) * 16);
    const int32_t* x[RR];
    for (int t = 0; t < RR; ++t) x[t] = reinterpret_cast<const int32_t*>(p.x + (r0 + t) * p.I);
    const int32_t* panel = reinterpret_cast<const int32_t*>(b.panel);
    for (int64_t g = g0; g < g1; ++g) {
      __m512i S[RR];
      for (int t = 0; t < RR; ++t) S[t] = _mm512_setzero_si512();
      const int32_t* pg = panel + g * pairs * 16;
      const int64_t xg = g * pairs;
      for (int64_t j = 0; j < pairs; ++j) {
        const __m512i w = _mm512_loadu_si512(pg + j * 16);
        for (int t = 0; t < RR; ++t) S[t] = _mm512_dpwssd_epi32(S[t], w, _mm512_set1_epi32(x[t][xg + j]));
      }
      const __m512 sc = _mm512_loadu_ps(b.scale + g * 16);
      for (int t = 0; t < RR; ++t) acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[t]), sc, acc[t]);
    }
    for (int t = 0; t < RR; ++t) _mm512_storeu_ps(b.acc + (r0 + t) * 16, acc[t]);
    return;
  }
#endif
  __m256 acc[RR][NV];
  for (int t = 0; t < RR; ++t)
    for (int v = 0; v < NV; ++v) acc[t][v] = _mm256_loadu_ps(b.acc + (r0 + t) * 16 + 8 * v);
  const int32_t* x[RR];
  for (int t = 0; t < RR; ++t) x[t] = reinterpret_cast<const int32_t*>(p.x + (r0 + t) * p.I);
  for (int64_t g = g0; g < g1; ++g) {
    __m256i S[RR][NV];
    for (int t = 0; t < RR; ++t)
      for (int v = 0; v < NV; ++v) S[t][v] = _mm256_setzero_si256();
    const __m256i* pg = b.panel + g * pairs * NV;
#pragma GCC unroll 4
    for (int64_t j = 0; j < pairs; ++j) {
      __m256i w[NV];
      for (int v = 0; v < NV; ++v) w[v] = _mm256_load_si256(pg + j * NV + v);
      for (int t = 0; t < RR; ++t) {
        const __m256i xt = _mm256_set1_epi32(x[t][g * pairs + j]);
        for (int v = 0; v < NV; ++v) S[t][v] = DotAdd(S[t][v], w[v], xt);
      }
    }
    for (int v = 0; v < NV; ++v) {
      const __m256 sc = _mm256_loadu_ps(b.scale + g * 16 + 8 * v);
      for (int t = 0; t < RR; ++t) acc[t][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[t][v]), sc, acc[t][v]);
    }
  }
  for (int t = 0; t < RR; ++t)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(b.acc + (r0 + t) * 16 + 8 * v, acc[t][v]);
}

// Tokens r0 .. r0 + RT of the block's rows: accm = fma(min', xsum, accm) group after group,
// then y = (acc + accm) * a. RT tokens at once: one token's accm is a chain of G dependent
// FMAs, which alone (~4 cycles each, xsum then [G, R], read G floats R apart) took half as long
// as the panel loop itself in a long int4 prefill step (perf); RT chains hide the latency, and
// each token reads its own row of xsum [R, G] in order.
// The same operations per cell, in the same order.
template <int NV, int RT>
void PanelMins(const Int4Args& p, const PanelBlock& b, int64_t o0, int64_t n, int64_t r0) {
  __m256 accm[RT][NV];
  for (int t = 0; t < RT; ++t)
    for (int v = 0; v < NV; ++v) accm[t][v] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.G; ++g) {
    const float* xs = p.xsum + r0 * p.G + g;
    for (int v = 0; v < NV; ++v) {
      const __m256 m = _mm256_loadu_ps(b.minp + g * 16 + 8 * v);
      for (int t = 0; t < RT; ++t) accm[t][v] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xs + t * p.G), accm[t][v]);
    }
  }
  for (int t = 0; t < RT; ++t)
    for (int v = 0; v < NV; ++v) {
      const int64_t r = r0 + t;
      alignas(32) float out[8];
      _mm256_store_ps(out, _mm256_add_ps(_mm256_loadu_ps(b.acc + r * 16 + 8 * v), accm[t][v]));
      float* yr = p.y + r * p.O + o0 + 8 * v;
      for (int k = 0; k < 8 && 8 * v + k < n; ++k) yr[k] = out[k] * p.a[r];
    }
}

// Rows [o0, o0 + n), n <= 8 NV, for every token: groups in blocks whose panel slice stays in
// L1 (~8 KiB) across all the tokens, then the min' terms and y (PanelMins).
template <int NV, bool kOneChunk>
void PanelRows(const Int4Args& p, const PanelBlock& b, int64_t o0, int64_t n) {
  const int64_t gs = p.I / p.G, per_block = std::max<int64_t>(1, 256 / gs);
  std::fill(b.acc, b.acc + p.R * 16, 0.0f);
  for (int64_t g0 = 0; g0 < p.G; g0 += per_block) {
    const int64_t g1 = std::min(p.G, g0 + per_block);
    int64_t r = 0;
    for (; r + kPanelTokens <= p.R; r += kPanelTokens) PanelGroups<kPanelTokens, NV, kOneChunk>(p, b, r, g0, g1);
    for (; r + 3 <= p.R; r += 3) PanelGroups<3, NV, kOneChunk>(p, b, r, g0, g1);
    for (; r < p.R; ++r) PanelGroups<1, NV, kOneChunk>(p, b, r, g0, g1);
  }
  int64_t r = 0;
  for (; r + kPanelTokens <= p.R; r += kPanelTokens) PanelMins<NV, kPanelTokens>(p, b, o0, n, r);
  for (; r < p.R; ++r) PanelMins<NV, 1>(p, b, o0, n, r);
}

template <bool kOneChunk>
void Int4PanelBlock(const Int4Args& p, int64_t ob, int64_t oe) {
  // Per thread, grown as needed: the panel (I / 2 pairs x 2 vectors), the block's scales and
  // min' [G][16], its cells' acc [R][16]; 32-byte aligned.
  thread_local std::vector<float> buf;
  float* panel = AlignedScratch(buf, static_cast<size_t>(8 * p.I + 32 * p.G + 16 * p.R));
  float *scale = panel + 8 * p.I, *minp = scale + 16 * p.G, *acc = minp + 16 * p.G;
  const PanelBlock b{reinterpret_cast<const __m256i*>(panel), scale, minp, acc};
  for (int64_t o = ob; o < oe; o += 16) {
    const int64_t n = std::min<int64_t>(16, oe - o);
    for (int64_t g = 0; g < p.G; ++g) {
      PrefetchScales(p, g, o);
      for (int64_t k = 0; k < 16; ++k) {
        const float sc = k < n ? Half(p.scale[g * p.O + o + k]) : 0.0f;
        scale[g * 16 + k] = sc;
        minp[g * 16 + k] = k < n && p.mins ? Half(p.mins[g * p.O + o + k]) : -8.0f * sc;  // as Int4Tile's m
      }
    }
    if (n > 8) {
      RepackPanel(p, o, n, 2, reinterpret_cast<__m256i*>(panel));
      PanelRows<2, kOneChunk>(p, b, o, n);
    } else {
      RepackPanel(p, o, n, 1, reinterpret_cast<__m256i*>(panel));
      PanelRows<1, kOneChunk>(p, b, o, n);
    }
  }
}

#ifdef JAXINFER_VNNI
// r[k] = sixteen 32-bit lanes of row k -> out[j * stride] = lane j of rows 0 .. 15 (r is
// overwritten): unpacks by 32 and 64 bits within 128-bit lanes, then 128-bit lane shuffles.
inline void Transpose16x16(__m512i r[16], __m512i* out, int64_t stride) {
  __m512i t[16];
  for (int k = 0; k < 8; ++k) {  // per 128-bit lane: rows 2k, 2k+1 interleaved
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int b = 0; b < 4; ++b) {  // r[4b + c]: in 128-bit lane L, lane 4L + c of rows 4b .. 4b + 3
    r[4 * b + 0] = _mm512_unpacklo_epi64(t[4 * b], t[4 * b + 2]);
    r[4 * b + 1] = _mm512_unpackhi_epi64(t[4 * b], t[4 * b + 2]);
    r[4 * b + 2] = _mm512_unpacklo_epi64(t[4 * b + 1], t[4 * b + 3]);
    r[4 * b + 3] = _mm512_unpackhi_epi64(t[4 * b + 1], t[4 * b + 3]);
  }
  for (int c4 = 0; c4 < 4; ++c4) {  // lane 4L + c4: 128-bit lane L of r[c4], r[4 + c4], r[8 + c4], r[12 + c4]
    const __m512i lo01 = _mm512_shuffle_i32x4(r[c4], r[4 + c4], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i hi01 = _mm512_shuffle_i32x4(r[8 + c4], r[12 + c4], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i lo23 = _mm512_shuffle_i32x4(r[c4], r[4 + c4], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i hi23 = _mm512_shuffle_i32x4(r[8 + c4], r[12 + c4], _MM_SHUFFLE(3, 2, 3, 2));
    out[(0 + c4) * stride] = _mm512_shuffle_i32x4(lo01, hi01, _MM_SHUFFLE(2, 0, 2, 0));
    out[(4 + c4) * stride] = _mm512_shuffle_i32x4(lo01, hi01, _MM_SHUFFLE(3, 1, 3, 1));
    out[(8 + c4) * stride] = _mm512_shuffle_i32x4(lo23, hi23, _MM_SHUFFLE(2, 0, 2, 0));
    out[(12 + c4) * stride] = _mm512_shuffle_i32x4(lo23, hi23, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// ---- int8 at many tokens, VNNI build: panels ------------------------------------------------
//
// int8's cells (Tile above) reduce each cell's eight int32 lanes at the end of a 2 x 4 tile.
// From kPanelRows tokens on, each thread instead repacks 16 weight rows at a time into a panel
// of int16 pairs whose zmm lanes are the 16 rows (as int4's, sign-extended int8), and a tile
// of 6 tokens broadcasts each token's activation pair against it: one vpdpwssd per pair and 16
// rows, no reduction. A lane sums kInt8PanelGroup inputs in int32 (256 x 32767 x 128 < 2^31),
// then adds that into int64 lanes: the cell's exact integer sum, as the cells form it, then
// float(sum) * a. So every element is the same number on either path (tested). The panel beats
// the cells on every model-like shape; it loses only where a few tokens meet a long, short
// weight (a few dozen inputs x thousands x a few dozen outputs).
constexpr int64_t kInt8PanelGroup = 256;

bool Int8PanelFits(int64_t R, int64_t I) { return R >= kPanelRows && I % 32 == 0; }

template <int RR>
void Int8PanelTile(const int16_t* x16, const float* as, const __m512i* panel, float* y, int64_t I, int64_t O,
                   int64_t o0, int64_t n, int64_t r0) {
  const int64_t P = I / 2;
  __m512i lo[RR], hi[RR];
  const int32_t* x[RR];
  for (int t = 0; t < RR; ++t) {
    lo[t] = hi[t] = _mm512_setzero_si512();
    x[t] = reinterpret_cast<const int32_t*>(x16 + (r0 + t) * I);
  }
  for (int64_t j0 = 0; j0 < P; j0 += kInt8PanelGroup / 2) {
    const int64_t j1 = std::min(P, j0 + kInt8PanelGroup / 2);
    __m512i S[RR];
    for (int t = 0; t < RR; ++t) S[t] = _mm512_setzero_si512();
    for (int64_t j = j0; j < j1; ++j) {
      const __m512i w = _mm512_load_si512(panel + j);
      for (int t = 0; t < RR; ++t) S[t] = _mm512_dpwssd_epi32(S[t], w, _mm512_set1_epi32(x[t][j]));
    }
    for (int t = 0; t < RR; ++t) {
      lo[t] = _mm512_add_epi64(lo[t], _mm512_cvtepi32_epi64(_mm512_castsi512_si256(S[t])));
      hi[t] = _mm512_add_epi64(hi[t], _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(S[t], 1)));
    }
  }
  for (int t = 0; t < RR; ++t) {
    alignas(64) int64_t sum[16];
    _mm512_store_si512(sum, lo[t]);
    _mm512_store_si512(sum + 8, hi[t]);
    float* yr = y + (r0 + t) * O + o0;
    for (int64_t k = 0; k < n; ++k) yr[k] = static_cast<float>(sum[k]) * as[r0 + t];
  }
}

void Int8PanelBlock(const int16_t* x16, const float* as, const int8_t* q, float* y, int64_t R, int64_t I, int64_t O,
                    int64_t ob, int64_t oe) {
  thread_local std::vector<float> buf;  // the panel: I / 2 pairs x one zmm, 64-byte aligned
  __m512i* panel = reinterpret_cast<__m512i*>(AlignedScratch(buf, static_cast<size_t>(8 * I), 16));
  for (int64_t o = ob; o < oe; o += 16) {
    const int64_t n = std::min<int64_t>(16, oe - o);
    for (int64_t c = 0; c < I; c += 32) {
      __m512i r[16];
      for (int k = 0; k < 16; ++k)
        r[k] = k < n ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (o + k) * I + c)))
                     : _mm512_setzero_si512();
      Transpose16x16(r, panel + c / 2, 1);
    }
    int64_t r = 0;
    for (; r + kPanelTokens <= R; r += kPanelTokens) Int8PanelTile<kPanelTokens>(x16, as, panel, y, I, O, o, n, r);
    for (; r < R; ++r) Int8PanelTile<1>(x16, as, panel, y, I, O, o, n, r);
  }
}
#endif  // JAXINFER_VNNI

// mins: [G, O] like scale when has_mins, else ignored (pass scale): no zeros written per call.
ffi::Error Int4Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                      ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> mins,
                      ffi::ResultBuffer<ffi::F32> y, int32_t has_mins) {
  const auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions(), md = mins.dimensions(),
             yd = y->dimensions();
  if (q.element_type() != ffi::DataType::S4 || xd.size() != 2 || qd.size() != 2 || sd.size() != 2 ||
      md.size() != 2 || yd.size() != 2 || xd[1] != qd[1] || sd[1] != qd[0] || md[0] != sd[0] ||
      md[1] != sd[1] || yd[0] != xd[0] || yd[1] != qd[0] || sd[0] == 0 || xd[1] % (32 * sd[0]) != 0 ||
      xd[1] / sd[0] > kMaxGroup)
    return ffi::Error::InvalidArgument(
        "int4_matmul: want x [R, I], q int4 [O, I], float16 scale and mins [G, O] -> y [R, O], I / G a "
        "multiple of 32 up to 4096");
  const int64_t R = xd[0], I = xd[1], G = sd[0];
  if (R == 0) return ffi::Error::Success();
  thread_local std::vector<int16_t> x16_buf;
  thread_local std::vector<float> a_buf, xsum_buf;
  int16_t* xp = Scratch(x16_buf, R * I);
  float *ap = Scratch(a_buf, R), *sp = Scratch(xsum_buf, G * R);
  const float* xf = x.typed_data();
  const bool panel = R >= kPanelRows;
  ParallelRows(pool, R, I * 4, 1, [=](int64_t rb, int64_t re) { Int4Activations(xf, R, I, G, ap, xp, sp, panel, rb, re); });
  const auto half = [](auto& b) { return reinterpret_cast<const uint16_t*>(b.untyped_data()); };
  Int4Args p{xp, ap, reinterpret_cast<const uint8_t*>(q.untyped_data()), half(scale),
             has_mins ? half(mins) : nullptr, sp, y->typed_data(), R, I, qd[0], G};
  if (!panel)
    ParallelRows(pool, p.O, p.I / 2 * R, 8, [p](int64_t ob, int64_t oe) { Int4Block(p, ob, oe); });
  else if (p.I / p.G == 32)
    ParallelRows(pool, p.O, p.I / 2 * R, 16, [p](int64_t ob, int64_t oe) { Int4PanelBlock<true>(p, ob, oe); });
  else
    ParallelRows(pool, p.O, p.I / 2 * R, 16, [p](int64_t ob, int64_t oe) { Int4PanelBlock<false>(p, ob, oe); });
  return ffi::Error::Success();
}

// ---- int8 groups ---------------------------------------------------------------------------
//
//   y[r, o] = ( sum_g scale[g, o] * S[r, g, o]  [+ sum_g min[g, o] * xsum[r, g]] ) * a[r]
//   S[r, g, o] = sum_{i in group g} x16[r, i] * q[o, i]   (exact, int32)
//
// Group-wise int8 weights (jaxinfer.quant's default int8: w = q scale + min per group of 32
// inputs, GGUF Q8_0's blocks w = q d without mins), scale and min float32 [G, O], x16 and
// xsum[r, g] = float(sum of x16 over group g) as for int4 but in input order (no nibbles to
// match). The int4 cells' arithmetic with the int8 rows loaded as they are (two vpmovsxbw per
// 32 inputs instead of the nibble unpack): per (r, o) one cell, group after group
//   acc = fma(float(S[g]), scale[g], acc);  accm = fma(min[g], xsum[g], accm)
// then y = (acc + accm) * a (without mins y = acc * a), the same float32 operations in every
// tile shape, so the result does not depend on the batch. S is exact (|S| <= 512 * 32767 *
// 128 < 2^31, kInt8MaxGroup); float(S) rounds it (past 2^24) the same way everywhere.
// Cells only (8 x 1 tiles for one token, 2 x 4 for more): no repacked panel as int4 and
// per-channel int8 have from 16 tokens on.

constexpr int64_t kInt8MaxGroup = 512;

struct Int8GArgs {
  const int16_t* x;     // [R, I], in input order
  const float* a;       // [R]
  const int8_t* q;      // [O, I]
  const float* scale;   // [G, O]
  const float* mins;    // [G, O], or nullptr
  const float* xsum;    // [G, R] (read only with mins)
  float* y;             // [R, O]
  int64_t R, I, O, G;
};

// Rows [rb, re) of x [R, I] -> a [R], x16 [R, I] and, when `sums`, xsum [G, R].
void Int8GActivations(const float* x, int64_t R, int64_t I, int64_t G, float* a, int16_t* x16, float* xsum,
                      bool sums, int64_t rb, int64_t re) {
  const int64_t gs = I / G;
  const __m256i ones = _mm256_set1_epi16(1);
  Int16Rows(x, I, a, x16, rb, re);
  if (!sums) return;
  for (int64_t r = rb; r < re; ++r)
    for (int64_t g = 0; g < G; ++g) {
      __m256i sum = _mm256_setzero_si256();  // |sum| <= 512 * 32767 < 2^31
      for (int64_t i = g * gs; i < (g + 1) * gs; i += 16)
        sum = _mm256_add_epi32(
            sum, _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x16 + r * I + i)), ones));
      xsum[g * R + r] = static_cast<float>(HSum32(sum));
    }
}

// Adds x rows r0 .. r0 + RR times weight rows o0 .. o0 + RO over group g's inputs to the
// int32 lanes of cells v[a * RR + b]. kOneChunk: groups of exactly 32 (Q8_0's), unrolled.
template <int RO, int RR, bool kOneChunk>
inline void Int8GroupSums(const Int8GArgs& p, int64_t o0, int64_t r0, int64_t g, __m256i* v) {
  const int64_t gs = kOneChunk ? 32 : p.I / p.G;
  for (int64_t i = g * gs; i < (g + 1) * gs; i += 32)
    for (int a = 0; a < RO; ++a) {
      const int8_t* row = p.q + (o0 + a) * p.I + i;
      const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
      const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16)));
      for (int b = 0; b < RR; ++b)
        v[a * RR + b] = Chunk32(v[a * RR + b], lo, hi, p.x + (r0 + b) * p.I + i);
    }
}

// Eight cells: RO x RR = 8 x 1 (one token) or 2 x 4; lane a * RR + b is (r0 + b, o0 + a).
template <int RO, int RR, bool kOneChunk>
void Int8GTile(const Int8GArgs& p, int64_t o0, int64_t r0) {
  static_assert(RO * RR == 8);
  __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
  // As Int4Tile: the RO rows are one contiguous block of q, streamed kInt4Ahead bytes ahead.
  const int64_t per_group = (RO * p.I + 64 * p.G - 1) / (64 * p.G);
  const char* ahead = reinterpret_cast<const char*>(p.q + o0 * p.I) + kInt4Ahead;
  for (int64_t g = 0; g < p.G; ++g) {
    __m256i v[8];
    for (int k = 0; k < 8; ++k) v[k] = _mm256_setzero_si256();
    for (int64_t k = 0; k < per_group; ++k) _mm_prefetch(ahead + (g * per_group + k) * 64, _MM_HINT_T0);
    Int8GroupSums<RO, RR, kOneChunk>(p, o0, r0, g, v);
    const float* sg = p.scale + g * p.O + o0;
    _mm_prefetch(reinterpret_cast<const char*>(sg + kScalePrefetch), _MM_HINT_T0);
    __m256 s;
    if constexpr (RO == 8)
      s = _mm256_loadu_ps(sg);
    else
      s = _mm256_set_m128(_mm_set1_ps(sg[1]), _mm_set1_ps(sg[0]));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Reduce8(v)), s, acc);
    if (p.mins) {
      const float* mg = p.mins + g * p.O + o0;
      _mm_prefetch(reinterpret_cast<const char*>(mg + kScalePrefetch), _MM_HINT_T0);
      __m256 m, xs;
      if constexpr (RO == 8) {
        m = _mm256_loadu_ps(mg);
        xs = _mm256_broadcast_ss(p.xsum + g * p.R + r0);
      } else {
        m = _mm256_set_m128(_mm_set1_ps(mg[1]), _mm_set1_ps(mg[0]));
        xs = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(p.xsum + g * p.R + r0));
      }
      accm = _mm256_fmadd_ps(m, xs, accm);
    }
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, p.mins ? _mm256_add_ps(acc, accm) : acc);
  for (int a = 0; a < RO; ++a)
    for (int b = 0; b < RR; ++b) p.y[(r0 + b) * p.O + o0 + a] = out[a * RR + b] * p.a[r0 + b];
}

// One cell, the same arithmetic as a lane of Int8GTile.
template <bool kOneChunk>
void Int8GCell(const Int8GArgs& p, int64_t o, int64_t r) {
  float acc = 0.0f, accm = 0.0f;
  for (int64_t g = 0; g < p.G; ++g) {
    __m256i v = _mm256_setzero_si256();
    Int8GroupSums<1, 1, kOneChunk>(p, o, r, g, &v);
    acc = std::fma(static_cast<float>(HSum32(v)), p.scale[g * p.O + o], acc);
    if (p.mins) accm = std::fma(p.mins[g * p.O + o], p.xsum[g * p.R + r], accm);
  }
  p.y[r * p.O + o] = (p.mins ? acc + accm : acc) * p.a[r];
}

template <bool kOneChunk>
void Int8GRows(const Int8GArgs& p, int64_t ob, int64_t oe) {
  int64_t o = ob;
  if (p.R == 1) {
    for (; o + 8 <= oe; o += 8) Int8GTile<8, 1, kOneChunk>(p, o, 0);
  } else {
    for (; o + 2 <= oe; o += 2) {
      int64_t r = 0;
      for (; r + 4 <= p.R; r += 4) Int8GTile<2, 4, kOneChunk>(p, o, r);
      for (; r < p.R; ++r) {
        Int8GCell<kOneChunk>(p, o, r);
        Int8GCell<kOneChunk>(p, o + 1, r);
      }
    }
  }
  for (; o < oe; ++o)
    for (int64_t r = 0; r < p.R; ++r) Int8GCell<kOneChunk>(p, o, r);
}

// mins: [G, O] like scale when has_mins, else ignored (pass scale).
ffi::Error Int8GroupMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                           ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> mins,
                           ffi::ResultBuffer<ffi::F32> y, int32_t has_mins) {
  const auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions(), md = mins.dimensions(),
             yd = y->dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2 || md.size() != 2 || yd.size() != 2 ||
      xd[1] != qd[1] || sd[1] != qd[0] || md[0] != sd[0] || md[1] != sd[1] || yd[0] != xd[0] ||
      yd[1] != qd[0] || sd[0] == 0 || xd[1] % (32 * sd[0]) != 0 || xd[1] / sd[0] > kInt8MaxGroup)
    return ffi::Error::InvalidArgument(
        "int8_group_matmul: want x [R, I], q int8 [O, I], float32 scale and mins [G, O] -> y [R, O], I / G a "
        "multiple of 32 up to 512");
  const int64_t R = xd[0], I = xd[1], G = sd[0];
  if (R == 0) return ffi::Error::Success();
  thread_local std::vector<int16_t> x16_buf;
  thread_local std::vector<float> a_buf, xsum_buf;
  int16_t* xp = Scratch(x16_buf, R * I);
  float *ap = Scratch(a_buf, R), *sp = has_mins ? Scratch(xsum_buf, G * R) : nullptr;
  const float* xf = x.typed_data();
  ParallelRows(pool, R, I * 4, 1,
               [=](int64_t rb, int64_t re) { Int8GActivations(xf, R, I, G, ap, xp, sp, has_mins, rb, re); });
  Int8GArgs p{xp, ap, q.typed_data(), scale.typed_data(), has_mins ? mins.typed_data() : nullptr, sp,
              y->typed_data(), R, I, qd[0], G};
  if (p.I / p.G == 32)
    ParallelRows(pool, p.O, p.I * R, 8, [p](int64_t ob, int64_t oe) { Int8GRows<true>(p, ob, oe); });
  else
    ParallelRows(pool, p.O, p.I * R, 8, [p](int64_t ob, int64_t oe) { Int8GRows<false>(p, ob, oe); });
  return ffi::Error::Success();
}

// ---- fp8 (e4m3fn) weights ---------------------------------------------------------------------
//
//   y[r, o] = float32( sum_i x[r, i] * w(q[o, i]) ) * scale[o]     x float32 [R, I], q e4m3fn [O, I]
//
// Weight-only, like the XLA form it replaces (x @ float(q), then the per-channel scales): the
// activations stay float32. (Where the CPU has AVX512-BF16 the build runs the next section's
// kernel instead, over bfloat16 activations.) XLA CPU converts e4m3 in software into a float32 copy of the
// whole weight on every call (tests/test_quant.py), so fp8 ran below float32 at every batch.
// Here each thread converts kFp8PanelRows weight rows at a time into a small float32 panel
// (exact: every e4m3 value is a float32) that a block of tokens then reads.
//
// Batch invariance: each cell (r, o) sums in one fixed order whatever the tile: kFp8Lanes
// lanes, lane k taking inputs i = k mod kFp8Lanes in order by FMA, the lanes added in one
// fixed tree (Fp8Sum), then the inputs past the last multiple of kFp8Lanes by scalar FMA,
// then the scale. The VNNI build (AVX-512) runs 16 lanes in zmm registers, 4 weight rows x
// 6 tokens a tile (24 accumulators of its 32 registers); AVX2 8 lanes, 4 x 3 (12 of 16).
// One library is one build, so a process sums every cell one way. At many tokens the AVX2
// tile comes near XLA's float32 GEMM without its float32 copy of the weight
// (`jaxinfer bench quant`).

// The eight lanes of v added in a fixed tree: (l0 + l4) + (l2 + l6), (l1 + l5) + (l3 + l7), then those.
inline float HSumF(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#ifdef JAXINFER_VNNI
using Fp8Vec = __m512;
constexpr int kFp8Lanes = 16, kFp8TileTokens = 6;
inline Fp8Vec Fp8Zero() { return _mm512_setzero_ps(); }
inline Fp8Vec Fp8Load(const float* p) { return _mm512_loadu_ps(p); }
inline Fp8Vec Fp8Fma(Fp8Vec a, Fp8Vec b, Fp8Vec c) { return _mm512_fmadd_ps(a, b, c); }
// Lanes k and k + 8 first, then HSumF's tree.
inline float Fp8Sum(Fp8Vec v) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return HSumF(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
}
#else
using Fp8Vec = __m256;
constexpr int kFp8Lanes = 8, kFp8TileTokens = 3;
inline Fp8Vec Fp8Zero() { return _mm256_setzero_ps(); }
inline Fp8Vec Fp8Load(const float* p) { return _mm256_loadu_ps(p); }
inline Fp8Vec Fp8Fma(Fp8Vec a, Fp8Vec b, Fp8Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float Fp8Sum(Fp8Vec v) { return HSumF(v); }
#endif

struct Fp8Args {
  const float* x;      // [R, I]
  const uint8_t* q;    // [O, I]
  const float* scale;  // [O]
  float* y;            // [R, O]
  int64_t R, I, O;
};

// Panel rows a (weight rows o0 + a, ld floats apart) x tokens r0 + b.
template <int RO, int RR>
void Fp8Tile(const Fp8Args& p, const float* panel, int64_t ld, int64_t o0, int64_t r0) {
  const int64_t IL = p.I / kFp8Lanes * kFp8Lanes;
  Fp8Vec acc[RO][RR];
  for (int a = 0; a < RO; ++a)
    for (int b = 0; b < RR; ++b) acc[a][b] = Fp8Zero();
  for (int64_t i = 0; i < IL; i += kFp8Lanes) {
    Fp8Vec xv[RR];
    for (int b = 0; b < RR; ++b) xv[b] = Fp8Load(p.x + (r0 + b) * p.I + i);
    for (int a = 0; a < RO; ++a) {
      const Fp8Vec w = Fp8Load(panel + a * ld + i);
      for (int b = 0; b < RR; ++b) acc[a][b] = Fp8Fma(w, xv[b], acc[a][b]);
    }
  }
  for (int a = 0; a < RO; ++a)
    for (int b = 0; b < RR; ++b) {
      float s = Fp8Sum(acc[a][b]);
      for (int64_t i = IL; i < p.I; ++i) s = std::fma(panel[a * ld + i], p.x[(r0 + b) * p.I + i], s);
      p.y[(r0 + b) * p.O + o0 + a] = s * p.scale[o0 + a];
    }
}

// Weight rows converted at a time, and tokens per pass over them. The panel (kFp8PanelRows x I
// floats, 74-196 KiB at the default model's I of 576-1536) and a block of kFp8Tokens
// activation rows (up to 295 KiB) stay in L2 (1 MiB on Zen 4) while every tile of the block
// reads them, where each 8-row panel used to meet all R tokens, streaming a prefill chunk's
// activations from L3 again per 8 weight rows.
constexpr int64_t kFp8PanelRows = 32;
constexpr int64_t kFp8Tokens = 48;  // a multiple of the tiles' 3 and 6

void Fp8Block(const Fp8Args& p, int64_t ob, int64_t oe) {
  thread_local std::vector<float> panel_buf;
  const int64_t ld = (p.I + 15) / 16 * 16;  // each panel row 64-byte aligned
  float* panel = AlignedScratch(panel_buf, static_cast<size_t>(kFp8PanelRows * ld), 16);
  for (int64_t o0 = ob; o0 < oe; o0 += kFp8PanelRows) {
    const int64_t rows = std::min<int64_t>(kFp8PanelRows, oe - o0);
    for (int64_t a = 0; a < rows; ++a) {
      const uint8_t* row = p.q + (o0 + a) * p.I;
      float* out = panel + a * ld;
      int64_t i = 0;
      for (; i + 8 <= p.I; i += 8) _mm256_store_ps(out + i, Fp8x8(row + i));
      for (; i < p.I; ++i) out[i] = Fp8One(row[i]);
    }
    for (int64_t t0 = 0; t0 < p.R; t0 += kFp8Tokens) {
      const int64_t t1 = std::min(p.R, t0 + kFp8Tokens);
      for (int64_t a0 = 0; a0 < rows; a0 += 8) {
        const int64_t n = std::min<int64_t>(8, rows - a0), o = o0 + a0;
        const float* sub = panel + a0 * ld;
        if (n == 8 && p.R == 1) {
          Fp8Tile<8, 1>(p, sub, ld, o, 0);
        } else if (n == 8) {
          for (int h = 0; h < 2; ++h) {
            int64_t r = t0;
            for (; r + kFp8TileTokens <= t1; r += kFp8TileTokens)
              Fp8Tile<4, kFp8TileTokens>(p, sub + 4 * h * ld, ld, o + 4 * h, r);
            for (; r < t1; ++r) Fp8Tile<4, 1>(p, sub + 4 * h * ld, ld, o + 4 * h, r);
          }
        } else {  // the matrix's last rows
          for (int64_t a = 0; a < n; ++a)
            for (int64_t r = t0; r < t1; ++r) Fp8Tile<1, 1>(p, sub + a * ld, ld, o + a, r);
        }
      }
    }
  }
}

#ifdef JAXINFER_BF16
// ---- fp8 with bfloat16 activations (AVX512-BF16) ------------------------------------------------
//
//   y[r, o] = float32( sum_j dpbf16(bf16(x[r, 2j..2j+1]), w(q[o, 2j..2j+1])) ) * scale[o]
//
// Where the CPU has AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids; int8_matmul.py adds
// JAXINFER_BF16 to the VNNI build there) fp8 runs on vdpbf16ps, which multiplies bfloat16 pairs
// into float32 lanes at twice float32 FMA's rate (as vpdpwssd; `jaxinfer bench simd-peak`). Every e4m3
// value is a bfloat16; the activations are rounded to bfloat16 once per call (round to nearest
// even, vcvtneps2bf16): their ~2^-9 relative error is small beside e4m3's 2^-4 and costs the
// quality table's fp8 row 0.04 points of perplexity (+1.82% -> +1.86%, README). The products
// are exact in float32.
//
// The panel's lanes are output rows, as int4's: each thread turns 64 weight rows at a time
// into [I / 2 pairs][4 blocks of 16 rows] bfloat16 pairs (Fp8x32Bf16, then a 16 x 16
// transpose of 32-bit pairs), and a tile of 3 tokens x 4 blocks broadcasts each token's pair
// j against four vectors of pair j: 12 accumulators, no reduction. Each cell (r, o) is one lane
// that takes pair after pair in order (vdpbf16ps: acc += x[2j+1] w[2j+1], then + x[2j] w[2j],
// each rounded, per Intel's definition), then one multiply by the scale: the same operations
// whatever the tile, the row count or the thread (odd I: a zero last pair half).
// Why: vdpbf16ps does two multiply-adds per lane where float32 FMA does one, so this block
// runs about twice Fp8Block's rate at many tokens, and above float32 FMA's peak
// (`jaxinfer bench simd-peak`; the rounding's cost in quality: docs/quantization.md).
constexpr int64_t kBf16Blocks = 4;  // 16-row blocks in a thread's panel
constexpr int kBf16Tokens = 3;      // tokens a tile: 3 x 4 accumulators for vdpbf16ps's latency

// Rows [rb, re) of x [R, I] -> xb [R, P] bfloat16 pairs (P = ceil(I / 2), a zero past I).
void Bf16Rows(const float* x, int64_t I, int64_t P, uint32_t* xb, int64_t rb, int64_t re) {
  for (int64_t r = rb; r < re; ++r) {
    uint16_t* out = reinterpret_cast<uint16_t*>(xb + r * P);
    const float* xr = x + r * I;
    int64_t i = 0;
    for (; i + 16 <= I; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xr + i)));
    if (i < 2 * P) {  // the last < 16 inputs (zeros past I), through the same instruction
      const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (I - i)) - 1), xr + i));
      _mm256_mask_storeu_epi16(out + i, static_cast<__mmask16>((1u << (2 * P - i)) - 1), v);
    }
  }
}

// 16 weight rows (nv of them real, the rest zero lanes) x 32 inputs from byte c -> pairs
// c / 2 .. c / 2 + 15, out[j * stride] = pair j with lane k = row k.
inline void Bf16Repack16x32(const uint8_t* const rows[16], int nv, int64_t c, __m512i* out, int64_t stride) {
  __m512i r[16];
  for (int k = 0; k < 16; ++k) r[k] = k < nv ? Fp8x32Bf16(rows[k] + c) : _mm512_setzero_si512();
  Transpose16x16(r, out, stride);
}

struct Bf16Args {
  const uint32_t* xb;  // [R, P] bfloat16 pairs
  const uint8_t* q;    // [O, I]
  const float* scale;  // [O]
  float* y;            // [R, O]
  int64_t R, I, O, P;
};

// Tokens r0 .. r0 + RR x NB blocks of the panel (rows o0 ..; n of them real).
template <int NB, int RR>
void Bf16Tile(const Bf16Args& p, const __m512i* panel, int64_t o0, int64_t n, int64_t r0) {
  __m512 acc[NB][RR];
  for (int b = 0; b < NB; ++b)
    for (int t = 0; t < RR; ++t) acc[b][t] = _mm512_setzero_ps();
  const uint32_t* x[RR];
  for (int t = 0; t < RR; ++t) x[t] = p.xb + (r0 + t) * p.P;
  for (int64_t j = 0; j < p.P; ++j) {
    __m512i w[NB];
    for (int b = 0; b < NB; ++b) w[b] = _mm512_load_si512(panel + j * NB + b);
    for (int t = 0; t < RR; ++t) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[t][j]));
      for (int b = 0; b < NB; ++b) acc[b][t] = _mm512_dpbf16_ps(acc[b][t], (__m512bh)w[b], xv);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t nb = std::min<int64_t>(16, n - 16 * b);
    const __mmask16 m = static_cast<__mmask16>(nb >= 16 ? 0xFFFF : (1u << nb) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(m, p.scale + o0 + 16 * b);
    for (int t = 0; t < RR; ++t) _mm512_mask_storeu_ps(p.y + (r0 + t) * p.O + o0 + 16 * b, m, _mm512_mul_ps(acc[b][t], s));
  }
}

template <int NB>
void Bf16PanelTokens(const Bf16Args& p, const __m512i* panel, int64_t o0, int64_t n) {
  int64_t r = 0;
  for (; r + kBf16Tokens <= p.R; r += kBf16Tokens) Bf16Tile<NB, kBf16Tokens>(p, panel, o0, n, r);
  for (; r < p.R; ++r) Bf16Tile<NB, 1>(p, panel, o0, n, r);
}

void Fp8Bf16Block(const Bf16Args& p, int64_t ob, int64_t oe) {
  thread_local std::vector<float> panel_buf;  // [P][kBf16Blocks] vectors, 64-byte aligned
  __m512i* panel = reinterpret_cast<__m512i*>(AlignedScratch(panel_buf, static_cast<size_t>(p.P * kBf16Blocks * 16), 16));
  for (int64_t o0 = ob; o0 < oe; o0 += 16 * kBf16Blocks) {
    const int64_t n = std::min<int64_t>(16 * kBf16Blocks, oe - o0), nb = (n + 15) / 16;
    for (int64_t b = 0; b < nb; ++b) {
      const int nv = static_cast<int>(std::min<int64_t>(16, n - 16 * b));
      const uint8_t* rows[16];
      for (int k = 0; k < 16; ++k) rows[k] = p.q + (o0 + 16 * b + std::min(k, nv - 1)) * p.I;
      int64_t c = 0;
      for (; c + 32 <= p.I; c += 32) Bf16Repack16x32(rows, nv, c, panel + (c / 2) * nb + b, nb);
      for (; c < p.I; c += 2) {  // the inputs past the last multiple of 32, a pair at a time
        alignas(64) uint32_t lanes[16] = {};
        for (int k = 0; k < nv; ++k)
          lanes[k] = Fp8Bf16One(rows[k][c]) | (c + 1 < p.I ? uint32_t{Fp8Bf16One(rows[k][c + 1])} << 16 : 0u);
        panel[(c / 2) * nb + b] = _mm512_load_si512(lanes);
      }
    }
    switch (nb) {
      case 4: Bf16PanelTokens<4>(p, panel, o0, n); break;
      case 3: Bf16PanelTokens<3>(p, panel, o0, n); break;
      case 2: Bf16PanelTokens<2>(p, panel, o0, n); break;
      default: Bf16PanelTokens<1>(p, panel, o0, n); break;
    }
  }
}
#endif  // JAXINFER_BF16

ffi::Error Fp8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::Buffer<ffi::F32> scale,
                     ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  if (q.element_type() != ffi::DataType::F8E4M3FN || xd.size() != 2 || qd.size() != 2 || sd.size() != 1 ||
      yd.size() != 2 || xd[1] != qd[1] || sd[0] != qd[0] || yd[0] != xd[0] || yd[1] != qd[0])
    return ffi::Error::InvalidArgument("fp8_matmul: want x [R, I], q float8_e4m3fn [O, I], scale [O] -> y [R, O]");
  Fp8Args p{x.typed_data(), reinterpret_cast<const uint8_t*>(q.untyped_data()), scale.typed_data(),
            y->typed_data(), xd[0], xd[1], qd[0]};
  if (p.R == 0) return ffi::Error::Success();
#ifdef JAXINFER_BF16
  const int64_t P = (p.I + 1) / 2;
  thread_local std::vector<uint32_t> xb_buf;
  uint32_t* xb = Scratch(xb_buf, p.R * P);
  ParallelRows(pool, p.R, p.I * 4, 1, [p, P, xb](int64_t rb, int64_t re) { Bf16Rows(p.x, p.I, P, xb, rb, re); });
  const Bf16Args b{xb, p.q, p.scale, p.y, p.R, p.I, p.O, P};
  ParallelRows(pool, p.O, p.I * p.R, 16, [b](int64_t ob, int64_t oe) { Fp8Bf16Block(b, ob, oe); });
#else
  ParallelRows(pool, p.O, p.I * p.R, 8, [p](int64_t ob, int64_t oe) { Fp8Block(p, ob, oe); });
#endif
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_int8_matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_int4_matmul, Int4Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("has_mins"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_int8_group_matmul, Int8GroupMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("has_mins"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_fp8_matmul, Fp8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
