// The per-sample kernels (NCHW: A samples of C channels of L contiguous positions, one S per
// sample), the generic loops every build has; kAvx2 in cpu_kernels.cpp says which dtypes run
// cpu_avx2.h's instead.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_avx512.h"  // scale_row, pair_grad_row: the bfloat16 output loops with AVX512_BF16
#include "cpu_half.h"

namespace mrs {
// ---- positions contiguous, one S per sample --------------------------------------------
// Here every loop runs over contiguous positions, where the half conversions vectorise in
// the loop itself (ld / st): bfloat16 is read and written in place (a shift, cheaper than a
// buffer; with AVX512_BF16 the output loops are cpu_avx512.h's, which store by vcvtneps2bf16),
// float16 with the x86 conversion instructions goes through the float32 buffers a block at a
// time (x1.4 faster than the integer maths in the loop on AVX-512).
#if defined(__F16C__) || defined(__AVX512F__)
constexpr bool kF16Simd = true;
#else
constexpr bool kF16Simd = false;
#endif
template <typename T>
constexpr bool kBuffered = std::is_same_v<T, f16> && kF16Simd;
#if defined(MRS_AVX512_BF16)
template <typename T>
constexpr bool kAvx512 = std::is_same_v<T, bf16>;
#else
template <typename T>
constexpr bool kAvx512 = false;
#endif
// Rows of positions as the loops read them: the source itself, or its block in float32.
template <typename T>
inline auto in_row(const T* src, float* buf, int64_t n) {
  if constexpr (kBuffered<T>) return row_f32(src, buf, n);
  else return src;
}
template <typename T>
inline auto out_row(T* dst, float* buf) {
  if constexpr (kBuffered<T>) return buf;
  else return dst;
}
template <typename T, typename B>
inline void out_flush(const B* buf, T* dst, int64_t n) {  // B: what out_row gave
  if constexpr (kBuffered<T>) flush(buf, dst, n);
}
template <typename T>
inline std::vector<float> row_buffer() {
  return std::vector<float>(kBuffered<T> ? kBlock : 0);
}
// The block of a row of L positions: a row read in place is one block.
template <typename T>
constexpr int64_t positions_block(int64_t L) {
  return kBuffered<T> ? kBlock : L;
}
template <typename T>
void fwd_sample(const T* x, const float* w, T* y, float* rsum, int64_t A, int64_t C,
                int64_t L, float eps, int nt) {
  const int64_t P = C / 2;
  const float n_pairs = static_cast<float>(P) * static_cast<float>(L);
  const int64_t blk = positions_block<T>(L);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    std::vector<float> ub = row_buffer<T>(), vb = row_buffer<T>(), yb = row_buffer<T>();
#pragma omp for schedule(static)
    for (int64_t a = 0; a < A; ++a) {
      const T* xa = x + a * C * L;
      T* ya = y + a * C * L;
      float s = 0.f;  // block by block: short float sums, then their total
      for (int64_t p = 0; p < P; ++p) {
        for (int64_t l0 = 0; l0 < L; l0 += blk) {
          const int64_t n = std::min(blk, L - l0);
          const auto* u = in_row(xa + 2 * p * L + l0, ub.data(), n);
          const auto* v = in_row(xa + (2 * p + 1) * L + l0, vb.data(), n);
          float sp = 0.f;
#pragma omp simd reduction(+ : sp)
          for (int64_t l = 0; l < n; ++l) {
            const float ul = ld(u[l]), vl = ld(v[l]);
            sp += std::sqrt(ul * ul + vl * vl + eps);
          }
          s += sp;
        }
      }
      if (rsum) rsum[a] = s;
      const float inv = n_pairs / s;
      for (int64_t ch = 0; ch < C; ++ch) {
        const float m = w ? inv * w[ch / 2] : inv;
        for (int64_t l0 = 0; l0 < L; l0 += blk) {
          const int64_t n = std::min(blk, L - l0);
          const auto* xr = in_row(xa + ch * L + l0, ub.data(), n);
          T* yd = ya + ch * L + l0;
          auto* yr = out_row(yd, yb.data());
          int64_t l1 = 0;  // the positions done by cpu_avx512.h, if any
          if constexpr (kAvx512<T>) l1 = avx512::scale_row(xr, yr, n, m);
#pragma omp simd
          for (int64_t l = l1; l < n; ++l) st(yr + l, ld(xr[l]) * m);
          out_flush(yr, yd, n);
        }
      }
    }
  }
}

template <typename T>
void bwd_sample(const T* x, const T* g, const float* w, const float* rsum, T* dx, float* dw,
                int64_t A, int64_t C, int64_t L, float eps, int nt) {
  const int64_t P = C / 2;
  const float n_pairs = static_cast<float>(P) * static_cast<float>(L);
  const int64_t blk = positions_block<T>(L);
  DwBuffers dwb(dw != nullptr, nt, P);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    float* my = dwb.mine();
    std::vector<float> gxs(C);  // per channel sum_l g x / S of this sample
    std::vector<float> ub = row_buffer<T>(), vb = row_buffer<T>(), gub = row_buffer<T>(),
                       gvb = row_buffer<T>(), dub = row_buffer<T>(), dvb = row_buffer<T>();
#pragma omp for schedule(static)
    for (int64_t a = 0; a < A; ++a) {
      const T* xa = x + a * C * L;
      const T* ga = g + a * C * L;
      T* da = dx + a * C * L;
      const float inv_s = n_pairs / rsum[a];
      float cs = 0.f;  // c / S = sum_k w g x / S
      for (int64_t ch = 0; ch < C; ++ch) {
        float t = 0.f;
        for (int64_t l0 = 0; l0 < L; l0 += blk) {
          const int64_t n = std::min(blk, L - l0);
          const auto* xr = in_row(xa + ch * L + l0, ub.data(), n);
          const auto* gr = in_row(ga + ch * L + l0, gub.data(), n);
          float tb = 0.f;
#pragma omp simd reduction(+ : tb)
          for (int64_t l = 0; l < n; ++l) tb += ld(gr[l]) * ld(xr[l]);
          t += tb;
        }
        gxs[ch] = t * inv_s;
        cs += (w ? w[ch / 2] : 1.f) * gxs[ch];
      }
      const float k = cs * inv_s / n_pairs;  // dx = w g / S - k x / r
      for (int64_t p = 0; p < P; ++p) {
        const float m = (w ? w[p] : 1.f) * inv_s;
        for (int64_t l0 = 0; l0 < L; l0 += blk) {
          const int64_t n = std::min(blk, L - l0);
          const int64_t o0 = 2 * p * L + l0, o1 = o0 + L;  // the pair's two channels
          const auto* u = in_row(xa + o0, ub.data(), n);
          const auto* v = in_row(xa + o1, vb.data(), n);
          const auto* gu = in_row(ga + o0, gub.data(), n);
          const auto* gv = in_row(ga + o1, gvb.data(), n);
          auto* du = out_row(da + o0, dub.data());
          auto* dv = out_row(da + o1, dvb.data());
          int64_t l1 = 0;
          if constexpr (kAvx512<T>) l1 = avx512::pair_grad_row(u, v, gu, gv, du, dv, n, k, m, eps);
#pragma omp simd
          for (int64_t l = l1; l < n; ++l) {
            const float ul = ld(u[l]), vl = ld(v[l]);
            const float kr = k / std::sqrt(ul * ul + vl * vl + eps);
            st(du + l, ld(gu[l]) * m - kr * ul);
            st(dv + l, ld(gv[l]) * m - kr * vl);
          }
          out_flush(du, da + o0, n);
          out_flush(dv, da + o1, n);
        }
      }
      if (my)
        for (int64_t p = 0; p < P; ++p) my[p] += gxs[2 * p] + gxs[2 * p + 1];
    }
  }
  dwb.reduce(dw);
}

}  // namespace mrs
