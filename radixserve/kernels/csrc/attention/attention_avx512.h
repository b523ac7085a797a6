// attention.cpp's AVX-512 paths for one (row, kv head): float32 or bfloat16 pools with
// AVX-512F, and bfloat16 pools with AVX512-BF16 dot products. Free of ATen, so that a test can
// build them alone for an emulated CPU (tests/emulated_cpu.py) as well as into the op; the
// scratch they need comes from the caller. attention.cpp says what a row computes.

#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "common/vector.h"

#ifdef RS_X86
namespace radixserve::attention {
// Internal linkage, as when this code lived in its .cpp file: GCC then inlines the functions
// called once, and the op's machine code is what it was measured as.
namespace {

RS_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
RS_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  // bfloat16 is the top half of a float32: widen and shift.
  __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// e^x for x <= 0 (scores minus their maximum): x = n ln2 + r with |r| <= ln2/2, a degree-6
// polynomial for e^r (Cephes' expf coefficients), then scale by 2^n. Relative error ~2e-7.
RS_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // below this e^x is 0 in float32 anyway
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// s[t] = e^(scale (s[t] - top)) for t < n; returns their sum.
RS_AVX512 inline float softmax_in_place(float* s, int64_t n, float top, float scale) {
  const __m512 mv = _mm512_set1_ps(top), sv = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    __m512 e = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv), sv));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (t < n) {
    __mmask16 tail = static_cast<__mmask16>((1u << (n - t)) - 1);
    __m512 e = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), mv), sv));
    _mm512_mask_storeu_ps(s + t, tail, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
  }
  return _mm512_reduce_add_ps(sum);
}

// A query head's attention sink (gpt-oss: a learned logit per head that joins the softmax's
// denominator and nothing else), or -inf for none. The paths keep scores unscaled, so the
// softmax's maximum takes the sink as sink / scale; its weight e^(sink - scale top) is summed
// into the total once the keys' are.
inline float sink_of(const float* sinks, int64_t g) {
  return sinks ? sinks[g] : -std::numeric_limits<float>::infinity();
}

inline float top_with_sink(float top, float sink, float scale) {
  return std::max(top, sink / scale);
}

// e^(sink - scale top), 0 for no sink (exp16 alone would give e^-87 there).
RS_AVX512 inline float sink_weight(float sink, float top, float scale) {
  if (sink == -std::numeric_limits<float>::infinity()) return 0.f;
  return _mm512_cvtss_f32(exp16(_mm512_set1_ps(sink - top * scale)));
}

RS_AVX512 inline float max_of(const float* s, int64_t n) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + t));
  float m = _mm512_reduce_max_ps(top);
  for (; t < n; ++t) m = std::max(m, s[t]);
  return m;
}

// The same as attention.cpp's attend_portable, 16 floats at a time; D (head_dim) is a
// multiple of 16. sinks: the G query heads' sinks, or null.
template <typename T, int D>
RS_AVX512 void attend_avx512(const float* q, const T* keys, const T* values,
                             const int32_t* slots, int64_t n, int64_t groups, float scale,
                             const float* sinks, float* scores, T* out) {
  constexpr int W = D / 16;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 qg[W];
    for (int j = 0; j < W; ++j) qg[j] = _mm512_loadu_ps(q + g * D + 16 * j);
    float* s = scores + g * n;
    for (int64_t t = 0; t < n; ++t) {
      const T* k = keys + static_cast<int64_t>(slots[t]) * D;
      __m512 acc = _mm512_mul_ps(qg[0], load16(k));
      for (int j = 1; j < W; ++j) acc = _mm512_fmadd_ps(qg[j], load16(k + 16 * j), acc);
      s[t] = _mm512_reduce_add_ps(acc);
    }
    const float sink = sink_of(sinks, g);
    const float top = top_with_sink(max_of(s, n), sink, scale);
    const float total = softmax_in_place(s, n, top, scale) + sink_weight(sink, top, scale);
    __m512 acc[W];
    for (int j = 0; j < W; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const T* v = values + static_cast<int64_t>(slots[t]) * D;
      __m512 p = _mm512_set1_ps(s[t]);
      for (int j = 0; j < W; ++j) acc[j] = _mm512_fmadd_ps(p, load16(v + 16 * j), acc[j]);
    }
    alignas(64) float row[D];
    __m512 inv = _mm512_set1_ps(1.0f / total);
    for (int j = 0; j < W; ++j) _mm512_store_ps(row + 16 * j, _mm512_mul_ps(acc[j], inv));
    for (int d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(row[d]);
  }
}

// bfloat16 pools on CPUs with AVX512-BF16: products of bfloat16 pairs summed into float32 by
// one instruction (vdpbf16ps), K and V never widened. Scores of 16 keys are reduced together
// (reduce16) rather than one horizontal sum per key; V is read two keys at a time,
// interleaved, against the two keys' probabilities (rounded to bfloat16, as a bfloat16 matmul
// of probabilities and V would round them).
// Probabilities x values for NG query heads at once (their accumulators stay in registers
// while each pair of V rows is interleaved once). Pair lane i of chunk c holds dims
// c*32 + 8*(i/4) + i%4 (from unpacklo) or that + 4 (from unpackhi).
template <int D, int NG>
RS_AVX512BF16 void weigh_values_bf16(const uint16_t* probs, int64_t stride, const float* total,
                                     const c10::BFloat16* values, const int32_t* slots,
                                     int64_t n, c10::BFloat16* out) {
  constexpr int C = D / 32;
  __m512 lo[NG][C], hi[NG][C];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 2) {
    const c10::BFloat16* a = values + static_cast<int64_t>(slots[t]) * D;
    const c10::BFloat16* b = t + 1 < n ? values + static_cast<int64_t>(slots[t + 1]) * D : nullptr;
    __m512i even[C], odd[C];
    for (int c = 0; c < C; ++c) {
      __m512i ra = _mm512_loadu_si512(a + 32 * c);
      __m512i rb = b ? _mm512_loadu_si512(b + 32 * c) : _mm512_setzero_si512();
      even[c] = _mm512_unpacklo_epi16(ra, rb);
      odd[c] = _mm512_unpackhi_epi16(ra, rb);
    }
    for (int g = 0; g < NG; ++g) {
      uint32_t pair;  // probs has a zero after each row's last entry
      std::memcpy(&pair, probs + g * stride + t, sizeof(pair));
      const __m512bh p = as_bh(_mm512_set1_epi32(static_cast<int32_t>(pair)));
      for (int c = 0; c < C; ++c) {
        lo[g][c] = _mm512_dpbf16_ps(lo[g][c], as_bh(even[c]), p);
        hi[g][c] = _mm512_dpbf16_ps(hi[g][c], as_bh(odd[c]), p);
      }
    }
  }
  for (int g = 0; g < NG; ++g) {
    const __m512 inv = _mm512_set1_ps(1.0f / total[g]);
    for (int c = 0; c < C; ++c) {
      alignas(64) float l[16], h[16];
      _mm512_store_ps(l, _mm512_mul_ps(lo[g][c], inv));
      _mm512_store_ps(h, _mm512_mul_ps(hi[g][c], inv));
      for (int i = 0; i < 16; ++i) {
        const int d = 32 * c + 8 * (i / 4) + i % 4;
        out[g * D + d] = static_cast<c10::BFloat16>(l[i]);
        out[g * D + d + 4] = static_cast<c10::BFloat16>(h[i]);
      }
    }
  }
}

// Scratch: scores [groups * n], probs [groups * (n + 2)], total [groups]. sinks: the G query
// heads' sinks, or null.
template <int D>
RS_AVX512BF16 void attend_bf16(const c10::BFloat16* q, const c10::BFloat16* keys,
                               const c10::BFloat16* values, const int32_t* slots, int64_t n,
                               int64_t groups, float scale, const float* sinks, float* scores,
                               uint16_t* probs, float* total, c10::BFloat16* out) {
  constexpr int C = D / 32;
  const int64_t stride = n + 2;  // each head's probabilities, a zero after the last
  for (int64_t g = 0; g < groups; ++g) {
    __m512bh qg[C];
    for (int c = 0; c < C; ++c) qg[c] = load_bh(q + g * D + 32 * c);
    float* s = scores + g * n;
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        const c10::BFloat16* k = keys + static_cast<int64_t>(slots[t + j]) * D;
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), load_bh(k), qg[0]);
        for (int c = 1; c < C; ++c) a = _mm512_dpbf16_ps(a, load_bh(k + 32 * c), qg[c]);
        acc[kReduceSlot[j]] = a;
      }
      _mm512_storeu_ps(s + t, reduce16(acc));
    }
    for (; t < n; ++t) {
      const c10::BFloat16* k = keys + static_cast<int64_t>(slots[t]) * D;
      __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), load_bh(k), qg[0]);
      for (int c = 1; c < C; ++c) a = _mm512_dpbf16_ps(a, load_bh(k + 32 * c), qg[c]);
      s[t] = _mm512_reduce_add_ps(a);
    }
    const float sink = sink_of(sinks, g);
    const float top = top_with_sink(max_of(s, n), sink, scale);
    total[g] = softmax_in_place(s, n, top, scale) + sink_weight(sink, top, scale);
    uint16_t* p = probs + g * stride;
    for (t = 0; t + 16 <= n; t += 16) {
      __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(s + t));
      std::memcpy(p + t, &h, sizeof(h));
    }
    for (; t < n; ++t) {
      c10::BFloat16 h(s[t]);
      std::memcpy(p + t, &h, sizeof(h));
    }
    p[n] = p[n + 1] = 0;
  }
  // Query heads in blocks whose accumulators fit the 32 vector registers.
  constexpr int kBlock = D == 64 ? 4 : 2;
  int64_t g = 0;
  for (; g + kBlock <= groups; g += kBlock)
    weigh_values_bf16<D, kBlock>(probs + g * stride, stride, total + g, values, slots, n,
                                 out + g * D);
  for (; g < groups; ++g)
    weigh_values_bf16<D, 1>(probs + g * stride, stride, total + g, values, slots, n,
                            out + g * D);
}

}  // namespace
}  // namespace radixserve::attention
#endif
