// The quantized matmul's AMX path (AMX-TILE, AMX-INT8), for groups of 16 activation rows; the
// AVX-512 VNNI path takes the rows left over.
//
// From a few dozen rows on, a prefill's matmul is bound by its integer multiply-adds. One tile
// multiply (tdpbssd, tdpbsud) takes 16 activation rows of a block (A: 16 x 32 bytes, from
// QuantizedRows::tiles) against the block's weights of 16 output rows (B) into 16 x 16 int32
// sums (C): 8,192 products, where one vpdpbusd makes 64. B's layout is k/4 rows of [16 output
// rows][4 bytes], which is what a panel's 64-byte units already are: Q8_0's units load as they
// are; Q4 nibbles and Q6_K's 6-bit values are unpacked into bytes first (a K-quant superblock
// once for 4 groups of rows). The sums are exact, as vpdpbusd's; C goes through memory into
// vectors whose lanes are the panel's rows, as the VNNI path's accumulators, and the float
// step after each block (K-quants: the integer scale per sub-block or group, the float step
// per superblock) is the other paths' (gguf_blocks.h), so the bits are the portable path's.
//
// A tile's K is one block (32 bytes; Q6_K's groups of 16: 16 bytes), since each block's int32
// sums take their own scales; that per-block step (a tile store, the sums read back and
// scaled on vectors), not the tile multiplies, bounds this path. It gains most over the VNNI
// path on Q8_0, Q4_K (whose integer scales ride in the unpacked weights) and Q6_K, least on
// Q4_0 and Q4_1 (benchmarks/bench_quant_matmul.py --max-path). Two C tiles alternate, so that
// one block's multiply runs while the other's sums are read out.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/amx.h"
#include "gguf/gguf_blocks.h"

#ifdef RS_X86
namespace radixserve::gguf {
namespace {

using amx::TileConfig;

// tmm0, tmm1: C, 16 rows of 16 int32; tmm2, tmm3: A, 16 activation rows of `k_bytes`; tmm4,
// tmm5: B, k_bytes / 4 rows of 64 bytes.
constexpr TileConfig config_for(int k_bytes) {
  TileConfig c;
  c.palette = 1;
  for (int t = 0; t < 6; ++t) {
    c.rows[t] = t >= 4 ? k_bytes / 4 : 16;
    c.colsb[t] = t == 2 || t == 3 ? k_bytes : 64;
  }
  return c;
}

// In static storage (amx.h says why).
alignas(64) constexpr TileConfig kConfig32 = config_for(32);
alignas(64) constexpr TileConfig kConfig16 = config_for(16);

constexpr int kGroup = 16;  // activation rows per tile
constexpr int64_t kAheadBlocks = 8;  // Q8_0's weight prefetch distance (16 ran alike, 32 slower)
constexpr int64_t kTileBytes = kGroup * 32;  // one block of 32 of a group's rows, in a.tiles
// Groups of rows per unpack of a Q4 block or K-quant superblock: sharing an unpack among 4
// beat one at a time, more were no faster (benchmarks/bench_quant_matmul.py).
constexpr int64_t kGroupsPerUnpack = 4;

RS_AMX inline __m512i scales_u8(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

RS_AMX inline __m512i scales_i8(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

RS_AMX inline __m512 halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

RS_AMX inline int32_t pair(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

#define RS_TILE_MULTIPLY(C, A, B, OP)                                 \
  RS_TILE_LOAD_SPAN(A, a, 32, (kGroup - 1) * 32 + kBytes);            \
  RS_TILE_LOAD_SPAN(B, b, 64, kBytes / 4 * kUnit);                    \
  RS_TILE_ZERO(C);                                                    \
  RS_TILE_DP(OP, C, A, B);                                            \
  RS_TILE_STORE_SPAN(C, c, 64, kGroup * kRows * 4)

// Tile multiply S (0 or 1: its own C, A and B tiles): activations a (16 rows of a.tiles, 32
// bytes apart, kBytes of each: the tile configuration's K) by the weight bytes b (kBytes / 4
// rows of 64 bytes), signed or unsigned weights, the sums stored to c (16 rows of 64 bytes).
// Its tile asm declares the memory it touches, no more.
template <int S, bool kSignedWeights, int kBytes = 32>
RS_AMX inline void multiply(const int8_t* a, const void* b, int32_t* c) {
  if constexpr (S == 0 && kSignedWeights) {
    RS_TILE_MULTIPLY(0, 2, 4, "tdpbssd");
  } else if constexpr (S == 0) {
    RS_TILE_MULTIPLY(0, 2, 4, "tdpbsud");
  } else if constexpr (kSignedWeights) {
    RS_TILE_MULTIPLY(1, 3, 5, "tdpbssd");
  } else {
    RS_TILE_MULTIPLY(1, 3, 5, "tdpbsud");
  }
}
#undef RS_TILE_MULTIPLY

// A block of 32's unpacked bytes: 8 rows of [16 output rows][4 bytes], weights 4j..4j+3 in
// row j. Q4 units hold weights 4t.. in their low nibbles and 16 + 4t.. in their high ones.
RS_AMX inline void unpack_q4(const uint8_t* units, uint8_t* out) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int t = 0; t < 4; ++t) {
    const __m512i v = _mm512_loadu_si512(units + t * kUnit);
    _mm512_store_si512(out + t * kUnit, _mm512_and_si512(v, low));
    _mm512_store_si512(out + (4 + t) * kUnit, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
  }
}

// The float step of Q8_0 block b for a group's 16 rows, given their int32 sums and their
// scales side by side (QuantizedRows::tile_dx).
RS_AMX inline void float_step_q8(const uint8_t* block, const float* dx, const int32_t* sums,
                                 __m512* sum) {
  const __m512 d = halves(block);
#pragma GCC unroll 16
  for (int r = 0; r < kGroup; ++r) {
    const __m512i p = _mm512_load_si512(sums + r * kRows);
    sum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(d, _mm512_set1_ps(dx[r])),
                             sum[r]);
  }
}

// Q8_0 for activation rows [r0, r0 + 16): acc[(r - r0) * 16 + lane]. Its units are the B
// tile as they are, and the 16 rows' float sums stay in registers.
RS_AMX void group_q8(const uint8_t* panel, const QuantizedRows& a, int64_t r0, float* acc) {
  constexpr int64_t stride = kQ8_0.panel_bytes, units_at = kQ8_0.units_at;
  const int64_t blocks = a.blocks;
  alignas(64) int32_t c[2][kGroup * kRows];
  // Unrolled before GCC decides where the array lives, which keeps it in registers.
  __m512 sum[kGroup];
#pragma GCC unroll 16
  for (int r = 0; r < kGroup; ++r) sum[r] = _mm512_setzero_ps();
  const int8_t* q = a.tiles + r0 / kGroup * blocks * kTileBytes;  // block b at b * 512
  const float* dx = a.tile_dx + r0 / kGroup * blocks * kGroup;    // block b at b * 16
  // Block b + 1's multiply is issued before block b's float step, so that each step reads
  // sums stored a step earlier.
  multiply<0, true>(q, panel + units_at, c[0]);
  for (int64_t b = 0; b < blocks; b += 2) {
    // The weights come from memory (a decode step's batch reads each once): ask for two
    // blocks kAheadBlocks ahead, past the panel's end into the next one's. With the
    // hardware's prefetch alone, rows on cold weights ran slower.
    const char* ahead = reinterpret_cast<const char*>(panel + (b + kAheadBlocks) * stride);
    for (int64_t i = 0; i < 2 * stride; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
    if (b + 1 < blocks)
      multiply<1, true>(q + kTileBytes * (b + 1), panel + (b + 1) * stride + units_at, c[1]);
    float_step_q8(panel + b * stride, dx + b * kGroup, c[0], sum);
    if (b + 1 >= blocks) break;
    if (b + 2 < blocks)
      multiply<0, true>(q + kTileBytes * (b + 2), panel + (b + 2) * stride + units_at, c[0]);
    float_step_q8(panel + (b + 1) * stride, dx + (b + 1) * kGroup, c[1], sum);
  }
#pragma GCC unroll 16
  for (int r = 0; r < kGroup; ++r) _mm512_storeu_ps(acc + r * kRows, sum[r]);
}

// Q4_0 and Q4_1 for `count` groups of 16 rows from r0: each block unpacked once for up to
// kGroupsPerUnpack groups, the float sums in acc.
template <Kind K>
RS_AMX void groups_q4(const uint8_t* panel, const QuantizedRows& a, int64_t r0, int64_t count,
                      float* acc) {
  constexpr Format f = format_for<K>();
  alignas(64) int32_t c[2][kGroup * kRows];
  alignas(64) uint8_t unpacked[8 * kUnit];
  for (int64_t i = 0; i < count * kGroup * kRows; ++i) acc[i] = 0.f;
  auto tile = [&](int64_t g, int64_t b) {
    return a.tiles + ((r0 / kGroup + g) * a.blocks + b) * kTileBytes;
  };
  for (int64_t first = 0; first < count; first += kGroupsPerUnpack) {
    const int64_t end = std::min(count, first + kGroupsPerUnpack);
    for (int64_t b = 0; b < a.blocks; ++b) {
      const uint8_t* block = panel + b * f.panel_bytes;
      unpack_q4(block + f.units_at, unpacked);
      const __m512 d = halves(block);
      for (int64_t g = first; g < end; g += 2) {
        const bool pair = g + 1 < end;
        multiply<0, false>(tile(g, b), unpacked, c[0]);
        if (pair) multiply<1, false>(tile(g + 1, b), unpacked, c[1]);
        for (int64_t h = g; h < g + (pair ? 2 : 1); ++h) {
          const int32_t* sums = c[h - g];
          float* out = acc + h * kGroup * kRows;
          for (int r = 0; r < kGroup; ++r) {
            const int64_t at = (r0 + h * kGroup + r) * a.blocks + b;
            __m512i p = _mm512_load_si512(sums + r * kRows);
            if constexpr (K == Kind::q4)
              p = _mm512_sub_epi32(p, _mm512_set1_epi32(8 * a.sums[at]));
            __m512 s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),
                                       _mm512_mul_ps(d, _mm512_set1_ps(a.dx[at])),
                                       _mm512_loadu_ps(out + r * kRows));
            if constexpr (K == Kind::q4m)
              s = _mm512_fmadd_ps(halves(block + 32), _mm512_set1_ps(a.dxs[at]), s);
            _mm512_storeu_ps(out + r * kRows, s);
          }
        }
      }
    }
  }
}

// total[r] += sc * (sums[r] - 32 * centre[r]) for the 16 rows: a Q6_K group's sums, centred
// (its weights are u - 32), weighed by its int8 scale per lane.
RS_AMX inline void add_scaled(const int32_t* sums, __m512i sc, const int16_t* centre,
                              int64_t centre_stride, __m512i* total) {
#pragma GCC unroll 16
  for (int r = 0; r < kGroup; ++r) {
    const __m512i p = _mm512_sub_epi32(_mm512_load_si512(sums + r * kRows),
                                       _mm512_set1_epi32(32 * centre[r * centre_stride]));
    total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(p, sc));
  }
}

// A K-quant superblock's weights as bytes, by sub-block (Q4_K: 8 of 8 rows of 64 bytes, times
// the sub-block's scale in two parts) or group (Q6_K: 16 of 4 rows).
template <Kind K>
RS_AMX void unpack_k(const uint8_t* block, uint8_t* out) {
  const uint8_t* units = block + format_for<K>().units_at;
  const __m512i low = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  if constexpr (K == Kind::q4k) {
    // Sub-block j = 2c + h: the low (h = 0) or high nibbles of units 8c..8c+7, times the
    // sub-block's scale sc_j = 8 hi_j + lo_j (6 bits): out holds w * hi_j, then w * lo_j,
    // both at most 15 * 7. A 16-bit multiply makes both bytes' products at once: they
    // cannot carry into each other.
    __m512i hi[8], lo[8];
    for (int j = 0; j < 8; ++j) {
      const __m512i sc = scales_u8(block + kQ4kScales + 16 * j);  // per lane, in each dword
      const __m512i words = _mm512_or_si512(sc, _mm512_slli_epi32(sc, 16));
      hi[j] = _mm512_srli_epi16(words, 3);
      lo[j] = _mm512_and_si512(words, _mm512_set1_epi16(7));
    }
    for (int u = 0; u < 32; ++u) {
      const __m512i v = _mm512_loadu_si512(units + u * kUnit);
      const int c = u / 8, t = u % 8;
      const __m512i nibbles[2] = {_mm512_and_si512(v, low),
                                  _mm512_and_si512(_mm512_srli_epi16(v, 4), low)};
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * c + h, row = j * 8 + t;
        _mm512_store_si512(out + row * kUnit, _mm512_mullo_epi16(nibbles[h], hi[j]));
        _mm512_store_si512(out + (64 + row) * kUnit, _mm512_mullo_epi16(nibbles[h], lo[j]));
      }
    }
  } else {
    // Group g = 8h + 2i + vq holds weights 128h + 32i + 16vq.. = 16g.. of the superblock:
    // rows v = 4vq..4vq+3 of the 6-bit values u_i built from ql units 16h + v, 16h + 8 + v
    // and qh unit 32 + 8h + v.
    for (int h = 0; h < 2; ++h)
      for (int v = 0; v < 8; ++v) {
        const __m512i lo_a = _mm512_loadu_si512(units + (16 * h + v) * kUnit);
        const __m512i lo_b = _mm512_loadu_si512(units + (16 * h + 8 + v) * kUnit);
        const __m512i hb = _mm512_loadu_si512(units + (32 + 8 * h + v) * kUnit);
        const __m512i u[4] = {
            _mm512_or_si512(_mm512_and_si512(lo_a, low),
                            _mm512_and_si512(_mm512_slli_epi16(hb, 4), bits45)),
            _mm512_or_si512(_mm512_and_si512(lo_b, low),
                            _mm512_and_si512(_mm512_slli_epi16(hb, 2), bits45)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo_a, 4), low),
                            _mm512_and_si512(hb, bits45)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo_b, 4), low),
                            _mm512_and_si512(_mm512_srli_epi16(hb, 2), bits45))};
        for (int i = 0; i < 4; ++i)
          _mm512_store_si512(out + (4 * (8 * h + 2 * i + v / 4) + v % 4) * kUnit, u[i]);
      }
  }
}

// Superblock b of a K-quant panel, its weights unpacked, for activation rows [r0, r0 + 16):
// the integer sums of all 16 rows in registers, then the float step into acc.
template <Kind K>
RS_AMX void superblock(const uint8_t* block, const uint8_t* unpacked, const QuantizedRows& a,
                       int64_t r0, int64_t b, float* acc) {
  alignas(64) int32_t c[2][kGroup * kRows];
  // Blocks of 32 of this group's rows, 8 per superblock.
  const int8_t* qb = a.tiles + (r0 / kGroup * (a.k / 32) + 8 * b) * kTileBytes;
  __m512i total[kGroup];  // in registers, as the Q8_0 loop's sums
#pragma GCC unroll 16
  for (int r = 0; r < kGroup; ++r) total[r] = _mm512_setzero_si512();
  if constexpr (K == Kind::q4k) {
    // sum_j sc_j P_j = 8 sum_j (w hi_j) . q + sum_j (w lo_j) . q: the scales ride in the
    // weights, so the 8 sub-blocks accumulate in two tiles (tmm0: hi, tmm1: lo) with no
    // integer step per sub-block. Exact: |sum_j (w lo_j) . q| <= 256 * 105 * 127.
    const uint8_t* hi = unpacked;
    const uint8_t* lo = unpacked + 64 * kUnit;
    RS_TILE_ZERO(0);
    RS_TILE_ZERO(1);
    for (int j = 0; j < 8; ++j) {
      RS_TILE_LOAD_SPAN(2, qb + kTileBytes * j, 32, kTileBytes);
      RS_TILE_LOAD_SPAN(4, hi + j * 8 * kUnit, 64, 8 * kUnit);
      RS_TILE_LOAD_SPAN(5, lo + j * 8 * kUnit, 64, 8 * kUnit);
      RS_TILE_DP("tdpbsud", 0, 2, 4);
      RS_TILE_DP("tdpbsud", 1, 2, 5);
    }
    RS_TILE_STORE_SPAN(0, c[0], 64, kGroup * kRows * 4);
    RS_TILE_STORE_SPAN(1, c[1], 64, kGroup * kRows * 4);
    for (int r = 0; r < kGroup; ++r)
      total[r] = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c[0] + r * kRows), 3),
                                  _mm512_load_si512(c[1] + r * kRows));
    const __m512 d = halves(block), dmin = halves(block + 32);
    __m512i m[4];  // int16 pairs (m_2p, m_2p+1) per lane
    for (int p = 0; p < 4; ++p) {
      const __m512i odd = scales_u8(block + kQ4kMins + 16 * (2 * p + 1));
      m[p] = _mm512_or_si512(scales_u8(block + kQ4kMins + 16 * (2 * p)),
                             _mm512_slli_epi32(odd, 16));
    }
    for (int r = 0; r < kGroup; ++r) {
      const int16_t* sums32 = a.sums32 + (r0 + r) * (a.k / 32) + 8 * b;
      __m512i mins = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p)
        mins = _mm512_add_epi32(
            mins, _mm512_madd_epi16(m[p], _mm512_set1_epi32(pair(sums32 + 2 * p))));
      const __m512 dx = _mm512_set1_ps(a.dx[(r0 + r) * a.blocks + b]);
      __m512 s = _mm512_loadu_ps(acc + r * kRows);
      s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), _mm512_mul_ps(d, dx), s);
      const __m512 negative = _mm512_castsi512_ps(_mm512_xor_si512(
          _mm512_castps_si512(_mm512_mul_ps(dmin, dx)), _mm512_set1_epi32(INT32_MIN)));
      _mm512_storeu_ps(acc + r * kRows, _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins), negative, s));
    }
  } else {
    const int16_t* sums16 = a.sums16 + r0 * (a.k / 16) + 16 * b;
    // Group g's activations are 16g..: the first (even g) or second 16 bytes of each row of
    // block of 32 g / 2.
    for (int g = 0; g < 16; g += 2) {
      multiply<0, false, 16>(qb + kTileBytes * (g / 2), unpacked + 4 * g * kUnit, c[0]);
      multiply<1, false, 16>(qb + kTileBytes * (g / 2) + 16, unpacked + 4 * (g + 1) * kUnit,
                         c[1]);
      add_scaled(c[0], scales_i8(block + kQ6kScales + 16 * g), sums16 + g, a.k / 16, total);
      add_scaled(c[1], scales_i8(block + kQ6kScales + 16 * (g + 1)), sums16 + g + 1, a.k / 16,
                 total);
    }
    const __m512 d = halves(block);
    for (int r = 0; r < kGroup; ++r) {
      const __m512 dx = _mm512_set1_ps(a.dx[(r0 + r) * a.blocks + b]);
      _mm512_storeu_ps(acc + r * kRows,
                       _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), _mm512_mul_ps(d, dx),
                                       _mm512_loadu_ps(acc + r * kRows)));
    }
  }
}

// `count` groups of 16 rows from r0 (a multiple of 16).
template <Kind K>
RS_AMX void groups(const uint8_t* panel, const QuantizedRows& a, int64_t r0, int64_t count,
                   float* acc) {
  if constexpr (K == Kind::q4k || K == Kind::q6k) {
    constexpr Format f = format_for<K>();
    alignas(64) uint8_t unpacked[128 * kUnit];  // Q4_K: two scaled copies; Q6_K: 64 units
    for (int64_t i = 0; i < count * kGroup * kRows; ++i) acc[i] = 0.f;
    for (int64_t first = 0; first < count; first += kGroupsPerUnpack) {
      const int64_t end = std::min(count, first + kGroupsPerUnpack);
      for (int64_t b = 0; b < a.blocks; ++b) {
        const uint8_t* block = panel + b * f.panel_bytes;
        unpack_k<K>(block, unpacked);
        for (int64_t g = first; g < end; ++g)
          superblock<K>(block, unpacked, a, r0 + g * kGroup, b, acc + g * kGroup * kRows);
      }
    }
  } else if constexpr (K == Kind::q8s) {
    for (int64_t g = 0; g < count; ++g)
      group_q8(panel, a, r0 + g * kGroup, acc + g * kGroup * kRows);
  } else {
    groups_q4<K>(panel, a, r0, count, acc);
  }
}

}  // namespace

RS_AMX void panel_amx(const Format& f, const uint8_t* panel, const QuantizedRows& a, int64_t r0,
                      int64_t rows, float* acc) {
  const int64_t count = rows / kGroup;
  if (count > 0) {
    // Every call configures the tiles: other code on this thread (oneDNN's AMX matmuls) sets
    // its own configuration between ours.
    const TileConfig* config = f.kind == Kind::q6k ? &kConfig16 : &kConfig32;
    RS_TILE_CONFIG(*config);
    with_kind(f.kind, [&](auto kind) RS_AMX {
      groups<decltype(kind)::value>(panel, a, r0, count, acc);
    });
    RS_TILE_RELEASE();  // a context switch then need not save the tiles
  }
  const int64_t done = count * kGroup;
  if (rows > done) panel_avx512(f, panel, a, r0 + done, rows - done, acc + done * kRows);
}

}  // namespace radixserve::gguf
#endif
