// The row kernels (tokens, NHWC: G groups of L rows of C contiguous channels, one S per group) of
// cpu_avx2.h (8 lanes) and cpu_avx512.h (16 lanes), written once over a vector type V. Loads and
// stores are contiguous, half conversions in registers; V::pair_squares turns two vectors of
// channels into one of pair sums, so one sqrt serves 2 V::kLanes channels, and V::spread_lo /
// spread_hi put each pair's value back over its two lanes. Same maths and float32 accumulation
// as the generic loops; the sums run in another order.
//
// What V provides (static): R (the register), kLanes, zero, set1, load (float, bf16, f16), store
// (the same three), store2 (two registers at once: one pack for bfloat16 on AVX2), add, mul, div,
// sqrt, fmadd, fmsub (a b - c), hsum, pair_squares (pairs in lane order, matching spread_lo /
// spread_hi), pair_squares_dup (each pair's sum over both its lanes).
#pragma once

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_half.h"

namespace mrs::simd {

template <class V, typename T, bool kAffine>
void fwd_rows(const T* x, const float* w, T* y, float* rsum, int64_t G, int64_t L, int64_t C,
              float eps, int nt) {
  constexpr int64_t N = V::kLanes;
  using R = typename V::R;
  const float n_pairs = static_cast<float>(C / 2) * static_cast<float>(L);
  const std::unique_ptr<float[]> w2 = per_channel(kAffine ? w : nullptr, C);
  const float* wc = w2.get();
  const R ve = V::set1(eps);
  // the magnitudes of the pairs of channels c .. c + 2N
  auto magnitudes = [&](const T* xr, int64_t c) {
    return V::sqrt(V::add(V::pair_squares(V::load(xr + c), V::load(xr + c + N)), ve));
  };
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
  for (int64_t a = 0; a < G; ++a) {
    float s = 0.f;  // row by row: short float sums, then their total
    for (int64_t l = 0; l < L; ++l) {
      const T* xr = x + (a * L + l) * C;
      R acc0 = V::zero(), acc1 = V::zero();
      int64_t c = 0;
      for (; c + 4 * N <= C; c += 4 * N) {  // two chains: the adds' latency stays hidden
        acc0 = V::add(acc0, magnitudes(xr, c));
        acc1 = V::add(acc1, magnitudes(xr, c + 2 * N));
      }
      for (; c + 2 * N <= C; c += 2 * N) acc0 = V::add(acc0, magnitudes(xr, c));
      float sr = V::hsum(V::add(acc0, acc1));
      for (; c < C; c += 2) {
        const float x0 = ld(xr[c]), x1 = ld(xr[c + 1]);
        sr += std::sqrt(x0 * x0 + x1 * x1 + eps);
      }
      s += sr;
    }
    if (rsum) rsum[a] = s;
    const float inv = n_pairs / s;
    const R vinv = V::set1(inv);
    for (int64_t l = 0; l < L; ++l) {
      const T* xr = x + (a * L + l) * C;
      T* yr = y + (a * L + l) * C;
      auto scaled = [&](int64_t c) {  // y of channels c .. c + N
        return V::mul(V::load(xr + c), kAffine ? V::mul(vinv, V::load(wc + c)) : vinv);
      };
      int64_t c = 0;
      for (; c + 2 * N <= C; c += 2 * N) V::store2(yr + c, scaled(c), scaled(c + N));
      for (; c + N <= C; c += N) V::store(yr + c, scaled(c));
      for (; c < C; ++c) st(yr + c, ld(xr[c]) * (kAffine ? inv * wc[c] : inv));
    }
  }
}

template <class V, typename T, bool kAffine, bool kDw>
void bwd_rows(const T* x, const T* g, const float* w, const float* rsum, T* dx, float* dw,
              int64_t G, int64_t L, int64_t C, float eps, int nt) {
  constexpr int64_t N = V::kLanes;
  using R = typename V::R;
  const float n_pairs = static_cast<float>(C / 2) * static_cast<float>(L);
  const std::unique_ptr<float[]> w2 = per_channel(kAffine ? w : nullptr, C);
  const float* wc = w2.get();
  DwBuffers dwb(kDw, nt, C);  // per-thread, per-channel rows: pairs are summed once, at the end
  const R ve = V::set1(eps);
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
        auto wg = [&](int64_t c) {  // w g of channels c .. c + N
          return kAffine ? V::mul(V::load(gr + c), V::load(wc + c)) : V::load(gr + c);
        };
        R acc0 = V::zero(), acc1 = V::zero();
        int64_t c = 0;
        for (; c + 2 * N <= C; c += 2 * N) {
          acc0 = V::fmadd(wg(c), V::load(xr + c), acc0);
          acc1 = V::fmadd(wg(c + N), V::load(xr + c + N), acc1);
        }
        for (; c + N <= C; c += N) acc0 = V::fmadd(wg(c), V::load(xr + c), acc0);
        float cr = V::hsum(V::add(acc0, acc1));
        for (; c < C; ++c) cr += (kAffine ? wc[c] : 1.f) * ld(gr[c]) * ld(xr[c]);
        csum += cr;
      }
      const float k = csum * inv_s * inv_s / n_pairs;  // dx = w g / S - k x / r
      const R vk = V::set1(k), vinv = V::set1(inv_s);
      for (int64_t l = 0; l < L; ++l) {
        const T* xr = x + (a * L + l) * C;
        const T* gr = g + (a * L + l) * C;
        T* dr = dx + (a * L + l) * C;
        // dx of channels c .. c + N given x there and k / r over their lanes; adds their g x / S
        // into this thread's weight-gradient row
        auto grad = [&](int64_t c, R xv, R kr) {
          const R gv = V::load(gr + c);
          const R m = kAffine ? V::mul(V::load(wc + c), vinv) : vinv;
          if constexpr (kDw) V::store(my + c, V::fmadd(V::mul(gv, xv), vinv, V::load(my + c)));
          return V::fmsub(gv, m, V::mul(kr, xv));
        };
        int64_t c = 0;
        for (; c + 2 * N <= C; c += 2 * N) {  // k / r of N pairs: one sqrt and one divide
          const R x0 = V::load(xr + c), x1 = V::load(xr + c + N);
          const R kr = V::div(vk, V::sqrt(V::add(V::pair_squares(x0, x1), ve)));
          const R d0 = grad(c, x0, V::spread_lo(kr));
          V::store2(dr + c, d0, grad(c + N, x1, V::spread_hi(kr)));
        }
        for (; c + N <= C; c += N) {
          const R x0 = V::load(xr + c);
          V::store(dr + c, grad(c, x0, V::div(vk, V::sqrt(V::add(V::pair_squares_dup(x0), ve)))));
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

}  // namespace mrs::simd
