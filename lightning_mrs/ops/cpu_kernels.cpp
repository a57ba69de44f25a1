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
// Channel c belongs to phasor c / 2. Inputs are float32, bfloat16 or float16, accumulated in
// float32. The weight is the per-phasor gain (P,) as the caller holds it (float32, bfloat16
// or float16: wkind 1, 2, 3; 0 = no weight), read as float32. rsum receives P * S per group
// (may be null: inference needs no backward); dw (P,) float32 may be null (no weight gradient).
// nt is the number of threads (the caller gives 1 for small inputs: a thread team costs more
// than the work).

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

inline float as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float ld(float v) { return v; }
inline void st(float* p, float v) { *p = v; }

struct bf16 { uint16_t bits; };
inline float ld(bf16 v) { return as_float(static_cast<uint32_t>(v.bits) << 16); }
inline void st(bf16* p, float f) {  // round to nearest even, NaN stays NaN
  uint32_t u = as_uint(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  p->bits = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// IEEE half by integer maths without branches, so that the loops vectorise (plain C++
// conversions of _Float16 compile to one scalar vcvtph2ps per element; F16C intrinsics
// would tie the source to x86). F. Giesen's "half <-> float" conversions, round to nearest
// even like torch's.
struct f16 { uint16_t bits; };
inline float ld(f16 v) {
  const uint32_t h = v.bits;
  const uint32_t em = h & 0x7fffu;
  // exponent and mantissa moved into place, rebiased by a multiply (exact, subnormals too)
  uint32_t u = as_uint(as_float(em << 13) * 0x1p112f);
  u |= em >= 0x7c00u ? 0x7f800000u : 0u;  // inf / NaN keep their mantissa
  return as_float(u | ((h & 0x8000u) << 16));
}
inline void st(f16* p, float f) {
  uint32_t u = as_uint(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  const uint32_t normal = (u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13;  // rebias, round, shift
  const uint32_t sub = as_uint(as_float(u) + 0.5f) - 0x3f000000u;      // the FPU rounds subnormals
  uint32_t o = u < 0x38800000u ? sub : normal;
  o = u >= 0x47800000u ? (u > 0x7f800000u ? 0x7e00u : 0x7c00u) : o;    // overflow: inf; NaN: qNaN
  p->bits = static_cast<uint16_t>(o | sign);
}

// The weight (P,) as float32: the caller's pointer for float32, else converted into buf.
const float* weight_f32(const void* w, int wkind, int64_t P, std::vector<float>& buf) {
  if (wkind == 0) return nullptr;
  if (wkind == 1) return static_cast<const float*>(w);
  buf.resize(P);
  if (wkind == 2)
    for (int64_t p = 0; p < P; ++p) buf[p] = ld(static_cast<const bf16*>(w)[p]);
  else
    for (int64_t p = 0; p < P; ++p) buf[p] = ld(static_cast<const f16*>(w)[p]);
  return buf.data();
}

// Per-thread weight-gradient rows (nt, P), summed into dw (P,) once all rows are done:
// no two threads write the same address, and no second pass over x and g is needed.
class DwBuffers {
 public:
  DwBuffers(bool on, int nt, int64_t P) : nt_(nt), P_(P), acc_(on ? static_cast<size_t>(nt) * P : 0, 0.f) {}
  // The calling thread's row, or null without a weight gradient.
  float* mine() {
    return acc_.empty() ? nullptr : acc_.data() + static_cast<size_t>(omp_get_thread_num()) * P_;
  }
  void reduce(float* dw) const {
    if (acc_.empty()) return;
    for (int64_t p = 0; p < P_; ++p) {
      float s = 0.f;
      for (int t = 0; t < nt_; ++t) s += acc_[t * P_ + p];
      dw[p] = s;
    }
  }

 private:
  int nt_;
  int64_t P_;
  std::vector<float> acc_;
};

// A row of T as float32: the row itself for float, else converted into buf by a contiguous
// loop (which vectorises for every T); the pair loops of the row kernels then read float32
// alone (with the half conversions inside those stride-2 loops, float16 ran scalar).
template <typename T>
inline const float* row_f32(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) buf[j] = ld(src[j]);
    return buf;
  }
}
// Where a row kernel writes its float32 result: the output row itself for float, else buf.
template <typename T>
inline float* out_f32(T* dst, float* buf) {
  if constexpr (std::is_same_v<T, float>) return dst;
  else return buf;
}
// The result of out_f32 stored into the output row (nothing to do for float).
template <typename T>
inline void flush(const float* buf, T* dst, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) st(dst + j, buf[j]);
  }
}
// Per-thread float32 rows for the conversions (empty for float).
template <typename T>
inline std::vector<float> scratch(int64_t n) {
  return std::vector<float>(std::is_same_v<T, float> ? 0 : n);
}

// ---- channels contiguous: G groups of L rows of C, one S per group ----------------------
// kAffine (and kDw): compiled with and without the weight (its gradient), so that the
// innermost loops carry no branch (w = 1 without a weight, which is exact).
template <typename T, bool kAffine>
void fwd_rows(const T* x, const float* w, T* y, float* rsum, int64_t G, int64_t L, int64_t C,
              float eps, int nt) {
  const int64_t P = C / 2;
  const float n_pairs = static_cast<float>(P) * static_cast<float>(L);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    std::vector<float> xb = scratch<T>(C), yb = scratch<T>(C);
#pragma omp for schedule(static)
    for (int64_t a = 0; a < G; ++a) {
      float s = 0.f;  // row by row: short float sums, then their total
      for (int64_t l = 0; l < L; ++l) {
        const float* xr = row_f32(x + (a * L + l) * C, xb.data(), C);
        float sr = 0.f;
#pragma omp simd reduction(+ : sr)
        for (int64_t p = 0; p < P; ++p) {
          const float x0 = xr[2 * p], x1 = xr[2 * p + 1];
          sr += std::sqrt(x0 * x0 + x1 * x1 + eps);
        }
        s += sr;
      }
      if (rsum) rsum[a] = s;
      const float inv = n_pairs / s;
      for (int64_t l = 0; l < L; ++l) {
        // one row per group (L = 1, tokens): the row converted above is still in the buffer
        const float* xr = row_f32(x + (a * L + l) * C, xb.data(), L == 1 ? 0 : C);
        T* yd = y + (a * L + l) * C;
        float* yr = out_f32(yd, yb.data());
#pragma omp simd
        for (int64_t p = 0; p < P; ++p) {
          const float m = kAffine ? inv * w[p] : inv;
          yr[2 * p] = xr[2 * p] * m;
          yr[2 * p + 1] = xr[2 * p + 1] * m;
        }
        flush(yr, yd, C);
      }
    }
  }
}

template <typename T, bool kAffine, bool kDw>
void bwd_rows(const T* x, const T* g, const float* w, const float* rsum, T* dx, float* dw,
              int64_t G, int64_t L, int64_t C, float eps, int nt) {
  const int64_t P = C / 2;
  const float n_pairs = static_cast<float>(P) * static_cast<float>(L);
  DwBuffers dwb(kDw, nt, P);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    float* my = dwb.mine();
    std::vector<float> xb = scratch<T>(C), gb = scratch<T>(C), db = scratch<T>(C);
#pragma omp for schedule(static)
    for (int64_t a = 0; a < G; ++a) {
      const float inv_s = n_pairs / rsum[a];
      float c = 0.f;  // sum_k w g x over the group
      for (int64_t l = 0; l < L; ++l) {
        const float* xr = row_f32(x + (a * L + l) * C, xb.data(), C);
        const float* gr = row_f32(g + (a * L + l) * C, gb.data(), C);
        float cr = 0.f;
#pragma omp simd reduction(+ : cr)
        for (int64_t p = 0; p < P; ++p) {
          const float gx = gr[2 * p] * xr[2 * p] + gr[2 * p + 1] * xr[2 * p + 1];
          cr += kAffine ? w[p] * gx : gx;
        }
        c += cr;
      }
      const float k = c * inv_s * inv_s / n_pairs;  // dx = w g / S - k x / r
      for (int64_t l = 0; l < L; ++l) {
        // one row per group (L = 1, tokens): the rows converted above are still in the buffers
        const int64_t n = L == 1 ? 0 : C;
        const float* xr = row_f32(x + (a * L + l) * C, xb.data(), n);
        const float* gr = row_f32(g + (a * L + l) * C, gb.data(), n);
        T* dd = dx + (a * L + l) * C;
        float* dr = out_f32(dd, db.data());
#pragma omp simd
        for (int64_t p = 0; p < P; ++p) {
          const float x0 = xr[2 * p], x1 = xr[2 * p + 1];
          const float g0 = gr[2 * p], g1 = gr[2 * p + 1];
          const float kr = k / std::sqrt(x0 * x0 + x1 * x1 + eps);
          const float m = kAffine ? w[p] * inv_s : inv_s;
          dr[2 * p] = g0 * m - kr * x0;
          dr[2 * p + 1] = g1 * m - kr * x1;
          if constexpr (kDw) my[p] += (g0 * x0 + g1 * x1) * inv_s;
        }
        flush(dr, dd, C);
      }
    }
  }
  dwb.reduce(dw);
}

// ---- positions contiguous, one S per sample --------------------------------------------
template <typename T>
void fwd_sample(const T* x, const float* w, T* y, float* rsum, int64_t A, int64_t C,
                int64_t L, float eps, int nt) {
  const int64_t P = C / 2;
  const float n_pairs = static_cast<float>(P) * static_cast<float>(L);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
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
    if (rsum) rsum[a] = s;
    const float inv = n_pairs / s;
    for (int64_t ch = 0; ch < C; ++ch) {
      const float m = w ? inv * w[ch / 2] : inv;
      const T* xc = xa + ch * L;
      T* yc = ya + ch * L;
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) st(yc + l, ld(xc[l]) * m);
    }
  }
}

template <typename T>
void bwd_sample(const T* x, const T* g, const float* w, const float* rsum, T* dx, float* dw,
                int64_t A, int64_t C, int64_t L, float eps, int nt) {
  const int64_t P = C / 2;
  const float n_pairs = static_cast<float>(P) * static_cast<float>(L);
  DwBuffers dwb(dw != nullptr, nt, P);
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
        const T* xc = xa + ch * L;
        const T* gc = ga + ch * L;
        float t = 0.f;
#pragma omp simd reduction(+ : t)
        for (int64_t l = 0; l < L; ++l) t += ld(gc[l]) * ld(xc[l]);
        gxs[ch] = t * inv_s;
        cs += (w ? w[ch / 2] : 1.f) * gxs[ch];
      }
      const float k = cs * inv_s / n_pairs;  // dx = w g / S - k x / r
      for (int64_t p = 0; p < P; ++p) {
        const T* x0 = xa + 2 * p * L;
        const T* x1 = x0 + L;
        const T* g0 = ga + 2 * p * L;
        const T* g1 = g0 + L;
        T* d0 = da + 2 * p * L;
        T* d1 = d0 + L;
        const float m = (w ? w[p] : 1.f) * inv_s;
#pragma omp simd
        for (int64_t l = 0; l < L; ++l) {
          const float u = ld(x0[l]), v = ld(x1[l]);
          const float kr = k / std::sqrt(u * u + v * v + eps);
          st(d0 + l, ld(g0[l]) * m - kr * u);
          st(d1 + l, ld(g1[l]) * m - kr * v);
        }
      }
      if (my)
        for (int64_t p = 0; p < P; ++p) my[p] += gxs[2 * p] + gxs[2 * p + 1];
    }
  }
  dwb.reduce(dw);
}

}  // namespace

// The exported entry points, one set per input dtype; w / wkind as in the header.
#define MRS_EXPORT(SUFFIX, T)                                                                   \
  extern "C" void mrs_fwd_rows_##SUFFIX(const void* x, const void* w, int wkind, void* y,      \
                                        float* rs, int64_t G, int64_t L, int64_t C, float eps,  \
                                        int nt) {                                               \
    std::vector<float> buf;                                                                     \
    const float* wf = weight_f32(w, wkind, C / 2, buf);                                         \
    (wf ? fwd_rows<T, true> : fwd_rows<T, false>)(static_cast<const T*>(x), wf,                \
                                                  static_cast<T*>(y), rs, G, L, C, eps, nt);    \
  }                                                                                             \
  extern "C" void mrs_bwd_rows_##SUFFIX(const void* x, const void* g, const void* w, int wkind, \
                                        const float* rs, void* dx, float* dw, int64_t G,        \
                                        int64_t L, int64_t C, float eps, int nt) {              \
    std::vector<float> buf;                                                                     \
    const float* wf = weight_f32(w, wkind, C / 2, buf);                                         \
    auto fn = !wf ? bwd_rows<T, false, false> : dw ? bwd_rows<T, true, true> : bwd_rows<T, true, false>; \
    fn(static_cast<const T*>(x), static_cast<const T*>(g), wf, rs, static_cast<T*>(dx), dw, G, \
       L, C, eps, nt);                                                                          \
  }                                                                                             \
  extern "C" void mrs_fwd_sample_##SUFFIX(const void* x, const void* w, int wkind, void* y,    \
                                          float* rs, int64_t A, int64_t C, int64_t L,           \
                                          float eps, int nt) {                                  \
    std::vector<float> buf;                                                                     \
    const float* wf = weight_f32(w, wkind, C / 2, buf);                                         \
    fwd_sample(static_cast<const T*>(x), wf, static_cast<T*>(y), rs, A, C, L, eps, nt);        \
  }                                                                                             \
  extern "C" void mrs_bwd_sample_##SUFFIX(const void* x, const void* g, const void* w,         \
                                          int wkind, const float* rs, void* dx, float* dw,      \
                                          int64_t A, int64_t C, int64_t L, float eps, int nt) { \
    std::vector<float> buf;                                                                     \
    const float* wf = weight_f32(w, wkind, C / 2, buf);                                         \
    bwd_sample(static_cast<const T*>(x), static_cast<const T*>(g), wf, rs,                      \
               static_cast<T*>(dx), wf ? dw : nullptr, A, C, L, eps, nt);                       \
  }

MRS_EXPORT(f32, float)
MRS_EXPORT(bf16, bf16)
MRS_EXPORT(f16, f16)
