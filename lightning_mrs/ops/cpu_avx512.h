// The vector type V16 of cpu_kernels.cpp's kernels (cpu_rows.h, cpu_sample.h) on AVX-512, built
// where cpu_half.h defines MRS_AVX512_BF16: two permutes give 16 pair sums, so one sqrt serves 32
// channels, and vcvtneps2bf16 stores bfloat16 in one instruction where the compiler's integer
// rounding took ten (docs/performance-lm.md#avx-512-row-kernels; where they run: MRS_SIMD in
// cpu_kernels.cpp). Same maths as the generic loops; sums run in another order and products may
// fuse otherwise.
#pragma once

#include "cpu_half.h"  // MRS_AVX512_BF16, load16 / store16 of float16 and bfloat16

#if defined(MRS_AVX512_BF16)
#include <immintrin.h>

#include <cstdint>

namespace mrs::avx512 {

using mrs::load16;
using mrs::store16;
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {  // the bits moved up: exact
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// The vector type of the kernels of cpu_rows.h and cpu_sample.h: 16 lanes.
struct V16 {
  using R = __m512;
  static constexpr int64_t kLanes = 16;
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float v) { return _mm512_set1_ps(v); }
  template <typename T>
  static R load(const T* p) { return load16(p); }
  template <typename T>
  static void store(T* p, R v) { store16(p, v); }
  template <typename T>
  static void store2(T* p, R a, R b) {
    store16(p, a);
    store16(p + 16, b);
  }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R div(R a, R b) { return _mm512_div_ps(a, b); }
  static R sqrt(R a) { return _mm512_sqrt_ps(a); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R fmsub(R a, R b, R c) { return _mm512_fmsub_ps(a, b, c); }
  static float hsum(R v) { return _mm512_reduce_add_ps(v); }
  // the 16 pair sums of squares of 32 channels (a: channels 0-15, b: 16-31), in pair order
  static R pair_squares(R a, R b) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    const R sa = _mm512_mul_ps(a, a), sb = _mm512_mul_ps(b, b);
    return _mm512_add_ps(_mm512_permutex2var_ps(sa, even, sb), _mm512_permutex2var_ps(sa, odd, sb));
  }
  // 16 pair values over the 32 channels of their pairs: channels 0-15 (lo) and 16-31 (hi)
  static R spread_lo(R v) {
    return _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), v);
  }
  static R spread_hi(R v) {
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8), v);
  }
  static R pair_squares_dup(R a) {  // each pair's sum of squares over both its lanes
    const R sa = _mm512_mul_ps(a, a);
    return _mm512_add_ps(sa, _mm512_permute_ps(sa, 0xB1));  // (c, c ^ 1): the same sum in both
  }
};

}  // namespace mrs::avx512
#endif
