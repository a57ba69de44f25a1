// One-pass CPU kernels of the fused MRSNorm (docs/method.md#the-fused-forward-and-backward).
//
// Compiled on first use by lightning_mrs/ops/cpu_kernels.py (the system C++ compiler, OpenMP,
// -O3 -march=native) and called through ctypes; lightning_mrs/ops/torch_kernels.py holds
// the same maths in plain torch (the reference the tests compare against).
//
// Why hand-written: the backward of MRSNorm needs, per group, c = sum_k w g x (a row
// reduction), then dx, and dw = sum over groups of g x / S (a column reduction). Inductor
// emits the column reduction as a second pass over g and x; here every thread adds its rows
// into its own dw buffer inside the row loop (the layout of ATen's LayerNorm backward), so
// g and x are read from memory once.
//
// Layouts (row-major, dense):
//   *_rows:   (G, L, C), channels contiguous, one S per group of L rows (tokens and NHWC
//             per position: L = 1; NHWC per sample: L = positions).
//   *_sample: (A, C, L), positions contiguous, one S per sample (NCHW per sample).
// Channel c belongs to phasor c / 2. Inputs are float32 or bfloat16, accumulated in float32;
// w2 is the per-channel gain (C,) in float32 or null; rsum holds P * S per group.

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float ld(float v) { return v; }
inline void st(float* p, float v) { *p = v; }

struct bf16 { uint16_t bits; };
inline float ld(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void st(bf16* p, float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    p->bits = static_cast<uint16_t>((u >> 16) | 0x40u);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  p->bits = static_cast<uint16_t>(u >> 16);
}

// Per-thread weight-gradient rows (nt, C), summed into dw (P,) once all rows are done:
// no two threads write the same address, and no second pass over x and g is needed.
class DwBuffers {
 public:
  DwBuffers(bool affine, int nt, int64_t C)
      : nt_(nt), C_(C), acc_(affine ? static_cast<size_t>(nt) * C : 0, 0.f) {}
  // The calling thread's row, or null without a weight.
  float* mine() {
    return acc_.empty() ? nullptr : acc_.data() + static_cast<size_t>(omp_get_thread_num()) * C_;
  }
  // dw[p] = sum over threads of both channels of phasor p; nothing without a weight.
  void reduce(float* dw) const {
    if (acc_.empty()) return;
    for (int64_t p = 0; p < C_ / 2; ++p) {
      float s = 0.f;
      for (int t = 0; t < nt_; ++t) s += acc_[t * C_ + 2 * p] + acc_[t * C_ + 2 * p + 1];
      dw[p] = s;
    }
  }

 private:
  int nt_;
  int64_t C_;
  std::vector<float> acc_;
};

// ---- channels contiguous: G groups of L rows of C, one S per group ----------------------
// kAffine: compiled once with and once without the weight, so that the innermost loops
// carry no branch (w = 1 without a weight, which is exact).
template <typename T, bool kAffine>
void fwd_rows(const T* x, const float* w2, T* y, float* rsum, int64_t G, int64_t L, int64_t C,
              float eps, int nt) {
  const int64_t P = C / 2;
  const float n_pairs = static_cast<float>(P) * static_cast<float>(L);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t a = 0; a < G; ++a) {
    float s = 0.f;  // row by row: short float sums, then their total
    for (int64_t l = 0; l < L; ++l) {
      const T* xr = x + (a * L + l) * C;
      float sr = 0.f;
#pragma omp simd reduction(+ : sr)
      for (int64_t p = 0; p < P; ++p) {
        const float x0 = ld(xr[2 * p]), x1 = ld(xr[2 * p + 1]);
        sr += std::sqrt(x0 * x0 + x1 * x1 + eps);
      }
      s += sr;
    }
    rsum[a] = s;
    const float inv = n_pairs / s;
    for (int64_t l = 0; l < L; ++l) {
      const T* xr = x + (a * L + l) * C;
      T* yr = y + (a * L + l) * C;
#pragma omp simd
      for (int64_t j = 0; j < C; ++j) st(yr + j, ld(xr[j]) * inv * (kAffine ? w2[j] : 1.f));
    }
  }
}

template <typename T, bool kAffine>
void bwd_rows(const T* x, const T* g, const float* w2, const float* rsum, T* dx, float* dw,
              int64_t G, int64_t L, int64_t C, float eps, int nt) {
  const int64_t P = C / 2;
  const float n_pairs = static_cast<float>(P) * static_cast<float>(L);
  DwBuffers dwb(kAffine, nt, C);
#pragma omp parallel num_threads(nt)
  {
    float* my = dwb.mine();
#pragma omp for schedule(static)
    for (int64_t a = 0; a < G; ++a) {
      const float inv_s = n_pairs / rsum[a];
      float c = 0.f;  // sum_k w g x over the group
      for (int64_t l = 0; l < L; ++l) {
        const T* xr = x + (a * L + l) * C;
        const T* gr = g + (a * L + l) * C;
        float cr = 0.f;
#pragma omp simd reduction(+ : cr)
        for (int64_t j = 0; j < C; ++j) cr += (kAffine ? w2[j] : 1.f) * ld(gr[j]) * ld(xr[j]);
        c += cr;
      }
      const float k = c * inv_s * inv_s / n_pairs;  // dx = w g / S - k x / r
      for (int64_t l = 0; l < L; ++l) {
        const T* xr = x + (a * L + l) * C;
        const T* gr = g + (a * L + l) * C;
        T* dr = dx + (a * L + l) * C;
#pragma omp simd
        for (int64_t p = 0; p < P; ++p) {
          const float x0 = ld(xr[2 * p]), x1 = ld(xr[2 * p + 1]);
          const float g0 = ld(gr[2 * p]), g1 = ld(gr[2 * p + 1]);
          const float kr = k / std::sqrt(x0 * x0 + x1 * x1 + eps);
          st(dr + 2 * p, (kAffine ? w2[2 * p] : 1.f) * g0 * inv_s - kr * x0);
          st(dr + 2 * p + 1, (kAffine ? w2[2 * p + 1] : 1.f) * g1 * inv_s - kr * x1);
          if constexpr (kAffine) {
            my[2 * p] += g0 * x0 * inv_s;
            my[2 * p + 1] += g1 * x1 * inv_s;
          }
        }
      }
    }
  }
  dwb.reduce(dw);
}

// ---- positions contiguous, one S per sample --------------------------------------------
template <typename T>
void fwd_sample(const T* x, const float* w2, T* y, float* rsum, int64_t A, int64_t C,
                int64_t L, float eps, int nt) {
  const int64_t P = C / 2;
  const float n_pairs = static_cast<float>(P) * static_cast<float>(L);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t a = 0; a < A; ++a) {
    const T* xa = x + a * C * L;
    T* ya = y + a * C * L;
    float s = 0.f;  // row by row: short float sums, then their total
    for (int64_t p = 0; p < P; ++p) {
      const T* x0 = xa + 2 * p * L;
      const T* x1 = x0 + L;
      float sp = 0.f;
#pragma omp simd reduction(+ : sp)
      for (int64_t l = 0; l < L; ++l) {
        const float u = ld(x0[l]), v = ld(x1[l]);
        sp += std::sqrt(u * u + v * v + eps);
      }
      s += sp;
    }
    rsum[a] = s;
    const float inv = n_pairs / s;
    for (int64_t ch = 0; ch < C; ++ch) {
      const float m = w2 ? inv * w2[ch] : inv;
      const T* xc = xa + ch * L;
      T* yc = ya + ch * L;
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) st(yc + l, ld(xc[l]) * m);
    }
  }
}

template <typename T>
void bwd_sample(const T* x, const T* g, const float* w2, const float* rsum, T* dx, float* dw,
                int64_t A, int64_t C, int64_t L, float eps, int nt) {
  const int64_t P = C / 2;
  const float n_pairs = static_cast<float>(P) * static_cast<float>(L);
  DwBuffers dwb(w2 != nullptr, nt, C);
#pragma omp parallel num_threads(nt)
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
        const T* xc = xa + ch * L;
        const T* gc = ga + ch * L;
        float t = 0.f;
#pragma omp simd reduction(+ : t)
        for (int64_t l = 0; l < L; ++l) t += ld(gc[l]) * ld(xc[l]);
        gxs[ch] = t * inv_s;
        cs += (w2 ? w2[ch] : 1.f) * gxs[ch];
      }
      const float k = cs * inv_s / n_pairs;  // dx = w g / S - k x / r
      for (int64_t p = 0; p < P; ++p) {
        const T* x0 = xa + 2 * p * L;
        const T* x1 = x0 + L;
        const T* g0 = ga + 2 * p * L;
        const T* g1 = g0 + L;
        T* d0 = da + 2 * p * L;
        T* d1 = d0 + L;
        const float m0 = (w2 ? w2[2 * p] : 1.f) * inv_s;
        const float m1 = (w2 ? w2[2 * p + 1] : 1.f) * inv_s;
#pragma omp simd
        for (int64_t l = 0; l < L; ++l) {
          const float u = ld(x0[l]), v = ld(x1[l]);
          const float kr = k / std::sqrt(u * u + v * v + eps);
          st(d0 + l, ld(g0[l]) * m0 - kr * u);
          st(d1 + l, ld(g1[l]) * m1 - kr * v);
        }
      }
      if (my)
        for (int64_t ch = 0; ch < C; ++ch) my[ch] += gxs[ch];
    }
  }
  dwb.reduce(dw);
}

}  // namespace

#define MRS_EXPORT(SUFFIX, T)                                                                \
  extern "C" void mrs_fwd_rows_##SUFFIX(const void* x, const float* w2, void* y, float* rs, \
                                        int64_t G, int64_t L, int64_t C, float eps, int nt) {   \
    (w2 ? fwd_rows<T, true> : fwd_rows<T, false>)(static_cast<const T*>(x), w2,             \
                                                  static_cast<T*>(y), rs, G, L, C, eps, nt); \
  }                                                                                        \
  extern "C" void mrs_bwd_rows_##SUFFIX(const void* x, const void* g, const float* w2,     \
                                        const float* rs, void* dx, float* dw, int64_t G,    \
                                        int64_t L, int64_t C, float eps, int nt) {         \
    (w2 ? bwd_rows<T, true> : bwd_rows<T, false>)(static_cast<const T*>(x),                 \
                                                  static_cast<const T*>(g), w2, rs,        \
                                                  static_cast<T*>(dx), dw, G, L, C, eps, nt); \
  }                                                                                        \
  extern "C" void mrs_fwd_sample_##SUFFIX(const void* x, const float* w2, void* y,          \
                                          float* rs, int64_t A, int64_t C, int64_t L,       \
                                          float eps, int nt) {                             \
    fwd_sample(static_cast<const T*>(x), w2, static_cast<T*>(y), rs, A, C, L, eps, nt);    \
  }                                                                                        \
  extern "C" void mrs_bwd_sample_##SUFFIX(const void* x, const void* g, const float* w2,   \
                                          const float* rs, void* dx, float* dw, int64_t A,  \
                                          int64_t C, int64_t L, float eps, int nt) {       \
    bwd_sample(static_cast<const T*>(x), static_cast<const T*>(g), w2, rs,                 \
               static_cast<T*>(dx), dw, A, C, L, eps, nt);                                 \
  }

MRS_EXPORT(f32, float)
MRS_EXPORT(bf16, bf16)
// No float16 entry: compilers convert _Float16 one element at a time (no F16C vectors from
// plain C++), which measured 2.7x LayerNorm's time; float16 goes to the Inductor kernels.
