// attention.cpp's AMX path: bfloat16 pools on CPUs with AMX-BF16, head_dim 64 or 128.
// One call attends a tile of up to 16 queries (the query heads of one kv head, for the rows of
// one context: a prefill chunk's rows, or one decode row) with tile multiplies:
//
//   scores S^T = K Q^T  A: 16 keys x 32 dims (where they lie in the pool when their slots are
//                       a run, else copied), B: the queries' dims in pairs, C: 16 keys x 16
//                       queries of float32 sums
//   softmax             per query column, vectorised across the 16 queries, one key at a time
//   out = P V           A: 16 queries x 32 keys of probabilities (rounded to bfloat16), B: V
//                       with each dim's two keys side by side (interleaved once per prefill
//                       chunk and kv head, or block by block for a decode row: TiledContext)
//
// A query's bits are a function of its own query, its context and its length alone: each tile
// sum reads one A row and one B column; the max, exponentials and the four running sums of
// the softmax (keys t = 0, 1, 2, 3 mod 4, combined in one fixed order) are lane by lane; keys
// past a query's length are masked to a probability of 0, which adds nothing. So a position
// gets the same bits whatever rows share its tile, decoded or prefilled (cache on == off).
// The arithmetic is not path 3's (it sums in another order): a machine runs one path.

#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

#include "common/amx.h"
#include "attention/attention_avx512.h"
#include "common/vector.h"

#ifdef RS_X86
namespace radixserve::attention {
namespace {

constexpr int kQueries = 16;  // queries per tile (B's and C's columns)

// Scratch that grows and is not initialised (std::vector's resize would write every element,
// on every call: the buffers live for one call of the op).
template <typename T>
struct Buffer {
  std::unique_ptr<T[]> data;
  int64_t size = 0;
  // At least n elements; the contents are lost when it grows.
  T* at_least(int64_t n) {
    if (n > size) {
      data.reset(new T[n]);
      size = n;
    }
    return data.get();
  }
};

// Every tile 16 rows of 64 bytes. Scores: B (queries) in tmm2-3 (D 64) or tmm2-5 (D 128), A
// (keys) in tmm1 and tmm7, C in tmm0 and tmm6. Output: C (four 16-dim slices) in tmm0-3, A
// (probabilities) in tmm4, B (values) in tmm5-6.
constexpr amx::TileConfig attention_config() {
  amx::TileConfig c;
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  return c;
}
alignas(64) constexpr amx::TileConfig kAttentionConfig = attention_config();

// 16 x 16 int32 transposed in registers: r[i] lane j becomes r[j] lane i.
RS_AMXBF16 inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + j], 128-bit lane q: rows 4i .. 4i+3 of column 4q + j.
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i ab_even = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
    const __m512i ab_odd = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
    const __m512i cd_even = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i cd_odd = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
    r[j] = _mm512_shuffle_i32x4(ab_even, cd_even, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(ab_even, cd_even, 0xDD);
    r[4 + j] = _mm512_shuffle_i32x4(ab_odd, cd_odd, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(ab_odd, cd_odd, 0xDD);
  }
}

// Pair n of a 32-dim slice: dims n of the two keys (permutex2var's second source: +32).
alignas(64) constexpr uint16_t kPairLow[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                               37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                               11, 43, 12, 44, 13, 45, 14, 46, 15, 47};

// Block `half` (keys 16 half .. 16 half + 15) of a context of n keys along `slots`, as rows D
// apart: where they lie when the slots are a run (the pool allocates runs), else copied into
// `copy` (zero past n).
template <int D>
RS_AMXBF16 inline const c10::BFloat16* key_block(const c10::BFloat16* pool_k,
                                                 const int32_t* slots, int64_t n, int64_t half,
                                                 c10::BFloat16* copy) {
  const int64_t t0 = half * 16;
  bool run = t0 + 16 <= n;
  for (int64_t i = 1; i < 16 && run; ++i) run = slots[t0 + i] == slots[t0] + i;
  if (run) return pool_k + static_cast<int64_t>(slots[t0]) * D;
  for (int64_t t = t0; t < t0 + 16; ++t) {
    if (t < n)
      std::memcpy(copy + (t - t0) * D, pool_k + static_cast<int64_t>(slots[t]) * D,
                  D * sizeof(*copy));
    else
      std::memset(copy + (t - t0) * D, 0, D * sizeof(*copy));
  }
  return copy;
}

// Values of keys 32 b .. 32 b + 31 (zero past n), dims 64 half .. 64 half + 63, as four B
// tiles into `tiles`: tile j holds 16 key pairs x dims 64 half + 16 j .. + 15, each dim's two
// keys side by side.
template <int D>
RS_AMXBF16 inline void value_block(const c10::BFloat16* pool_v, const int32_t* slots,
                                   int64_t n, int64_t b, int half, uint16_t* tiles) {
  const __m512i low = _mm512_load_si512(kPairLow);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t pair = 0; pair < 16; ++pair) {
    const int64_t t = b * 32 + 2 * pair;
    const c10::BFloat16* first = t < n ? pool_v + static_cast<int64_t>(slots[t]) * D : nullptr;
    const c10::BFloat16* second =
        t + 1 < n ? pool_v + static_cast<int64_t>(slots[t + 1]) * D : nullptr;
    for (int c = 0; c < 2; ++c) {
      const int64_t at = 64 * half + 32 * c;
      const __m512i x = first ? _mm512_loadu_si512(first + at) : _mm512_setzero_si512();
      const __m512i y = second ? _mm512_loadu_si512(second + at) : _mm512_setzero_si512();
      uint16_t* tile = tiles + (2 * c * 16 + pair) * 32;
      _mm512_storeu_si512(tile, _mm512_permutex2var_epi16(x, low, y));
      _mm512_storeu_si512(tile + 16 * 32, _mm512_permutex2var_epi16(x, high, y));
    }
  }
}

// One context (one kv head's keys and values along a slot table), as attend_amx reads it.
// Laid out, once for all the tiles that read it (a prefill chunk's): key blocks as key_block
// gives them, values as value_block's B tiles (per 32 keys, D/16 tiles); grown as longer rows
// of the table come. Or streamed, for a context only one tile reads (a decode row's): each
// block is made as the tile reaches it, in L1, rather than written out and read back.
template <int D>
struct TiledContext {
  const c10::BFloat16* pool_keys = nullptr;  // which context
  const c10::BFloat16* pool_values = nullptr;
  const int32_t* table = nullptr;
  int64_t length = 0;  // keys laid out, or the streamed context's
  bool streamed = false;
  Buffer<const c10::BFloat16*> key_blocks;  // [blocks * 2]: 16 rows of D, D apart
  Buffer<c10::BFloat16> keys;  // [blocks * 32][D], the copies
  Buffer<uint16_t> values;  // [blocks][D / 16][16 pairs][32]

  void stream(const c10::BFloat16* pool_k, const c10::BFloat16* pool_v, const int32_t* slots,
              int64_t n) {
    pool_keys = pool_k;
    pool_values = pool_v;
    table = slots;
    length = n;
    streamed = true;
  }

  // The first n keys of the table, room made for `capacity` (the longest row that will read
  // it), so that it is laid out once as it grows.
  RS_AMXBF16 void lay_out(const c10::BFloat16* pool_k, const c10::BFloat16* pool_v,
                          const int32_t* slots, int64_t n, int64_t capacity) {
    if (streamed || pool_k != pool_keys || slots != table) {
      pool_keys = pool_k;
      pool_values = pool_v;
      table = slots;
      length = 0;
      streamed = false;
    }
    if (n <= length) return;
    const int64_t blocks = (n + 31) / 32, room = (std::max(n, capacity) + 31) / 32;
    if (keys.size < blocks * 32 * D) {
      length = 0;  // lost in growing
      keys.at_least(room * 32 * D);
      values.at_least(room * 32 * D);
      key_blocks.at_least(room * 2);
    }
    for (int64_t b = length / 32; b < blocks; ++b) {  // the last partial block again
      for (int64_t half = 2 * b; half < 2 * b + 2; ++half)
        key_blocks.data[half] = key_block<D>(pool_k, slots, n, half, keys.data.get() + half * 16 * D);
      for (int half = 0; half < D / 64; ++half)
        value_block<D>(pool_v, slots, n, b, half,
                       values.data.get() + (b * (D / 16) + 4 * half) * 16 * 32);
    }
    length = n;
  }

  // Key block `half` and the values' tiles of block b, dims 64 half ..: laid out, or made in
  // the caller's scratch.
  RS_AMXBF16 const c10::BFloat16* keys_at(int64_t half, c10::BFloat16* scratch) const {
    return streamed ? key_block<D>(pool_keys, table, length, half, scratch)
                    : key_blocks.data[half];
  }
  RS_AMXBF16 const uint16_t* values_at(int64_t b, int half, uint16_t* scratch) const {
    if (!streamed) return values.data.get() + (b * (D / 16) + 4 * half) * 16 * 32;
    value_block<D>(pool_values, table, length, b, half, scratch);
    return scratch;
  }
};

// A thread's scratch for attend_amx, grown to the longest context it meets.
struct AmxScratch {
  Buffer<float> scores;  // [keys][16 queries]
  Buffer<uint16_t> probs;  // [keys / 32][16 queries][32 keys], bfloat16
  alignas(64) uint32_t queries[4][16][16];  // B tiles of the queries' dim pairs
  alignas(64) c10::BFloat16 keys[2][16 * 128];  // a streamed context's key blocks
  alignas(64) uint16_t values[4 * 16 * 32];  // and value tiles
  alignas(64) float out[kQueries * 128];
};

// Query lanes' probability (unnormalised) for key t, 0 where t is past a lane's length; added
// to that key's running sum.
RS_AMXBF16 inline __m512 weight(const float* scores, __m512 top, __m512 scale, __m512i lengths,
                                int64_t t, __m512& sum) {
  const __mmask16 live =
      _mm512_cmpgt_epi32_mask(lengths, _mm512_set1_epi32(static_cast<int>(t)));
  const __m512 x = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(scores + t * kQueries), top), scale);
  const __m512 e = _mm512_maskz_mov_ps(live, exp16(x));
  sum = _mm512_add_ps(sum, e);
  return e;
}

// Dims 32 S .. 32 S + 31 of the scores of key blocks k and next (null: k alone): A in tmm1
// and tmm7, B (the queries' slice) in tmm2 + S, sums into tmm0 and tmm6.
template <int S>
RS_AMXBF16 inline void score_slice(const c10::BFloat16* k, const c10::BFloat16* next,
                                   int64_t key_bytes) {
  RS_TILE_LOAD(1, k + 32 * S, key_bytes);
  if (next) RS_TILE_LOAD(7, next + 32 * S, key_bytes);
#define RS_SLICE(B)                        \
  RS_TILE_DP("tdpbf16ps", 0, 1, B);        \
  if (next) RS_TILE_DP("tdpbf16ps", 6, 7, B)
  if constexpr (S == 0) {
    RS_SLICE(2);
  } else if constexpr (S == 1) {
    RS_SLICE(3);
  } else if constexpr (S == 2) {
    RS_SLICE(4);
  } else {
    RS_SLICE(5);
  }
#undef RS_SLICE
}

// Queries q[i] (D bfloat16 values; i < count <= 16) with lengths n[i] over the context laid
// out in ctx (at least max n[i] keys); outputs to outs[i]. sinks: 16 queries' attention sinks
// (-inf past count), or null (attention_avx512.h's sink_of says how they count). The tiles are
// configured by the caller (kAttentionConfig).
template <int D>
RS_AMXBF16 void attend_amx(const c10::BFloat16* const* q, const int64_t* n, int count,
                           const TiledContext<D>& ctx, float scale, const float* sinks,
                           AmxScratch& s, c10::BFloat16* const* outs) {
  static_assert(D == 64 || D == 128);
  int64_t longest = 0;
  for (int i = 0; i < count; ++i) longest = std::max(longest, n[i]);
  const int64_t blocks = (longest + 31) / 32;
  float* scores = s.scores.at_least(blocks * 32 * kQueries);
  uint16_t* probs = s.probs.at_least(blocks * 32 * kQueries);
  // B for the scores: per 32 dims, row k holds each query's dims 2k, 2k+1.
  for (int c = 0; c < D / 32; ++c) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i)
      r[i] = i < count ? _mm512_loadu_si512(q[i] + 32 * c) : _mm512_setzero_si512();
    transpose16(r);
    for (int k = 0; k < 16; ++k) _mm512_store_si512(s.queries[c][k], r[k]);
  }
  // Two blocks of 16 keys at a time, each with its own A and C tiles, so that one block's
  // loads and multiplies need not wait for the other's to finish.
  const int64_t tiles16 = (longest + 15) / 16;
  RS_TILE_LOAD(2, s.queries[0], 64);
  RS_TILE_LOAD(3, s.queries[1], 64);
  if constexpr (D == 128) {
    RS_TILE_LOAD(4, s.queries[2], 64);
    RS_TILE_LOAD(5, s.queries[3], 64);
  }
  for (int64_t b = 0; b < tiles16; b += 2) {
    const c10::BFloat16* k = ctx.keys_at(b, s.keys[0]);
    const c10::BFloat16* next = b + 1 < tiles16 ? ctx.keys_at(b + 1, s.keys[1]) : nullptr;
    RS_TILE_ZERO(0);
    RS_TILE_ZERO(6);
    score_slice<0>(k, next, 2 * D);
    score_slice<1>(k, next, 2 * D);
    if constexpr (D == 128) {
      score_slice<2>(k, next, 2 * D);
      score_slice<3>(k, next, 2 * D);
    }
    RS_TILE_STORE(0, scores + b * 16 * kQueries, 64);
    if (next) RS_TILE_STORE(6, scores + (b + 1) * 16 * kQueries, 64);
  }

  // Softmax down each query's column: key t counts for query i while t < n[i].
  alignas(64) int32_t lengths[16];
  for (int i = 0; i < 16; ++i) lengths[i] = i < count ? static_cast<int32_t>(n[i]) : 0;
  const __m512i nv = _mm512_load_si512(lengths);
  // Keys before the shortest length count for every query; four maxima break the chain of
  // dependent vmaxps (max is exact, so their order does not matter).
  int64_t shortest = longest;
  for (int i = 0; i < count; ++i) shortest = std::min(shortest, n[i]);
  __m512 tops[4];
  for (int j = 0; j < 4; ++j) tops[j] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 4 <= shortest; t += 4)
    for (int j = 0; j < 4; ++j)
      tops[j] = _mm512_max_ps(tops[j], _mm512_loadu_ps(scores + (t + j) * kQueries));
  for (; t < longest; ++t) {
    const __mmask16 live = _mm512_cmpgt_epi32_mask(nv, _mm512_set1_epi32(static_cast<int>(t)));
    tops[0] = _mm512_mask_max_ps(tops[0], live, tops[0], _mm512_loadu_ps(scores + t * kQueries));
  }
  __m512 top = _mm512_max_ps(_mm512_max_ps(tops[0], tops[1]), _mm512_max_ps(tops[2], tops[3]));
  top = _mm512_maskz_mov_ps(_mm512_cmpgt_epi32_mask(nv, _mm512_setzero_si512()), top);
  const __m512 sv = _mm512_set1_ps(scale);
  if (sinks) top = _mm512_max_ps(top, _mm512_div_ps(_mm512_loadu_ps(sinks), sv));
  // Probability pairs of keys 2k, 2k+1 side by side (cvtne2ps puts the first key's 16 in the
  // low half).
  alignas(64) static constexpr uint16_t kPairs[32] = {
      0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pairs = _mm512_load_si512(kPairs);
  // Running sums of keys t = 0, 1, 2, 3 mod 4, in registers.
  __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0, sum2 = sum0, sum3 = sum0;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i r[16];
    for (int k = 0; k < 16; k += 2) {
      const int64_t t = b * 32 + 2 * k;  // a multiple of 4
      const __m512 e0 = weight(scores, top, sv, nv, t, sum0);
      const __m512 e1 = weight(scores, top, sv, nv, t + 1, sum1);
      const __m512 e2 = weight(scores, top, sv, nv, t + 2, sum2);
      const __m512 e3 = weight(scores, top, sv, nv, t + 3, sum3);
      const __m512bh low = _mm512_cvtne2ps_pbh(e1, e0), high = _mm512_cvtne2ps_pbh(e3, e2);
      r[k] = _mm512_permutexvar_epi16(pairs, reinterpret_cast<const __m512i&>(low));
      r[k + 1] = _mm512_permutexvar_epi16(pairs, reinterpret_cast<const __m512i&>(high));
    }
    transpose16(r);  // row i: query i's 32 probabilities
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(probs + (b * 16 + i) * 32, r[i]);
  }
  const __m512 total = _mm512_add_ps(_mm512_add_ps(sum0, sum1), _mm512_add_ps(sum2, sum3));

  // out = P V, 64 dims (four C tiles) at a time.
  for (int half = 0; half < D / 64; ++half) {
    RS_TILE_ZERO(0);
    RS_TILE_ZERO(1);
    RS_TILE_ZERO(2);
    RS_TILE_ZERO(3);
    // Slices alternate B tiles (5, 6): a load need not wait for the multiply before it to
    // have read its tile.
    for (int64_t b = 0; b < blocks; ++b) {
      const uint16_t* v = ctx.values_at(b, half, s.values);
      RS_TILE_LOAD(4, probs + b * 16 * 32, 64);
      RS_TILE_LOAD(5, v, 64);
      RS_TILE_LOAD(6, v + 16 * 32, 64);
      RS_TILE_DP("tdpbf16ps", 0, 4, 5);
      RS_TILE_DP("tdpbf16ps", 1, 4, 6);
      RS_TILE_LOAD(5, v + 2 * 16 * 32, 64);
      RS_TILE_LOAD(6, v + 3 * 16 * 32, 64);
      RS_TILE_DP("tdpbf16ps", 2, 4, 5);
      RS_TILE_DP("tdpbf16ps", 3, 4, 6);
    }
    float* o = s.out + 64 * half;
    RS_TILE_STORE(0, o, D * 4);
    RS_TILE_STORE(1, o + 16, D * 4);
    RS_TILE_STORE(2, o + 32, D * 4);
    RS_TILE_STORE(3, o + 48, D * 4);
  }
  alignas(64) float totals[16], top_lanes[16];
  _mm512_store_ps(totals, total);
  _mm512_store_ps(top_lanes, top);
  for (int i = 0; i < count; ++i) {
    if (sinks) totals[i] += sink_weight(sinks[i], top_lanes[i], scale);
    const __m512 inv = _mm512_set1_ps(1.0f / totals[i]);
    for (int d = 0; d < D; d += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(s.out + i * D + d), inv));
      std::memcpy(outs[i] + d, &h, sizeof(h));
    }
  }
}

}  // namespace
}  // namespace radixserve::attention
#endif
