// Float <-> bfloat16 / float16 conversions of the CPU kernels, the float32 row buffers they
// convert through, the weight as float32 and the per-thread weight-gradient rows.
#pragma once

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <omp.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace mrs {

// Half rows go through float32 buffers kBlock values at a time (whole buffers of a 4096-wide row
// left L1 and doubled the backward's time per byte); a row of at most kBlock channels is one
// block, converted once for both passes. Float rows are read in place.
constexpr int64_t kBlock = 512;  // even: a block holds whole pairs

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
// conversions of _Float16 compile to one scalar vcvtph2ps per element): every CPU, and the
// tails of the x86 conversions below. F. Giesen's "half <-> float" conversions, round to
// nearest even like torch's.
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

// float16 with the x86 conversion instructions where the compiler may use them (-march=native on
// a CPU with F16C or AVX-512; one instruction per 8 or 16 values, rounding to nearest even like st):
// the vectors of cpu_avx2.h / cpu_avx512.h and the first values of a row here (ld / st do the rest).
#if defined(__F16C__) || defined(__AVX512F__)
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
inline __m256 load8(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store8(f16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, kRound)); }
#endif
#if defined(__AVX512F__)
inline __m512 load16(const f16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void store16(f16* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, kRound)); }
#endif
inline int64_t f16_to_f32_simd([[maybe_unused]] const f16* src, [[maybe_unused]] float* dst, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(dst + j, load16(src + j));
#elif defined(__F16C__)
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dst + j, load8(src + j));
#endif
  return j;
}
inline int64_t f32_to_f16_simd([[maybe_unused]] const float* src, [[maybe_unused]] f16* dst, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) store16(dst + j, _mm512_loadu_ps(src + j));
#elif defined(__F16C__)
  for (; j + 8 <= n; j += 8) store8(dst + j, _mm256_loadu_ps(src + j));
#endif
  return j;
}

// bfloat16 stores with AVX512_BF16 (vcvtneps2bf16: nearest even, one instruction per 8 or 16
// values; the integer rounding of st takes about ten), unless the "generic" kernel set asks for st
// alone. Every CPU with AVX512_BF16 has AVX512DQ and AVX512VL.
#if defined(__AVX512BF16__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && !defined(MRS_KERNELS_GENERIC)
#define MRS_AVX512_BF16 1
// v's floats through st one at a time: the exact rounding (a NaN quieted with its sign and
// payload), for a vector holding a subnormal, which the instruction flushes to zero.
template <typename V>
inline void st_each(bf16* p, V v) {
  constexpr int n = sizeof(V) / sizeof(float);
  alignas(64) float f[n];
  std::memcpy(f, &v, sizeof(V));
  for (int i = 0; i < n; ++i) st(p + i, f[i]);
}
// 16 (8) floats as bfloat16 at p, exactly as st would store them; the subnormal test is one
// vfpclassps (0x20: the denormal class; an integer test took 20 % of a bfloat16 row forward).
inline void store16(bf16* p, __m512 v) {
  if (_mm512_fpclass_ps_mask(v, 0x20) != 0) [[unlikely]] return st_each(p, v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store8(bf16* p, __m256 v) {
  if (_mm256_fpclass_ps_mask(v, 0x20) != 0) [[unlikely]] return st_each(p, v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), (__m128i)_mm256_cvtneps_pbh(v));
}
#endif
// The first values of a float32 row as bfloat16 with store16; returns how many (0 without it).
inline int64_t f32_to_bf16_simd([[maybe_unused]] const float* src, [[maybe_unused]] bf16* dst,
                                 [[maybe_unused]] int64_t n) {
  int64_t j = 0;
#if defined(MRS_AVX512_BF16)
  for (; j + 16 <= n; j += 16) store16(dst + j, _mm512_loadu_ps(src + j));
#endif
  return j;
}

// A row of T as float32: the row itself for float, else converted into buf by contiguous
// loops (which vectorise for every T); the pair loops of the row kernels then read float32
// alone (with the half conversions inside those stride-2 loops, float16 ran scalar).
template <typename T>
inline const float* row_f32(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    int64_t j = 0;
    if constexpr (std::is_same_v<T, f16>) j = f16_to_f32_simd(src, buf, n);
#pragma omp simd
    for (int64_t i = j; i < n; ++i) buf[i] = ld(src[i]);
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
    int64_t j = 0;
    if constexpr (std::is_same_v<T, f16>) j = f32_to_f16_simd(buf, dst, n);
    if constexpr (std::is_same_v<T, bf16>) j = f32_to_bf16_simd(buf, dst, n);
#pragma omp simd
    for (int64_t i = j; i < n; ++i) st(dst + i, buf[i]);
  }
}
// Per-thread float32 rows for the conversions (empty for float).
template <typename T>
inline std::vector<float> scratch(int64_t n) {
  return std::vector<float>(std::is_same_v<T, float> ? 0 : n);
}

// The per-phasor gain (P,) spread over the channels (C,), for the row kernels' loops over channels.
// Built on every call, so it must be cheap: no zero fill, and a loop over pairs, which the compiler
// vectorises (it left a loop over channels reading w[c / 2] scalar: 1.5 of the 4.1 us of a
// one-row forward of 4096 channels on an AMD EPYC).
inline std::unique_ptr<float[]> per_channel(const float* w, int64_t C) {
  if (!w) return nullptr;
  std::unique_ptr<float[]> w2(new float[C]);
  float* out = w2.get();
  for (int64_t p = 0; p < C / 2; ++p) out[2 * p] = out[2 * p + 1] = w[p];
  return w2;
}

// The weight (P,) as float32: the caller's pointer for float32, else converted into buf.
inline const float* weight_f32(const void* w, int wkind, int64_t P, std::vector<float>& buf) {
  if (wkind == 0) return nullptr;
  if (wkind == 1) return static_cast<const float*>(w);
  buf.resize(P);
  if (wkind == 2)
    for (int64_t p = 0; p < P; ++p) buf[p] = ld(static_cast<const bf16*>(w)[p]);
  else
    for (int64_t p = 0; p < P; ++p) buf[p] = ld(static_cast<const f16*>(w)[p]);
  return buf.data();
}

// Per-thread weight-gradient rows (nt rows of n), summed into dw once all rows are done: no two
// threads write the same address, no second pass over x and g. The rows are pages apart:
// adjacent ones made the two-thread backward of 2048 x 128 x1.9 slower on an AVX-512 Xeon (the
// prefetchers pulling the other thread's lines; bench_cpu_kernels.py lm_2048x128).
class DwBuffers {
 public:
  static constexpr int64_t kPage = 4096 / sizeof(float);  // floats per 4 KiB page
  DwBuffers(bool on, int nt, int64_t n)
      : nt_(nt), n_(n), stride_(((n + kPage - 1) / kPage + 1) * kPage),  // whole pages, one spare
        acc_(on ? static_cast<size_t>(nt * stride_ + kPage) : 0, 0.f), base_(first_page(acc_)) {}
  DwBuffers(const DwBuffers&) = delete;  // base_ points into acc_
  DwBuffers& operator=(const DwBuffers&) = delete;
  // The calling thread's row, or null without a weight gradient.
  float* mine() { return base_ ? base_ + omp_get_thread_num() * stride_ : nullptr; }
  void reduce(float* dw) const {
    if (!base_) return;
    for (int64_t p = 0; p < n_; ++p) {
      float s = 0.f;
      for (int t = 0; t < nt_; ++t) s += base_[t * stride_ + p];
      dw[p] = s;
    }
  }

 private:
  static float* first_page(std::vector<float>& acc) {  // the buffer's first page boundary
    if (acc.empty()) return nullptr;
    const auto misalign = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(acc.data()) % 4096 / sizeof(float));
    return acc.data() + (misalign ? kPage - misalign : 0);
  }
  int nt_;
  int64_t n_, stride_;
  std::vector<float> acc_;  // never resized: base_ points into it
  float* base_;
};

}  // namespace mrs
