// One-pass CPU kernels of the fused MRSNorm (docs/method.md#the-fused-forward-and-backward).
//
// Compiled on first use by lightning_mrs/ops/cpu_kernels.py (the system C++ compiler, OpenMP,
// -O3 -march=native) and called through ctypes; lightning_mrs/ops/torch_kernels.py holds
// the same maths in plain torch (the reference the tests compare against). The float <->
// half conversions, the row buffers and the weight-gradient rows are in cpu_half.h; the
// per-sample (NCHW) loops in cpu_sample.h; the row kernels of an AVX2 build in cpu_avx2.h, the
// bfloat16 loops of an AVX512_BF16 build in cpu_avx512.h. This file: the generic row loops and
// which kernels each dtype runs (the exported entry points).
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
#include "cpu_sample.h"

namespace {

using namespace mrs;

// ---- channels contiguous: G groups of L rows of C, one S per group ----------------------
// Half rows go through float32 buffers kBlock values at a time (cpu_half.h).
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
  const std::unique_ptr<float[]> w2 = per_channel(kAffine ? w : nullptr, C);
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
          const float* wc = kAffine ? w2.get() + j0 : nullptr;
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
