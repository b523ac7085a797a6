// GGUF's quantized blocks and the panel layout they are repacked into: the one file that
// knows GGUF's bits. gguf_pack.cpp gathers blocks into panels; the matmul paths
// (gguf_matmul*.cpp) read panels only.
//
// A panel holds 16 output rows. Its blocks follow in k order, so a panel streams linearly.
// Each panel block puts the 16 rows' scales side by side (fp16 d[16], ...), then "units" of
// 64 bytes: 4 bytes of each row in turn, [row 0..15][4 bytes]. A vector of 8 (AVX2, one half
// of a unit) or 16 (AVX-512, a whole unit) int32 lanes then holds 4 weights of 8 or 16 rows,
// and one broadcast group of 4 activations serves all of them: the dot products need no
// horizontal sums. Rows past N are zero blocks (d = 0); no path writes them.
//
// Panel blocks (offsets in bytes; [n][16] is one byte per row, n times):
//   Q8_0 (32)   d@0 · 8 units@32: unit j = q[4j..4j+3]                               544 = 1.00x
//   Q4_0 (32)   d@0 · 4 units@32: unit t = qs[4t..4t+3]                               288 = 1.00x
//   Q4_1 (32)   d@0 · m@32 · 4 units@64                                               320 = 1.00x
//   Q4_K (256)  d@0 · dmin@32 · sc[8][16]@64 · m[8][16]@192 · 32 units@320:
//               unit p = qs[4p..4p+3], scales and mins unpacked from 6 bits          2368 = 1.03x
//   Q6_K (256)  d@0 · sc int8[16][16]@32 · 48 units@288: units 0..31 = ql quads,
//               units 32..47 = qh quads                                              3360 = 1.00x
// Q4 nibbles in unit t: low = weights 4t..4t+3, high = 16+4t..16+4t+3 (GGUF's own order).
// Q4_K unit 8c+t: low = weights 64c+4t.. (sub-block 2c), high = 64c+32+4t.. (sub-block 2c+1).
// Q6_K, half h of the block, v < 8: ql units A = 16h+v, B = 16h+8+v and qh unit H = 32+8h+v
// hold weights 128h+4v.. (A low, H bits 0-1), +32 (B low, bits 2-3), +64 (A high, bits 4-5)
// and +96 (B high, bits 6-7).

#pragma once

#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/vector.h"

namespace radixserve::gguf {

constexpr int kRows = 16;  // output rows per panel
constexpr int kUnit = 64;  // bytes per unit: 4 bytes of each of 16 rows

// How a panel stores a block's integers: signed bytes (q8s), nibbles (q4, q4m: Q4_0, Q4_1),
// Q4_K nibbles with 8 sub-block scales and mins, Q6_K 6-bit values with 16 group scales.
enum class Kind { q8s, q4, q4m, q4k, q6k };

// body(std::integral_constant<Kind, K>{}) for `kind` K: the one switch on block format, which
// each matmul path (gguf_matmul_{avx2,avx512,amx}.cpp) gives its own per-format template, so a
// path's inner loops are compiled once per format and chosen once per panel call. The body
// carries its path's target attribute, so that the path's template is inlined into it.
template <typename Body>
inline void with_kind(Kind kind, Body&& body) {
  switch (kind) {
    case Kind::q8s: return body(std::integral_constant<Kind, Kind::q8s>{});
    case Kind::q4: return body(std::integral_constant<Kind, Kind::q4>{});
    case Kind::q4m: return body(std::integral_constant<Kind, Kind::q4m>{});
    case Kind::q4k: return body(std::integral_constant<Kind, Kind::q4k>{});
    case Kind::q6k: return body(std::integral_constant<Kind, Kind::q6k>{});
  }
}

// One supported GGUF type: its file block and its panel block.
struct Format {
  int64_t ggml_type;
  Kind kind;
  int block;        // weights per block: 32, or 256 for K-quants
  int type_bytes;   // bytes of one GGUF block
  int panel_bytes;  // bytes of one panel block (16 rows)
  int units_at;     // offset of the units in a panel block
};

constexpr Format kQ8_0{8, Kind::q8s, 32, 34, 32 + 8 * kUnit, 32};
constexpr Format kQ4_0{2, Kind::q4, 32, 18, 32 + 4 * kUnit, 32};
constexpr Format kQ4_1{3, Kind::q4m, 32, 20, 64 + 4 * kUnit, 64};
constexpr Format kQ4_K{12, Kind::q4k, 256, 144, 320 + 32 * kUnit, 320};
constexpr Format kQ6_K{14, Kind::q6k, 256, 210, 288 + 48 * kUnit, 288};
constexpr int kQ4kScales = 64, kQ4kMins = 192, kQ6kScales = 32;

// The format of each kind, for code that is compiled per kind.
template <Kind K>
constexpr const Format& format_for() {
  switch (K) {
    case Kind::q8s: return kQ8_0;
    case Kind::q4: return kQ4_0;
    case Kind::q4m: return kQ4_1;
    case Kind::q4k: return kQ4_K;
    default: return kQ6_K;
  }
}

// The format of a GGUF type id, or nullptr where panels do not exist for it.
inline const Format* format_of(int64_t ggml_type) {
  switch (ggml_type) {
    case 8: return &kQ8_0;
    case 2: return &kQ4_0;
    case 3: return &kQ4_1;
    case 12: return &kQ4_K;
    case 14: return &kQ6_K;
    default: return nullptr;
  }
}

inline float half_at(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, sizeof(h));
  return static_cast<float>(h);
}

// fp16 scale s of panel row `lane` in one panel block: 0 is d; 1 is m (Q4_1) or dmin (Q4_K).
inline float scale_at(const uint8_t* block, int s, int lane) {
  return half_at(block + 32 * s + 2 * lane);
}

// Byte b of the 4 that row `lane` holds in unit u.
inline uint8_t unit_byte(const Format& f, const uint8_t* block, int u, int lane, int b) {
  return block[f.units_at + u * kUnit + 4 * lane + b];
}

// The integer of weight i of a block for panel row `lane`: the signed quant (q8s), the
// nibble u (Q4_0's weight is d * (u - 8), Q4_1's d * u + m, Q4_K's d * sc * u - dmin * m), or
// Q6_K's u in 0..63 (weight d * sc * (u - 32)).
inline int weight_int(const Format& f, const uint8_t* block, int lane, int i) {
  switch (f.kind) {
    case Kind::q8s: return static_cast<int8_t>(unit_byte(f, block, i / 4, lane, i % 4));
    case Kind::q4:
    case Kind::q4m:
      return (unit_byte(f, block, (i % 16) / 4, lane, i % 4) >> (i < 16 ? 0 : 4)) & 15;
    case Kind::q4k: {
      const int c = i / 64, high = (i / 32) & 1, l = i % 32;
      return (unit_byte(f, block, 8 * c + l / 4, lane, l % 4) >> (4 * high)) & 15;
    }
    case Kind::q6k: {
      const int h = i / 128, t = (i % 128) / 32, l = i % 32;
      const int lo = unit_byte(f, block, 16 * h + 8 * (t & 1) + l / 4, lane, l % 4);
      const int hi = unit_byte(f, block, 32 + 8 * h + l / 4, lane, l % 4);
      return ((lo >> (4 * (t >> 1))) & 15) | (((hi >> (2 * t)) & 3) << 4);
    }
  }
  return 0;
}

// Activations quantized per block, one row per row of x: q in [-127, 127] and dx the float
// scale (x ~ q * dx). Blocks of 32 (Q8_0, Q4_x) also have sums of q per block and dxs = dx *
// float(sums); blocks of 256 (K-quants) have int16 sums of q per 16 and per 32 instead.
struct QuantizedRows {
  const int8_t* q;
  const float* dx;
  const int32_t* sums;
  const float* dxs;
  const int16_t* sums16;
  const int16_t* sums32;
  int64_t k;       // activations per row
  int64_t blocks;  // k / block
  // The AMX path's copy of q, by tile: for each group of 16 rows and each block of 32, the 16
  // rows' 32 bytes side by side (512 bytes). A tile then loads 512 contiguous bytes instead of
  // 16 rows k bytes apart, which for k a multiple of 4096 all fall in one set of the L1
  // cache. nullptr where the call does not run that path.
  const int8_t* tiles = nullptr;
  // Blocks of 32 on that path: dx by tile, the 16 rows' scales of a group's block side by side,
  // so that the float step takes each row's scale at a fixed offset.
  const float* tile_dx = nullptr;
};

// Float accumulators of one panel for activation rows [r0, r0 + rows): acc[r * 16 + lane].
// For every (row, lane) and block b in k order, every path computes exactly, in float32:
//   Q8_0, Q4_0, Q4_1: P = int32 dot product of the block's weight integers with q
//     (Q4_0: minus 8 * sums); acc = fma(float(P), d_w * dx, acc); Q4_1 then
//     acc = fma(m_w, dxs, acc)
//   Q4_K: I = sum_j sc_j * P_j over sub-blocks of 32, Imin = sum_j m_j * sums32_j;
//     acc = fma(float(I), d_w * dx, acc); acc = fma(float(Imin), -(dmin_w * dx), acc)
//   Q6_K: I = sum_g sc_g * (P_g - 32 * sums16_g) over groups of 16;
//     acc = fma(float(I), d_w * dx, acc)
// so a row's result is the same bits whatever path, tile or thread computes it.
void panel_portable(const Format& f, const uint8_t* panel, const QuantizedRows& a, int64_t r0,
                    int64_t rows, float* acc);
void quantize_row32_portable(const float* x, int64_t k, int8_t* q, float* dx, int32_t* sums,
                             float* dxs);
void quantize_row256_portable(const float* x, int64_t k, int8_t* q, float* dx, int16_t* sums16,
                              int16_t* sums32);
#ifdef RS_X86
void panel_avx2(const Format& f, const uint8_t* panel, const QuantizedRows& a, int64_t r0,
                int64_t rows, float* acc);
void quantize_row32_avx2(const float* x, int64_t k, int8_t* q, float* dx, int32_t* sums,
                         float* dxs);
void quantize_row256_avx2(const float* x, int64_t k, int8_t* q, float* dx, int16_t* sums16,
                          int16_t* sums32);
void panel_avx512(const Format& f, const uint8_t* panel, const QuantizedRows& a, int64_t r0,
                  int64_t rows, float* acc);
void panel_amx(const Format& f, const uint8_t* panel, const QuantizedRows& a, int64_t r0,
               int64_t rows, float* acc);
#endif

// 127 / top for quantizing a block of activations, or 0 where that is not finite: a block of
// zeros, or one so small (top below ~3.7e-37) that the inverse overflows; its values then
// quantize to 0 on every path.
inline float inverse_of_top(float top) {
  const float id = top > 0.f ? 127.f / top : 0.f;
  return std::isfinite(id) ? id : 0.f;
}

}  // namespace radixserve::gguf
