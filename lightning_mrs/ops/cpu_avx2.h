// The kernels of cpu_kernels.cpp for AVX2 (8 float lanes), built where the compiler targets AVX2,
// FMA and F16C unless the "generic" kernel set asks for the loops alone (kAvx2 in cpu_kernels.cpp
// says which dtypes run them). Why: the generic loops read a phasor's two channels with stride 2
// (deinterleaved by vpermd + blends) and convert half rows through buffers, so compute set the
// time of half rows. Here loads and stores are contiguous, conversions happen in registers, and
// the pairs stay inside a vector (cpu_rows.h over V8 below; cpu_avx512.h over 16 lanes). Same
// maths and float32 accumulation; the sums run in another order. With AVX512_BF16 and AVX512VL,
// bfloat16 is stored with vcvtneps2bf16 on 8 lanes.
#pragma once

// MRS_KERNELS_AVX2 / MRS_KERNELS_GENERIC: the kernel sets "avx2" and "generic" (cpu_kernels.py:
// LIGHTNING_MRS_CPU_KERNEL_SET).
#if defined(MRS_KERNELS_AVX2) && !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "LIGHTNING_MRS_CPU_KERNEL_SET=avx2 needs a CPU with AVX2, FMA and F16C; use auto or generic here"
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(MRS_KERNELS_GENERIC)
#define MRS_AVX2 1

#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_half.h"
#include "cpu_rows.h"

namespace mrs::avx2 {

#if defined(MRS_BF16_STORE8)
constexpr bool kCvtBf16 = true;  // store8(bf16*) is one conversion instruction (cpu_half.h)
#else
constexpr bool kCvtBf16 = false;
#endif

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {  // the bits moved up: exact
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const f16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(f16* p, __m256 v) {  // nearest even, like st(f16*)
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, kRound));
}
// bfloat16 bits of 8 floats in 8 x uint32 lanes: nearest even, NaN stays NaN (st(bf16*) on 8 lanes)
inline __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i top = _mm256_srli_epi32(u, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(top, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan = _mm256_or_si256(top, _mm256_set1_epi32(0x40));  // quiet, sign and payload kept
  return _mm256_blendv_epi8(rounded, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
#if defined(MRS_BF16_STORE8)
using mrs::store8;  // bfloat16 with AVX512_BF16 and VL: vcvtneps2bf16 behind the subnormal test
#else
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

// The vector type of the row kernels (cpu_rows.h): 8 lanes.
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

// ---- positions contiguous, one S per sample: (A, C, L) ---------------------------------
// The generic loops convert bfloat16 in the loop (the compiler's shifts and packs) and float16
// through buffers; here both convert in registers, 8 positions at a time.
template <typename T>
void fwd_sample(const T* x, const float* w, T* y, float* rsum, int64_t A, int64_t C, int64_t L,
                float eps, int nt) {
  const int64_t P = C / 2;
  const float n_pairs = static_cast<float>(P) * static_cast<float>(L);
  const __m256 ve = _mm256_set1_ps(eps);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
  for (int64_t a = 0; a < A; ++a) {
    const T* xa = x + a * C * L;
    T* ya = y + a * C * L;
    float s = 0.f;  // pair by pair: short float sums, then their total
    for (int64_t p = 0; p < P; ++p) {
      const T* u = xa + 2 * p * L;
      const T* v = u + L;
      auto magnitudes = [&](int64_t i) {  // r of the pair at positions i .. i + 8
        const __m256 ui = load8(u + i), vi = load8(v + i);
        return _mm256_sqrt_ps(_mm256_add_ps(_mm256_fmadd_ps(ui, ui, _mm256_mul_ps(vi, vi)), ve));
      };
      __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
      int64_t l = 0;
      for (; l + 16 <= L; l += 16) {  // two chains: the adds' latency stays hidden
        acc0 = _mm256_add_ps(acc0, magnitudes(l));
        acc1 = _mm256_add_ps(acc1, magnitudes(l + 8));
      }
      for (; l + 8 <= L; l += 8) acc0 = _mm256_add_ps(acc0, magnitudes(l));
      float sp = hsum(_mm256_add_ps(acc0, acc1));
      for (; l < L; ++l) {
        const float ul = ld(u[l]), vl = ld(v[l]);
        sp += std::sqrt(ul * ul + vl * vl + eps);
      }
      s += sp;
    }
    if (rsum) rsum[a] = s;
    const float inv = n_pairs / s;
    for (int64_t ch = 0; ch < C; ++ch) {
      const float m = w ? inv * w[ch / 2] : inv;
      const __m256 vm = _mm256_set1_ps(m);
      const T* xr = xa + ch * L;
      T* yr = ya + ch * L;
      int64_t l = 0;
      for (; l + 16 <= L; l += 16)
        store16(yr + l, _mm256_mul_ps(load8(xr + l), vm), _mm256_mul_ps(load8(xr + l + 8), vm));
      for (; l + 8 <= L; l += 8) store8(yr + l, _mm256_mul_ps(load8(xr + l), vm));
      for (; l < L; ++l) st(yr + l, ld(xr[l]) * m);
    }
  }
}

template <typename T>
void bwd_sample(const T* x, const T* g, const float* w, const float* rsum, T* dx, float* dw,
                int64_t A, int64_t C, int64_t L, float eps, int nt) {
  const int64_t P = C / 2;
  const float n_pairs = static_cast<float>(P) * static_cast<float>(L);
  DwBuffers dwb(dw != nullptr, nt, P);
  const __m256 ve = _mm256_set1_ps(eps);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    float* my = dwb.mine();
    std::vector<float> gxs(C);  // per channel sum_l g x / S of this sample
#pragma omp for schedule(static)
    for (int64_t a = 0; a < A; ++a) {
      const T* xa = x + a * C * L;
      const T* ga = g + a * C * L;
      T* da = dx + a * C * L;
      const float inv_s = n_pairs / rsum[a];
      float cs = 0.f;  // c / S = sum_k w g x / S
      for (int64_t ch = 0; ch < C; ++ch) {
        const T* xr = xa + ch * L;
        const T* gr = ga + ch * L;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        int64_t l = 0;
        for (; l + 16 <= L; l += 16) {
          acc0 = _mm256_fmadd_ps(load8(gr + l), load8(xr + l), acc0);
          acc1 = _mm256_fmadd_ps(load8(gr + l + 8), load8(xr + l + 8), acc1);
        }
        for (; l + 8 <= L; l += 8) acc0 = _mm256_fmadd_ps(load8(gr + l), load8(xr + l), acc0);
        float t = hsum(_mm256_add_ps(acc0, acc1));
        for (; l < L; ++l) t += ld(gr[l]) * ld(xr[l]);
        gxs[ch] = t * inv_s;
        cs += (w ? w[ch / 2] : 1.f) * gxs[ch];
      }
      const float k = cs * inv_s / n_pairs;  // dx = w g / S - k x / r
      const __m256 vk = _mm256_set1_ps(k);
      for (int64_t p = 0; p < P; ++p) {
        const float m = (w ? w[p] : 1.f) * inv_s;
        const __m256 vm = _mm256_set1_ps(m);
        const int64_t o0 = 2 * p * L, o1 = o0 + L;  // the pair's two channels
        const T *u = xa + o0, *v = xa + o1, *gu = ga + o0, *gv = ga + o1;
        T *du = da + o0, *dv = da + o1;
        auto k_over_r = [&](__m256 ul, __m256 vl) {
          return _mm256_div_ps(vk, _mm256_sqrt_ps(_mm256_add_ps(_mm256_fmadd_ps(ul, ul, _mm256_mul_ps(vl, vl)), ve)));
        };
        int64_t l = 0;
        for (; l + 16 <= L; l += 16) {
          const __m256 u0 = load8(u + l), v0 = load8(v + l), u1 = load8(u + l + 8), v1 = load8(v + l + 8);
          const __m256 kr0 = k_over_r(u0, v0), kr1 = k_over_r(u1, v1);
          store16(du + l, _mm256_fmsub_ps(load8(gu + l), vm, _mm256_mul_ps(kr0, u0)),
                  _mm256_fmsub_ps(load8(gu + l + 8), vm, _mm256_mul_ps(kr1, u1)));
          store16(dv + l, _mm256_fmsub_ps(load8(gv + l), vm, _mm256_mul_ps(kr0, v0)),
                  _mm256_fmsub_ps(load8(gv + l + 8), vm, _mm256_mul_ps(kr1, v1)));
        }
        for (; l + 8 <= L; l += 8) {
          const __m256 ul = load8(u + l), vl = load8(v + l);
          const __m256 kr = k_over_r(ul, vl);
          store8(du + l, _mm256_fmsub_ps(load8(gu + l), vm, _mm256_mul_ps(kr, ul)));
          store8(dv + l, _mm256_fmsub_ps(load8(gv + l), vm, _mm256_mul_ps(kr, vl)));
        }
        for (; l < L; ++l) {
          const float ul = ld(u[l]), vl = ld(v[l]);
          const float kr = k / std::sqrt(ul * ul + vl * vl + eps);
          st(du + l, ld(gu[l]) * m - kr * ul);
          st(dv + l, ld(gv[l]) * m - kr * vl);
        }
      }
      if (my)
        for (int64_t p = 0; p < P; ++p) my[p] += gxs[2 * p] + gxs[2 * p + 1];
    }
  }
  dwb.reduce(dw);
}

}  // namespace mrs::avx2

#endif
