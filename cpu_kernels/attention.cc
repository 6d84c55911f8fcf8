// Decode attention over a paged KV cache for XLA CPU: an XLA FFI handler.
//
//   out[s, r, k, g, :] = sum_j w_j v[j, k, :dv] / sum_j w_j,   w_j = exp(c_j - max_j c_j)
//   c_j = q[s, r, k, g] . k[j, k]   (soft-capped: cap * tanh(c_j / cap))
//
// q float32 [S, R, K, G, d] (already scaled), k_pages [N, p, K, d], v_pages [N, p, K, dv']
// (the first dv columns are the values), q_pos int32 [S, R], page_indices int32 [S, P] ->
// out float32 [S, R, K, G, dv]. The pages are float32, bfloat16 (or its bits as uint16, as
// the CPU cache stores it), or quantized: int8, or float8 e4m3fn (or its bits as uint8),
// with float32 k_scale / v_scale [N, p, K], one per token and kv head (key j's vector is
// values * scale; the score is q . values times the scale, a value row enters with its
// weight times its scale). Row (s, r) sees keys j = lo .. q_pos[s, r]
// (lo = q_pos - window + 1 with a window, else 0), key j in page page_indices[s, j / p],
// slot j % p. A row with q_pos < 0 is zeros and reads nothing (the caller's padding rows).
//
// Why a kernel: jaxinfer.ops' XLA path runs a decode as a loop of ~15 small XLA operations
// per 128 keys per layer (gather, two einsums, the online softmax's updates), and XLA CPU
// pays a few microseconds per operation: at batch 1 that loop was about a quarter of a
// decode step of the default model (`jaxinfer bench trace`). Here a row's keys are read in
// two passes (scores, then values), with the softmax in between, in one call per layer.
//
// Each (s, r, k) item is computed by one thread in one fixed order (keys in order, every
// sum the same tree), whatever S, R or the thread split: a row's result does not depend on
// the rest of the batch (greedy batch invariance).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "convert.h"
#include "parallel.h"

namespace ffi = xla::ffi;

namespace {

using jaxinfer_cpu::AlignedScratch;
using jaxinfer_cpu::ParallelRows;

// exp of eight floats: 2^n e^f with n = round(x log2 e), |f| <= ln 2 / 2, e^f by a degree-6
// polynomial (Cephes' expf coefficients), within ~2 ulp of expf. Inputs here are <= 0 (a
// score minus the row's maximum); below -87.3 the result is clamped near 0 (~1e-38).
inline __m256 Exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.37626f)), _mm256_set1_ps(-87.33654f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // f = x - n ln 2, ln 2 in two parts so n * (high part) is exact
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// How the pages hold their values.
enum class Kv { kF32, kBf16, kInt8, kFp8 };

// Eight values of a page row, from element idx on, as float32 (exact for every kind).
template <Kv kind>
inline __m256 Load8(const void* base, int64_t idx) {
  if constexpr (kind == Kv::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + idx);
  } else if constexpr (kind == Kv::kBf16) {  // bfloat16 is float32's top half
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + idx));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (kind == Kv::kInt8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + idx));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  } else {
    return jaxinfer_cpu::Fp8x8(static_cast<const uint8_t*>(base) + idx);
  }
}

// The kind of pages of an element type; none for one the kernel does not read.
inline std::optional<Kv> KindOf(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return Kv::kF32;
    case ffi::DataType::BF16: case ffi::DataType::U16: return Kv::kBf16;
    case ffi::DataType::S8: return Kv::kInt8;
    case ffi::DataType::F8E4M3FN: case ffi::DataType::U8: return Kv::kFp8;
    default: return std::nullopt;
  }
}

struct Args {
  const float* q;
  const void *k, *v;
  const float *k_scale, *v_scale;  // [N * p, K] each, or null (float pages)
  const int32_t *q_pos, *pages;
  float* out;
  int64_t S, R, K, G, d, N, p, dvp, dv, P, window;
  float soft_cap;
};

// Keys lo .. hi of sequence s, page by page: fn(j, row offset of key j in the pages' [N * p] rows).
template <typename Fn>
inline void ForKeys(const Args& a, int64_t s, int64_t lo, int64_t hi, Fn fn) {
  for (int64_t j = lo; j <= hi;) {
    const int64_t page = std::clamp<int64_t>(a.pages[s * a.P + j / a.p], 0, a.N - 1);
    const int64_t end = std::min(hi, (j / a.p + 1) * a.p - 1);
    for (; j <= end; ++j) fn(j, page * a.p + j % a.p);
  }
}

// Item (s, r, k): kv head k's G query heads of row r of sequence s.
template <Kv kind>
void Item(const Args& a, int64_t item) {
  const int64_t s = item / (a.R * a.K), r = item / a.K % a.R, k = item % a.K;
  const int64_t G = a.G, d = a.d, dv = a.dv;
  float* out = a.out + item * G * dv;
  const int64_t pos = a.q_pos[s * a.R + r];
  const int64_t hi = std::min(pos, a.P * a.p - 1);
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0;
  if (pos < 0 || hi < lo) {
    std::fill(out, out + G * dv, 0.0f);
    return;
  }
  const int64_t L = hi - lo + 1, L8 = (L + 7) / 8 * 8;
  thread_local std::vector<float> buf;
  // [G][L8] scores, then weights; [G][dv] weighted sums of values; [G] sums of weights; one
  // key's or value's row as float32 (converted once for the G heads that read it)
  float* w = AlignedScratch(buf, G * L8 + G * dv + G + std::max(d, dv) + 8);
  float *acc = w + G * L8, *total = acc + G * dv, *row_f = total + (G + 7) / 8 * 8;  // (32-byte aligned)
  const float* q = a.q + item * G * d;
  // Row `at` of the pages (n values from element at) as float32: in place for float32 pages.
  const auto as_float = [&](const void* pages, int64_t at, int64_t n) -> const float* {
    if constexpr (kind == Kv::kF32) return static_cast<const float*>(pages) + at;
    for (int64_t i = 0; i < n; i += 8) _mm256_store_ps(row_f + i, Load8<kind>(pages, at + i));
    return row_f;
  };

  ForKeys(a, s, lo, hi, [&](int64_t j, int64_t row) {
    const float* kj = as_float(a.k, (row * a.K + k) * d, d);
    const float ks = a.k_scale ? a.k_scale[row * a.K + k] : 1.0f;  // (x * 1 is x, exactly)
    for (int64_t g = 0; g < G; ++g) {
      __m256 c = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) c = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + i), _mm256_loadu_ps(kj + i), c);
      float score = HSum(c) * ks;
      if (a.soft_cap > 0) score = a.soft_cap * std::tanh(score / a.soft_cap);
      w[g * L8 + j - lo] = score;
    }
  });

  for (int64_t g = 0; g < G; ++g) {
    float* wg = w + g * L8;
    float m = wg[0];
    for (int64_t j = 1; j < L; ++j) m = std::max(m, wg[j]);
    std::fill(wg + L, wg + L8, m);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < L8; j += 8) {
      const __m256 e = Exp8(_mm256_sub_ps(_mm256_load_ps(wg + j), _mm256_set1_ps(m)));
      _mm256_store_ps(wg + j, e);
      if (j + 8 <= L) sum = _mm256_add_ps(sum, e);
    }
    float t = HSum(sum);
    for (int64_t j = L / 8 * 8; j < L; ++j) t += wg[j];
    total[g] = t;
  }

  std::fill(acc, acc + G * dv, 0.0f);
  ForKeys(a, s, lo, hi, [&](int64_t j, int64_t row) {
    const float* vj = as_float(a.v, (row * a.K + k) * a.dvp, dv);
    const float vs = a.v_scale ? a.v_scale[row * a.K + k] : 1.0f;
    for (int64_t g = 0; g < G; ++g) {
      const __m256 wj = _mm256_set1_ps(w[g * L8 + j - lo] * vs);
      float* ag = acc + g * dv;
      for (int64_t i = 0; i < dv; i += 8)
        _mm256_store_ps(ag + i, _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj + i), _mm256_load_ps(ag + i)));
    }
  });
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < dv; ++i) out[g * dv + i] = acc[g * dv + i] / total[g];
}

// k_scale / v_scale: [N, p, K] float32 with int8 or float8 pages; ignored for float pages
// (the caller passes any float32 buffer).
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> q_pos,
                           ffi::Buffer<ffi::S32> pages, ffi::ResultBuffer<ffi::F32> out, int64_t window,
                           float soft_cap) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), pd = q_pos.dimensions(),
             td = pages.dimensions(), od = out->dimensions(), ksd = k_scale.dimensions(), vsd = v_scale.dimensions();
  const std::optional<Kv> known = KindOf(k.element_type());
  const Kv kind = known.value_or(Kv::kF32);
  const bool scaled = kind == Kv::kInt8 || kind == Kv::kFp8;
  const auto per_token = [&](auto sd) { return sd.size() == 3 && sd[0] == kd[0] && sd[1] == kd[1] && sd[2] == kd[2]; };
  if (qd.size() != 5 || kd.size() != 4 || vd.size() != 4 || pd.size() != 2 || td.size() != 2 || od.size() != 5 ||
      kd[2] != qd[2] || kd[3] != qd[4] || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || pd[0] != qd[0] ||
      pd[1] != qd[1] || td[0] != qd[0] || od[0] != qd[0] || od[1] != qd[1] || od[2] != qd[2] || od[3] != qd[3] ||
      od[4] > vd[3] || qd[4] % 8 != 0 || od[4] % 8 != 0 || kd[0] == 0 || kd[1] == 0 || !known ||
      v.element_type() != k.element_type() || (scaled && !(per_token(ksd) && per_token(vsd))))
    return ffi::Error::InvalidArgument(
        "decode_attention: want q [S, R, K, G, d], k_pages [N, p, K, d], v_pages [N, p, K, >= dv] of one dtype "
        "(float32, bfloat16 or its uint16 bits, int8, float8_e4m3fn or its uint8 bits; the last two with "
        "k_scale, v_scale [N, p, K]), q_pos [S, R], page_indices [S, P] -> [S, R, K, G, dv], d and dv multiples of 8");
  const Args a{q.typed_data(), k.untyped_data(), v.untyped_data(), scaled ? k_scale.typed_data() : nullptr,
               scaled ? v_scale.typed_data() : nullptr, q_pos.typed_data(), pages.typed_data(), out->typed_data(),
               qd[0], qd[1], qd[2], qd[3], qd[4], kd[0], kd[1], vd[3], od[4], td[1], window, soft_cap};
  const int64_t items = a.S * a.R * a.K;
  // Work per item: at most the table's P * p keys of d + dv values for G heads.
  const int64_t cost = a.P * a.p * (a.d + a.dv) * a.G;
  const auto run = [&](auto item) { ParallelRows(pool, items, cost, 1, [a, item](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) item(a, i);
  }); };
  switch (kind) {
    case Kv::kF32: run(Item<Kv::kF32>); break;
    case Kv::kBf16: run(Item<Kv::kBf16>); break;
    case Kv::kInt8: run(Item<Kv::kInt8>); break;
    case Kv::kFp8: run(Item<Kv::kFp8>); break;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_decode_attention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("soft_cap"));
