// The per-sample kernels (NCHW: A samples of C channels of L contiguous positions, one S per
// sample): the generic loops every build has, and the same kernels over a vector type V (cpu_rows.h
// says what V provides), which MRS_SIMD in cpu_kernels.cpp chooses where they are built. Every loop
// runs over contiguous positions, where the half conversions vectorise in the loop itself (ld / st).
#pragma once

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_half.h"

namespace mrs {

// The sum of a phasor's magnitudes r = sqrt(u^2 + v^2 + eps) at positions l0 .. L of its two rows.
template <typename T>
inline float pair_magnitudes(const T* u, const T* v, int64_t l0, int64_t L, float eps) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t l = l0; l < L; ++l) {
    const float ul = ld(u[l]), vl = ld(v[l]);
    s += std::sqrt(ul * ul + vl * vl + eps);
  }
  return s;
}

// A phasor's gradient at positions l0 .. L of its two rows (u, v: its channels; gu, gv: their output
// gradients): du = gu m - u k / r, dv = gv m - v k / r, r = sqrt(u^2 + v^2 + eps).
template <typename T>
inline void pair_grad(const T* u, const T* v, const T* gu, const T* gv, T* du, T* dv, int64_t l0, int64_t L,
                      float k, float m, float eps) {
#pragma omp simd
  for (int64_t l = l0; l < L; ++l) {
    const float ul = ld(u[l]), vl = ld(v[l]);
    const float kr = k / std::sqrt(ul * ul + vl * vl + eps);
    st(du + l, ld(gu[l]) * m - kr * ul);
    st(dv + l, ld(gv[l]) * m - kr * vl);
  }
}

template <typename T>
void fwd_sample(const T* x, const float* w, T* y, float* rsum, int64_t A, int64_t C, int64_t L, float eps, int nt) {
  const int64_t P = C / 2;
  const float n_pairs = static_cast<float>(P) * static_cast<float>(L);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
  for (int64_t a = 0; a < A; ++a) {
    const T* xa = x + a * C * L;
    T* ya = y + a * C * L;
    float s = 0.f;  // pair by pair: short float sums, then their total
    for (int64_t p = 0; p < P; ++p) {
      const T *u = xa + 2 * p * L, *v = u + L;
      s += pair_magnitudes(u, v, 0, L, eps);
    }
    if (rsum) rsum[a] = s;
    const float inv = n_pairs / s;
    for (int64_t ch = 0; ch < C; ++ch) {
      const float m = w ? inv * w[ch / 2] : inv;
      const T* xr = xa + ch * L;
      T* yr = ya + ch * L;
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) st(yr + l, ld(xr[l]) * m);
    }
  }
}

template <typename T>
void bwd_sample(const T* x, const T* g, const float* w, const float* rsum, T* dx, float* dw, int64_t A, int64_t C,
                int64_t L, float eps, int nt) {
  const int64_t P = C / 2;
  const float n_pairs = static_cast<float>(P) * static_cast<float>(L);
  DwBuffers dwb(dw != nullptr, nt, P);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    float* my = dwb.mine();
    std::vector<float> gxs(C);  // per channel sum_l g x / S of this sample
#pragma omp for schedule(static)
    for (int64_t a = 0; a < A; ++a) {
      const T *xa = x + a * C * L, *ga = g + a * C * L;
      T* da = dx + a * C * L;
      const float inv_s = n_pairs / rsum[a];
      float cs = 0.f;  // c / S = sum_k w g x / S
      for (int64_t ch = 0; ch < C; ++ch) {
        const T *xr = xa + ch * L, *gr = ga + ch * L;
        float t = 0.f;
#pragma omp simd reduction(+ : t)
        for (int64_t l = 0; l < L; ++l) t += ld(gr[l]) * ld(xr[l]);
        gxs[ch] = t * inv_s;
        cs += (w ? w[ch / 2] : 1.f) * gxs[ch];
      }
      const float k = cs * inv_s / n_pairs;  // dx = w g / S - k x / r
      for (int64_t p = 0; p < P; ++p) {
        const float m = (w ? w[p] : 1.f) * inv_s;
        const int64_t o0 = 2 * p * L, o1 = o0 + L;  // the pair's two channels
        const T *u = xa + o0, *v = xa + o1, *gu = ga + o0, *gv = ga + o1;
        T *du = da + o0, *dv = da + o1;
        pair_grad(u, v, gu, gv, du, dv, 0, L, k, m, eps);
      }
      if (my)
        for (int64_t p = 0; p < P; ++p) my[p] += gxs[2 * p] + gxs[2 * p + 1];
    }
  }
  dwb.reduce(dw);
}

}  // namespace mrs

namespace mrs::simd {

// The generic loops above over V::kLanes positions at a time, with two accumulator chains (the
// adds' latency stays hidden) and the half conversions in registers.
template <class V, typename T>
void fwd_sample(const T* x, const float* w, T* y, float* rsum, int64_t A, int64_t C, int64_t L, float eps, int nt) {
  constexpr int64_t N = V::kLanes;
  using R = typename V::R;
  const int64_t P = C / 2;
  const float n_pairs = static_cast<float>(P) * static_cast<float>(L);
  const R ve = V::set1(eps);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
  for (int64_t a = 0; a < A; ++a) {
    const T* xa = x + a * C * L;
    T* ya = y + a * C * L;
    float s = 0.f;
    for (int64_t p = 0; p < P; ++p) {
      const T *u = xa + 2 * p * L, *v = u + L;
      auto magnitudes = [&](int64_t i) {  // r of the pair at positions i .. i + N
        const R ui = V::load(u + i), vi = V::load(v + i);
        return V::sqrt(V::add(V::fmadd(ui, ui, V::mul(vi, vi)), ve));
      };
      R acc0 = V::zero(), acc1 = V::zero();
      int64_t l = 0;
      for (; l + 2 * N <= L; l += 2 * N) {
        acc0 = V::add(acc0, magnitudes(l));
        acc1 = V::add(acc1, magnitudes(l + N));
      }
      for (; l + N <= L; l += N) acc0 = V::add(acc0, magnitudes(l));
      s += V::hsum(V::add(acc0, acc1)) + pair_magnitudes(u, v, l, L, eps);  // and the last positions
    }
    if (rsum) rsum[a] = s;
    const float inv = n_pairs / s;
    for (int64_t ch = 0; ch < C; ++ch) {
      const float m = w ? inv * w[ch / 2] : inv;
      const R vm = V::set1(m);
      const T* xr = xa + ch * L;
      T* yr = ya + ch * L;
      int64_t l = 0;
      for (; l + 2 * N <= L; l += 2 * N) V::store2(yr + l, V::mul(V::load(xr + l), vm), V::mul(V::load(xr + l + N), vm));
      for (; l + N <= L; l += N) V::store(yr + l, V::mul(V::load(xr + l), vm));
      for (; l < L; ++l) st(yr + l, ld(xr[l]) * m);
    }
  }
}

template <class V, typename T>
void bwd_sample(const T* x, const T* g, const float* w, const float* rsum, T* dx, float* dw, int64_t A, int64_t C,
                int64_t L, float eps, int nt) {
  constexpr int64_t N = V::kLanes;
  using R = typename V::R;
  const int64_t P = C / 2;
  const float n_pairs = static_cast<float>(P) * static_cast<float>(L);
  DwBuffers dwb(dw != nullptr, nt, P);
  const R ve = V::set1(eps);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    float* my = dwb.mine();
    std::vector<float> gxs(C);  // per channel sum_l g x / S of this sample
#pragma omp for schedule(static)
    for (int64_t a = 0; a < A; ++a) {
      const T *xa = x + a * C * L, *ga = g + a * C * L;
      T* da = dx + a * C * L;
      const float inv_s = n_pairs / rsum[a];
      float cs = 0.f;  // c / S = sum_k w g x / S
      for (int64_t ch = 0; ch < C; ++ch) {
        const T *xr = xa + ch * L, *gr = ga + ch * L;
        R acc0 = V::zero(), acc1 = V::zero();
        int64_t l = 0;
        for (; l + 2 * N <= L; l += 2 * N) {
          acc0 = V::fmadd(V::load(gr + l), V::load(xr + l), acc0);
          acc1 = V::fmadd(V::load(gr + l + N), V::load(xr + l + N), acc1);
        }
        for (; l + N <= L; l += N) acc0 = V::fmadd(V::load(gr + l), V::load(xr + l), acc0);
        float t = V::hsum(V::add(acc0, acc1));
        for (; l < L; ++l) t += ld(gr[l]) * ld(xr[l]);
        gxs[ch] = t * inv_s;
        cs += (w ? w[ch / 2] : 1.f) * gxs[ch];
      }
      const float k = cs * inv_s / n_pairs;  // dx = w g / S - k x / r
      const R vk = V::set1(k);
      for (int64_t p = 0; p < P; ++p) {
        const float m = (w ? w[p] : 1.f) * inv_s;
        const R vm = V::set1(m);
        const int64_t o0 = 2 * p * L, o1 = o0 + L;  // the pair's two channels
        const T *u = xa + o0, *v = xa + o1, *gu = ga + o0, *gv = ga + o1;
        T *du = da + o0, *dv = da + o1;
        auto k_over_r = [&](R ul, R vl) { return V::div(vk, V::sqrt(V::add(V::fmadd(ul, ul, V::mul(vl, vl)), ve))); };
        int64_t l = 0;
        for (; l + 2 * N <= L; l += 2 * N) {
          const R u0 = V::load(u + l), v0 = V::load(v + l), u1 = V::load(u + l + N), v1 = V::load(v + l + N);
          const R kr0 = k_over_r(u0, v0), kr1 = k_over_r(u1, v1);
          V::store2(du + l, V::fmsub(V::load(gu + l), vm, V::mul(kr0, u0)),
                    V::fmsub(V::load(gu + l + N), vm, V::mul(kr1, u1)));
          V::store2(dv + l, V::fmsub(V::load(gv + l), vm, V::mul(kr0, v0)),
                    V::fmsub(V::load(gv + l + N), vm, V::mul(kr1, v1)));
        }
        for (; l + N <= L; l += N) {
          const R ul = V::load(u + l), vl = V::load(v + l), kr = k_over_r(ul, vl);
          V::store(du + l, V::fmsub(V::load(gu + l), vm, V::mul(kr, ul)));
          V::store(dv + l, V::fmsub(V::load(gv + l), vm, V::mul(kr, vl)));
        }
        pair_grad(u, v, gu, gv, du, dv, l, L, k, m, eps);  // the last positions
      }
      if (my)
        for (int64_t p = 0; p < P; ++p) my[p] += gxs[2 * p] + gxs[2 * p + 1];
    }
  }
  dwb.reduce(dw);
}

}  // namespace mrs::simd
