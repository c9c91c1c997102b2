// CPU decode fast path: a whole Llama decoder stack in one call.
//
// Small batches on CPU (decode, speculative verification) are bound by reading the weights
// once per step and, in eager PyTorch, by the dispatch of the ~25 small operators each layer
// runs. This file runs every layer of the stack for M <= a few dozen rows without returning to
// Python: RMSNorm (+ residual), fused QKV, rotary, the paged KV write, attention over the paged
// cache, O projection, gate/up, SiLU-and-mul and down, with matrix products that read each
// weight once for all M rows from a copy packed for them (``pack``) and elementwise steps 16
// lanes at a time, on AVX-512 (vdpbf16ps for bfloat16 where the CPU has AVX-512 BF16) or AVX2
// + FMA machines (elsewhere bfloat16 is widened to fp32 in registers; the same packed layout).
// Values are rounded to the model dtype at the same points as the eager modules in
// models/llama.py and models/layers.py (their reference). Built at first use by
// kernels/cpu_decode.py.

// ATen's tensor, the factories used and pybind11 with torch's tensor casters, not
// <torch/extension.h>: that header (all of torch's C++ API) took 12 s of the compiler's time to
// read, most of each build.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// ---------------------------------------------------------------- element access

inline float ld(const float* p) { return *p; }
inline float ld(const uint16_t* p) {
  uint32_t u = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to the storage type (round to nearest even for bfloat16, as c10::BFloat16 does).
inline void st(float* p, float v) { *p = v; }
inline void st(uint16_t* p, float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if (std::isnan(v)) {
    *p = 0x7FC0;
    return;
  }
  u += 0x7FFF + ((u >> 16) & 1);
  *p = static_cast<uint16_t>(u >> 16);
}
template <typename T>
inline float rnd(float v) {  // v rounded through T
  T t;
  st(&t, v);
  return ld(&t);
}
// The two values of a bfloat16 pair held in one 32-bit word (the even one in the low half).
inline void split_pair(uint32_t bits, float& even, float& odd) {
  const uint32_t e = bits << 16, o = bits & 0xFFFF0000u;
  std::memcpy(&even, &e, 4);
  std::memcpy(&odd, &o, 4);
}

// ---------------------------------------------------------------- 16-lane vectors
//
// V holds 16 fp32 lanes: one __m512 where the build machine has AVX-512 (F, BW), two __m256
// where it has AVX2 and FMA (-march=native decides). Mask: the first n lanes of a load or
// store (the rest load as zero and are not written).

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct V {
  __m512 v;
};
using Mask = __mmask16;
inline Mask first(int64_t n) {
  return n >= 16 ? static_cast<Mask>(0xFFFF) : static_cast<Mask>((1u << n) - 1);
}
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vset(float x) { return {_mm512_set1_ps(x)}; }
inline V vld(const float* p, Mask k) { return {_mm512_maskz_loadu_ps(k, p)}; }
inline V vld(const uint16_t* p, Mask k) {
  const __m256i h = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16(k, p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline V vld_or(const float* p, Mask k, float fill) {  // lanes past k hold fill
  return {_mm512_mask_loadu_ps(_mm512_set1_ps(fill), k, p)};
}
inline V vldu(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstu(float* p, V a) { _mm512_storeu_ps(p, a.v); }
inline V vkeep(V a, Mask k) { return {_mm512_maskz_mov_ps(k, a.v)}; }
inline V vadd(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V vsub(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V vdiv(V a, V b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V vmax(V a, V b) { return {_mm512_max_ps(a.v, b.v)}; }  // b if either is NaN
inline V vmin(V a, V b) { return {_mm512_min_ps(a.v, b.v)}; }
inline V vfmadd(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V vfmsub(V a, V b, V c) { return {_mm512_fmsub_ps(a.v, b.v, c.v)}; }
inline V vfnmadd(V a, V b, V c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
inline float vhsum(V a) { return _mm512_reduce_add_ps(a.v); }
inline float vhmax(V a) { return _mm512_reduce_max_ps(a.v); }
inline V vround(V a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline V vscale2(V p, V n) { return {_mm512_scalef_ps(p.v, n.v)}; }  // p * 2^n
// The bfloat16 bits (round to nearest even, NaN kept) of each lane, in the low 16 bits.
inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r,
                                 _mm512_set1_epi32(0x7FC0));
}
inline void vst(float* p, V a, Mask k) { _mm512_mask_storeu_ps(p, k, a.v); }
inline void vst(uint16_t* p, V a, Mask k) {
  _mm512_mask_storeu_epi16(p, k, _mm512_castsi256_si512(_mm512_cvtepi32_epi16(bf16_bits(a.v))));
}
inline V vbf16(V a) {  // a rounded through bfloat16
  return {_mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(a.v), 16))};
}
#if defined(__AVX512BF16__)
constexpr const char* ISA = "avx512_bf16";
// One K pair of 16 packed bfloat16 outputs (vdpbf16ps operands) and a row's activation pair.
using WPair = __m512bh;
using XPair = __m512bh;
inline WPair wpair(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline XPair xpair(uint32_t bits) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(bits)); }
inline V dot2(V acc, WPair w, XPair x) { return {_mm512_dpbf16_ps(acc.v, w, x)}; }
// Blocks of 16 outputs and rows per tile, by weight type: 6 rows x 4 blocks (24 accumulators
// and 4 weights fit 32 registers).
template <typename T>
constexpr int NB = 4;
template <typename T>
constexpr int R_MAX = 6;
constexpr bool WIDE_X = false;  // vdpbf16ps takes the bfloat16 pair as it is
#else
constexpr const char* ISA = "avx512";
// Without vdpbf16ps: the pair's even and odd halves widened to fp32 (shift / mask), and the
// row's activation pair widened and broadcast.
struct WPair {
  __m512 even, odd;
};
struct XPair {
  __m512 even, odd;
};
inline WPair wpair(const uint16_t* p) {
  const __m512i w = _mm512_loadu_si512(p);
  const __m512i odd_bits = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(w, odd_bits))};
}
inline XPair xpair(uint32_t bits) {
  float even, odd;
  split_pair(bits, even, odd);
  return {_mm512_set1_ps(even), _mm512_set1_ps(odd)};
}
// The same from the pair already widened to fp32 (x[0] even, x[1] odd): broadcast loads.
inline XPair xpair(const float* x) { return {_mm512_set1_ps(x[0]), _mm512_set1_ps(x[1])}; }
#define TANDEM_WIDE_XPAIR
inline V dot2(V acc, const WPair& w, const XPair& x) {
  return {_mm512_fmadd_ps(w.odd, x.odd, _mm512_fmadd_ps(w.even, x.even, acc.v))};
}
// Blocks of 16 outputs and rows per tile, by weight type. bfloat16: 12 rows x 2 blocks (24
// accumulators, 2 x 2 widened weights, 2 activations); fewer tiles pay the widening fewer times:
// 8 rows of gate_up 3072x576 in 102 us (6 x 3: 114), the LM head 1.67 ms (2.20), 16 rows about
// the same. fp32: 6 rows x 3 blocks (at 16 rows 221 us against 256 for 12 x 2).
template <typename T>
constexpr int NB = std::is_same_v<T, float> ? 3 : 2;
template <typename T>
constexpr int R_MAX = std::is_same_v<T, float> ? 6 : 12;
// bfloat16 activations are widened to fp32 once per product (broadcast straight from memory
// then, no per-row shifts): 16 rows of gate_up 3072x576 took 200 us this way, 267 without
// (2-core Xeon without AVX-512 BF16); on AVX2 (a Zen EPYC) it was slower.
constexpr bool WIDE_X = true;
#endif

#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* ISA = "avx2";
struct V {
  __m256 lo, hi;
};
using Mask = int64_t;  // lanes: the first n
inline Mask first(int64_t n) { return n; }
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vset(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V vldu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstu(float* p, V a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline __m256 widen(__m128i h) {  // 8 bfloat16 -> 8 fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V vldu(const uint16_t* p) {
  return {widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
// Fewer than 16 lanes go through a 16-lane buffer (no masked 16-bit loads or stores in AVX2).
template <typename T>
inline V vld_or(const T* p, Mask n, T fill) {
  if (n >= 16) return vldu(p);
  T buf[16];
  std::fill_n(buf, 16, fill);
  std::copy_n(p, n, buf);
  return vldu(buf);
}
inline V vld(const float* p, Mask n) { return vld_or(p, n, 0.f); }
inline V vld(const uint16_t* p, Mask n) { return vld_or(p, n, uint16_t{0}); }
inline V vkeep(V a, Mask n) {
  if (n >= 16) return a;
  const __m256 f = _mm256_set1_ps(static_cast<float>(n));
  const __m256 lo = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), f, _CMP_LT_OQ);
  const __m256 hi = _mm256_cmp_ps(_mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15), f, _CMP_LT_OQ);
  return {_mm256_and_ps(a.lo, lo), _mm256_and_ps(a.hi, hi)};
}
#define TANDEM_V2(name, op)                                                       \
  inline V name(V a, V b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
TANDEM_V2(vadd, _mm256_add_ps)
TANDEM_V2(vsub, _mm256_sub_ps)
TANDEM_V2(vmul, _mm256_mul_ps)
TANDEM_V2(vdiv, _mm256_div_ps)
TANDEM_V2(vmax, _mm256_max_ps)  // b if either is NaN
TANDEM_V2(vmin, _mm256_min_ps)
#undef TANDEM_V2
inline V vfmadd(V a, V b, V c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V vfmsub(V a, V b, V c) {
  return {_mm256_fmsub_ps(a.lo, b.lo, c.lo), _mm256_fmsub_ps(a.hi, b.hi, c.hi)};
}
inline V vfnmadd(V a, V b, V c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline float vhsum(V a) {
  const __m256 s = _mm256_add_ps(a.lo, a.hi);
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float vhmax(V a) {
  const __m256 s = _mm256_max_ps(a.lo, a.hi);
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline V vround(V a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
// p * 2^n for integral n in [-252, 252]: two factors 2^(n/2) built in the exponent field (one
// would not reach fp32's denormals or overflow), as scalef does in one step.
inline __m256 pow2(__m256i e) {  // e in [-126, 127]
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
}
inline __m256 scale2(__m256 p, __m256 n) {
  const __m256i a = _mm256_cvttps_epi32(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)));
  const __m256i b = _mm256_sub_epi32(_mm256_cvtps_epi32(n), a);
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(a)), pow2(b));
}
inline V vscale2(V p, V n) { return {scale2(p.lo, n.lo), scale2(p.hi, n.hi)}; }
inline __m256i bf16_bits(__m256 v) {  // as the AVX-512 version, 8 lanes
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}
inline void vst(float* p, V a, Mask n) {
  if (n >= 16) return vstu(p, a);
  float buf[16];
  vstu(buf, a);
  std::copy_n(buf, n, p);
}
inline void vst(uint16_t* p, V a, Mask n) {
  // packus interleaves 128-bit halves: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] -> reorder.
  const __m256i w = _mm256_permute4x64_epi64(
      _mm256_packus_epi32(bf16_bits(a.lo), bf16_bits(a.hi)), 0xD8);
  if (n >= 16) return _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w);
  uint16_t buf[16];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf), w);
  std::copy_n(buf, n, p);
}
inline __m256 bf16_value(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16));
}
inline V vbf16(V a) { return {bf16_value(a.lo), bf16_value(a.hi)}; }
// One K pair of 16 packed bfloat16 outputs, widened: even and odd K of outputs 0-7 and 8-15;
// a row's activation pair, widened and broadcast.
struct WPair {
  __m256 even_lo, odd_lo, even_hi, odd_hi;
};
struct XPair {
  __m256 even, odd;
};
inline WPair wpair(const uint16_t* p) {
  const __m256i odd_bits = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(lo, odd_bits)),
          _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(hi, odd_bits))};
}
inline XPair xpair(uint32_t bits) {
  float even, odd;
  split_pair(bits, even, odd);
  return {_mm256_set1_ps(even), _mm256_set1_ps(odd)};
}
inline V dot2(V acc, const WPair& w, const XPair& x) {
  return {_mm256_fmadd_ps(w.odd_lo, x.odd, _mm256_fmadd_ps(w.even_lo, x.even, acc.lo)),
          _mm256_fmadd_ps(w.odd_hi, x.odd, _mm256_fmadd_ps(w.even_hi, x.even, acc.hi))};
}
// Blocks of 16 outputs per weight group (the prefetch unit), per register tile, and rows per
// tile (16 ymm registers). bfloat16: 4 rows x 2 blocks (a few accumulators spill; tried 5-6
// rows x 1 block, with and without widened activations: slower). fp32: 6 rows x 1 block (12
// accumulators, 2 weights, a broadcast) once a step has 2 rows or more; one row keeps the
// 2-block tile (12% faster batch-1 steps). On a 2-core Zen 3 EPYC, SmolLM2-135M's fp32 products
// at 16 rows ran at 50 GFLOPS with 4 x 2 tiles and 77-90 with 6 x 1: a 16-row decode step went
// from 82-91 ms to 53-57, and eager sgemm no longer wins for larger steps.
template <typename T>
constexpr int NB = 2;
template <typename T>
constexpr int TILE_NB = std::is_same_v<T, float> ? 1 : 2;
template <typename T>
constexpr int R_MAX = std::is_same_v<T, float> ? 6 : 4;
#define TANDEM_TILE_NB
// bfloat16 steps of WIDE_ROWS rows or more widen each weight block once into an fp32 scratch
// and run the fp32 6-row tiles over it (the same sums in the same order): on the Zen 3 EPYC,
// SmolLM2-135M's products at 16 rows 88-90 -> 111 GFLOPS, at 64 rows 91-93 -> 148-150.
constexpr int64_t WIDE_ROWS = 6;
// Row pair kp of a packed bfloat16 block as fp32: wb[2 kp] (even K) and wb[2 kp + 1] (odd K),
// 16 outputs each.
inline void widen_pair(const uint16_t* p, float* wb) {
  const WPair w = wpair(p);
  _mm256_storeu_ps(wb, w.even_lo);
  _mm256_storeu_ps(wb + 8, w.even_hi);
  _mm256_storeu_ps(wb + 16, w.odd_lo);
  _mm256_storeu_ps(wb + 24, w.odd_hi);
}
constexpr bool WIDE_X = false;  // see the AVX-512 build without BF16

#else
#error "the CPU decode fast path needs AVX-512 (F, BW) or AVX2 with FMA"
#endif
#ifndef TANDEM_TILE_NB
template <typename T>
constexpr int TILE_NB = NB<T>;  // a tile spans the whole weight group
constexpr int64_t WIDE_ROWS = 0;  // no widened-weight tiles
inline void widen_pair(const uint16_t*, float*) {}
#endif
#ifndef TANDEM_WIDE_XPAIR
// WIDE_X is off here: the fp32 pair back to its bfloat16 bits (exact: the values came from
// bfloat16), so that the widened tile below compiles on every ISA.
inline XPair xpair(const float* x) {
  uint32_t even, odd;
  std::memcpy(&even, x, 4);
  std::memcpy(&odd, x + 1, 4);
  return xpair((even >> 16) | (odd & 0xFFFF0000u));
}
#endif

template <typename T>
inline V vrnd(V v) {  // v rounded through T
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return vbf16(v);
  }
}
// exp(x): x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial for exp(r), scaled by 2^n.
// x is first clamped to [-104, 89] (NaN kept), where exp is already 0 / inf in fp32: far
// larger |x| would leave r outside the polynomial's range. Within 0.93 ulp of the exact value
// on [-87, 88] (4M points checked, AVX-512; tests/test_cpu_decode.py checks 1 ulp).
inline V vexp(V x) {
  x = vmin(vset(89.f), vmax(vset(-104.f), x));
  const V n = vround(vmul(x, vset(1.44269504088896341f)));
  V r = vfnmadd(n, vset(0.693359375f), x);
  r = vfnmadd(n, vset(-2.12194440e-4f), r);
  V p = vset(1.f / 5040);
  p = vfmadd(p, r, vset(1.f / 720));
  p = vfmadd(p, r, vset(1.f / 120));
  p = vfmadd(p, r, vset(1.f / 24));
  p = vfmadd(p, r, vset(1.f / 6));
  p = vfmadd(p, r, vset(0.5f));
  p = vfmadd(p, r, vset(1.f));
  p = vfmadd(p, r, vset(1.f));
  return vscale2(p, n);
}

// ---------------------------------------------------------------- matrix-vector products

// Weights are packed once (``pack``) so that 16 consecutive output features sit side by side:
// bfloat16 [ceil(O/16), ceil(K/2), 16, 2] (pairs along K, the operand layout of vdpbf16ps),
// float32 [ceil(O/16), K, 16]. Padding is zero. A tile keeps R rows x NB<T> blocks of 16 outputs
// in registers and, for each K step, loads NB weight vectors and broadcasts one activation
// (pair) per row: no horizontal sums, each weight vector used by R rows. Output feature o of
// every row sums K in the same order whatever the tile (batch-invariant results).
constexpr int64_t LANES = 16;

struct Mat {
  const void* p;
  int64_t O, K;
  int qbits = 0;  // 8 or 4: Q8_0 / Q4_1 blocks (``pack_blocks``), whatever the activations
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <int R, int W>
inline void zero(V (&acc)[R][W]) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) acc[r][j] = vzero();
}
template <typename T, int R, int W>
inline void store_tile(V (&acc)[R][W], T* y, int64_t m, int64_t o0, int64_t O) {
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < W; ++j) {
      const int64_t o = o0 + j * LANES;
      if (o < O) vst(y + (m + r) * O + o, acc[r][j], first(O - o));
    }
  }
}

// Weights to bring into L2 while a tile computes: `per_step` bytes (whole lines) at each K
// step, from p (see rows()).
struct Prefetch {
  const char* p = nullptr;
  int64_t per_step = 0;  // bytes per K step (whole cache lines)
  inline void at(int64_t k) const {
    if (p == nullptr) return;
    for (int64_t i = 0; i < per_step; i += 64) _mm_prefetch(p + k * per_step + i, _MM_HINT_T1);
  }
};

// y[m .. m+R, 16 b .. 16 (b+W)] from packed weight blocks b .. b+W.
template <int R, int W>
inline void tile(const uint16_t* x, const Mat& w, uint16_t* y, int64_t m, int64_t b,
                 const Prefetch& pf) {
  const int64_t K = w.K, kp_stride = ceil_div(K, 2);
  const uint16_t* pb = static_cast<const uint16_t*>(w.p) + b * kp_stride * 2 * LANES;
  V acc[R][W];
  zero(acc);
  // One K pair: pair(r) is row r's two activations as one 32-bit word.
  auto step = [&](int64_t kp, auto pair) {
    pf.at(kp);
    WPair wv[W];
    for (int j = 0; j < W; ++j) wv[j] = wpair(pb + (j * kp_stride + kp) * 2 * LANES);
    for (int r = 0; r < R; ++r) {
      const XPair xb = xpair(pair(r));
      for (int j = 0; j < W; ++j) acc[r][j] = dot2(acc[r][j], wv[j], xb);
    }
  };
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    step(kp, [&](int r) {
      uint32_t v;
      std::memcpy(&v, x + (m + r) * K + 2 * kp, 4);
      return v;
    });
  }
  if (K % 2) {  // the last activation pairs with the packed zero
    step(K / 2, [&](int r) { return static_cast<uint32_t>(x[(m + r) * K + K - 1]); });
  }
  store_tile<uint16_t, R, W>(acc, y, m, b * LANES, w.O);
}
template <int R, int W>
inline void tile(const float* x, const Mat& w, float* y, int64_t m, int64_t b,
                 const Prefetch& pf) {
  const int64_t K = w.K;
  const float* pb = static_cast<const float*>(w.p) + b * K * LANES;
  V acc[R][W];
  zero(acc);
  for (int64_t k = 0; k < K; ++k) {
    pf.at(k);
    V wv[W];
    for (int j = 0; j < W; ++j) wv[j] = vldu(pb + (j * K + k) * LANES);
    for (int r = 0; r < R; ++r) {
      const V xb = vset(x[(m + r) * K + k]);
      for (int j = 0; j < W; ++j) acc[r][j] = vfmadd(wv[j], xb, acc[r][j]);
    }
  }
  store_tile<float, R, W>(acc, y, m, b * LANES, w.O);
}

// The same from activations widened to fp32 (WIDE_X): xf [M, K rounded up to even], the
// padding zero.
template <int R, int W>
inline void tile(const float* xf, const Mat& w, uint16_t* y, int64_t m, int64_t b,
                 const Prefetch& pf) {
  const int64_t kp_stride = ceil_div(w.K, 2), K2 = 2 * kp_stride;
  const uint16_t* pb = static_cast<const uint16_t*>(w.p) + b * kp_stride * 2 * LANES;
  V acc[R][W];
  zero(acc);
  for (int64_t kp = 0; kp < kp_stride; ++kp) {
    pf.at(kp);
    WPair wv[W];
    for (int j = 0; j < W; ++j) wv[j] = wpair(pb + (j * kp_stride + kp) * 2 * LANES);
    for (int r = 0; r < R; ++r) {
      const XPair xb = xpair(xf + (m + r) * K2 + 2 * kp);
      for (int j = 0; j < W; ++j) acc[r][j] = dot2(acc[r][j], wv[j], xb);
    }
  }
  store_tile<uint16_t, R, W>(acc, y, m, b * LANES, w.O);
}

// Rows m .. m+R of one block from its weights widened to fp32 (wb [K][16]) and the rows'
// activations widened (xf [M][K]), stored as bfloat16.
template <int R>
inline void wide_tile(const float* xf, int64_t K, const float* wb, uint16_t* y, int64_t m,
                      int64_t o0, int64_t O) {
  V acc[R][1];
  zero(acc);
  for (int64_t k = 0; k < K; ++k) {
    const V wv = vldu(wb + k * LANES);
    for (int r = 0; r < R; ++r) acc[r][0] = vfmadd(wv, vset(xf[(m + r) * K + k]), acc[r][0]);
  }
  store_tile<uint16_t, R, 1>(acc, y, m, o0, O);
}
template <int R = R_MAX<float> - 1>
inline void rest_wide_tile(int64_t r, const float* xf, int64_t K, const float* wb, uint16_t* y,
                           int64_t m, int64_t o0, int64_t O) {
  if constexpr (R >= 1) {
    if (r == R) return wide_tile<R>(xf, K, wb, y, m, o0, O);
    rest_wide_tile<R - 1>(r, xf, K, wb, y, m, o0, O);
  }
}

// All M rows of bfloat16 blocks b .. b+W through widened weights (WIDE_ROWS); the weights of
// `next` are prefetched while the blocks are widened.
template <int W>
void wide_rows(const uint16_t* x, const Mat& w, uint16_t* y, int64_t M, int64_t b,
               const char* next, int64_t next_bytes) {
  constexpr int R = R_MAX<float>;
  const int64_t K = w.K, kp_stride = ceil_div(K, 2);
  thread_local std::vector<float> xf, wb;
  xf.resize(M * K);
  wb.resize(kp_stride * 2 * LANES);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = ld(x + i);
  const int64_t per_step =
      next == nullptr ? 0 : ceil_div(ceil_div(next_bytes, W * kp_stride), 64) * 64;
  for (int s = 0; s < W; ++s) {
    const uint16_t* pb = static_cast<const uint16_t*>(w.p) + (b + s) * kp_stride * 2 * LANES;
    const Prefetch pf{next == nullptr ? nullptr : next + s * kp_stride * per_step, per_step};
    for (int64_t kp = 0; kp < kp_stride; ++kp) {
      pf.at(kp);
      widen_pair(pb + kp * 2 * LANES, wb.data() + 2 * kp * LANES);
    }
    const int64_t o0 = (b + s) * LANES;
    int64_t m = 0;
    for (; m + R <= M; m += R) wide_tile<R>(xf.data(), K, wb.data(), y, m, o0, w.O);
    if (m < M) rest_wide_tile(M - m, xf.data(), K, wb.data(), y, m, o0, w.O);
  }
}

// One tile of r < R_MAX<T> rows (R counts down to the one that matches).
template <typename X, typename T, int W, int R = R_MAX<T> - 1>
inline void rest_tile(int64_t r, const X* x, const Mat& w, T* y, int64_t m, int64_t b,
                      const Prefetch& pf) {
  if constexpr (R >= 1) {
    if (r == R) return tile<R, W>(x, w, y, m, b, pf);
    rest_tile<X, T, W, R - 1>(r, x, w, y, m, b, pf);
  }
}

// All M rows for blocks b .. b+W. `next` (may be null): `next_bytes` of weights the caller
// reads next, prefetched into L2 in equal shares by every row tile, so that memory fetches the
// next group for the whole time this one computes (the first tile streams this group; the
// later ones read it from cache). At 16 rows (a 12-row tile and a 4-row one), prefetching in
// the second tile only left the first waiting on memory: 30 layers of SmolLM2-135M products
// took 17.7 / 19.8 ms, prefetching in both 14.5 / 15.1 (and the LM head 4.1 / 4.4 -> 3.3 ms).
// Tiles span TW = TILE_NB<T> of the W blocks (all W for a single row).
template <typename X, typename T, int W>
inline void rows(const X* x, const Mat& w, T* y, int64_t M, int64_t b, const char* next,
                 int64_t next_bytes) {
  const int64_t ksteps = std::is_same_v<T, float> ? w.K : ceil_div(w.K, 2);
  constexpr int R = R_MAX<T>;
  constexpr int TW = W < TILE_NB<T> ? W : TILE_NB<T>;
  static_assert(W % TW == 0);
  const bool split = TW < W && M > 1;
  const int64_t tiles = ceil_div(M, R) * (split ? W / TW : 1);
  const int64_t per_tile = next == nullptr ? 0 : ceil_div(next_bytes, tiles);
  const int64_t per_step = ceil_div(ceil_div(per_tile, ksteps), 64) * 64;
  int64_t t = 0;
  auto pf = [&]() {
    Prefetch p;
    if (next != nullptr && t * per_tile < next_bytes) {
      p = Prefetch{next + t * per_tile, per_step};
    }
    ++t;
    return p;
  };
  if constexpr (std::is_same_v<T, uint16_t> && std::is_same_v<X, uint16_t>) {
    if (WIDE_ROWS > 0 && M >= WIDE_ROWS) return wide_rows<W>(x, w, y, M, b, next, next_bytes);
  }
  auto tiles_of = [&](auto width) {  // tiles `width` blocks wide over all M rows
    constexpr int N = decltype(width)::value;
    for (int s = 0; s < W; s += N) {
      int64_t m = 0;
      for (; m + R <= M; m += R) tile<R, N>(x, w, y, m, b + s, pf());
      // The rest: one tile, one weight read.
      if (m < M) rest_tile<X, T, N>(M - m, x, w, y, m, b + s, pf());
    }
  };
  if (split) return tiles_of(std::integral_constant<int, TW>{});
  tiles_of(std::integral_constant<int, W>{});
}

// y[m, o] = sum_k x[m, k] * w[o, k] for m < M, w packed (x: T, or fp32 for bfloat16 T).
template <typename X, typename T>
void matvec_rows(const X* x, const Mat& w, T* y, int64_t M) {
  constexpr int nb_max = NB<T>;
  const int64_t blocks = ceil_div(w.O, LANES), groups = ceil_div(blocks, nb_max);
  const int64_t block_bytes =
      (std::is_same_v<T, float> ? w.K : 2 * ceil_div(w.K, 2)) * LANES * int64_t(sizeof(T));
  const char* base = static_cast<const char*>(w.p);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      // This thread's next group, if any (prefetched while this one computes).
      const int64_t nb =
          g + 1 < end ? std::min<int64_t>(nb_max, blocks - (g + 1) * nb_max) : 0;
      const char* next = nb > 0 ? base + (g + 1) * nb_max * block_bytes : nullptr;
      if ((g + 1) * nb_max <= blocks) {
        rows<X, T, nb_max>(x, w, y, M, g * nb_max, next, nb * block_bytes);
      } else {
        for (int64_t b = g * nb_max; b < blocks; ++b) rows<X, T, 1>(x, w, y, M, b, nullptr, 0);
      }
    }
  });
}

// ---------------------------------------------------------------- block-quantized weights
// GGUF's Q8_0 and Q4_1 blocks: 32 weights along K share an fp16 scale d (and for Q4_1 a
// minimum m): w = d * q + c' with q int8 (Q8_0, c' = 0) or a 4-bit q in 0 .. 15 (Q4_1, c' = m).
// ``pack_blocks`` keeps those values in a layout of 16 outputs x 32 K per block, as unsigned
// bytes u (Q8_0: u = q + 128; Q4_1: u = q), so w = d * u + c with c = -128 d (Q8_0) or m:
//   Q8_0: 8 groups of 64 bytes, group g = lanes 0 .. 15 x K 4g .. 4g + 3 (one 32-bit word per
//         output, the operand layout of vpdpbusd), then d and c as fp16 [16] each: 576 bytes.
//   Q4_1: 4 groups of 64 bytes, byte (lane, i) of group g holding K 4g + i in its low nibble
//         and K 16 + 4g + i in its high one, then d and c: 320 bytes.
// The activations are quantized per row and 32-block on a 15-bit grid in two int8 passes
// (``quantize_rows``), so y[m, o] = sum_blocks d dx S + c sx, S the exact integer dot product
// of u and the row's grid values: the only error besides fp32 sums is the activations'
// rounding to that grid.
constexpr int64_t QBLOCK = 32;
#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)) || \
    (!(defined(__AVX512F__) && defined(__AVX512BW__)) && defined(__AVXVNNI__))
constexpr bool TANDEM_VNNI = true;
#else
constexpr bool TANDEM_VNNI = false;
#endif
// Bytes per block of 16 outputs x 32 K: the weights, then d and c (fp16 [16] each).
constexpr int64_t qb_weight_bytes(int bits) { return bits == 8 ? 512 : 256; }
constexpr int64_t qb_bytes(int bits) { return qb_weight_bytes(bits) + 64; }

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct VI {
  __m512i v;
};
inline VI vi_zero() { return {_mm512_setzero_si512()}; }
inline VI vi_ld(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline VI vi_set(int32_t x) { return {_mm512_set1_epi32(x)}; }
inline VI vi_lo4(VI a) { return {_mm512_and_si512(a.v, _mm512_set1_epi8(0x0F))}; }
inline VI vi_hi4(VI a) {
  return {_mm512_and_si512(_mm512_srli_epi16(a.v, 4), _mm512_set1_epi8(0x0F))};
}
// acc + per 32-bit lane the sum of its 4 products u8(a) * s8(b).
inline VI dot4(VI acc, VI a, VI b) {
#if defined(__AVX512VNNI__)
  return {_mm512_dpbusd_epi32(acc.v, a.v, b.v)};
#else  // without VNNI: widened to 16 bits (vpmaddubsw would saturate u8 255 * s8 -128 pairs)
  const __m512i m = _mm512_set1_epi16(0x00FF);
  const __m512i a_even = _mm512_and_si512(a.v, m), a_odd = _mm512_srli_epi16(a.v, 8);
  const __m512i b_even = _mm512_srai_epi16(_mm512_slli_epi16(b.v, 8), 8);
  const __m512i b_odd = _mm512_srai_epi16(b.v, 8);
  const __m512i s = _mm512_add_epi32(_mm512_madd_epi16(a_even, b_even), _mm512_madd_epi16(a_odd, b_odd));
  return {_mm512_add_epi32(acc.v, s)};
#endif
}
inline V vi_float(VI a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline V vld_f16(const uint8_t* p) {  // 16 fp16 -> fp32
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
// 16 lanes (integral values in [-127, 127]) stored as int8.
inline void vst_i8(int8_t* p, V a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a.v)));
}
#else
struct VI {
  __m256i lo, hi;
};
inline VI vi_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline VI vi_ld(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline VI vi_set(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline __m256i lo4(__m256i a) { return _mm256_and_si256(a, _mm256_set1_epi8(0x0F)); }
inline __m256i hi4(__m256i a) { return lo4(_mm256_srli_epi16(a, 4)); }
inline VI vi_lo4(VI a) { return {lo4(a.lo), lo4(a.hi)}; }
inline VI vi_hi4(VI a) { return {hi4(a.lo), hi4(a.hi)}; }
inline __m256i dot4(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, a, b);
#else
  const __m256i m = _mm256_set1_epi16(0x00FF);
  const __m256i a_even = _mm256_and_si256(a, m), a_odd = _mm256_srli_epi16(a, 8);
  const __m256i b_even = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8);
  const __m256i b_odd = _mm256_srai_epi16(b, 8);
  const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(a_even, b_even), _mm256_madd_epi16(a_odd, b_odd));
  return _mm256_add_epi32(acc, s);
#endif
}
inline VI dot4(VI acc, VI a, VI b) { return {dot4(acc.lo, a.lo, b.lo), dot4(acc.hi, a.hi, b.hi)}; }
inline V vi_float(VI a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline V vld_f16(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline void vst_i8(int8_t* p, V a) {
  const __m256i w = _mm256_permute4x64_epi64(
      _mm256_packs_epi32(_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}
#endif

// Rows of x quantized per 32-block in two int8 passes: x = dx (254 xq + xr) up to rounding,
// xq = round(x / (254 dx)) as Q8_0 quantizes (254 dx = max |x| / 127) and xr the residual
// rounded on a 254 times finer grid (|xr| <= 127): a 15-bit grid per block, finer than a
// bfloat16 activation's own rounding, at the cost of a second pass of byte dot products. dx
// [M, K / 32] is the fine step, sx [M, K / 32] = dx times the sum of (254 xq + xr) over the
// block.
struct QuantRows {
  std::vector<int8_t> xq, xr;
  std::vector<float> dx, sx;
};
template <typename T>
QuantRows quantize_rows(const T* x, int64_t M, int64_t K) {
  const int64_t nkb = K / QBLOCK;
  QuantRows q{std::vector<int8_t>(M * K), std::vector<int8_t>(M * K),
              std::vector<float>(M * nkb), std::vector<float>(M * nkb)};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nkb; ++b) {
      const int64_t i = m * K + b * QBLOCK;
      const V a = vld(x + i, first(16)), c = vld(x + i + 16, first(16));
      const float amax = vhmax(vmax(vmax(a, vsub(vzero(), a)), vmax(c, vsub(vzero(), c))));
      const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
      const float fine = d / 254.f, ifine = amax > 0.f ? 254.f * 127.f / amax : 0.f;
      const V qa = vround(vmul(a, vset(id))), qc = vround(vmul(c, vset(id)));
      // The residuals, within half a coarse step: |r| <= 127 fine steps (clamped for rounding).
      const V lim = vset(127.f);
      const V ra = vmax(vmin(vround(vmul(vfnmadd(qa, vset(d), a), vset(ifine))), lim), vsub(vzero(), lim));
      const V rc = vmax(vmin(vround(vmul(vfnmadd(qc, vset(d), c), vset(ifine))), lim), vsub(vzero(), lim));
      vst_i8(q.xq.data() + i, qa);
      vst_i8(q.xq.data() + i + 16, qc);
      vst_i8(q.xr.data() + i, ra);
      vst_i8(q.xr.data() + i + 16, rc);
      q.dx[m * nkb + b] = fine;
      q.sx[m * nkb + b] = fine * (254.f * (vhsum(qa) + vhsum(qc)) + vhsum(ra) + vhsum(rc));
    }
  }
  return q;
}

inline int32_t word(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline VI times254(VI a) {  // (a << 8) - (a << 1)
  return {_mm512_sub_epi32(_mm512_slli_epi32(a.v, 8), _mm512_slli_epi32(a.v, 1))};
}
inline VI vi_add(VI a, VI b) { return {_mm512_add_epi32(a.v, b.v)}; }
#else
inline __m256i times254(__m256i a) {
  return _mm256_sub_epi32(_mm256_slli_epi32(a, 8), _mm256_slli_epi32(a, 1));
}
inline VI times254(VI a) { return {times254(a.lo), times254(a.hi)}; }
inline VI vi_add(VI a, VI b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
#endif

// One 32-block of a tile: s[r][j] = 254 (u . xq) + (u . xr), the exact integer (|S| < 2^29)
// of rows m + r and outputs 16 (b + j) .. (weights at pw, rows' bytes at xq / xr). Each weight
// vector is loaded (and for Q4_1 unpacked) once for both passes and every row.
template <int BITS, int R, int W>
inline void qb_block(VI (&s)[R][W], const uint8_t* pw, int64_t stride, const int8_t* xq,
                     const int8_t* xr, int64_t K) {
  VI t[R][W];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) s[r][j] = t[r][j] = vi_zero();
  if constexpr (BITS == 8) {
    for (int g = 0; g < 8; ++g) {
      VI wv[W];
      for (int j = 0; j < W; ++j) wv[j] = vi_ld(pw + j * stride + g * 64);
      for (int r = 0; r < R; ++r) {
        const VI a = vi_set(word(xq + r * K + 4 * g)), b = vi_set(word(xr + r * K + 4 * g));
        for (int j = 0; j < W; ++j) {
          s[r][j] = dot4(s[r][j], wv[j], a);
          t[r][j] = dot4(t[r][j], wv[j], b);
        }
      }
    }
  } else {
    for (int g = 0; g < 4; ++g) {
      VI lo[W], hi[W];
      for (int j = 0; j < W; ++j) {
        const VI raw = vi_ld(pw + j * stride + g * 64);
        lo[j] = vi_lo4(raw);
        hi[j] = vi_hi4(raw);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* a = xq + r * K + 4 * g;
        const int8_t* b = xr + r * K + 4 * g;
        const VI al = vi_set(word(a)), ah = vi_set(word(a + 16));
        const VI bl = vi_set(word(b)), bh = vi_set(word(b + 16));
        for (int j = 0; j < W; ++j) {
          s[r][j] = dot4(dot4(s[r][j], lo[j], al), hi[j], ah);
          t[r][j] = dot4(dot4(t[r][j], lo[j], bl), hi[j], bh);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) s[r][j] = vi_add(times254(s[r][j]), t[r][j]);
}

// y[m .. m+R, 16 b .. 16 (b+W)] from blocks b .. b + W of a ``pack_blocks`` weight: per
// 32-block y += d dx S + c sx in fp32 (S from ``qb_block``).
template <int BITS, int R, int W, typename T>
inline void qb_tile(const QuantRows& q, int64_t K, const uint8_t* pb, int64_t stride, T* y,
                    int64_t m, int64_t o0, int64_t O) {
  constexpr int64_t BB = qb_bytes(BITS), WB = qb_weight_bytes(BITS);
  const int64_t nkb = K / QBLOCK;
  V acc[R][W];
  zero(acc);
  for (int64_t kb = 0; kb < nkb; ++kb) {
    VI s[R][W];
    const uint8_t* pw = pb + kb * BB;
    const int64_t xo = m * K + kb * QBLOCK;
    qb_block<BITS>(s, pw, stride, q.xq.data() + xo, q.xr.data() + xo, K);
    for (int j = 0; j < W; ++j) {
      const V d = vld_f16(pw + j * stride + WB), c = vld_f16(pw + j * stride + WB + 32);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m + r) * nkb + kb;
        acc[r][j] = vfmadd(vmul(vi_float(s[r][j]), vset(q.dx[i])), d, acc[r][j]);
        acc[r][j] = vfmadd(c, vset(q.sx[i]), acc[r][j]);
      }
    }
  }
  store_tile<T, R, W>(acc, y, m, o0, O);
}
template <int BITS, int W, typename T, int R>
inline void qb_rest(int64_t r, const QuantRows& q, int64_t K, const uint8_t* pb, int64_t stride,
                    T* y, int64_t m, int64_t o0, int64_t O) {
  if constexpr (R >= 1) {
    if (r == R) return qb_tile<BITS, R, W>(q, K, pb, stride, y, m, o0, O);
    qb_rest<BITS, W, T, R - 1>(r, q, K, pb, stride, y, m, o0, O);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Rows x blocks per tile: 2 x 8 int32 sums (both passes) and 8 fp32 accumulators (R = 3 or 4
// with 2 blocks measured the same, within this machine's noise).
constexpr int QB_ROWS = 2, QB_BLOCKS = 4;
#else
constexpr int QB_ROWS = 2, QB_BLOCKS = 1;  // each a pair of ymm registers
#endif

// y[m, o] = sum_k x[m, k] * w[o, k] for m < M, w from ``pack_blocks`` (BITS 8 or 4).
template <int BITS, typename T>
void matvec_qb(const T* x, const Mat& w, T* y, int64_t M) {
  constexpr int R = QB_ROWS, NB = QB_BLOCKS;
  const int64_t K = w.K, blocks = ceil_div(w.O, LANES), stride = (K / QBLOCK) * qb_bytes(BITS);
  const QuantRows q = quantize_rows(x, M, K);
  const uint8_t* base = static_cast<const uint8_t*>(w.p);
  at::parallel_for(0, ceil_div(blocks, NB), 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t b = g * NB;
      const uint8_t* pb = base + b * stride;
      for (int64_t m = 0; m < M; m += R) {
        const int64_t r = std::min<int64_t>(R, M - m);
        if (b + NB <= blocks) {
          qb_rest<BITS, NB, T, R>(r, q, K, pb, stride, y, m, b * LANES, w.O);
        } else {  // the last group's blocks one by one
          for (int64_t c = b; c < blocks; ++c)
            qb_rest<BITS, 1, T, R>(r, q, K, base + c * stride, stride, y, m, c * LANES, w.O);
        }
      }
    }
  });
}

// y[m, o] = sum_k x[m, k] * w[o, k] for m < M, w packed.
template <typename T>
void matvec(const T* x, const Mat& w, T* y, int64_t M) {
  if (w.qbits == 8) return matvec_qb<8>(x, w, y, M);
  if (w.qbits == 4) return matvec_qb<4>(x, w, y, M);
  if constexpr (WIDE_X && std::is_same_v<T, uint16_t>) {
    const int64_t K = w.K, K2 = 2 * ceil_div(K, 2);
    std::vector<float> xf(M * K2, 0.f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) xf[m * K2 + k] = ld(x + m * K + k);
    return matvec_rows(xf.data(), w, y, M);
  } else {
    return matvec_rows(x, w, y, M);
  }
}

// ---------------------------------------------------------------- elementwise

// out = w * rms_norm(x) (fp32 math; bfloat16: the normalised value is rounded before the
// weight multiply, as in the eager RMSNorm).
template <typename T>
void rms_norm(const T* x, const T* w, T* out, int64_t M, int64_t H, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = x + m * H;
    V ss = vzero();
    for (int64_t i = 0; i < H; i += LANES) {
      const V v = vld(xr + i, first(H - i));
      ss = vfmadd(v, v, ss);
    }
    const V inv = vset(1.f / std::sqrt(vhsum(ss) / static_cast<float>(H) + eps));
    for (int64_t i = 0; i < H; i += LANES) {
      const Mask k = first(H - i);
      const V n = vrnd<T>(vmul(vld(xr + i, k), inv));
      vst(out + m * H + i, vmul(vld(w + i, k), n), k);
    }
  }
}

// residual = round(h + residual) in place.
template <typename T>
void add_into(const T* h, T* residual, int64_t n) {
  for (int64_t i = 0; i < n; i += LANES) {
    const Mask k = first(n - i);
    vst(residual + i, vadd(vld(h + i, k), vld(residual + i, k)), k);
  }
}

// Neox rotary on the first (num_heads + num_kv_heads) heads of each qkv row, in place.
template <typename T>
void rotary(T* qkv, const int64_t* positions, const float* cos_sin, int64_t M, int64_t heads,
            int64_t D, int64_t row_stride) {
  const int64_t half = D / 2;
  for (int64_t m = 0; m < M; ++m) {
    const float* cs = cos_sin + positions[m] * D;
    for (int64_t h = 0; h < heads; ++h) {
      T* x = qkv + m * row_stride + h * D;
      for (int64_t i = 0; i < half; i += LANES) {
        const Mask k = first(half - i);
        const V x1 = vld(x + i, k), x2 = vld(x + half + i, k);
        const V c = vld(cs + i, k), s = vld(cs + half + i, k);
        vst(x + i, vfmsub(x1, c, vmul(x2, s)), k);
        vst(x + half + i, vfmadd(x2, c, vmul(x1, s)), k);
      }
    }
  }
}

// out = round(round(silu(gate)) * up), gate_up rows = [gate | up].
template <typename T>
void silu_mul(const T* gu, T* out, int64_t M, int64_t I) {
  constexpr int64_t CHUNK = 256;
  const int64_t chunks = ceil_div(I, CHUNK);
  // Threads only for work worth waking them (several rows of a wide MLP).
  at::parallel_for(0, M * chunks, std::max<int64_t>(1, 8192 / CHUNK), [&](int64_t b, int64_t end) {
    for (int64_t c = b; c < end; ++c) {
      const int64_t m = c / chunks, i0 = (c % chunks) * CHUNK, i1 = std::min(I, i0 + CHUNK);
      const T* g = gu + m * 2 * I;
      for (int64_t i = i0; i < i1; i += LANES) {
        const Mask k = first(i1 - i);
        const V a = vld(g + i, k);
        const V e = vexp(vsub(vzero(), a));
        const V sl = vrnd<T>(vdiv(a, vadd(vset(1.f), e)));
        vst(out + m * I + i, vmul(sl, vld(g + I + i, k)), k);
      }
    }
  });
}

// ---------------------------------------------------------------- attention

struct Paged {
  const int32_t* block_tables;
  int64_t bt_stride;
  const int64_t* row_seq;  // [M] sequence of each row (a sequence's rows are consecutive)
  const int64_t* kv_len;   // [M] keys each row sees (causal, this step's keys included)
  int64_t block_size;
  // [M] tree attention words, or null (every row causal). A row r of its sequence's step rows
  // with a nonzero word sees the keys before the sequence's first step row (the prefix) and,
  // among step rows 0..r, row i iff bit i is set (rows past 63 never): draft-tree verification
  // and the draft's frontier passes (kernels/paged_attention.py, the same contract).
  const int64_t* tree_words;
};

// The cache slot of every key each row sees (the same for every layer of a step).
struct KeySlots {
  std::vector<int64_t> slots;  // row m's keys at slots[start[m] .. start[m] + len[m])
  std::vector<int64_t> start, len;
  KeySlots(const Paged& p, int64_t M, int64_t num_slots) : start(M), len(M) {
    std::vector<int64_t> row(M), prefix(M);  // row in its sequence's step rows; keys before them
    std::vector<uint64_t> seen(M, 0);        // the step rows a tree row sees
    int64_t total = 0;
    for (int64_t m = 0; m < M; ++m) {
      row[m] = m > 0 && p.row_seq[m] == p.row_seq[m - 1] ? row[m - 1] + 1 : 0;
      prefix[m] = p.kv_len[m] - 1 - row[m];
      const uint64_t word = p.tree_words ? static_cast<uint64_t>(p.tree_words[m]) : 0;
      seen[m] = row[m] >= 63 ? word : word & ((uint64_t{2} << row[m]) - 1);
      len[m] = word ? prefix[m] + __builtin_popcountll(seen[m]) : p.kv_len[m];
      TORCH_CHECK(len[m] >= 1, "a tree row sees no key");
      start[m] = total;
      total += len[m];
    }
    slots.resize(total);
    for (int64_t m = 0; m < M; ++m) {
      const int32_t* table = p.block_tables + p.row_seq[m] * p.bt_stride;
      int64_t* out = slots.data() + start[m];
      auto put = [&](int64_t j) {
        const int64_t slot =
            static_cast<int64_t>(table[j / p.block_size]) * p.block_size + j % p.block_size;
        TORCH_CHECK(slot >= 0 && slot < num_slots, "block table entry is out of range");
        *out++ = slot;
      };
      if (!p.tree_words || p.tree_words[m] == 0) {  // causal
        for (int64_t j = 0; j < p.kv_len[m]; ++j) put(j);
        continue;
      }
      for (int64_t j = 0; j < prefix[m]; ++j) put(j);
      for (int64_t i = 0; i < 64 && i <= row[m]; ++i) {
        if ((seen[m] >> i) & 1) put(prefix[m] + i);
      }
    }
  }
};

// The keys one attention task reads: keys j < L of kv heads kv0 .. kv0 + kv_heads at cache
// slots slot[j]; the task's heads are per_kv per kv head, each a [width] row of q / acc.
struct KeyRange {
  const int64_t* slot;
  int64_t L, Hkv, kv0, kv_heads, D, per_kv, width;
  // Key j's kv head kv in `cache`, bringing in the same a few keys ahead.
  template <typename T>
  inline const T* at(const T* cache, int64_t j, int64_t kv) const {
    constexpr int64_t PREFETCH_KEYS = 4;
    if (j + PREFETCH_KEYS < L) {
      const char* r =
          reinterpret_cast<const char*>(cache + (slot[j + PREFETCH_KEYS] * Hkv + kv0 + kv) * D);
      for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) {
        _mm_prefetch(r + b, _MM_HINT_T0);
      }
    }
    return cache + (slot[j] * Hkv + kv0 + kv) * D;
  }
};

// A head's 16-lane chunks known at compile time (1 .. 8: head_dim <= 128), else (0) read at
// run time (up to MAX_CHUNKS): the chunk loops unroll and a head's dot product or value sum
// stays in registers.
constexpr int64_t MAX_CHUNKS = 16;
template <int C>
using Chunks = std::integral_constant<int, C>;
template <typename F>
inline void with_chunks(int64_t chunks, F&& f) {
  switch (chunks) {
    case 1: return f(Chunks<1>{});
    case 2: return f(Chunks<2>{});
    case 3: return f(Chunks<3>{});
    case 4: return f(Chunks<4>{});
    case 5: return f(Chunks<5>{});
    case 6: return f(Chunks<6>{});
    case 7: return f(Chunks<7>{});
    case 8: return f(Chunks<8>{});
    default: return f(Chunks<0>{});
  }
}

// scores[g * L + j] = (q_g . k_j) * scale for the task's heads g: each dot product sums its
// chunks in order, then across lanes (the same arithmetic for any task shape).
template <typename T, int C>
void score_keys(const float* q, const T* k_cache, const KeyRange& r, float scale, float* scores) {
  const int64_t nc = C > 0 ? C : ceil_div(r.D, LANES);
  for (int64_t j = 0; j < r.L; ++j) {
    for (int64_t kv = 0; kv < r.kv_heads; ++kv) {
      const T* k = r.at(k_cache, j, kv);
      V kc[C > 0 ? C : MAX_CHUNKS];
      for (int64_t c = 0; c < nc; ++c) kc[c] = vld(k + c * LANES, first(r.D - c * LANES));
      for (int64_t g = kv * r.per_kv; g < (kv + 1) * r.per_kv; ++g) {
        const float* qg = q + g * r.width;
        V dot = vzero();
        for (int64_t c = 0; c < nc; ++c) dot = vfmadd(vldu(qg + c * LANES), kc[c], dot);
        scores[g * r.L + j] = vhsum(dot) * scale;
      }
    }
  }
}

// acc[g] = sum_j p[g * L + j] v_j for the task's `heads` heads, keys in order.
template <typename T, int C>
void sum_values(const float* p, const T* v_cache, const KeyRange& r, int64_t heads, float* acc) {
  const int64_t nc = C > 0 ? C : ceil_div(r.D, LANES);
  for (int64_t g = 0; g < heads; ++g) {
    const int64_t kv = g / r.per_kv;
    V a[C > 0 ? C : MAX_CHUNKS];
    for (int64_t c = 0; c < nc; ++c) a[c] = vzero();
    for (int64_t j = 0; j < r.L; ++j) {
      const T* v = r.at(v_cache, j, kv);
      const V pe = vset(p[g * r.L + j]);
      for (int64_t c = 0; c < nc; ++c) {
        a[c] = vfmadd(pe, vld(v + c * LANES, first(r.D - c * LANES)), a[c]);
      }
    }
    for (int64_t c = 0; c < nc; ++c) vstu(acc + g * r.width + c * LANES, a[c]);
  }
}

// out[m, h, :] = softmax(q k^T * scale) v over the row's keys; query head h reads kv head
// h / (H / Hkv). fp32 scores and accumulation; probabilities rounded to T before the value sum
// (as the CPU flash-attention kernel does for reduced precision).
//
// A row's keys go in pieces of KEY_CHUNK (a long context spreads over the threads even for one
// row); a row with several pieces merges them flash-decoding style (each piece's softmax is
// taken against its own maximum, then rescaled). The pieces depend on the row's key count
// only, never on the batch, so a row's result is the same alone or in any batch.
template <typename T>
void attention(const T* qkv, int64_t row_stride, const T* k_cache, const T* v_cache, T* out,
               const Paged& p, const KeySlots& ks, int64_t M, int64_t H, int64_t Hkv, int64_t D,
               float scale) {
  constexpr int64_t MAX_HEADS = 64, KEY_CHUNK = 512;
  const int64_t group = H / Hkv, threads = at::get_num_threads();
  const int64_t chunks = ceil_div(D, LANES), width = chunks * LANES;
  TORCH_CHECK(chunks <= MAX_CHUNKS, "head_dim ", D, " is over ", MAX_CHUNKS * LANES);
  // Pieces: (row, first key, end key); the partial results of multi-piece rows go to `part`.
  struct Piece {
    int64_t m, j0, j1, part;  // part: index of its partials, -1 if it is the row's only piece
  };
  std::vector<Piece> pieces;
  std::vector<int64_t> row_part(M, -1), row_pieces(M);  // a row's first partials, its pieces
  int64_t parts = 0;
  for (int64_t m = 0; m < M; ++m) {
    const int64_t L = ks.len[m], n = std::max<int64_t>(1, ceil_div(L, KEY_CHUNK));
    row_pieces[m] = n;
    if (n > 1) row_part[m] = parts;
    for (int64_t c = 0; c < n; ++c) {
      pieces.push_back({m, c * KEY_CHUNK, std::min(L, (c + 1) * KEY_CHUNK), n > 1 ? parts++ : -1});
    }
  }
  const int64_t P = static_cast<int64_t>(pieces.size());
  // Heads per task: all of a row's (each key's kv heads sit side by side in the cache: one
  // contiguous read), else one kv head's group (each key read and widened once for them), else
  // one head, as the pieces allow keeping every thread busy. (Same arithmetic either way.)
  int64_t hpt = 1;
  if (H <= MAX_HEADS && P >= 2 * threads) {
    hpt = H;
  } else if (group <= MAX_HEADS && P * Hkv >= threads) {
    hpt = group;
  }
  const int64_t per_kv = std::min(hpt, group);  // heads of the task per kv head it reads
  const int64_t sets = H / hpt;
  // Partials per (part, head): the piece's max score, its probability sum, its value sum.
  std::vector<float> part_max(parts * H), part_sum(parts * H), part_acc(parts * H * width);
  at::parallel_for(0, P * sets, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(hpt * width), acc(hpt * width), scores;
    for (int64_t t = begin; t < end; ++t) {
      const Piece& pc = pieces[t / sets];
      const int64_t m = pc.m, h0 = (t % sets) * hpt, L = pc.j1 - pc.j0;
      const int64_t kv0 = h0 / group, kv1 = kv0 + ceil_div(hpt, group);  // kv heads it reads
      const int64_t* slot = ks.slots.data() + ks.start[m] + pc.j0;
      for (int64_t g = 0; g < hpt; ++g) {
        const T* qr = qkv + m * row_stride + (h0 + g) * D;
        for (int64_t c = 0; c < chunks; ++c) {  // zero past D
          vstu(&q[g * width + c * LANES], vld(qr + c * LANES, first(D - c * LANES)));
        }
      }
      const KeyRange keys{slot, L, Hkv, kv0, kv1 - kv0, D, per_kv, width};
      scores.resize(hpt * L);
      with_chunks(chunks, [&](auto c) {
        score_keys<T, decltype(c)::value>(q.data(), k_cache, keys, scale, scores.data());
      });
      float sum[MAX_HEADS], top_of[MAX_HEADS];
      for (int64_t g = 0; g < hpt; ++g) {  // probabilities, unnormalised, rounded to T
        float* sg = scores.data() + g * L;
        V mx = vset(-INFINITY);
        for (int64_t j = 0; j < L; j += LANES) {
          const Mask k = first(L - j);
          mx = vmax(mx, vld_or(sg + j, k, -INFINITY));
        }
        top_of[g] = vhmax(mx);
        const V top = vset(top_of[g]);
        V total = vzero();
        for (int64_t j = 0; j < L; j += LANES) {
          const Mask k = first(L - j);
          const V x = vsub(vld(sg + j, k), top);
          const V e = vkeep(vexp(x), k);
          total = vadd(total, e);
          vst(sg + j, vrnd<T>(e), k);
        }
        sum[g] = vhsum(total);
      }
      with_chunks(chunks, [&](auto c) {
        sum_values<T, decltype(c)::value>(scores.data(), v_cache, keys, hpt, acc.data());
      });
      for (int64_t g = 0; g < hpt; ++g) {
        if (pc.part >= 0) {  // one piece of several: keep the partials
          const int64_t i = pc.part * H + h0 + g;
          part_max[i] = top_of[g];
          part_sum[i] = sum[g];
          std::copy_n(&acc[g * width], width, &part_acc[i * width]);
          continue;
        }
        const V total = vset(sum[g]);
        T* o = out + (m * H + h0 + g) * D;
        for (int64_t c = 0; c < chunks; ++c) {
          const V a = vldu(&acc[g * width + c * LANES]);
          vst(o + c * LANES, vdiv(a, total), first(D - c * LANES));
        }
      }
    }
  });
  if (parts == 0) return;
  // Merge the pieces of each multi-piece row: rescale each to the row's maximum.
  at::parallel_for(0, M * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(width);
    for (int64_t mh = begin; mh < end; ++mh) {
      const int64_t m = mh / H, h = mh % H, first_part = row_part[m], n = row_pieces[m];
      if (first_part < 0) continue;  // one piece: written directly
      float top = -INFINITY;
      for (int64_t c = 0; c < n; ++c) top = std::max(top, part_max[(first_part + c) * H + h]);
      float total = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c = 0; c < n; ++c) {
        const int64_t i = (first_part + c) * H + h;
        const float w = std::exp(part_max[i] - top);
        total += w * part_sum[i];
        for (int64_t d = 0; d < width; ++d) acc[d] += w * part_acc[i * width + d];
      }
      T* o = out + (m * H + h) * D;
      for (int64_t d = 0; d < D; ++d) st(o + d, acc[d] / total);
    }
  });
}

// ---------------------------------------------------------------- the stack

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// A weight packed by ``pack`` for an [O, K] matrix, checked against that shape.
Mat packed(const at::Tensor& t, int64_t O, int64_t K) {
  if (t.scalar_type() == at::kByte) {  // ``pack_blocks``: [O / 16, K / 32, block bytes]
    const int bits = t.dim() == 3 && t.size(2) == qb_bytes(8) ? 8 : 4;
    TORCH_CHECK(t.is_contiguous() && t.dim() == 3 && K % QBLOCK == 0 &&
                    t.size(0) == ceil_div(O, LANES) && t.size(1) == K / QBLOCK &&
                    t.size(2) == qb_bytes(bits),
                "a block-quantized weight does not match its shape [", O, ", ", K, "]: got ",
                t.sizes());
    return Mat{t.data_ptr(), O, K, bits};
  }
  const bool bf16 = t.scalar_type() == at::kBFloat16;
  const std::vector<int64_t> want =
      bf16 ? std::vector<int64_t>{ceil_div(O, LANES), ceil_div(K, 2), LANES, 2}
           : std::vector<int64_t>{ceil_div(O, LANES), K, LANES};
  TORCH_CHECK(t.is_contiguous() && t.sizes().vec() == want,
              "a packed weight does not match its shape [", O, ", ", K, "]: got ", t.sizes());
  return Mat{t.data_ptr(), O, K};
}

// What every layer of one step shares.
struct Step {
  int64_t M, H, Hkv, D, hidden, inter;
  float eps, scale;
  const int64_t* pos;   // [M] positions
  const int64_t* slot;  // [M] KV-write slots
  const float* cos_sin;
  const Paged& p;
  KeySlots keys;
  Step(int64_t M, int64_t H, int64_t Hkv, int64_t D, int64_t hidden, int64_t inter, double eps,
       double scale, const at::Tensor& positions, const at::Tensor& slots,
       const at::Tensor& cos_sin, const Paged& p, int64_t num_slots)
      : M(M), H(H), Hkv(Hkv), D(D), hidden(hidden), inter(inter), eps(static_cast<float>(eps)),
        scale(static_cast<float>(scale)), pos(positions.data_ptr<int64_t>()),
        slot(slots.data_ptr<int64_t>()), cos_sin(cos_sin.data_ptr<float>()), p(p),
        keys(p, M, num_slots) {}
};

// The attention sublayer on normed rows xin [M, in_dim]: QKV, rotary, the KV write, attention
// over the paged cache, O projection into out [M, hidden].
template <typename T>
void attention_block(const Step& s, const T* xin, const Mat& w_qkv, const Mat& w_o, T* k_cache,
                     T* v_cache, T* out) {
  const int64_t M = s.M, kv = s.Hkv * s.D, width = (s.H + 2 * s.Hkv) * s.D;
  std::vector<T> qkv(M * width), attn(M * s.H * s.D);
  matvec(xin, w_qkv, qkv.data(), M);
  rotary(qkv.data(), s.pos, s.cos_sin, M, s.H + s.Hkv, s.D, width);
  for (int64_t m = 0; m < M; ++m) {
    const T* row = qkv.data() + m * width;
    std::memcpy(k_cache + s.slot[m] * kv, row + s.H * s.D, kv * sizeof(T));
    std::memcpy(v_cache + s.slot[m] * kv, row + s.H * s.D + kv, kv * sizeof(T));
  }
  attention(qkv.data(), width, k_cache, v_cache, attn.data(), s.p, s.keys, M, s.H, s.Hkv, s.D,
            s.scale);
  matvec(attn.data(), w_o, out, M);
}

// The MLP sublayer on rows of the residual stream: out = down(silu(gate) * up)(norm(residual)).
template <typename T>
void mlp_block(int64_t rows, int64_t hidden, float eps, const T* residual, const T* w_norm,
               const Mat& w_gate_up, const Mat& w_down, T* out) {
  const int64_t inter = w_down.K;
  std::vector<T> h(rows * hidden), gu(rows * 2 * inter), act(rows * inter);
  rms_norm(residual, w_norm, h.data(), rows, hidden, eps);
  matvec(h.data(), w_gate_up, gu.data(), rows);
  silu_mul(gu.data(), act.data(), rows, inter);
  matvec(act.data(), w_down, out, rows);
}

template <typename T>
std::vector<at::Tensor> run_stack(const at::Tensor& x, const Step& s,
                                     const std::vector<at::Tensor>& weights,
                                     const std::vector<at::Tensor>& caches,
                                     const at::Tensor& final_norm,
                                     const std::vector<int64_t>& capture) {
  const int64_t M = s.M, hidden = s.hidden;
  const int64_t layers = static_cast<int64_t>(caches.size() / 2);
  const int64_t width = (s.H + 2 * s.Hkv) * s.D;
  auto opts = x.options();
  at::Tensor residual = x.clone();
  at::Tensor mlp_out = at::empty({M, hidden}, opts);
  std::vector<T> h(M * hidden);
  std::vector<at::Tensor> result(1 + capture.size());
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = &weights[l * 6];
    const Mat qkv = packed(w[1], width, hidden), o = packed(w[2], hidden, s.H * s.D);
    const Mat gate_up = packed(w[4], 2 * s.inter, hidden), down = packed(w[5], hidden, s.inter);
    if (l > 0) add_into(ptr<T>(mlp_out), ptr<T>(residual), M * hidden);
    rms_norm(ptr<T>(residual), ptr<T>(w[0]), h.data(), M, hidden, s.eps);
    attention_block(s, h.data(), qkv, o, ptr<T>(caches[2 * l]), ptr<T>(caches[2 * l + 1]),
                    h.data());
    add_into(h.data(), ptr<T>(residual), M * hidden);
    mlp_block(M, hidden, s.eps, ptr<T>(residual), ptr<T>(w[3]), gate_up, down, ptr<T>(mlp_out));
    for (size_t c = 0; c < capture.size(); ++c) {
      if (capture[c] == l) {
        at::Tensor cap = residual.clone();
        add_into(ptr<T>(mlp_out), ptr<T>(cap), M * hidden);
        result[1 + c] = cap;
      }
    }
  }
  add_into(ptr<T>(mlp_out), ptr<T>(residual), M * hidden);
  at::Tensor out = at::empty({M, hidden}, opts);
  rms_norm(ptr<T>(residual), ptr<T>(final_norm), ptr<T>(out), M, hidden, s.eps);
  result[0] = out;
  return result;
}

// The Eagle3 midlayer: attention over cat[norm(embeds), hidden_norm(hidden)] on every row (each
// writes its draft KV), then the residual add and MLP on the `pick` rows only. Returns the
// pre-norm output [P, hidden]. weights: input norm, hidden norm, QKV, O, post-attention norm,
// gate/up, down.
template <typename T>
at::Tensor run_eagle3(const at::Tensor& embeds, const at::Tensor& hidden_in,
                         const std::vector<int64_t>& pick, const Step& s,
                         const std::vector<at::Tensor>& w, const at::Tensor& k_cache,
                         const at::Tensor& v_cache) {
  const int64_t M = s.M, H = s.hidden, P = static_cast<int64_t>(pick.size());
  std::vector<T> x(M * 2 * H), o(M * H);
  for (int64_t m = 0; m < M; ++m) {
    rms_norm(ptr<T>(embeds) + m * H, ptr<T>(w[0]), x.data() + m * 2 * H, 1, H, s.eps);
    rms_norm(ptr<T>(hidden_in) + m * H, ptr<T>(w[1]), x.data() + m * 2 * H + H, 1, H, s.eps);
  }
  const Mat qkv = packed(w[2], (s.H + 2 * s.Hkv) * s.D, 2 * H), wo = packed(w[3], H, s.H * s.D);
  const Mat gate_up = packed(w[5], 2 * s.inter, H), down = packed(w[6], H, s.inter);
  attention_block(s, x.data(), qkv, wo, ptr<T>(k_cache), ptr<T>(v_cache), o.data());
  at::Tensor residual = at::empty({P, H}, embeds.options());
  for (int64_t i = 0; i < P; ++i) {
    std::memcpy(ptr<T>(residual) + i * H, o.data() + pick[i] * H, H * sizeof(T));
    add_into(ptr<T>(hidden_in) + pick[i] * H, ptr<T>(residual) + i * H, H);
  }
  at::Tensor out = at::empty({P, H}, embeds.options());
  mlp_block(P, H, s.eps, ptr<T>(residual), ptr<T>(w[4]), gate_up, down, ptr<T>(out));
  add_into(ptr<T>(residual), ptr<T>(out), P * H);
  return out;
}

}  // namespace

namespace {

// Checks what one step's rows index (positions, write slots, sequences, key counts, caches)
// and returns the paged-cache view of the step.
Paged check_step(const at::Tensor& x, const at::Tensor& positions,
                 const at::Tensor& slots, const at::Tensor& row_seq,
                 const at::Tensor& kv_len, const at::Tensor& block_tables,
                 const std::vector<at::Tensor>& caches, const std::vector<at::Tensor>& weights,
                 const at::Tensor& cos_sin, int64_t num_kv_heads, int64_t head_dim,
                 int64_t block_size, const at::Tensor& tree_words = at::Tensor()) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, hidden] tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "dtype must be bfloat16 or float32");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.size(1) == head_dim,
              "cos_sin must be float32 [positions, head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt, "block_tables must be int32");
  for (const auto& t : weights) {
    TORCH_CHECK(t.is_contiguous() &&
                    (t.scalar_type() == x.scalar_type() ||
                     (t.scalar_type() == at::kByte && t.dim() == 3)),
                "weights must be contiguous and in the activation dtype (matrices: or quantized "
                "blocks)");
  }
  for (const auto& t : caches) {
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == x.scalar_type(),
                "KV caches must be contiguous and in the activation dtype");
  }
  TORCH_CHECK(caches.size() >= 2 && positions.size(0) == x.size(0) &&
                  slots.size(0) == x.size(0) && row_seq.size(0) == x.size(0) &&
                  kv_len.size(0) == x.size(0),
              "positions, slots, row_seq and kv_len need one entry per row");
  const int64_t num_slots = caches[0].numel() / (num_kv_heads * head_dim);
  const int64_t max_keys = block_tables.size(1) * block_size;
  for (int64_t m = 0; m < x.size(0); ++m) {
    const int64_t pos = positions.data_ptr<int64_t>()[m], slot = slots.data_ptr<int64_t>()[m];
    const int64_t seq = row_seq.data_ptr<int64_t>()[m], len = kv_len.data_ptr<int64_t>()[m];
    TORCH_CHECK(pos >= 0 && pos < cos_sin.size(0), "position ", pos, " is out of range");
    TORCH_CHECK(slot >= 0 && slot < num_slots, "KV slot ", slot, " is out of range");
    TORCH_CHECK(seq >= 0 && seq < block_tables.size(0), "row sequence is out of range");
    TORCH_CHECK(len >= 1 && len <= max_keys, "key count ", len, " is out of range");
  }
  const bool tree = tree_words.defined() && tree_words.numel() > 0;
  if (tree) {
    TORCH_CHECK(tree_words.scalar_type() == at::kLong && tree_words.is_contiguous() &&
                    tree_words.size(0) == x.size(0),
                "tree_words must be int64 [M]");
  }
  return Paged{block_tables.data_ptr<int32_t>(),
               block_tables.size(1),
               row_seq.data_ptr<int64_t>(),
               kv_len.data_ptr<int64_t>(),
               block_size,
               tree ? tree_words.data_ptr<int64_t>() : nullptr};
}

}  // namespace

// Returns [final normed hidden [M, hidden], the residual stream after each capture layer].
std::vector<at::Tensor> llama_stack(
    at::Tensor x, at::Tensor positions, at::Tensor slots, at::Tensor row_seq,
    at::Tensor kv_len, at::Tensor block_tables, at::Tensor tree_words,
    std::vector<at::Tensor> weights, std::vector<at::Tensor> caches,
    at::Tensor final_norm, at::Tensor cos_sin, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, int64_t intermediate_size, double eps, double scale,
    std::vector<int64_t> capture) {
  TORCH_CHECK(weights.size() == caches.size() * 3, "6 weights and 2 caches per layer");
  const Paged p = check_step(x, positions, slots, row_seq, kv_len, block_tables, caches, weights,
                             cos_sin, num_kv_heads, head_dim, block_size, tree_words);
  const Step s(x.size(0), num_heads, num_kv_heads, head_dim, x.size(1), intermediate_size, eps,
               scale, positions, slots, cos_sin, p, caches[0].numel() / (num_kv_heads * head_dim));
  if (x.scalar_type() == at::kBFloat16) {
    return run_stack<uint16_t>(x, s, weights, caches, final_norm, capture);
  }
  return run_stack<float>(x, s, weights, caches, final_norm, capture);
}

// One Eagle3 midlayer step (see run_eagle3); `pick` empty = every row.
at::Tensor eagle3_layer(at::Tensor embeds, at::Tensor hidden, std::vector<int64_t> pick,
                           at::Tensor positions, at::Tensor slots, at::Tensor row_seq,
                           at::Tensor kv_len, at::Tensor block_tables,
                           at::Tensor tree_words, std::vector<at::Tensor> weights,
                           at::Tensor k_cache, at::Tensor v_cache, at::Tensor cos_sin,
                           int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           int64_t intermediate_size, double eps, double scale) {
  TORCH_CHECK(weights.size() == 7, "7 weights");
  TORCH_CHECK(hidden.sizes() == embeds.sizes() && hidden.is_contiguous() &&
                  hidden.scalar_type() == embeds.scalar_type(),
              "hidden must match embeds");
  const std::vector<at::Tensor> caches{k_cache, v_cache};
  const Paged p = check_step(embeds, positions, slots, row_seq, kv_len, block_tables, caches,
                             weights, cos_sin, num_kv_heads, head_dim, block_size, tree_words);
  const int64_t M = embeds.size(0);
  if (pick.empty()) {
    for (int64_t m = 0; m < M; ++m) pick.push_back(m);
  }
  for (int64_t r : pick) TORCH_CHECK(r >= 0 && r < M, "picked row ", r, " is out of range");
  const Step s(M, num_heads, num_kv_heads, head_dim, embeds.size(1), intermediate_size, eps, scale,
               positions, slots, cos_sin, p, k_cache.numel() / (num_kv_heads * head_dim));
  if (embeds.scalar_type() == at::kBFloat16) {
    return run_eagle3<uint16_t>(embeds, hidden, pick, s, weights, k_cache, v_cache);
  }
  return run_eagle3<float>(embeds, hidden, pick, s, weights, k_cache, v_cache);
}

// w [O, K] (bfloat16 or float32) in the layout ``matvec`` reads (zero padding).
at::Tensor pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "pack: w [O, K] expected");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat,
              "dtype must be bfloat16 or float32");
  const int64_t O = w.size(0), K = w.size(1), O16 = ceil_div(O, LANES) * LANES;
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  const int64_t K2 = bf16 ? ceil_div(K, 2) * 2 : K;
  at::Tensor padded = at::zeros({O16, K2}, w.options());
  padded.narrow(0, 0, O).narrow(1, 0, K).copy_(w);
  if (bf16) {
    return padded.view({O16 / LANES, LANES, K2 / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  }
  return padded.view({O16 / LANES, LANES, K}).permute({0, 2, 1}).contiguous();
}

// x [M, K] @ w.T → [M, out_features] in x's dtype; w as ``pack`` (or ``pack_blocks``) left it.
at::Tensor linear(at::Tensor x, at::Tensor w, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "linear: x [M, K] expected");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() || w.scalar_type() == at::kByte,
              "linear: x and w dtypes differ");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "dtype must be bfloat16 or float32");
  x = x.contiguous();
  const Mat m = packed(w, out_features, x.size(1));
  auto y = at::empty({x.size(0), out_features}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    matvec(ptr<uint16_t>(x), m, ptr<uint16_t>(y), x.size(0));
  } else {
    matvec(ptr<float>(x), m, ptr<float>(y), x.size(0));
  }
  return y;
}

// The first index of row x[0 .. n)'s maximum, or of its first NaN (torch.argmax's answer).
// Blocks of 256 keep their maxima (vector passes); the first block holding the row's maximum is
// then scanned. Rows with inf or NaN (x - x is NaN) are scanned whole, one value at a time.
template <typename T>
int64_t row_argmax(const T* x, int64_t n, std::vector<float>& block_max) {
  constexpr int64_t BLOCK = 256;
  const int64_t blocks = ceil_div(n, BLOCK);
  block_max.resize(blocks);
  V finite = vzero();
  float tail_finite = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t end = std::min(n, (b + 1) * BLOCK);
    V mx = vset(-INFINITY);
    int64_t i = b * BLOCK;
    for (; i + LANES <= end; i += LANES) {
      const V v = vld(x + i, first(LANES));
      mx = vmax(mx, v);
      finite = vadd(finite, vsub(v, v));
    }
    float m = vhmax(mx);
    for (; i < end; ++i) {  // the row's last values
      m = std::max(m, ld(x + i));
      tail_finite += ld(x + i) - ld(x + i);
    }
    block_max[b] = m;
  }
  if (!std::isfinite(vhsum(finite) + tail_finite)) {
    int64_t best = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float v = ld(x + i), top = ld(x + best);
      if (std::isnan(v)) return i;
      if (v > top) best = i;
    }
    return best;
  }
  const float top = *std::max_element(block_max.begin(), block_max.end());
  const int64_t b = std::find(block_max.begin(), block_max.end(), top) - block_max.begin();
  for (int64_t i = b * BLOCK;; ++i) {
    if (ld(x + i) == top) return i;
  }
}

// x [B, V] (bfloat16 or float32, rows contiguous) -> int64 [B]: x.argmax(-1).
at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "argmax_rows: x [B, V > 0] expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "dtype must be bfloat16 or float32");
  if (x.stride(1) != 1) x = x.contiguous();
  const int64_t B = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = at::empty({B}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> block_max;
    for (int64_t b = b0; b < b1; ++b) {
      o[b] = x.scalar_type() == at::kBFloat16
                 ? row_argmax(ptr<uint16_t>(x) + b * stride, n, block_max)
                 : row_argmax(ptr<float>(x) + b * stride, n, block_max);
    }
  });
  return out;
}

// The softmax probability of row x[0 .. n)'s maximum `top`: 1 / sum(exp(x - top)) (NaN for a
// row with NaN).
template <typename T>
float row_top_probability(const T* x, int64_t n, float top) {
  const V t = vset(top);
  V total = vzero();
  for (int64_t i = 0; i < n; i += LANES) {
    const Mask k = first(n - i);
    total = vadd(total, vkeep(vexp(vsub(vld(x + i, k), t)), k));
  }
  return 1.f / vhsum(total);
}

// Greedy Eagle3 draft steps 1 .. steps for one row per request, in one call (the draft loop's
// per-step Python work gone): step j embeds row b's previous draft (a target id) from the
// target's embedding (rounded to the head's dtype), runs the midlayer at position
// positions[b] + j (writing its draft KV; block index clamped to the table, as the eager
// loop's metadata does), applies the final norm, the LM head over the draft vocabulary and its
// argmax, and maps the draft id to a target id (id + d2t[id]). hidden [B, H]: step 0's picked
// midlayer outputs; tokens [B]: step 0's drafts. Returns [B, steps] target ids.
// Confidence (cum non-empty: each row's product of its drafts' probabilities after step 0):
// conf [B, steps] gets each step's running product (the head's softmax probability of its
// argmax times the row's product so far), and the chain stops after a step where every row's
// product is under min_conf (no later draft would be verified): the steps not run repeat the
// row's last draft with confidence 0.
template <typename T, typename E>
at::Tensor run_eagle3_chain(at::Tensor h, std::vector<int64_t> tok, std::vector<float> cum,
                               float min_conf, float* conf,
                               const at::Tensor& positions, const at::Tensor& block_tables,
                               const E* embedding, int64_t vocab,
                               const std::vector<at::Tensor>& weights,
                               const std::vector<at::Tensor>& caches,
                               const at::Tensor& cos_sin, const at::Tensor& final_norm,
                               const Mat& lm_head, const int64_t* d2t, int64_t steps,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t block_size, int64_t inter, double eps, double scale) {
  const int64_t B = h.size(0), H = h.size(1), V = lm_head.O;
  const auto i64 = h.options().dtype(at::kLong);
  at::Tensor drafts = at::empty({B, steps}, i64);
  at::Tensor pos = at::empty({B}, i64), slots = at::empty({B}, i64);
  at::Tensor row_seq = at::arange(B, i64), kv_len = at::empty({B}, i64);
  at::Tensor embeds = at::empty({B, H}, h.options());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t width = block_tables.size(1);
  std::vector<T> normed(B * H), logits(B * V);
  std::vector<float> block_max;
  for (int64_t j = 1; j <= steps; ++j) {
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(tok[b] >= 0 && tok[b] < vocab, "draft token ", tok[b], " is out of range");
      const int64_t p = positions.data_ptr<int64_t>()[b] + j;
      const int64_t block = tables[b * width + std::min(p / block_size, width - 1)];
      pos.data_ptr<int64_t>()[b] = p;
      slots.data_ptr<int64_t>()[b] = block * block_size + p % block_size;
      kv_len.data_ptr<int64_t>()[b] = p + 1;
      for (int64_t i = 0; i < H; ++i) st(ptr<T>(embeds) + b * H + i, ld(embedding + tok[b] * H + i));
    }
    const Paged pg = check_step(embeds, pos, slots, row_seq, kv_len, block_tables, caches,
                                weights, cos_sin, num_kv_heads, head_dim, block_size);
    const Step s(B, num_heads, num_kv_heads, head_dim, H, inter, eps, scale, pos, slots, cos_sin,
                 pg, caches[0].numel() / (num_kv_heads * head_dim));
    std::vector<int64_t> all(B);
    for (int64_t b = 0; b < B; ++b) all[b] = b;
    h = run_eagle3<T>(embeds, h, all, s, weights, caches[0], caches[1]);
    rms_norm(ptr<T>(h), ptr<T>(final_norm), normed.data(), B, H, static_cast<float>(eps));
    matvec(normed.data(), lm_head, logits.data(), B);
    bool confident = cum.empty();
    for (int64_t b = 0; b < B; ++b) {
      const T* row = logits.data() + b * V;
      const int64_t id = row_argmax(row, V, block_max);
      tok[b] = id + d2t[id];
      drafts.data_ptr<int64_t>()[b * steps + j - 1] = tok[b];
      if (!cum.empty()) {
        cum[b] *= row_top_probability(row, V, ld(row + id));
        conf[b * steps + j - 1] = cum[b];
        confident = confident || cum[b] >= min_conf;  // NaN: not confident
      }
    }
    if (!confident) {
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t i = j; i < steps; ++i) {
          drafts.data_ptr<int64_t>()[b * steps + i] = tok[b];
          conf[b * steps + i] = 0.f;
        }
      }
      break;
    }
  }
  return drafts;
}

// confidence: empty (no confidence), or float32 [B], each row's product of draft probabilities
// so far; returns (drafts [B, steps], their running products [B, steps] or empty).
std::tuple<at::Tensor, at::Tensor> eagle3_chain(
    at::Tensor hidden, at::Tensor tokens, at::Tensor positions, at::Tensor block_tables,
    at::Tensor embedding, std::vector<at::Tensor> weights, at::Tensor k_cache,
    at::Tensor v_cache, at::Tensor cos_sin, at::Tensor final_norm, at::Tensor lm_head,
    at::Tensor d2t, int64_t steps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t intermediate_size, double eps, double scale,
    at::Tensor confidence, double min_confidence) {
  TORCH_CHECK(weights.size() == 7, "7 weights");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden [B, H] expected");
  const int64_t B = hidden.size(0), H = hidden.size(1), V = d2t.size(0);
  TORCH_CHECK(steps >= 1, "steps must be positive");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.numel() == B, "tokens [B] int64");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == B &&
                  positions.is_contiguous(),
              "positions [B] int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.is_contiguous(),
              "block_tables [B, blocks] expected");
  TORCH_CHECK(embedding.dim() == 2 && embedding.size(1) == H && embedding.is_contiguous() &&
                  (embedding.scalar_type() == at::kFloat ||
                   embedding.scalar_type() == hidden.scalar_type()),
              "embedding [vocab, H] in float32 or the head's dtype expected");
  TORCH_CHECK(final_norm.numel() == H && final_norm.scalar_type() == hidden.scalar_type(),
              "final_norm [H] in the head's dtype expected");
  TORCH_CHECK(lm_head.scalar_type() == hidden.scalar_type() || lm_head.scalar_type() == at::kByte,
              "lm_head in the head's dtype or quantized blocks");
  TORCH_CHECK(d2t.scalar_type() == at::kLong && d2t.is_contiguous(), "d2t [V] int64");
  const Mat head = packed(lm_head, V, H);
  const int64_t* map = d2t.data_ptr<int64_t>();
  for (int64_t i = 0; i < V; ++i) {
    TORCH_CHECK(i + map[i] >= 0 && i + map[i] < embedding.size(0), "d2t maps out of the vocab");
  }
  auto t = tokens.contiguous();
  std::vector<int64_t> tok(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + B);
  std::vector<float> cum;
  at::Tensor conf = at::empty({0}, hidden.options().dtype(at::kFloat));
  if (confidence.numel() > 0) {
    TORCH_CHECK(confidence.scalar_type() == at::kFloat && confidence.numel() == B,
                "confidence [B] float32 expected");
    auto c = confidence.contiguous();
    cum.assign(c.data_ptr<float>(), c.data_ptr<float>() + B);
    conf = at::empty({B, steps}, hidden.options().dtype(at::kFloat));
  }
  const std::vector<at::Tensor> caches{k_cache, v_cache};
  auto run = [&](auto tag, const auto* emb) {
    using T = decltype(tag);
    return run_eagle3_chain<T>(hidden, tok, cum, static_cast<float>(min_confidence),
                               conf.numel() > 0 ? conf.data_ptr<float>() : nullptr, positions,
                               block_tables, emb, embedding.size(0), weights, caches, cos_sin,
                               final_norm, head, map, steps, num_heads, num_kv_heads, head_dim,
                               block_size, intermediate_size, eps, scale);
  };
  const bool fp32_embedding = embedding.scalar_type() == at::kFloat;
  at::Tensor drafts;
  if (hidden.scalar_type() == at::kBFloat16) {
    drafts = fp32_embedding ? run(uint16_t{}, ptr<float>(embedding))
                            : run(uint16_t{}, ptr<uint16_t>(embedding));
  } else {
    TORCH_CHECK(hidden.scalar_type() == at::kFloat, "dtype must be bfloat16 or float32");
    drafts = run(float{}, ptr<float>(embedding));
  }
  return {drafts, conf};
}

// exp of each element of a float32 tensor through vexp (the softmax and SiLU exponential), for
// its accuracy test.
at::Tensor exp_lanes(at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "exp_lanes: float32 expected");
  x = x.contiguous();
  auto y = at::empty_like(x);
  const float* px = x.data_ptr<float>();
  float* py = y.data_ptr<float>();
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; i += LANES) vst(py + i, vexp(vld(px + i, first(n - i))), first(n - i));
  return y;
}

#ifdef TANDEM_EXPECT_ISA  // tests: compiling with -march=... picks the branch they expect
static_assert(std::string_view(ISA) == TANDEM_EXPECT_ISA, "unexpected instruction set branch");
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("llama_stack", &llama_stack, "Llama decoder stack for small batches (CPU)");
  m.def("pack", &pack, "a weight in the layout linear / llama_stack / eagle3_layer read (CPU)");
  m.def("linear", &linear, "x @ w.T for a few rows, w packed (CPU)");
  m.def("eagle3_layer", &eagle3_layer, "Eagle3 midlayer for small batches (CPU)");
  m.def("eagle3_chain", &eagle3_chain,
        "greedy Eagle3 draft steps after the first, with their confidence (CPU)");
  m.def("argmax_rows", &argmax_rows, "x.argmax(-1) of a [B, V] tensor (CPU)");
  m.def("isa", []() { return std::string(ISA); }, "the instruction set it was built for");
  m.def("vnni", []() { return TANDEM_VNNI; }, "whether the block products use VNNI dot products");
  m.def("exp_lanes", &exp_lanes, "exp through the kernels' vector exp (tests)");
}
