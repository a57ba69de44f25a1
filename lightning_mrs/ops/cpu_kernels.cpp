// One-pass CPU kernels of the fused MRSNorm (docs/method.md#the-fused-forward-and-backward).
//
// Compiled on first use by lightning_mrs/ops/cpu_kernels.py (the system C++ compiler, OpenMP,
// -O3 -march=native) and called through ctypes; lightning_mrs/ops/torch_kernels.py holds
// the same maths in plain torch (the reference the tests compare against). The float <->
// half conversions, the row buffers and the weight-gradient rows are in cpu_half.h; the row
// kernels of an AVX2 build in cpu_avx2.h, the bfloat16 loops of an AVX512_BF16 build in
// cpu_avx512.h.
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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_avx2.h"
#include "cpu_avx512.h"
#include "cpu_half.h"

namespace {

using namespace mrs;

// ---- channels contiguous: G groups of L rows of C, one S per group ----------------------
// Half rows go through float32 buffers a block of kBlock values at a time: whole buffers of
// a 4096-wide row (x, g and dx: 48 KiB) would not stay in L1 beside the weight and the
// weight-gradient row, and the backward ran at twice float32's time per byte. A row of at
// most kBlock channels is one block, converted once for both passes. Float rows are read in
// place, in one block. The sample kernels convert their float16 rows of positions the same way.
constexpr int64_t kBlock = 512;  // even: a block holds whole pairs
// The block of a row of C channels: float rows need no buffer, and blocks cost them time (each
// block's sum ends in a horizontal add), so they are one block of C.
template <typename T>
constexpr int64_t row_block(int64_t C) {
  return std::is_same_v<T, float> ? C : kBlock;
}

// The generic loops: every build has them; where cpu_avx2.h is built, kAvx2 below says which
// dtypes run its kernels instead.

// kAffine (and kDw): compiled with and without the weight (its gradient), so that the
// innermost loops carry no branch (w = 1 without a weight, which is exact).
template <typename T, bool kAffine>
void fwd_rows(const T* x, const float* w, T* y, float* rsum, int64_t G, int64_t L, int64_t C,
              float eps, int nt) {
  const int64_t P = C / 2;
  const float n_pairs = static_cast<float>(P) * static_cast<float>(L);
  const int64_t blk = row_block<T>(C);
  const bool one_block = L == 1 && C <= blk;  // the buffer still holds the row in pass 2
  // the per-channel gain: the output pass runs over contiguous channels (no stride-2 stores)
  std::vector<float> w2(kAffine ? C : 0);
  if constexpr (kAffine)
    for (int64_t c = 0; c < C; ++c) w2[c] = w[c / 2];
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    std::vector<float> xb = scratch<T>(kBlock), yb = scratch<T>(kBlock);
#pragma omp for schedule(static)
    for (int64_t a = 0; a < G; ++a) {
      float s = 0.f;  // block by block: short float sums, then their total
      for (int64_t l = 0; l < L; ++l) {
        for (int64_t j0 = 0; j0 < C; j0 += blk) {
          const int64_t n = std::min(blk, C - j0);
          const float* xr = row_f32(x + (a * L + l) * C + j0, xb.data(), n);
          float sr = 0.f;
#pragma omp simd reduction(+ : sr)
          for (int64_t p = 0; p < n / 2; ++p) {
            const float x0 = xr[2 * p], x1 = xr[2 * p + 1];
            sr += std::sqrt(x0 * x0 + x1 * x1 + eps);
          }
          s += sr;
        }
      }
      if (rsum) rsum[a] = s;
      const float inv = n_pairs / s;
      for (int64_t l = 0; l < L; ++l) {
        for (int64_t j0 = 0; j0 < C; j0 += blk) {
          const int64_t n = std::min(blk, C - j0);
          const float* xr = row_f32(x + (a * L + l) * C + j0, xb.data(), one_block ? 0 : n);
          const float* wc = kAffine ? w2.data() + j0 : nullptr;
          T* yd = y + (a * L + l) * C + j0;
          if constexpr (std::is_same_v<T, bf16>) {  // rounded straight into the output: integer maths, in place
#pragma omp simd
            for (int64_t c = 0; c < n; ++c) st(yd + c, xr[c] * (kAffine ? inv * wc[c] : inv));
          } else {
            float* yr = out_f32(yd, yb.data());
#pragma omp simd
            for (int64_t c = 0; c < n; ++c) yr[c] = xr[c] * (kAffine ? inv * wc[c] : inv);
            flush(yr, yd, n);
          }
        }
      }
    }
  }
}

template <typename T, bool kAffine, bool kDw>
void bwd_rows(const T* x, const T* g, const float* w, const float* rsum, T* dx, float* dw,
              int64_t G, int64_t L, int64_t C, float eps, int nt) {
  const int64_t P = C / 2;
  const float n_pairs = static_cast<float>(P) * static_cast<float>(L);
  const int64_t blk = row_block<T>(C);
  const bool one_block = L == 1 && C <= blk;  // the buffers still hold the rows in pass 2
  DwBuffers dwb(kDw, nt, P);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    float* my = dwb.mine();
    std::vector<float> xb = scratch<T>(kBlock), gb = scratch<T>(kBlock), db = scratch<T>(kBlock);
#pragma omp for schedule(static)
    for (int64_t a = 0; a < G; ++a) {
      const float inv_s = n_pairs / rsum[a];
      float c = 0.f;  // sum_k w g x over the group
      for (int64_t l = 0; l < L; ++l) {
        for (int64_t j0 = 0; j0 < C; j0 += blk) {
          const int64_t n = std::min(blk, C - j0);
          const float* xr = row_f32(x + (a * L + l) * C + j0, xb.data(), n);
          const float* gr = row_f32(g + (a * L + l) * C + j0, gb.data(), n);
          const float* wb = kAffine ? w + j0 / 2 : nullptr;
          float cr = 0.f;
#pragma omp simd reduction(+ : cr)
          for (int64_t p = 0; p < n / 2; ++p) {
            const float gx = gr[2 * p] * xr[2 * p] + gr[2 * p + 1] * xr[2 * p + 1];
            cr += kAffine ? wb[p] * gx : gx;
          }
          c += cr;
        }
      }
      const float k = c * inv_s * inv_s / n_pairs;  // dx = w g / S - k x / r
      for (int64_t l = 0; l < L; ++l) {
        for (int64_t j0 = 0; j0 < C; j0 += blk) {
          const int64_t n = std::min(blk, C - j0);
          const float* xr = row_f32(x + (a * L + l) * C + j0, xb.data(), one_block ? 0 : n);
          const float* gr = row_f32(g + (a * L + l) * C + j0, gb.data(), one_block ? 0 : n);
          const float* wb = kAffine ? w + j0 / 2 : nullptr;
          float* mb = kDw ? my + j0 / 2 : nullptr;
          T* dd = dx + (a * L + l) * C + j0;
          float* dr = out_f32(dd, db.data());
#pragma omp simd
          for (int64_t p = 0; p < n / 2; ++p) {
            const float x0 = xr[2 * p], x1 = xr[2 * p + 1];
            const float g0 = gr[2 * p], g1 = gr[2 * p + 1];
            const float kr = k / std::sqrt(x0 * x0 + x1 * x1 + eps);
            const float m = kAffine ? wb[p] * inv_s : inv_s;
            dr[2 * p] = g0 * m - kr * x0;
            dr[2 * p + 1] = g1 * m - kr * x1;
            if constexpr (kDw) mb[p] += (g0 * x0 + g1 * x1) * inv_s;
          }
          flush(dr, dd, n);
        }
      }
    }
  }
  dwb.reduce(dw);
}


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

// Which kernels a dtype runs. Without AVX-512 (or with the "avx2" kernel set), cpu_avx2.h's for
// every dtype. On an AVX-512 build, its float16 kernels only: measured on an AVX-512 AMD EPYC
// (docs/performance-lm.md#parity-on-an-avx-512-cpu), the loops above convert float16 one value
// at a time and lose to F16C in registers (ln_2048x4096: x1.06 against x0.82 of nn.LayerNorm),
// while their AVX-512 float32 and bfloat16 code beats the 8-lane kernels (spatial bfloat16: x0.81
// against x1.08 of nn.GroupNorm).
#if defined(MRS_AVX2)
#if defined(MRS_KERNELS_AVX2) || !defined(__AVX512F__)
template <typename T>
constexpr bool kAvx2 = true;
#else
template <typename T>
constexpr bool kAvx2 = std::is_same_v<T, f16>;
#endif
#define MRS_KERNEL(T, fn, ...) (kAvx2<T> ? &mrs::avx2::fn<__VA_ARGS__> : &fn<__VA_ARGS__>)
#else
template <typename T>
constexpr bool kAvx2 = false;
#define MRS_KERNEL(T, fn, ...) (&fn<__VA_ARGS__>)
#endif
// The row kernels (tokens, NHWC) of cpu_avx512.h on an AVX512_BF16 build under the kernel set
// "auto", for every dtype: on an Intel AVX-512 Xeon they beat both cpu_avx2.h's and the loops
// above in float32, bfloat16 and float16 (bench_cpu_kernels.py lm_2048x128 forward+backward,
// ms: 0.085 / 0.095 / 0.095, 0.099 / 0.108 / 0.148, 0.086 / 0.089 / 0.120). The per-sample
// kernels (NCHW) keep the choice of kAvx2.
#if defined(MRS_AVX512_BF16) && !defined(MRS_KERNELS_AVX2)
constexpr bool kAvx512Rows = true;
#define MRS_ROWS(T, fn, ...) (&mrs::simd::fn<mrs::avx512::V16, __VA_ARGS__>)
#else
constexpr bool kAvx512Rows = false;
#define MRS_ROWS(T, fn, ...) MRS_KERNEL(T, fn, __VA_ARGS__)
#endif

}  // namespace

// The exported entry points, one set per input dtype; w / wkind as in the header.
#define MRS_EXPORT(SUFFIX, T)                                                                   \
  extern "C" void mrs_fwd_rows_##SUFFIX(const void* x, const void* w, int wkind, void* y,      \
                                        float* rs, int64_t G, int64_t L, int64_t C, float eps,  \
                                        int nt) {                                               \
    std::vector<float> buf;                                                                     \
    const float* wf = weight_f32(w, wkind, C / 2, buf);                                         \
    (wf ? MRS_ROWS(T, fwd_rows, T, true) : MRS_ROWS(T, fwd_rows, T, false))(                   \
        static_cast<const T*>(x), wf, static_cast<T*>(y), rs, G, L, C, eps, nt);                \
  }                                                                                             \
  extern "C" void mrs_bwd_rows_##SUFFIX(const void* x, const void* g, const void* w, int wkind, \
                                        const float* rs, void* dx, float* dw, int64_t G,        \
                                        int64_t L, int64_t C, float eps, int nt) {              \
    std::vector<float> buf;                                                                     \
    const float* wf = weight_f32(w, wkind, C / 2, buf);                                         \
    auto fn = !wf ? MRS_ROWS(T, bwd_rows, T, false, false)                                      \
              : dw ? MRS_ROWS(T, bwd_rows, T, true, true) : MRS_ROWS(T, bwd_rows, T, true, false); \
    fn(static_cast<const T*>(x), static_cast<const T*>(g), wf, rs, static_cast<T*>(dx), dw, G, \
       L, C, eps, nt);                                                                          \
  }                                                                                             \
  extern "C" void mrs_fwd_sample_##SUFFIX(const void* x, const void* w, int wkind, void* y,    \
                                          float* rs, int64_t A, int64_t C, int64_t L,           \
                                          float eps, int nt) {                                  \
    std::vector<float> buf;                                                                     \
    const float* wf = weight_f32(w, wkind, C / 2, buf);                                         \
    MRS_KERNEL(T, fwd_sample, T)(static_cast<const T*>(x), wf, static_cast<T*>(y), rs, A, C, L, eps, nt); \
  }                                                                                             \
  extern "C" void mrs_bwd_sample_##SUFFIX(const void* x, const void* g, const void* w,         \
                                          int wkind, const float* rs, void* dx, float* dw,      \
                                          int64_t A, int64_t C, int64_t L, float eps, int nt) { \
    std::vector<float> buf;                                                                     \
    const float* wf = weight_f32(w, wkind, C / 2, buf);                                         \
    MRS_KERNEL(T, bwd_sample, T)(static_cast<const T*>(x), static_cast<const T*>(g), wf, rs,    \
               static_cast<T*>(dx), wf ? dw : nullptr, A, C, L, eps, nt);                       \
  }

// Which kernels this build runs (cpu_kernels.py: loaded_kernels): 1 = the generic loops, 2 =
// cpu_avx2.h's, 3 = cpu_avx2.h's for float16 and the generic loops for the others, 4 = the row
// kernels of cpu_avx512.h for every dtype, and for the per-sample kernels as 3 with the bfloat16
// stores of cpu_half.h / cpu_avx512.h (AVX512_BF16; every such CPU has AVX2 and F16C).
extern "C" int mrs_kernel_set() {
  if (kAvx2<float> && kAvx2<bf16>) return 2;
  if (kAvx512Rows) return 4;
  if (kAvx2<f16>) return 3;
  return 1;
}

MRS_EXPORT(f32, float)
MRS_EXPORT(bf16, bf16)
MRS_EXPORT(f16, f16)
