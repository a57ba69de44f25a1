// The vectors of cpu_kernels.cpp for AVX2 (8 float lanes), built where the compiler targets AVX2,
// FMA and F16C unless the "generic" kernel set asks for the loops alone (kAvx2 in cpu_kernels.cpp
// says which dtypes run them). Why: the generic loops read a phasor's two channels with stride 2
// (deinterleaved by vpermd + blends) and convert half rows through buffers, so compute set the
// time of half rows. The kernels of cpu_rows.h and cpu_sample.h over V8 below load and store
// contiguously, convert in registers and keep the pairs inside a vector (cpu_avx512.h: 16 lanes).
// Same maths and float32 accumulation; the sums run in another order. With AVX512_BF16, bfloat16
// is stored with vcvtneps2bf16 on 8 lanes.
#pragma once

// MRS_KERNELS_AVX2 / MRS_KERNELS_GENERIC: the kernel sets "avx2" and "generic" (cpu_kernels.py:
// LIGHTNING_MRS_CPU_KERNEL_SET).
#if defined(MRS_KERNELS_AVX2) && !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "LIGHTNING_MRS_CPU_KERNEL_SET=avx2 needs a CPU with AVX2, FMA and F16C; use auto or generic here"
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(MRS_KERNELS_GENERIC)
#define MRS_AVX2 1

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "cpu_half.h"

namespace mrs::avx2 {

using mrs::load8;  // float16 (cpu_half.h)
using mrs::store8;
#if defined(MRS_AVX512_BF16)
constexpr bool kCvtBf16 = true;  // store8(bf16*) is one conversion instruction (cpu_half.h)
#else
constexpr bool kCvtBf16 = false;
#endif

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {  // the bits moved up: exact
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// bfloat16 bits of 8 floats in 8 x uint32 lanes: nearest even, NaN stays NaN (st(bf16*) on 8 lanes)
inline __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i top = _mm256_srli_epi32(u, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(top, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan = _mm256_or_si256(top, _mm256_set1_epi32(0x40));  // quiet, sign and payload kept
  return _mm256_blendv_epi8(rounded, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
#if !defined(MRS_AVX512_BF16)  // else cpu_half.h's: vcvtneps2bf16 behind the subnormal test
inline void store8(bf16* p, __m256 v) {
  const __m256i r = bf16_bits(v);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
#endif
// 16 values at once: for bfloat16 by integer maths, one pack and one 32-byte store
template <typename T>
inline void store16(T* p, __m256 a, __m256 b) {
  if constexpr (std::is_same_v<T, bf16> && !kCvtBf16) {
    const __m256i packed = _mm256_packus_epi32(bf16_bits(a), bf16_bits(b));  // lanes [a0-3 b0-3 | a4-7 b4-7]
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xd8));
  } else {
    store8(p, a);
    store8(p + 8, b);
  }
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The vector type of the kernels of cpu_rows.h and cpu_sample.h: 8 lanes.
struct V8 {
  using R = __m256;
  static constexpr int64_t kLanes = 8;
  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float v) { return _mm256_set1_ps(v); }
  template <typename T>
  static R load(const T* p) { return load8(p); }
  template <typename T>
  static void store(T* p, R v) { store8(p, v); }
  template <typename T>
  static void store2(T* p, R a, R b) { store16(p, a, b); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R div(R a, R b) { return _mm256_div_ps(a, b); }
  static R sqrt(R a) { return _mm256_sqrt_ps(a); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R fmsub(R a, R b, R c) { return _mm256_fmsub_ps(a, b, c); }
  static float hsum(R v) { return avx2::hsum(v); }
  // the 8 pair sums of squares of 16 channels: lanes [a01 a23 b01 b23 | a45 a67 b45 b67]
  static R pair_squares(R a, R b) { return _mm256_hadd_ps(_mm256_mul_ps(a, a), _mm256_mul_ps(b, b)); }
  // those lanes back over a's and b's channels
  static R spread_lo(R v) { return _mm256_unpacklo_ps(v, v); }
  static R spread_hi(R v) { return _mm256_unpackhi_ps(v, v); }
  static R pair_squares_dup(R a) {
    const R sa = _mm256_mul_ps(a, a);
    return _mm256_add_ps(sa, _mm256_permute_ps(sa, 0xB1));  // (c, c ^ 1): the same sum in both
  }
};

}  // namespace mrs::avx2

#endif
