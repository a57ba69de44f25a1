// The CPU kernels of the operators lightning_mrs::mrs_norm_fwd and mrs_norm_bwd (defined in
// library.py): one-pass kernels of the fused MRSNorm (docs/method.md#the-fused-forward-and-backward).
//
// Built and imported as `lightning_mrs_cpu` by cpu_kernels.py (see its docstring). Conversions and
// buffers: cpu_half.h; per-sample kernels: cpu_sample.h; vector row kernels: cpu_rows.h, over the
// vector types of cpu_avx2.h / cpu_avx512.h. Here: the generic row loops, which kernels each dtype
// runs, and the operators.
//
// Why hand-written: the backward of MRSNorm needs, per group, c = sum_k w g x (a row
// reduction), then dx, and dw = sum over groups of g x / S (a column reduction). Inductor
// emits the column reduction as a second pass over g and x; here every thread adds its rows
// into its own dw buffer inside the row loop (the layout of ATen's LayerNorm backward), so
// g and x are read from memory once.
//
// Layouts, read in the tensor's own memory (dense):
//   rows:   (G, L, C), channels contiguous, one S per group of L rows (tokens and NHWC
//           per position: L = 1; NHWC per sample: L = positions).
//   sample: (A, C, L), positions contiguous, one S per sample (NCHW per sample).
// Channel c belongs to phasor c / 2. Inputs are float32, bfloat16 or float16, accumulated in
// float32; the per-phasor weight (P,) is read as float32. rsum receives P * S per group; dw (P,)
// float32 may be null (no weight gradient). nt is the number of threads (1 for small inputs: a
// thread team costs more than the work).

#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_avx2.h"
#include "cpu_avx512.h"
#include "cpu_half.h"
#include "cpu_rows.h"
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

// Which kernels a dtype runs, for rows and per sample alike (MRS_SIMD): the kernels of cpu_rows.h
// and cpu_sample.h over cpu_avx512.h's V16 on an AVX512_BF16 build under "auto", for every dtype
// (faster than both others on an AVX-512 Xeon: docs/performance-lm.md#avx-512-row-kernels); else
// over cpu_avx2.h's V8 for every dtype without AVX-512 (or with the "avx2" set), and on AVX-512 for
// float16 only, where the generic loops lose to F16C in registers while their float32 and bfloat16
// code beats 8 lanes (docs/performance-lm.md#parity-on-an-avx-512-cpu); else the generic loops.
#if defined(MRS_AVX2) && (defined(MRS_KERNELS_AVX2) || !defined(__AVX512F__))
template <typename T>
constexpr bool kAvx2 = true;
#elif defined(MRS_AVX2)
template <typename T>
constexpr bool kAvx2 = std::is_same_v<T, f16>;
#else
template <typename T>
constexpr bool kAvx2 = false;
#endif
#if defined(MRS_AVX512_BF16) && !defined(MRS_KERNELS_AVX2)
constexpr bool kAvx512 = true;
#define MRS_SIMD(T, fn, ...) (&mrs::simd::fn<mrs::avx512::V16, __VA_ARGS__>)
#elif defined(MRS_AVX2)
constexpr bool kAvx512 = false;
#define MRS_SIMD(T, fn, ...) (kAvx2<T> ? &mrs::simd::fn<mrs::avx2::V8, __VA_ARGS__> : &fn<__VA_ARGS__>)
#else
constexpr bool kAvx512 = false;
#define MRS_SIMD(T, fn, ...) (&fn<__VA_ARGS__>)
#endif

// Which kernels this build runs (cpu_kernels.py: loaded_kernels): 1 = the generic loops, 2 =
// cpu_avx2.h's, 3 = cpu_avx2.h's for float16 and the generic loops for the others, 4 = cpu_avx512.h's.
int mrs_kernel_set() {
  if (kAvx512) return 4;
  if (kAvx2<float> && kAvx2<bf16>) return 2;
  if (kAvx2<f16>) return 3;
  return 1;
}

// Elements per thread below which a call runs on one thread: waking an OpenMP team costs
// microseconds, more than normalising a few thousand values (settable for tests).
std::atomic<int64_t> g_min_numel_per_thread{1 << 15};

int threads(int64_t numel) {
  const int64_t per = g_min_numel_per_thread.load(std::memory_order_relaxed);
  if (numel < 2 * per) return 1;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), numel / per)));
}

int dtype_index(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: return -1;
  }
}

int wkind_of(const void* w, at::ScalarType t) { return w ? 1 + dtype_index(t) : 0; }  // weight_f32's: 0 none, 1-3

// The kernel of one dtype and layout, with the weight as float32 (converted from its own dtype
// in a buffer: float32, bfloat16 or float16) and each variant compiled with and without it.
template <typename T>
void forward_kernel(bool rows, const void* x, const void* w, at::ScalarType wt, void* y, float* rs, int64_t a,
                    int64_t b, int64_t c, float eps, int nt) {
  std::vector<float> buf;
  const float* wf = weight_f32(w, wkind_of(w, wt), (rows ? c : b) / 2, buf);
  const T* xp = static_cast<const T*>(x);
  T* yp = static_cast<T*>(y);
  if (!rows) return MRS_SIMD(T, fwd_sample, T)(xp, wf, yp, rs, a, b, c, eps, nt);
  (wf ? MRS_SIMD(T, fwd_rows, T, true) : MRS_SIMD(T, fwd_rows, T, false))(xp, wf, yp, rs, a, b, c, eps, nt);
}

template <typename T>
void backward_kernel(bool rows, const void* x, const void* g, const void* w, at::ScalarType wt, const float* rs,
                     void* dx, float* dw, int64_t a, int64_t b, int64_t c, float eps, int nt) {
  std::vector<float> buf;
  const float* wf = weight_f32(w, wkind_of(w, wt), (rows ? c : b) / 2, buf);
  const T *xp = static_cast<const T*>(x), *gp = static_cast<const T*>(g);
  T* dp = static_cast<T*>(dx);
  if (!rows) return MRS_SIMD(T, bwd_sample, T)(xp, gp, wf, rs, dp, wf ? dw : nullptr, a, b, c, eps, nt);
  auto fn = !wf ? MRS_SIMD(T, bwd_rows, T, false, false)
            : dw ? MRS_SIMD(T, bwd_rows, T, true, true) : MRS_SIMD(T, bwd_rows, T, true, false);
  fn(xp, gp, wf, rs, dp, dw, a, b, c, eps, nt);
}

// x's memory as the kernels read it: rows (G, L, C) or per sample (A, C, L).
struct View {
  int dtype;
  bool rows;
  int64_t a, b, c;  // (G, L, C) or (A, C, L)
};

View view_of(const at::Tensor& x, int64_t channel_dim, bool spatial, const char* op) {
  const int k = dtype_index(x.scalar_type());
  TORCH_CHECK(k >= 0, "lightning_mrs::", op, ": x must be float32, bfloat16 or float16, not ", x.scalar_type());
  TORCH_CHECK(channel_dim >= 0 && channel_dim < x.dim() && x.size(channel_dim) % 2 == 0 && x.size(channel_dim) > 0,
              "lightning_mrs::", op, ": channel_dim ", channel_dim, " of shape ", x.sizes(), " must hold an even number of channels");
  const int64_t n = x.numel(), C = x.size(channel_dim), N = spatial ? x.size(0) : 1;
  if (n == 0) return View{k, true, spatial ? N : 0, 0, C};
  const bool batch_outer = !spatial || N <= 1 || x.stride(0) == n / N;
  const bool dense = x.is_non_overlapping_and_dense();
  if (dense && batch_outer && x.stride(channel_dim) == 1) {
    return spatial ? View{k, true, N, n / (N * C), C} : View{k, true, n / C, 1, C};
  }
  TORCH_CHECK(dense && batch_outer && spatial && channel_dim > 0 && x.stride(channel_dim) == n / (N * C),
              "lightning_mrs::", op, ": the C++ kernels need the channels contiguous, or the positions contiguous "
              "with spatial=True, in a dense tensor (got strides ", x.strides(), "); call lightning_mrs.mrs_norm, "
              "which handles every layout");
  return View{k, false, N, C, n / (N * C)};
}

// The weight as the kernels read it: float32, bfloat16 or float16, contiguous (else a float32
// copy); undefined without a weight.
at::Tensor kernel_weight(const at::Tensor& x, const std::optional<at::Tensor>& weight, int64_t C, const char* op) {
  if (!weight.has_value()) return at::Tensor();
  const at::Tensor& w = *weight;
  TORCH_CHECK(w.dim() == 1 && w.numel() == C / 2 && w.device() == x.device(), "lightning_mrs::", op,
              ": the weight must be a (C // 2,) = (", C / 2, ",) tensor on x's device, not ", w.sizes(), " on ",
              w.device());
  return dtype_index(w.scalar_type()) >= 0 && w.is_contiguous() ? w : w.to(at::kFloat).contiguous();
}

// fn<T>(args...) for the T of dtype index k (float32, bfloat16, float16).
#define MRS_BY_DTYPE(k, fn, ...) \
  (k == 0 ? fn<float>(__VA_ARGS__) : k == 1 ? fn<bf16>(__VA_ARGS__) : fn<f16>(__VA_ARGS__))

// (y, r_sum): y like x, r_sum = P * S per group, float32 (groups,).
std::tuple<at::Tensor, at::Tensor> fwd(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps,
                                       int64_t channel_dim, bool spatial) {
  const View v = view_of(x, channel_dim, spatial, "mrs_norm_fwd");
  const at::Tensor w = kernel_weight(x, weight, x.size(channel_dim), "mrs_norm_fwd");
  at::Tensor y = at::empty_like(x);
  at::Tensor r_sum = at::empty({v.a}, x.options().dtype(at::kFloat));  // (groups,)
  if (x.numel() > 0) {
    MRS_BY_DTYPE(v.dtype, forward_kernel, v.rows, x.const_data_ptr(), w.defined() ? w.const_data_ptr() : nullptr,
                 w.defined() ? w.scalar_type() : at::kFloat, y.mutable_data_ptr(), r_sum.mutable_data_ptr<float>(),
                 v.a, v.b, v.c, static_cast<float>(eps), threads(x.numel()));
  }
  return {y, r_sum};
}

// (dx, dw) for the upstream gradient grad: dx like x, dw like the weight (an empty tensor in x's
// dtype when no weight gradient is asked for: an operator cannot return None).
std::tuple<at::Tensor, at::Tensor> bwd(const at::Tensor& grad, const at::Tensor& x,
                                       const std::optional<at::Tensor>& weight, const at::Tensor& r_sum, double eps,
                                       int64_t channel_dim, bool spatial, bool need_weight_grad) {
  const View v = view_of(x, channel_dim, spatial, "mrs_norm_bwd");
  const at::Tensor w = kernel_weight(x, weight, x.size(channel_dim), "mrs_norm_bwd");
  TORCH_CHECK(grad.sizes() == x.sizes(), "lightning_mrs::mrs_norm_bwd: grad must have x's shape ", x.sizes(),
              ", not ", grad.sizes());
  TORCH_CHECK(r_sum.scalar_type() == at::kFloat && r_sum.is_contiguous() && r_sum.numel() == v.a,
              "lightning_mrs::mrs_norm_bwd: r_sum must be mrs_norm_fwd's contiguous float32 (", v.a, ",), not ",
              r_sum.scalar_type(), " ", r_sum.sizes());
  // the kernels read grad in x's memory order; a hook or a loss may hand back another dtype or layout
  at::Tensor g = grad.scalar_type() == x.scalar_type() ? grad : grad.to(x.scalar_type());
  if (g.strides() != x.strides()) g = at::empty_like(x).copy_(g);
  at::Tensor dx = at::empty_like(x);
  const bool with_dw = need_weight_grad && w.defined();
  at::Tensor dw = at::empty({with_dw ? x.size(channel_dim) / 2 : 0}, x.options().dtype(with_dw ? at::kFloat : x.scalar_type()));
  if (x.numel() > 0) {
    MRS_BY_DTYPE(v.dtype, backward_kernel, v.rows, x.const_data_ptr(), g.const_data_ptr(),
                 w.defined() ? w.const_data_ptr() : nullptr, w.defined() ? w.scalar_type() : at::kFloat,
                 r_sum.const_data_ptr<float>(), dx.mutable_data_ptr(), with_dw ? dw.mutable_data_ptr<float>() : nullptr,
                 v.a, v.b, v.c, static_cast<float>(eps), threads(x.numel()));
  } else if (with_dw) {
    dw.zero_();
  }
  if (with_dw && weight->scalar_type() != at::kFloat) dw = dw.to(weight->scalar_type());
  return {dx, dw};
}

std::unique_ptr<torch::Library> g_registration;  // this build's kernels, while registered

PyObject* activate(PyObject*, PyObject*) {
  if (!g_registration) {
    g_registration = std::make_unique<torch::Library>(torch::Library::IMPL, "lightning_mrs", c10::DispatchKey::CPU,
                                                      __FILE__, __LINE__);
    g_registration->impl("mrs_norm_fwd", &fwd);
    g_registration->impl("mrs_norm_bwd", &bwd);
  }
  Py_RETURN_NONE;
}

PyObject* deactivate(PyObject*, PyObject*) {
  g_registration.reset();
  Py_RETURN_NONE;
}

PyObject* kernel_set(PyObject*, PyObject*) { return PyLong_FromLong(mrs_kernel_set()); }

PyObject* py_threads(PyObject*, PyObject* numel) { return PyLong_FromLong(threads(PyLong_AsLongLong(numel))); }

PyObject* min_numel_per_thread(PyObject*, PyObject* numel) {
  const int64_t n = PyLong_AsLongLong(numel);
  return PyLong_FromLongLong(n > 0 ? g_min_numel_per_thread.exchange(n) : g_min_numel_per_thread.load());
}

PyMethodDef kMethods[] = {
    {"activate", activate, METH_NOARGS, "Register this build's kernels for lightning_mrs::mrs_norm_fwd/bwd on the CPU."},
    {"deactivate", deactivate, METH_NOARGS, "Take this build's CPU kernels back."},
    {"kernel_set", kernel_set, METH_NOARGS, "Which kernels this build runs (cpu_kernels.cpp: mrs_kernel_set)."},
    {"threads", py_threads, METH_O, "The OpenMP threads of a call on this many elements."},
    {"min_numel_per_thread", min_numel_per_thread, METH_O, "Set (n > 0) and return the previous per-thread minimum."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "lightning_mrs_cpu", nullptr, -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit_lightning_mrs_cpu() { return PyModule_Create(&kModule); }
