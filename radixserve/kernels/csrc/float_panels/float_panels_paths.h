// The paths of float_panels.cpp's matmul: the arithmetic only, free of ATen, so that a test
// can build them alone for an emulated CPU (tests/emulated_cpu.py) as well as into the op.
// float_panels.cpp says why the kernel exists and what it computes.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/vector.h"

namespace radixserve::float_panels {
// Internal linkage, as when this code lived in its .cpp file: GCC then inlines the functions
// called once, and the op's machine code is what it was measured as.
namespace {

constexpr int64_t kPanel = 16;  // output rows per panel

// Unrolled before GCC maps the accumulator arrays to registers; otherwise it keeps a copy of
// them in memory, stored at every step (measured: a third of the FMA rate).
#define RS_UNROLL _Pragma("GCC unroll 32")

enum Path : int64_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

inline float widen(float w) { return w; }
inline float widen(c10::Half w) { return static_cast<float>(w); }
inline float widen(c10::BFloat16 w) { return static_cast<float>(w); }

// One call's operands. out and bias are padded to whole panels (ldo = 16 P columns).
struct Problem {
  const float* x;  // [m, k]
  int64_t m, k, ldo;
  const float* bias;  // [ldo] or null
  float* out;         // [m, ldo]
};

// The oracle: each output's chain of std::fma, one panel at a time.
template <class T>
void panels_portable(const Problem& pr, const T* w, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const T* panel = w + p * pr.k * kPanel;
    for (int64_t row = 0; row < pr.m; ++row) {
      const float* x = pr.x + row * pr.k;
      float sums[kPanel] = {};
      for (int64_t s = 0; s < pr.k; ++s)
        for (int64_t j = 0; j < kPanel; ++j)
          sums[j] = std::fma(x[s], widen(panel[s * kPanel + j]), sums[j]);
      float* out = pr.out + row * pr.ldo + p * kPanel;
      for (int64_t j = 0; j < kPanel; ++j)
        out[j] = pr.bias ? sums[j] + pr.bias[p * kPanel + j] : sums[j];
    }
  }
}

// The size of the tile starting at row `done` when `rows` are cut into tiles of at most `most`
// rows, as even as can be (the larger ones first): a short last tile would have too few
// independent FMA chains to hide their latency.
inline int64_t tile_rows(int64_t rows, int64_t most, int64_t done) {
  const int64_t tiles = (rows + most - 1) / most, base = rows / tiles;
  return done < rows % tiles * (base + 1) ? base + 1 : base;
}

// Calls f(std::integral_constant<int, rows>) for a run-time rows in [1, Max].
template <int Max, class F>
void with_rows(int64_t rows, F&& f) {
  if constexpr (Max >= 1) {
    if (rows == Max) return f(std::integral_constant<int, Max>{});
    with_rows<Max - 1>(rows, f);
  }
}

#ifdef RS_X86
// ----- AVX2 + FMA + F16C: 16 outputs are two ymm -----

// 16 weights widened to float32. bfloat16 comes out as outputs (0, 2, .., 14) and (1, 3, .., 15):
// one shift and one mask instead of two zero-extensions; store16 puts them back in order.
RS_AVX2 inline void load16(const float* p, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(p);
  b = _mm256_loadu_ps(p + 8);
}
RS_AVX2 inline void load16(const c10::Half* p, __m256& a, __m256& b) {
  a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}
RS_AVX2 inline void load16(const c10::BFloat16* p, __m256& a, __m256& b) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  b = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000))));
}

// Stores 16 sums (+ bias) in output order; `even_odd`: a and b hold the even and odd outputs.
template <bool even_odd>
RS_AVX2 inline void store16(__m256 a, __m256 b, const float* bias, float* out) {
  if constexpr (even_odd) {
    const __m256 low = _mm256_unpacklo_ps(a, b), high = _mm256_unpackhi_ps(a, b);
    a = _mm256_permute2f128_ps(low, high, 0x20);
    b = _mm256_permute2f128_ps(low, high, 0x31);
  }
  if (bias) {
    a = _mm256_add_ps(a, _mm256_loadu_ps(bias));
    b = _mm256_add_ps(b, _mm256_loadu_ps(bias + 8));
  }
  _mm256_storeu_ps(out, a);
  _mm256_storeu_ps(out + 8, b);
}

// Rows [0, MR) of x against NP neighbouring panels over all of k, each weight loaded once and
// widened in registers. 2 * MR * NP accumulators (at most 12 of 16 ymm).
template <int MR, int NP, class T>
RS_AVX2 void tile_avx2(const float* x, int64_t k, const T* w, int64_t stride, float* out,
                              int64_t ldo, const float* bias) {
  static_assert(MR * NP <= 6, "12 accumulators");
  __m256 acc[MR][NP][2];
  RS_UNROLL for (int r = 0; r < MR; ++r)
    RS_UNROLL for (int j = 0; j < NP; ++j)
      acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < k; ++s) {
    RS_UNROLL for (int j = 0; j < NP; ++j) {
      __m256 w0, w1;
      load16(w + j * stride + s * kPanel, w0, w1);
      RS_UNROLL for (int r = 0; r < MR; ++r) {
        const __m256 xr = _mm256_broadcast_ss(x + r * k + s);
        acc[r][j][0] = _mm256_fmadd_ps(xr, w0, acc[r][j][0]);
        acc[r][j][1] = _mm256_fmadd_ps(xr, w1, acc[r][j][1]);
      }
    }
  }
  constexpr bool even_odd = std::is_same_v<T, c10::BFloat16>;
  RS_UNROLL for (int r = 0; r < MR; ++r)
    RS_UNROLL for (int j = 0; j < NP; ++j)
      store16<even_odd>(acc[r][j][0], acc[r][j][1], bias ? bias + j * kPanel : nullptr,
                        out + r * ldo + j * kPanel);
}

struct Avx2 {
  static constexpr int kTileRows = 6;  // 6 x 16 outputs: 12 ymm
  // Panels per tile of 1 to 3 rows (all of x): as many accumulators as leave registers for
  // the broadcasts, the weights and the bfloat16 mask (more spill one to the stack: 2x slower).
  static constexpr int panels_for(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }

  template <int MR, int NP, class T>
  static void tile(const float* x, int64_t k, const T* w, int64_t stride, float* out,
                   int64_t ldo, const float* bias) {
    tile_avx2<MR, NP>(x, k, w, stride, out, ldo, bias);
  }
};

// ----- AVX-512F: 16 outputs are one zmm; the same chains as AVX2 -----

RS_AVX512 inline __m512 load16_512(const float* p) { return _mm512_loadu_ps(p); }
RS_AVX512 inline __m512 load16_512(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
RS_AVX512 inline __m512 load16_512(const c10::BFloat16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

RS_AVX512 inline void store16_512(__m512 v, const float* bias, float* out) {
  if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
  _mm512_storeu_ps(out, v);
}

template <int MR, int NP, class T>
RS_AVX512 void tile_avx512(const float* x, int64_t k, const T* w, int64_t stride,
                                  float* out, int64_t ldo, const float* bias) {
  static_assert(MR * NP <= 24, "24 accumulators");
  __m512 acc[MR][NP];
  RS_UNROLL for (int r = 0; r < MR; ++r)
    RS_UNROLL for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < k; ++s) {
    RS_UNROLL for (int j = 0; j < NP; ++j) {
      const __m512 wj = load16_512(w + j * stride + s * kPanel);
      RS_UNROLL for (int r = 0; r < MR; ++r)
        acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * k + s]), wj, acc[r][j]);
    }
  }
  RS_UNROLL for (int r = 0; r < MR; ++r)
    RS_UNROLL for (int j = 0; j < NP; ++j)
      store16_512(acc[r][j], bias ? bias + j * kPanel : nullptr, out + r * ldo + j * kPanel);
}

struct Avx512 {
  static constexpr int kTileRows = 12;  // 12 x 16 outputs: 12 zmm
  static constexpr int panels_for(int rows) { return rows == 3 ? 6 : 8; }

  template <int MR, int NP, class T>
  static void tile(const float* x, int64_t k, const T* w, int64_t stride, float* out,
                   int64_t ldo, const float* bias) {
    tile_avx512<MR, NP>(x, k, w, stride, out, ldo, bias);
  }
};

// ----- the loop both vector paths share -----

// Up to 3 rows: one tile of every row against NP panels at a time. More: per panel, tiles of
// rows, the first streaming the panel from memory and the others finding it in cache.
template <class Isa, class T>
void panels_vector(const Problem& pr, const T* w, int64_t p0, int64_t p1) {
  const int64_t stride = pr.k * kPanel;
  auto tile = [&](auto rows, auto panels, int64_t r, int64_t p) {
    Isa::template tile<decltype(rows)::value, decltype(panels)::value>(
        pr.x + r * pr.k, pr.k, w + p * stride, stride, pr.out + r * pr.ldo + p * kPanel, pr.ldo,
        pr.bias ? pr.bias + p * kPanel : nullptr);
  };
  if (pr.m <= 3) {
    with_rows<3>(pr.m, [&](auto rows) {
      constexpr int NP = Isa::panels_for(rows);
      int64_t p = p0;
      for (; p + NP <= p1; p += NP) tile(rows, std::integral_constant<int, NP>{}, 0, p);
      for (; p < p1; ++p) tile(rows, std::integral_constant<int, 1>{}, 0, p);
    });
    return;
  }
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t r = 0; r < pr.m;) {
      const int64_t mr = tile_rows(pr.m, Isa::kTileRows, r);
      with_rows<Isa::kTileRows>(mr, [&](auto rows) {
        tile(rows, std::integral_constant<int, 1>{}, r, p);
      });
      r += mr;
    }
}
#endif

template <class T>
void run_panels(const Problem& pr, const T* w, int64_t path, int64_t p0, int64_t p1) {
#ifdef RS_X86
  if (path == kAvx512) return panels_vector<Avx512>(pr, w, p0, p1);
  if (path == kAvx2) return panels_vector<Avx2>(pr, w, p0, p1);
#endif
  panels_portable(pr, w, p0, p1);
}

}  // namespace
}  // namespace radixserve::float_panels

#undef RS_UNROLL  // a pragma for the loops above, not for the includer
