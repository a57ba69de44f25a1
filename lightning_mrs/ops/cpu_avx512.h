// The AVX-512 kernels of cpu_kernels.cpp: built where cpu_half.h defines MRS_AVX512_BF16 (the
// compiler targets AVX-512 and AVX512_BF16, -march=native on such a CPU, and the "generic" kernel
// set does not ask for the loops of cpu_kernels.cpp alone). Included by cpu_kernels.cpp only;
// part of the build's cache key (lightning_mrs/ops/cpu_kernels.py). Two parts:
//
// The bfloat16 output loops of the sample kernels (NCHW per sample). In those loops the compiler
// rounds each float to bfloat16 with integer maths (about ten vector instructions per 16 values,
// then a pack), and that store set the time. Plain truncation (wrong rounding, a bound) made the
// backward 20 % and the forward 18 % faster on an AVX-512 EPYC; vcvtneps2bf16 rounds to nearest
// even in one instruction. A float32 buffer between the loop and the conversion (as float16
// does) was 15-19 % slower than the integer maths instead: here the loads, the maths and the
// store stay in registers.
//
// The row kernels (tokens, NHWC), as cpu_avx2.h's with 16 lanes: every load and store is
// contiguous, the half conversions happen in registers, and a phasor's two channels stay in one
// vector. Two permutes of two vectors of squares give 16 pair sums, one sqrt (and one divide)
// serve 32 channels, and two more permutes spread each pair's value back over its two lanes. Why:
// the generic loops read the pairs with stride 2 and convert half rows through float32 buffers;
// on an Intel AVX-512 Xeon a bfloat16 forward of (2048, 128) took twice float16's time there
// (docs/performance-lm.md#avx-512-row-kernels). Which dtypes run them: kAvx512Rows in
// cpu_kernels.cpp.
//
// Same maths as the generic loops; sums run in another order and products may fuse otherwise
// (tests: the float64 reference, and the generic kernels).
#pragma once

#include "cpu_half.h"  // MRS_AVX512_BF16, store16

#if defined(MRS_AVX512_BF16)
#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <vector>

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

// The 16 pair sums of squares of 32 channels (a: channels 0-15, b: 16-31), in pair order.
inline __m512 pair_squares(__m512 a, __m512 b) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  const __m512 sa = _mm512_mul_ps(a, a), sb = _mm512_mul_ps(b, b);
  return _mm512_add_ps(_mm512_permutex2var_ps(sa, even, sb), _mm512_permutex2var_ps(sa, odd, sb));
}
// 16 pair values over the 32 channels of their pairs: channels 0-15 (lo) and 16-31 (hi).
inline __m512 spread_lo(__m512 v) {
  return _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), v);
}
inline __m512 spread_hi(__m512 v) {
  return _mm512_permutexvar_ps(_mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8), v);
}
// The pair sums of squares of 16 channels, each over both lanes of its pair.
inline __m512 pair_squares_dup(__m512 a) {
  const __m512 sa = _mm512_mul_ps(a, a);
  return _mm512_add_ps(sa, _mm512_permute_ps(sa, 0xB1));  // (c, c ^ 1): the same sum in both
}

// The per-phasor gain (P,) spread over the channels (C,): every loop here runs over channels.
inline std::vector<float> per_channel(const float* w, int64_t C) {
  std::vector<float> w2(w ? C : 0);
  for (int64_t c = 0; c < static_cast<int64_t>(w2.size()); ++c) w2[c] = w[c / 2];
  return w2;
}

template <typename T, bool kAffine>
void fwd_rows(const T* x, const float* w, T* y, float* rsum, int64_t G, int64_t L, int64_t C,
              float eps, int nt) {
  const float n_pairs = static_cast<float>(C / 2) * static_cast<float>(L);
  const std::vector<float> w2 = per_channel(kAffine ? w : nullptr, C);
  const float* wc = w2.data();
  const __m512 ve = _mm512_set1_ps(eps);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
  for (int64_t a = 0; a < G; ++a) {
    float s = 0.f;  // row by row: short float sums, then their total
    for (int64_t l = 0; l < L; ++l) {
      const T* xr = x + (a * L + l) * C;
      __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
      int64_t c = 0;
      for (; c + 64 <= C; c += 64) {  // two chains: the adds' latency stays hidden
        acc0 = _mm512_add_ps(acc0, _mm512_sqrt_ps(_mm512_add_ps(pair_squares(load16(xr + c), load16(xr + c + 16)), ve)));
        acc1 = _mm512_add_ps(acc1, _mm512_sqrt_ps(_mm512_add_ps(pair_squares(load16(xr + c + 32), load16(xr + c + 48)), ve)));
      }
      for (; c + 32 <= C; c += 32)
        acc0 = _mm512_add_ps(acc0, _mm512_sqrt_ps(_mm512_add_ps(pair_squares(load16(xr + c), load16(xr + c + 16)), ve)));
      float sr = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
      for (; c < C; c += 2) {
        const float x0 = ld(xr[c]), x1 = ld(xr[c + 1]);
        sr += std::sqrt(x0 * x0 + x1 * x1 + eps);
      }
      s += sr;
    }
    if (rsum) rsum[a] = s;
    const float inv = n_pairs / s;
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int64_t l = 0; l < L; ++l) {
      const T* xr = x + (a * L + l) * C;
      T* yr = y + (a * L + l) * C;
      int64_t c = 0;
      for (; c + 16 <= C; c += 16)
        store(yr + c, _mm512_mul_ps(load16(xr + c), kAffine ? _mm512_mul_ps(vinv, _mm512_loadu_ps(wc + c)) : vinv));
      for (; c < C; ++c) st(yr + c, ld(xr[c]) * (kAffine ? inv * wc[c] : inv));
    }
  }
}

template <typename T, bool kAffine, bool kDw>
void bwd_rows(const T* x, const T* g, const float* w, const float* rsum, T* dx, float* dw,
              int64_t G, int64_t L, int64_t C, float eps, int nt) {
  const float n_pairs = static_cast<float>(C / 2) * static_cast<float>(L);
  const std::vector<float> w2 = per_channel(kAffine ? w : nullptr, C);
  const float* wc = w2.data();
  DwBuffers dwb(kDw, nt, C);  // per-thread, per-channel rows: pairs are summed once, at the end
  const __m512 ve = _mm512_set1_ps(eps);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    float* my = dwb.mine();
#pragma omp for schedule(static)
    for (int64_t a = 0; a < G; ++a) {
      const float inv_s = n_pairs / rsum[a];
      float csum = 0.f;  // sum_k w g x over the group, row by row
      for (int64_t l = 0; l < L; ++l) {
        const T* xr = x + (a * L + l) * C;
        const T* gr = g + (a * L + l) * C;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        int64_t c = 0;
        for (; c + 32 <= C; c += 32) {
          __m512 g0 = load16(gr + c), g1 = load16(gr + c + 16);
          if constexpr (kAffine) {
            g0 = _mm512_mul_ps(g0, _mm512_loadu_ps(wc + c));
            g1 = _mm512_mul_ps(g1, _mm512_loadu_ps(wc + c + 16));
          }
          acc0 = _mm512_fmadd_ps(g0, load16(xr + c), acc0);
          acc1 = _mm512_fmadd_ps(g1, load16(xr + c + 16), acc1);
        }
        for (; c + 16 <= C; c += 16) {
          __m512 g0 = load16(gr + c);
          if constexpr (kAffine) g0 = _mm512_mul_ps(g0, _mm512_loadu_ps(wc + c));
          acc0 = _mm512_fmadd_ps(g0, load16(xr + c), acc0);
        }
        float cr = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
        for (; c < C; ++c) cr += (kAffine ? wc[c] : 1.f) * ld(gr[c]) * ld(xr[c]);
        csum += cr;
      }
      const float k = csum * inv_s * inv_s / n_pairs;  // dx = w g / S - k x / r
      const __m512 vk = _mm512_set1_ps(k), vinv = _mm512_set1_ps(inv_s);
      for (int64_t l = 0; l < L; ++l) {
        const T* xr = x + (a * L + l) * C;
        const T* gr = g + (a * L + l) * C;
        T* dr = dx + (a * L + l) * C;
        // dx and the weight-gradient row of 16 channels, given k / r over their lanes
        auto grad16 = [&](int64_t c, __m512 x0, __m512 kr) {
          const __m512 g0 = load16(gr + c);
          const __m512 m = kAffine ? _mm512_mul_ps(_mm512_loadu_ps(wc + c), vinv) : vinv;
          store(dr + c, _mm512_fmsub_ps(g0, m, _mm512_mul_ps(kr, x0)));
          if constexpr (kDw) _mm512_storeu_ps(my + c, _mm512_fmadd_ps(_mm512_mul_ps(g0, x0), vinv, _mm512_loadu_ps(my + c)));
        };
        int64_t c = 0;
        for (; c + 32 <= C; c += 32) {  // k / r of 16 pairs, one sqrt and one divide
          const __m512 x0 = load16(xr + c), x1 = load16(xr + c + 16);
          const __m512 kr = _mm512_div_ps(vk, _mm512_sqrt_ps(_mm512_add_ps(pair_squares(x0, x1), ve)));
          grad16(c, x0, spread_lo(kr));
          grad16(c + 16, x1, spread_hi(kr));
        }
        for (; c + 16 <= C; c += 16) {
          const __m512 x0 = load16(xr + c);
          grad16(c, x0, _mm512_div_ps(vk, _mm512_sqrt_ps(_mm512_add_ps(pair_squares_dup(x0), ve))));
        }
        for (; c < C; c += 2) {
          const float x0 = ld(xr[c]), x1 = ld(xr[c + 1]), g0 = ld(gr[c]), g1 = ld(gr[c + 1]);
          const float kr = k / std::sqrt(x0 * x0 + x1 * x1 + eps);
          const float m = kAffine ? wc[c] * inv_s : inv_s;
          st(dr + c, g0 * m - kr * x0);
          st(dr + c + 1, g1 * m - kr * x1);
          if constexpr (kDw) {
            my[c] += g0 * x0 * inv_s;
            my[c + 1] += g1 * x1 * inv_s;
          }
        }
      }
    }
  }
  if constexpr (kDw) {
    std::vector<float> per_channel_dw(C);
    dwb.reduce(per_channel_dw.data());
    for (int64_t p = 0; p < C / 2; ++p) dw[p] = per_channel_dw[2 * p] + per_channel_dw[2 * p + 1];
  }
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
