// The C++ row kernels as torch operators: what a compiled graph calls for the op's fast path.
//
// A compiled graph (torch.compile) that normalises contiguous channels-last CPU tokens calls
// lightning_mrs::rows_forward and lightning_mrs::rows_backward (library.py chooses them when
// tracing, where the eager call would run RowsPlan). Their CPU kernels below check the call,
// allocate the outputs and call cpu_kernels.cpp's row kernels, with no Python on the way: the
// Python body of the general ops cost 42 us a forward and 49 us a backward call inside a
// compiled Llama step (docs/performance-lm.md#the-compiled-paths-dispatch-in-c-a-third-fix).
//
// The row kernels live in the library cpu_kernels.py builds (one per kernel set); this file only
// holds their addresses, which cpu_torch_ops.py sets through mrs_set_row_kernels whenever the
// kernel set in use changes (cpu_kernels.using), so every call runs the set in use, as eager
// calls do. Built against torch's headers by cpu_torch_ops.py (C++20, like torch itself).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <tuple>

namespace {

// cpu_kernels.cpp's mrs_fwd_rows_* and mrs_bwd_rows_* (w / wkind: the weight and its dtype)
using FwdFn = void (*)(const void* x, const void* w, int wkind, void* y, float* rs, int64_t G,
                       int64_t L, int64_t C, float eps, int nt);
using BwdFn = void (*)(const void* x, const void* g, const void* w, int wkind, const float* rs,
                       void* dx, float* dw, int64_t G, int64_t L, int64_t C, float eps, int nt);

// one entry per input dtype: float32, bfloat16, float16
std::atomic<FwdFn> g_fwd[3] = {};
std::atomic<BwdFn> g_bwd[3] = {};
std::atomic<int64_t> g_min_numel_per_thread{1 << 15};

int dtype_index(at::ScalarType t, const char* op, const char* what) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default:
      TORCH_CHECK(false, "lightning_mrs::", op, ": ", what, " must be float32, bfloat16 or float16, not ", t);
  }
}

// The threads for numel elements, as cpu_kernels.threads() counts them.
int threads(int64_t numel) {
  const int64_t per = g_min_numel_per_thread.load(std::memory_order_relaxed);
  if (numel < 2 * per) return 1;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), numel / per)));
}

// What a call of either op hands the kernels, after the checks both share.
struct Rows {
  int64_t C, G;        // channels, groups (one S per row)
  const void* w;       // the weight, or null
  int wkind;           // its dtype as cpu_kernels.py's _WKIND (0: none)
};

Rows rows_of(const at::Tensor& x, const std::optional<at::Tensor>& weight, const char* op) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "lightning_mrs::", op,
              ": x must be a contiguous tensor with the channels in its last dim (got strides ",
              x.strides(), "); call lightning_mrs.mrs_norm, which handles every layout");
  const int64_t C = x.size(-1);
  TORCH_CHECK(C > 0 && C % 2 == 0, "lightning_mrs::", op, ": the last dim must hold an even number of channels, not ", C);
  if (!weight.has_value()) return {C, x.numel() / C, nullptr, 0};
  const at::Tensor& w = *weight;
  TORCH_CHECK(w.dim() == 1 && w.numel() == C / 2 && w.is_contiguous() && w.device() == x.device(),
              "lightning_mrs::", op, ": the weight must be a contiguous (C // 2,) = (", C / 2,
              ",) tensor on x's device, not ", w.sizes(), " on ", w.device());
  return {C, x.numel() / C, w.const_data_ptr(), 1 + dtype_index(w.scalar_type(), op, "the weight")};
}

template <typename Fn>
Fn loaded(const std::atomic<Fn>* table, int k, const char* op) {
  Fn fn = table[k].load(std::memory_order_acquire);
  TORCH_CHECK(fn != nullptr, "lightning_mrs::", op,
              ": the C++ row kernels are not loaded in this process (lightning_mrs.ops.cpu_torch_ops.load() "
              "loads them; cpu_kernels.build_error() says why they could not be built)");
  return fn;
}

// (y, r_sum): y like x, r_sum = P * S per row, float32 (groups,).
std::tuple<at::Tensor, at::Tensor> rows_forward(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                                double eps) {
  const int k = dtype_index(x.scalar_type(), "rows_forward", "x");
  const Rows r = rows_of(x, weight, "rows_forward");
  at::Tensor y = at::empty_like(x);
  at::Tensor r_sum = at::empty({r.G}, x.options().dtype(at::kFloat));  // (groups,)
  if (r.G == 0) return {y, r_sum};
  loaded(g_fwd, k, "rows_forward")(x.const_data_ptr(), r.w, r.wkind, y.mutable_data_ptr(),
                                   r_sum.mutable_data_ptr<float>(), r.G, 1, r.C, static_cast<float>(eps),
                                   threads(x.numel()));
  return {y, r_sum};
}

// (dx, dw) for the upstream gradient grad: dx like x, dw like the weight (an empty tensor in x's
// dtype when no weight gradient is asked for: an operator cannot return None).
std::tuple<at::Tensor, at::Tensor> rows_backward(const at::Tensor& grad, const at::Tensor& x,
                                                 const std::optional<at::Tensor>& weight, const at::Tensor& r_sum,
                                                 double eps, bool need_weight_grad) {
  const int k = dtype_index(x.scalar_type(), "rows_backward", "x");
  const Rows r = rows_of(x, weight, "rows_backward");
  TORCH_CHECK(grad.sizes() == x.sizes(), "lightning_mrs::rows_backward: grad must have x's shape ", x.sizes(),
              ", not ", grad.sizes());
  TORCH_CHECK(r_sum.scalar_type() == at::kFloat && r_sum.is_contiguous() && r_sum.numel() == r.G,
              "lightning_mrs::rows_backward: r_sum must be rows_forward's contiguous float32 (", r.G, ",), not ",
              r_sum.scalar_type(), " ", r_sum.sizes());
  // a hook or a loss may hand back another dtype or a layout of its own
  const at::Tensor g = (grad.scalar_type() == x.scalar_type() ? grad : grad.to(x.scalar_type())).contiguous();
  at::Tensor dx = at::empty_like(x);
  const bool with_dw = need_weight_grad && weight.has_value();
  at::Tensor dw = at::empty({with_dw ? r.C / 2 : 0}, x.options().dtype(with_dw ? at::kFloat : x.scalar_type()));
  if (r.G > 0) {
    loaded(g_bwd, k, "rows_backward")(x.const_data_ptr(), g.const_data_ptr(), r.w, r.wkind,
                                      r_sum.const_data_ptr<float>(), dx.mutable_data_ptr(),
                                      with_dw ? dw.mutable_data_ptr<float>() : nullptr, r.G, 1, r.C,
                                      static_cast<float>(eps), threads(x.numel()));
  } else if (with_dw) {
    dw.zero_();
  }
  if (with_dw && weight->scalar_type() != at::kFloat) dw = dw.to(weight->scalar_type());
  return {dx, dw};
}

}  // namespace

// The kernels of the set in use (cpu_torch_ops.py): float32, bfloat16, float16 forward and
// backward row kernels, and cpu_kernels.MIN_NUMEL_PER_THREAD.
extern "C" void mrs_set_row_kernels(void* const* fwd, void* const* bwd, int64_t min_numel_per_thread) {
  for (int k = 0; k < 3; ++k) {
    g_fwd[k].store(reinterpret_cast<FwdFn>(fwd[k]), std::memory_order_release);
    g_bwd[k].store(reinterpret_cast<BwdFn>(bwd[k]), std::memory_order_release);
  }
  g_min_numel_per_thread.store(min_numel_per_thread, std::memory_order_relaxed);
}

TORCH_LIBRARY_FRAGMENT(lightning_mrs, m) {
  m.def("rows_forward(Tensor x, Tensor? weight, float eps) -> (Tensor, Tensor)");
  m.def("rows_backward(Tensor grad, Tensor x, Tensor? weight, Tensor r_sum, float eps, bool need_weight_grad) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(lightning_mrs, CPU, m) {
  m.impl("rows_forward", &rows_forward);
  m.impl("rows_backward", &rows_backward);
}
