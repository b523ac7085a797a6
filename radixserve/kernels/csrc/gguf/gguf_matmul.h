// What the GGUF matmul's entry (gguf_matmul.cpp) shares with the other ops that run its panel
// paths (gguf_moe.cpp): the activation quantization, the path chooser, the work shares and
// the bfloat16 writer.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "gguf/gguf_blocks.h"

namespace radixserve::gguf {

constexpr int64_t kRowChunk = 256;  // activation rows per call of a panel path (scratch size)

// x [M, K] quantized per block of 32 or 256: QuantizedRows' arrays (for blocks of 32 the sums
// and dxs, for 256 sums16 and sums32; the others empty), carved from one allocation: a decode
// step makes a hundred calls of a few microseconds, where six allocations each showed.
struct Quantized {
  at::Tensor buffer;
  QuantizedRows rows{};
};

// x [M, K] (float32 or bfloat16) quantized per block of `block` (32 or 256) on `path`; with
// tile_scales, also the AMX path's Q8_0 scales by tile.
Quantized quantize(const at::Tensor& x, int block, int path, bool tile_scales = false);

// Activation rows [r0, r0 + rows) against one panel: acc[(r - r0) * 16 + lane].
using PanelPath = void (*)(const Format&, const uint8_t*, const QuantizedRows&, int64_t, int64_t,
                           float*);

// The panel function of `path` (an index of path_names("gguf")).
PanelPath panel_path(int path);

// max_path checked and capped at this CPU's best path.
int checked_path(int64_t max_path);

// Runs [0, runs) split into equal contiguous shares, one per thread, each an atomic (front,
// back) pair: the owner takes runs from the front, others take them from the back once their
// own share is done, so every run is taken exactly once.
class RunShares {
 public:
  RunShares(int64_t runs, int64_t shares)
      : count_(shares), bounds_(new Bounds[static_cast<size_t>(shares)]) {
    for (int64_t i = 0; i < shares; ++i)
      bounds_[i].value.store(pack(runs * i / shares, runs * (i + 1) / shares));
  }

  // The next run for the caller that owns shares [first, end): from the front of its own, then
  // from the back of the others'; -1 once none is left.
  int64_t take(int64_t first, int64_t end) {
    for (int64_t i = first; i < end; ++i)
      if (const int64_t run = take_from(i, false); run >= 0) return run;
    for (int64_t k = 1; k < count_; ++k)
      if (const int64_t run = take_from((end - 1 + k) % count_, true); run >= 0) return run;
    return -1;
  }

 private:
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | static_cast<uint64_t>(back) << 32;
  }

  int64_t take_from(int64_t share, bool back) {
    std::atomic<uint64_t>& bounds = bounds_[share].value;
    uint64_t seen = bounds.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(seen & 0xFFFFFFFFu);
      const int64_t end = static_cast<int64_t>(seen >> 32);
      if (front >= end) return -1;
      const uint64_t taken = back ? pack(front, end - 1) : pack(front + 1, end);
      if (bounds.compare_exchange_weak(seen, taken, std::memory_order_relaxed))
        return back ? end - 1 : front;
    }
  }

  // One cache line each: a thread takes from its own share's bounds once per run, and with
  // the shares' bounds side by side every take moved the line away from the other thread.
  struct alignas(64) Bounds {
    std::atomic<uint64_t> value;
  };

  int64_t count_;
  std::unique_ptr<Bounds[]> bounds_;
};

// c10::BFloat16's rounding of one value: to nearest even, NaN as 0x7FC0.
inline uint16_t bf16_bits(uint32_t u) {
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// `count` <= 16 floats to bfloat16 with those bits, four at a time: a prefill's outputs are
// millions of values, and one at a time their rounding cost 15% of a 512-row matmul.
inline void write_bf16(const float* row, int64_t count, c10::BFloat16* out) {
#ifdef RS_X86
  if (count == kRows) {
    // SSE2, which every x86-64 CPU has: four values per step.
    const __m128i low_bit = _mm_set1_epi32(1), bias = _mm_set1_epi32(0x7FFF);
    const __m128i magnitude = _mm_set1_epi32(0x7FFFFFFF), inf = _mm_set1_epi32(0x7F800000);
    const __m128i nan = _mm_set1_epi32(0x7FC0);
    __m128i half[4];
    for (int q = 0; q < 4; ++q) {
      const __m128i u = _mm_castps_si128(_mm_loadu_ps(row + 4 * q));
      const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), low_bit);
      const __m128i rounded = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u, bias), lsb), 16);
      const __m128i is_nan = _mm_cmpgt_epi32(_mm_and_si128(u, magnitude), inf);
      const __m128i bits = _mm_or_si128(_mm_andnot_si128(is_nan, rounded),
                                        _mm_and_si128(is_nan, nan));
      // Sign-extended from 16 bits, so that the signed pack keeps the bits.
      half[q] = _mm_srai_epi32(_mm_slli_epi32(bits, 16), 16);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_packs_epi32(half[0], half[1]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out) + 1, _mm_packs_epi32(half[2], half[3]));
    return;
  }
#endif
  for (int64_t lane = 0; lane < count; ++lane) {
    uint32_t u;
    std::memcpy(&u, row + lane, sizeof(u));
    const uint16_t bits = bf16_bits(u);
    std::memcpy(out + lane, &bits, sizeof(bits));
  }
}

}  // namespace radixserve::gguf
