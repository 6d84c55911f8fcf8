// Element conversions the kernels share (header-only): float8 e4m3fn bytes to float32.
#ifndef JAXINFER_CPU_KERNELS_CONVERT_H_
#define JAXINFER_CPU_KERNELS_CONVERT_H_

#include <immintrin.h>

#include <cmath>
#include <cstdint>
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

}  // namespace jaxinfer_cpu

#endif  // JAXINFER_CPU_KERNELS_CONVERT_H_
