// The per-sample kernels (NCHW: A samples of C channels of L contiguous positions, one S per
// sample), written once over their four row operations: by loops the compiler vectorises (Loops,
// every build), or over a vector type V (Vectors<V>; cpu_rows.h says what V provides), which
// MRS_SIMD in cpu_kernels.cpp chooses where it is built. Every row is contiguous positions, where
// the half conversions vectorise in the loop itself (ld / st) or happen in registers (V).
#pragma once

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_half.h"

namespace mrs {

// The row operations on positions l0 .. L of contiguous rows (u, v: a phasor's two channels).
struct Loops {
  // sum of the magnitudes r = sqrt(u^2 + v^2 + eps)
  template <typename T>
  static float magnitudes(const T* u, const T* v, float eps, int64_t L, int64_t l0 = 0) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t l = l0; l < L; ++l) {
      const float ul = ld(u[l]), vl = ld(v[l]);
      s += std::sqrt(ul * ul + vl * vl + eps);
    }
    return s;
  }
  // y = x m
  template <typename T>
  static void scale(const T* x, T* y, float m, int64_t L, int64_t l0 = 0) {
#pragma omp simd
    for (int64_t l = l0; l < L; ++l) st(y + l, ld(x[l]) * m);
  }
  // sum of g x
  template <typename T>
  static float dot(const T* g, const T* x, int64_t L, int64_t l0 = 0) {
    float t = 0.f;
#pragma omp simd reduction(+ : t)
    for (int64_t l = l0; l < L; ++l) t += ld(g[l]) * ld(x[l]);
    return t;
  }
  // the phasor's gradient (gu, gv: the output gradients): du = gu m - u k / r, dv = gv m - v k / r
  template <typename T>
  static void pair_grad(const T* u, const T* v, const T* gu, const T* gv, T* du, T* dv, float k, float m, float eps,
                        int64_t L, int64_t l0 = 0) {
#pragma omp simd
    for (int64_t l = l0; l < L; ++l) {
      const float ul = ld(u[l]), vl = ld(v[l]);
      const float kr = k / std::sqrt(ul * ul + vl * vl + eps);
      st(du + l, ld(gu[l]) * m - kr * ul);
      st(dv + l, ld(gv[l]) * m - kr * vl);
    }
  }
};

// The same over V::kLanes positions at a time, with two accumulator chains (the adds' latency
// stays hidden); Loops takes the last positions.
template <class V>
struct Vectors {
  static constexpr int64_t N = V::kLanes;
  using R = typename V::R;

  template <typename T>
  static float magnitudes(const T* u, const T* v, float eps, int64_t L) {
    const R ve = V::set1(eps);
    auto r = [&](int64_t i) {  // r at positions i .. i + N
      const R ui = V::load(u + i), vi = V::load(v + i);
      return V::sqrt(V::add(V::fmadd(ui, ui, V::mul(vi, vi)), ve));
    };
    R acc0 = V::zero(), acc1 = V::zero();
    int64_t l = 0;
    for (; l + 2 * N <= L; l += 2 * N) {
      acc0 = V::add(acc0, r(l));
      acc1 = V::add(acc1, r(l + N));
    }
    for (; l + N <= L; l += N) acc0 = V::add(acc0, r(l));
    return V::hsum(V::add(acc0, acc1)) + Loops::magnitudes(u, v, eps, L, l);
  }
  template <typename T>
  static void scale(const T* x, T* y, float m, int64_t L) {
    const R vm = V::set1(m);
    int64_t l = 0;
    for (; l + 2 * N <= L; l += 2 * N) V::store2(y + l, V::mul(V::load(x + l), vm), V::mul(V::load(x + l + N), vm));
    for (; l + N <= L; l += N) V::store(y + l, V::mul(V::load(x + l), vm));
    Loops::scale(x, y, m, L, l);
  }
  template <typename T>
  static float dot(const T* g, const T* x, int64_t L) {
    R acc0 = V::zero(), acc1 = V::zero();
    int64_t l = 0;
    for (; l + 2 * N <= L; l += 2 * N) {
      acc0 = V::fmadd(V::load(g + l), V::load(x + l), acc0);
      acc1 = V::fmadd(V::load(g + l + N), V::load(x + l + N), acc1);
    }
    for (; l + N <= L; l += N) acc0 = V::fmadd(V::load(g + l), V::load(x + l), acc0);
    float t = V::hsum(V::add(acc0, acc1));
    for (; l < L; ++l) t += ld(g[l]) * ld(x[l]);  // in order, onto the vector sum (as the kernels always did)
    return t;
  }
  template <typename T>
  static void pair_grad(const T* u, const T* v, const T* gu, const T* gv, T* du, T* dv, float k, float m, float eps,
                        int64_t L) {
    const R vk = V::set1(k), vm = V::set1(m), ve = V::set1(eps);
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
    Loops::pair_grad(u, v, gu, gv, du, dv, k, m, eps, L, l);
  }
};

template <typename T, class Ops = Loops>
void fwd_sample(const T* x, const float* w, T* y, float* rsum, int64_t A, int64_t C, int64_t L, float eps, int nt) {
  const int64_t P = C / 2;
  const float n_pairs = static_cast<float>(P) * static_cast<float>(L);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
  for (int64_t a = 0; a < A; ++a) {
    const T* xa = x + a * C * L;
    T* ya = y + a * C * L;
    float s = 0.f;  // pair by pair: short float sums, then their total
    for (int64_t p = 0; p < P; ++p) s += Ops::magnitudes(xa + 2 * p * L, xa + (2 * p + 1) * L, eps, L);
    if (rsum) rsum[a] = s;
    const float inv = n_pairs / s;
    for (int64_t ch = 0; ch < C; ++ch) Ops::scale(xa + ch * L, ya + ch * L, w ? inv * w[ch / 2] : inv, L);
  }
}

template <typename T, class Ops = Loops>
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
        gxs[ch] = Ops::dot(ga + ch * L, xa + ch * L, L) * inv_s;
        cs += (w ? w[ch / 2] : 1.f) * gxs[ch];
      }
      const float k = cs * inv_s / n_pairs;  // dx = w g / S - k x / r
      for (int64_t p = 0; p < P; ++p) {
        const int64_t o0 = 2 * p * L, o1 = o0 + L;  // the pair's two channels
        Ops::pair_grad(xa + o0, xa + o1, ga + o0, ga + o1, da + o0, da + o1, k, (w ? w[p] : 1.f) * inv_s, eps, L);
      }
      if (my)
        for (int64_t p = 0; p < P; ++p) my[p] += gxs[2 * p] + gxs[2 * p + 1];
    }
  }
  dwb.reduce(dw);
}

}  // namespace mrs

namespace mrs::simd {  // the kernels over V, named as cpu_rows.h's are (simd::fn<V, T>)

template <class V, typename T>
void fwd_sample(const T* x, const float* w, T* y, float* rsum, int64_t A, int64_t C, int64_t L, float eps, int nt) {
  mrs::fwd_sample<T, Vectors<V>>(x, w, y, rsum, A, C, L, eps, nt);
}

template <class V, typename T>
void bwd_sample(const T* x, const T* g, const float* w, const float* rsum, T* dx, float* dw, int64_t A, int64_t C,
                int64_t L, float eps, int nt) {
  mrs::bwd_sample<T, Vectors<V>>(x, g, w, rsum, dx, dw, A, C, L, eps, nt);
}

}  // namespace mrs::simd
