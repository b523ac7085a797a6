// skinny_matmul.cpp's AVX512-BF16 arithmetic: tiles of output rows against rows of x. Free of
// ATen, so that a test can build it alone for an emulated CPU (tests/emulated_cpu.py) as well
// as into the op; skinny_matmul.cpp says why the kernel exists.

#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "common/vector.h"

#ifdef RS_X86
namespace radixserve::skinny_matmul {
// Internal linkage, as when this code lived in its .cpp file: GCC then inlines the functions
// called once, and the op's machine code is what it was measured as.
namespace {

constexpr int64_t kPrefetchRows = 16;

// Output rows [n0, n0 + NR) for rows [m0, m0 + MR) of x: NR * MR <= 16 accumulators of 16
// partial sums, reduced together. Each weight row chunk is loaded once for all MR rows of x,
// so the first pass over a block streams the weights from memory while it computes.
template <int NR, int MR>
RS_AVX512BF16 inline void tile(const c10::BFloat16* x, const c10::BFloat16* w, int64_t k,
                               int64_t n0, int64_t m0, float* out, int64_t n) {
  static_assert(NR * MR <= 16, "16 accumulators");
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 32) {
    __m512bh xr[MR];
    for (int r = 0; r < MR; ++r) xr[r] = load_bh(x + (m0 + r) * k + c);
    for (int j = 0; j < NR; ++j) {
      const c10::BFloat16* row = w + (n0 + j) * k + c;
      // The line kPrefetchRows rows ahead: the hardware prefetcher alone falls behind when
      // every line is worked on this long (a prefetch past the end of W is harmless). One
      // row of x leaves each line quickly enough for the hardware alone (measured).
      if constexpr (MR > 1)
        _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * k), _MM_HINT_T0);
      const __m512bh wj = load_bh(row);
      for (int r = 0; r < MR; ++r)
        acc[r * NR + j] = _mm512_dpbf16_ps(acc[r * NR + j], wj, xr[r]);
    }
  }
  __m512 ordered[16];
  for (int i = 0; i < 16; ++i) ordered[kReduceSlot[i]] = acc[i];
  alignas(64) float sums[16];
  _mm512_store_ps(sums, reduce16(ordered));
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) out[(m0 + r) * n + n0 + j] = sums[r * NR + j];
}

// Output rows [n0, n0 + 16) for every row of x: the widest tiles first; later passes find
// the block's weights (16 rows, 18 KB at K = 576) in L1.
RS_AVX512BF16 void rows_block(const c10::BFloat16* x, const c10::BFloat16* w,
                                     int64_t m_rows, int64_t k, int64_t n, int64_t n0,
                                     float* out) {
  int64_t m = 0;
  for (; m + 8 <= m_rows; m += 8)
    for (int j = 0; j < 16; j += 2) tile<2, 8>(x, w, k, n0 + j, m, out, n);
  for (; m + 4 <= m_rows; m += 4)
    for (int j = 0; j < 16; j += 4) tile<4, 4>(x, w, k, n0 + j, m, out, n);
  for (; m + 2 <= m_rows; m += 2)
    for (int j = 0; j < 16; j += 8) tile<8, 2>(x, w, k, n0 + j, m, out, n);
  if (m < m_rows) tile<16, 1>(x, w, k, n0, m, out, n);
}

}  // namespace
}  // namespace radixserve::skinny_matmul
#endif
