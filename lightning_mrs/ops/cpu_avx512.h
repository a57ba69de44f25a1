// The AVX-512 kernels of cpu_kernels.cpp, built where cpu_half.h defines MRS_AVX512_BF16. Two parts:
// the bfloat16 output loops of the sample kernels (NCHW per sample), where the compiler's integer
// rounding (ten instructions per 16 values) set the time and vcvtneps2bf16 rounds to nearest even
// in one, in registers (a float32 buffer was 15-19 % slower); and the vector type V16 of the row
// kernels (cpu_rows.h): two permutes give 16 pair sums, one sqrt serves 32 channels
// (docs/performance-lm.md#avx-512-row-kernels; where they run: kAvx512Rows in cpu_kernels.cpp).
// Same maths as the generic loops; sums run in another order and products may fuse otherwise.
#pragma once

#include "cpu_half.h"  // MRS_AVX512_BF16, store16

#if defined(MRS_AVX512_BF16)
#include <immintrin.h>

#include <cstdint>

#include "cpu_rows.h"

namespace mrs::avx512 {

inline __m512 load16(const bf16* p) {  // the bits moved up: exact
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// y = x m over the first positions of a row of n; returns how many (a multiple of 16).
inline int64_t scale_row(const bf16* x, bf16* y, int64_t n, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  int64_t l = 0;
  for (; l + 16 <= n; l += 16) store16(y + l, _mm512_mul_ps(load16(x + l), vm));
  return l;
}

// A phasor's gradient over the first positions of its two rows (u, v: its channels; gu, gv: their
// output gradients): du = gu m - u k / r, dv = gv m - v k / r, r = sqrt(u^2 + v^2 + eps).
// Returns how many positions (a multiple of 16).
inline int64_t pair_grad_row(const bf16* u, const bf16* v, const bf16* gu, const bf16* gv, bf16* du,
                             bf16* dv, int64_t n, float k, float m, float eps) {
  const __m512 vk = _mm512_set1_ps(k), vm = _mm512_set1_ps(m), ve = _mm512_set1_ps(eps);
  int64_t l = 0;
  for (; l + 16 <= n; l += 16) {
    const __m512 ul = load16(u + l), vl = load16(v + l);
    const __m512 q = _mm512_add_ps(_mm512_fmadd_ps(ul, ul, _mm512_mul_ps(vl, vl)), ve);
    const __m512 kr = _mm512_div_ps(vk, _mm512_sqrt_ps(q));  // k / r
    store16(du + l, _mm512_fnmadd_ps(kr, ul, _mm512_mul_ps(load16(gu + l), vm)));
    store16(dv + l, _mm512_fnmadd_ps(kr, vl, _mm512_mul_ps(load16(gv + l), vm)));
  }
  return l;
}

// ---- the row kernels --------------------------------------------------------------------
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const f16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store(bf16* p, __m512 v) { store16(p, v); }
inline void store(f16* p, __m512 v) {  // nearest even, like st(f16*)
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, kRound));
}

// The vector type of the row kernels (cpu_rows.h: simd::fwd_rows<V16, ...>): 16 lanes.
struct V16 {
  using R = __m512;
  static constexpr int64_t kLanes = 16;
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float v) { return _mm512_set1_ps(v); }
  template <typename T>
  static R load(const T* p) { return load16(p); }
  template <typename T>
  static void store(T* p, R v) { avx512::store(p, v); }
  template <typename T>
  static void store2(T* p, R a, R b) {
    avx512::store(p, a);
    avx512::store(p + 16, b);
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

#else
namespace mrs::avx512 {  // not built: the generic loops take every position (kAvx512 is false)
template <typename... A>
inline int64_t scale_row(A...) { return 0; }
template <typename... A>
inline int64_t pair_grad_row(A...) { return 0; }
}  // namespace mrs::avx512
#endif
