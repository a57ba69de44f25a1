// The bfloat16 output loops of the sample kernels of cpu_kernels.cpp (NCHW per sample) with
// AVX-512 and AVX512_BF16: built where cpu_half.h defines MRS_AVX512_BF16 (the compiler targets
// both, -march=native on such a CPU, and the "generic" kernel set does not ask for the loops of
// cpu_kernels.cpp alone). Included by cpu_kernels.cpp only; part of the build's cache key
// (lightning_mrs/ops/cpu_kernels.py).
//
// Why: in those loops the compiler rounds each float to bfloat16 with integer maths (about ten
// vector instructions per 16 values, then a pack), and that store set the time. Plain
// truncation (wrong rounding, a bound) made the backward 20 % and the forward 18 % faster on an
// AVX-512 EPYC; vcvtneps2bf16 rounds to nearest even in one instruction. A float32 buffer
// between the loop and the conversion (as float16 does) was 15-19 % slower than the integer
// maths instead: here the loads, the maths and the store stay in registers. Same maths as the
// generic loops; the backward's products may fuse in another order (tests: the float64
// reference, and the generic kernels).
#pragma once

#include "cpu_half.h"  // MRS_AVX512_BF16, store16

#if defined(MRS_AVX512_BF16)
#include <immintrin.h>

#include <cstdint>

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

}  // namespace mrs::avx512

#else
namespace mrs::avx512 {  // not built: the generic loops take every position (kAvx512 is false)
template <typename... A>
inline int64_t scale_row(A...) { return 0; }
template <typename... A>
inline int64_t pair_grad_row(A...) { return 0; }
}  // namespace mrs::avx512
#endif
