// Element conversions the kernels share (header-only): float8 e4m3fn bytes to float32.
#ifndef JAXINFER_CPU_KERNELS_CONVERT_H_
#define JAXINFER_CPU_KERNELS_CONVERT_H_

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace jaxinfer_cpu {

// Eight e4m3fn bytes -> eight float32, exactly: sign | exponent + 120 | mantissa for normal
// values, mantissa x 2^-9 for subnormals, NaN for S.1111.111 (e4m3fn has no infinities).
inline __m256 Fp8x8(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i em = _mm256_and_si256(v, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.0f / 512));
  __m256 f = _mm256_blendv_ps(normal, subnormal, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), em)));
  f = _mm256_blendv_ps(f, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                       _mm256_castsi256_ps(_mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7F))));
  return _mm256_or_ps(f, _mm256_castsi256_ps(sign));
}

// The same for one byte (the inputs past the last multiple of 8).
inline float Fp8One(uint8_t b) {
  const int em = b & 0x7F;
  float f = em == 0x7F ? std::numeric_limits<float>::quiet_NaN()
            : em < 8   ? static_cast<float>(em) * (1.0f / 512)
                       : std::ldexp(static_cast<float>(8 + (em & 7)), (em >> 3) - 10);
  return (b & 0x80) ? -f : f;
}

#ifdef JAXINFER_BF16
// 32 e4m3fn bytes -> 32 bfloat16, exactly (three mantissa bits fit bfloat16's seven): sign |
// (exponent + 120) | mantissa << 4 for normal values, m x 2^-9 (m = 1..7) from a table for
// subnormals, a quiet NaN for S.1111.111. AVX512-BW.
inline __m512i Fp8x32Bf16(const uint8_t* p) {
  alignas(64) static const uint16_t kSubnormal[32] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i em = _mm512_and_si512(v, _mm512_set1_epi16(0x7F));
  const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x80)), 8);
  __m512i b = _mm512_add_epi16(_mm512_slli_epi16(em, 4), _mm512_set1_epi16(120 << 7));
  b = _mm512_mask_mov_epi16(b, _mm512_cmplt_epu16_mask(em, _mm512_set1_epi16(8)),
                            _mm512_permutexvar_epi16(em, _mm512_load_si512(kSubnormal)));
  b = _mm512_mask_mov_epi16(b, _mm512_cmpeq_epi16_mask(em, _mm512_set1_epi16(0x7F)), _mm512_set1_epi16(0x7FC0));
  return _mm512_or_si512(b, sign);
}

// The same for one byte: Fp8One's float32 (exact) without its low 16 bits, all zero.
inline uint16_t Fp8Bf16One(uint8_t b) {
  const float f = Fp8One(b);
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>(u >> 16);
}
#endif

}  // namespace jaxinfer_cpu

#endif  // JAXINFER_CPU_KERNELS_CONVERT_H_
