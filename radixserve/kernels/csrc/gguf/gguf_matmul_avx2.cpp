// The quantized matmul's AVX2 path (FMA, F16C): what this project's AVX2-only machines run.
//
// A ymm register holds 8 output rows of a panel (half h of each 64-byte unit), 4 weights per
// int32 lane; one broadcast of 4 activations serves all 8 rows. vpmaddubsw multiplies
// unsigned weight bytes by signed activation bytes into int16 pairs and vpmaddwd widens them
// to int32: Q4 nibbles (0..15) times |q| <= 127 leave room for eight pair sums in int16, so a
// block takes 8 vpmaddubsw and one vpmaddwd per half; Q8_0's signed bytes use the sign trick
// (|w| times q with w's sign) and widen after each one. The unpacked weights of a block are
// shared by the R activation rows of a tile. K-quants weigh each sub-block's int16 pair sums
// by its scale in the vpmaddwd (scales duplicated into both int16 halves of a lane), so their
// sums stay exact int32 too. Float operations follow panel_portable exactly.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gguf/gguf_blocks.h"

#ifdef RS_X86
namespace radixserve::gguf {
namespace {

// Keeps the compiler from rebalancing a chain of integer adds into a tree whose 16 maddubs
// results per row would all be live at once (and spilled): the chain stays a chain. The loops
// over a block's units are unrolled by pragma: left as loops, GCC branched on the first
// iteration's `t == 0 ?` and copied the chained registers around (Q4_K 16-24% slower).
RS_AVX2 inline __m256i chained(__m256i v) {
  asm("" : "+x"(v));
  return v;
}

RS_AVX2 inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

// Int32 dot products of one block for R activation rows: dot[r][h] has rows 8h..8h+7.
template <Kind K, int R>
RS_AVX2 inline void block_dots(const uint8_t* units, const int8_t* const* q, __m256i (*dot)[2]) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (K == Kind::q8s) {
    #pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(units + j * kUnit));
      const __m256i w1 =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(units + j * kUnit + 32));
      const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
      for (int r = 0; r < R; ++r) {
        const __m256i x = broadcast4(q[r] + 4 * j);
        const __m256i d0 =
            _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(x, w0)), ones);
        const __m256i d1 =
            _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(x, w1)), ones);
        dot[r][0] = j == 0 ? d0 : chained(_mm256_add_epi32(dot[r][0], d0));
        dot[r][1] = j == 0 ? d1 : chained(_mm256_add_epi32(dot[r][1], d1));
      }
    }
  } else {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i pairs[R][2];
    #pragma GCC unroll 8
    for (int t = 0; t < 4; ++t) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(units + t * kUnit));
      const __m256i v1 =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(units + t * kUnit + 32));
      const __m256i lo0 = _mm256_and_si256(v0, low);
      const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
      const __m256i lo1 = _mm256_and_si256(v1, low);
      const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
      for (int r = 0; r < R; ++r) {
        const __m256i xl = broadcast4(q[r] + 4 * t), xh = broadcast4(q[r] + 16 + 4 * t);
        const __m256i d0 =
            _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xl), _mm256_maddubs_epi16(hi0, xh));
        const __m256i d1 =
            _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xl), _mm256_maddubs_epi16(hi1, xh));
        // At most 8 * 15 * 127 * 2 = 30480 per int16: no overflow.
        pairs[r][0] = t == 0 ? d0 : chained(_mm256_add_epi16(pairs[r][0], d0));
        pairs[r][1] = t == 0 ? d1 : chained(_mm256_add_epi16(pairs[r][1], d1));
      }
    }
    for (int r = 0; r < R; ++r) {
      dot[r][0] = _mm256_madd_epi16(pairs[r][0], ones);
      dot[r][1] = _mm256_madd_epi16(pairs[r][1], ones);
    }
  }
}

// Panel blocks ahead to prefetch, about 1.1 KB: the hardware prefetcher alone lags when each
// line is worked on this long. Q8_0's blocks are twice Q4_x's (2 ahead measured 5% faster
// than 4 at one row).
template <Kind K>
constexpr int64_t kAhead = K == Kind::q8s ? 2 : 4;

// Activation rows [r0, r0 + R) against one panel: acc[(r - r0) * 16 + lane].
template <Kind K, int R>
RS_AVX2 void tile(const uint8_t* panel, const QuantizedRows& a, int64_t r0, float* acc) {
  __m256 sum[R][2];
  const int8_t* q[R];
  for (int r = 0; r < R; ++r) {
    sum[r][0] = sum[r][1] = _mm256_setzero_ps();
    q[r] = a.q + (r0 + r) * a.k;
  }
  constexpr int64_t stride = format_for<K>().panel_bytes, units_at = format_for<K>().units_at;
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* block = panel + b * stride;
    for (int64_t line = 0; line < stride; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block + kAhead<K> * stride + line),
                   _MM_HINT_T0);
    __m256i dot[R][2];
    block_dots<K, R>(block + units_at, q, dot);
    for (int r = 0; r < R; ++r) q[r] += 32;
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    const __m256 d1 =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16)));
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * a.blocks + b;
      __m256i p0 = dot[r][0], p1 = dot[r][1];
      if constexpr (K == Kind::q4) {
        const __m256i offset = _mm256_set1_epi32(8 * a.sums[at]);
        p0 = _mm256_sub_epi32(p0, offset);
        p1 = _mm256_sub_epi32(p1, offset);
      }
      const __m256 dx = _mm256_set1_ps(a.dx[at]);
      sum[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_mul_ps(d0, dx), sum[r][0]);
      sum[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_mul_ps(d1, dx), sum[r][1]);
      if constexpr (K == Kind::q4m) {
        const __m256 dxs = _mm256_set1_ps(a.dxs[at]);
        const __m256 m0 =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32)));
        const __m256 m1 =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 48)));
        sum[r][0] = _mm256_fmadd_ps(m0, dxs, sum[r][0]);
        sum[r][1] = _mm256_fmadd_ps(m1, dxs, sum[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc + r * kRows, sum[r][0]);
    _mm256_storeu_ps(acc + r * kRows + 8, sum[r][1]);
  }
}

// Each lane's byte of p[0..7] (8 rows' u8 scales or mins), as int16 pairs (v, v) per lane:
// vpmaddwd with it weighs a lane's two int16 pair sums by the lane's scale.
RS_AVX2 inline __m256i duplicated_u8(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
}

RS_AVX2 inline __m256i duplicated_i8(const uint8_t* p) {
  const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}

// int16 pairs (a[lane], b[lane]) of two rows of 8 bytes, unsigned or signed.
RS_AVX2 inline __m256i paired_u8(const uint8_t* a, const uint8_t* b) {
  const __m256i va = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)));
  const __m256i vb = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  return _mm256_or_si256(va, _mm256_slli_epi32(vb, 16));
}

RS_AVX2 inline __m256i paired_i8(const uint8_t* a, const uint8_t* b) {
  const __m256i va = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)));
  const __m256i vb = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  return _mm256_or_si256(_mm256_and_si256(va, _mm256_set1_epi32(0xFFFF)),
                         _mm256_slli_epi32(vb, 16));
}

RS_AVX2 inline __m256i load_unit(const uint8_t* units, int unit) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(units + unit * kUnit));
}

RS_AVX2 inline __m256i broadcast_pair(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

// Q4_K: I (total) and Imin (mins) of one superblock for rows 8h..8h+7 of the panel.
template <int R>
RS_AVX2 inline void q4k_sums(const uint8_t* block, int h, const int8_t* const* q,
                             const int16_t* const* sums32, __m256i* total, __m256i* mins) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const uint8_t* units = block + kQ4_K.units_at + 32 * h;
  for (int r = 0; r < R; ++r) total[r] = mins[r] = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    __m256i lo_pairs[R], hi_pairs[R];
    #pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m256i v =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(units + (8 * c + t) * kUnit));
      const __m256i lo = _mm256_and_si256(v, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      for (int r = 0; r < R; ++r) {
        // At most 8 * 15 * 127 * 2 = 30480 per int16: no overflow.
        const __m256i dl = _mm256_maddubs_epi16(lo, broadcast4(q[r] + 64 * c + 4 * t));
        const __m256i dh = _mm256_maddubs_epi16(hi, broadcast4(q[r] + 64 * c + 32 + 4 * t));
        lo_pairs[r] = t == 0 ? dl : chained(_mm256_add_epi16(lo_pairs[r], dl));
        hi_pairs[r] = t == 0 ? dh : chained(_mm256_add_epi16(hi_pairs[r], dh));
      }
    }
    const __m256i sc_lo = duplicated_u8(block + kQ4kScales + 16 * (2 * c) + 8 * h);
    const __m256i sc_hi = duplicated_u8(block + kQ4kScales + 16 * (2 * c + 1) + 8 * h);
    for (int r = 0; r < R; ++r)
      total[r] = _mm256_add_epi32(total[r],
                                  _mm256_add_epi32(_mm256_madd_epi16(lo_pairs[r], sc_lo),
                                                   _mm256_madd_epi16(hi_pairs[r], sc_hi)));
  }
  for (int p = 0; p < 4; ++p) {
    const __m256i m = paired_u8(block + kQ4kMins + 16 * (2 * p) + 8 * h,
                                block + kQ4kMins + 16 * (2 * p + 1) + 8 * h);
    for (int r = 0; r < R; ++r)
      mins[r] = _mm256_add_epi32(mins[r], _mm256_madd_epi16(m, broadcast_pair(sums32[r] + 2 * p)));
  }
}

// int16 pairs (a[row], b[row]) per int32 lane from two rows of 16 bytes (one byte per panel
// row), rows 8h..8h+7 in out[h], the bytes unsigned or signed. With a == b a lane holds its
// row's byte twice, so vpmaddwd weighs both of the lane's int16 pair sums by that row's scale.
template <bool Signed>
RS_AVX2 inline void row_pairs(const uint8_t* a, const uint8_t* b, __m256i* out) {
  const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i vb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m128i lo = _mm_unpacklo_epi8(va, vb), hi = _mm_unpackhi_epi8(va, vb);
  out[0] = Signed ? _mm256_cvtepi8_epi16(lo) : _mm256_cvtepu8_epi16(lo);
  out[1] = Signed ? _mm256_cvtepi8_epi16(hi) : _mm256_cvtepu8_epi16(hi);
}

// Part `part` of `parts` of the 64-byte lines of a panel block of `bytes` at `ahead`, into
// cache. With one activation row a superblock is worked on briefly, and the 37 (Q4_K) or 53
// (Q6_K) prefetches of the next-but-one issued at once outrun the core's queue of misses: a
// few at a time, spread over the block's work, streamed Q6_K 25% and Q4_K 10% faster.
template <int64_t Bytes>
RS_AVX2 inline void prefetch_part(const uint8_t* ahead, int part, int parts) {
  constexpr int64_t lines = (Bytes + 63) / 64;
  const int64_t per = (lines + parts - 1) / parts;
  for (int64_t line = per * part; line < std::min(per * (part + 1), lines); ++line)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * line), _MM_HINT_T0);
}

// Q4_K for one activation row: I (total) and Imin (mins) of one superblock for all 16 rows
// of the panel at once, total[h] holding rows 8h..8h+7. Both halves of a unit share each
// activation broadcast and each scale load; the integers are those of q4k_sums. `ahead` is
// the block to prefetch meanwhile.
RS_AVX2 inline void q4k_sums_one(const uint8_t* block, const int8_t* q, const int16_t* sums32,
                                 __m256i* total, __m256i* mins, const uint8_t* ahead) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const uint8_t* units = block + kQ4_K.units_at;
  total[0] = total[1] = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    prefetch_part<kQ4_K.panel_bytes>(ahead, c, 4);
    __m256i lo_pairs[2], hi_pairs[2];
    #pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const uint8_t* unit = units + (8 * c + t) * kUnit;
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 32));
      const __m256i lo0 = _mm256_and_si256(v0, low), lo1 = _mm256_and_si256(v1, low);
      const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
      const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
      // At most 8 * 15 * 127 * 2 = 30480 per int16: no overflow.
      const __m256i xl = broadcast4(q + 64 * c + 4 * t);
      const __m256i xh = broadcast4(q + 64 * c + 32 + 4 * t);
      const __m256i l0 = _mm256_maddubs_epi16(lo0, xl), l1 = _mm256_maddubs_epi16(lo1, xl);
      const __m256i h0 = _mm256_maddubs_epi16(hi0, xh), h1 = _mm256_maddubs_epi16(hi1, xh);
      lo_pairs[0] = t == 0 ? l0 : chained(_mm256_add_epi16(lo_pairs[0], l0));
      lo_pairs[1] = t == 0 ? l1 : chained(_mm256_add_epi16(lo_pairs[1], l1));
      hi_pairs[0] = t == 0 ? h0 : chained(_mm256_add_epi16(hi_pairs[0], h0));
      hi_pairs[1] = t == 0 ? h1 : chained(_mm256_add_epi16(hi_pairs[1], h1));
    }
    __m256i sc_lo[2], sc_hi[2];
    const uint8_t* sc = block + kQ4kScales + 16 * (2 * c);
    row_pairs<false>(sc, sc, sc_lo);
    row_pairs<false>(sc + 16, sc + 16, sc_hi);
    for (int h = 0; h < 2; ++h)
      total[h] = _mm256_add_epi32(total[h],
                                  _mm256_add_epi32(_mm256_madd_epi16(lo_pairs[h], sc_lo[h]),
                                                   _mm256_madd_epi16(hi_pairs[h], sc_hi[h])));
  }
  mins[0] = mins[1] = _mm256_setzero_si256();
  for (int p = 0; p < 4; ++p) {
    __m256i m[2];
    row_pairs<false>(block + kQ4kMins + 16 * (2 * p), block + kQ4kMins + 16 * (2 * p + 1), m);
    const __m256i s = broadcast_pair(sums32 + 2 * p);
    mins[0] = _mm256_add_epi32(mins[0], _mm256_madd_epi16(m[0], s));
    mins[1] = _mm256_add_epi32(mins[1], _mm256_madd_epi16(m[1], s));
  }
}

// Q6_K's 6-bit values (0..63) of the four quads i = 0..3 whose low nibbles lie in ql units
// a (i = 0, 2: low, high) and b (i = 1, 3) and whose top bits lie in qh unit hb (bits 2i, 2i+1
// moved to bits 4-5).
RS_AVX2 inline void q6k_quads(__m256i a, __m256i b, __m256i hb, __m256i* u) {
  const __m256i low = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  u[0] = _mm256_or_si256(_mm256_and_si256(a, low),
                         _mm256_and_si256(_mm256_slli_epi16(hb, 4), bits45));
  u[1] = _mm256_or_si256(_mm256_and_si256(b, low),
                         _mm256_and_si256(_mm256_slli_epi16(hb, 2), bits45));
  u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low),
                         _mm256_and_si256(hb, bits45));
  u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low),
                         _mm256_and_si256(_mm256_srli_epi16(hb, 2), bits45));
}

// Q6_K's offset term of rows 8h..8h+7 for R activation rows: total[r] -= 32 * sum_g sc_g *
// sums16_g (u - 32 is the signed weight).
template <int R>
RS_AVX2 inline void q6k_offset(const uint8_t* block, int h, const int16_t* const* sums16,
                               __m256i* total) {
  for (int p = 0; p < 8; ++p) {
    const __m256i sc = paired_i8(block + kQ6kScales + 16 * (2 * p) + 8 * h,
                                 block + kQ6kScales + 16 * (2 * p + 1) + 8 * h);
    for (int r = 0; r < R; ++r)
      total[r] = _mm256_sub_epi32(
          total[r],
          _mm256_slli_epi32(_mm256_madd_epi16(sc, broadcast_pair(sums16[r] + 2 * p)), 5));
  }
}

// Q6_K: I of one superblock for rows 8h..8h+7 of the panel.
template <int R>
RS_AVX2 inline void q6k_sums(const uint8_t* block, int h, const int8_t* const* q,
                             const int16_t* const* sums16, __m256i* total) {
  const uint8_t* units = block + kQ6_K.units_at + 32 * h;
  for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_si256();
  for (int half = 0; half < 2; ++half) {
    for (int vq = 0; vq < 2; ++vq) {
      __m256i sc[4];  // groups 8 half + 2i + vq
      for (int i = 0; i < 4; ++i)
        sc[i] = duplicated_i8(block + kQ6kScales + 16 * (8 * half + 2 * i + vq) + 8 * h);
      for (int v = 4 * vq; v < 4 * vq + 4; ++v) {
        const __m256i a = load_unit(units, 16 * half + v), b = load_unit(units, 16 * half + 8 + v);
        const __m256i hb = load_unit(units, 32 + 8 * half + v);
        __m256i u[4];
        q6k_quads(a, b, hb, u);
        for (int r = 0; r < R; ++r)
          for (int i = 0; i < 4; ++i) {
            // Each pair sum (at most 2 * 63 * 127) is weighed by its group's scale at once.
            const __m256i x = broadcast4(q[r] + 128 * half + 32 * i + 4 * v);
            total[r] = chained(_mm256_add_epi32(
                total[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u[i], x), sc[i])));
          }
      }
    }
  }
  q6k_offset<R>(block, h, sums16, total);
}

// Superblocks ahead to prefetch (4.7 KB for Q4_K; 4 or 8 measured no faster).
constexpr int64_t kAheadK = 2;

// The 6-bit values u (0..63) of quad i (weights 128 half + 32 i + 4 v..) for rows 8h..8h+7:
// the low nibble from ql unit A (i = 0, 2) or B (i = 1, 3), low or high, and bits 2i, 2i+1
// of the qh unit moved to bits 4-5.
template <int I>
RS_AVX2 inline __m256i q6k_values(const uint8_t* units, int half, int v, int h) {
  const __m256i low = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  const __m256i ql = _mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(units + (16 * half + 8 * (I & 1) + v) * kUnit + 32 * h));
  const __m256i qh = _mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(units + (32 + 8 * half + v) * kUnit + 32 * h));
  const __m256i nibble = _mm256_and_si256(I < 2 ? ql : _mm256_srli_epi16(ql, 4), low);
  __m256i high;
  if constexpr (I == 0) high = _mm256_slli_epi16(qh, 4);
  if constexpr (I == 1) high = _mm256_slli_epi16(qh, 2);
  if constexpr (I == 2) high = qh;
  if constexpr (I == 3) high = _mm256_srli_epi16(qh, 2);
  return _mm256_or_si256(nibble, _mm256_and_si256(high, bits45));
}

// Q6_K for one activation row: I of one superblock for all 16 rows of the panel, total[h]
// holding rows 8h..8h+7; the integers are those of q6k_sums. Quad i of values v and v + 1
// share a group scale, and two pair sums of 6-bit values (each at most 2 * 63 * 127) still
// fit in int16, so they are added before the one vpmaddwd that weighs them by the scale.
template <int I>
RS_AVX2 inline void q6k_quad(const uint8_t* block, int half, int vq, const int8_t* q,
                             __m256i* total) {
  const uint8_t* units = block + kQ6_K.units_at;
  __m256i sc[2];
  const uint8_t* scale = block + kQ6kScales + 16 * (8 * half + 2 * I + vq);
  row_pairs<true>(scale, scale, sc);
  for (int pair = 0; pair < 2; ++pair) {
    const int v = 4 * vq + 2 * pair;
    const __m256i x0 = broadcast4(q + 128 * half + 32 * I + 4 * v);
    const __m256i x1 = broadcast4(q + 128 * half + 32 * I + 4 * v + 4);
    for (int h = 0; h < 2; ++h) {
      const __m256i sum = _mm256_add_epi16(
          _mm256_maddubs_epi16(q6k_values<I>(units, half, v, h), x0),
          _mm256_maddubs_epi16(q6k_values<I>(units, half, v + 1, h), x1));
      total[h] = _mm256_add_epi32(total[h], _mm256_madd_epi16(sum, sc[h]));
    }
  }
}

RS_AVX2 inline void q6k_sums_one(const uint8_t* block, const int8_t* q, const int16_t* sums16,
                                 __m256i* total, const uint8_t* ahead) {
  total[0] = total[1] = _mm256_setzero_si256();
  for (int half = 0; half < 2; ++half)
    for (int vq = 0; vq < 2; ++vq) {
      prefetch_part<kQ6_K.panel_bytes>(ahead, 2 * half + vq, 4);
      q6k_quad<0>(block, half, vq, q, total);
      q6k_quad<1>(block, half, vq, q, total);
      q6k_quad<2>(block, half, vq, q, total);
      q6k_quad<3>(block, half, vq, q, total);
    }
  for (int p = 0; p < 8; ++p) {  // - 32 * sum_g sc_g * sums16_g
    __m256i sc[2];
    row_pairs<true>(block + kQ6kScales + 16 * (2 * p), block + kQ6kScales + 16 * (2 * p + 1), sc);
    const __m256i s = broadcast_pair(sums16 + 2 * p);
    for (int h = 0; h < 2; ++h)
      total[h] = _mm256_sub_epi32(total[h], _mm256_slli_epi32(_mm256_madd_epi16(sc[h], s), 5));
  }
}

// K-quant superblocks for activation rows [r0, r0 + R) against one panel.
template <Kind K, int R>
RS_AVX2 void tile_k(const uint8_t* panel, const QuantizedRows& a, int64_t r0, float* acc) {
  constexpr int64_t stride = format_for<K>().panel_bytes;
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 sum[R][2];
  const int8_t* q[R];
  const int16_t* sums[R];
  for (int r = 0; r < R; ++r) {
    sum[r][0] = sum[r][1] = _mm256_setzero_ps();
    q[r] = a.q + (r0 + r) * a.k;
    sums[r] = K == Kind::q4k ? a.sums32 + (r0 + r) * (a.k / 32) : a.sums16 + (r0 + r) * (a.k / 16);
  }
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* block = panel + b * stride;
    if constexpr (R > 1)  // (one row spreads its prefetches over the block's work)
      for (int64_t line = 0; line < stride; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(block + kAheadK * stride + line), _MM_HINT_T0);
    // One row takes both halves of the panel in one pass (Q4_K 12%, Q6_K 20% faster,
    // measured); with more rows those accumulators no longer fit in registers, and each half
    // is a pass of its own.
    __m256i totals[2][R], mins_of[2][R];  // [half][row]
    if constexpr (R == 1 && K == Kind::q4k)
      q4k_sums_one(block, q[0], sums[0], &totals[0][0], &mins_of[0][0],
                   block + kAheadK * stride);
    if constexpr (R == 1 && K == Kind::q6k)
      q6k_sums_one(block, q[0], sums[0], &totals[0][0], block + kAheadK * stride);
    for (int h = 0; h < 2; ++h) {
      __m256i* total = totals[h];
      __m256i* mins = mins_of[h];
      if constexpr (R > 1 && K == Kind::q4k) q4k_sums<R>(block, h, q, sums, total, mins);
      if constexpr (R > 1 && K == Kind::q6k) q6k_sums<R>(block, h, q, sums, total);
      const __m256 d =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * h)));
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(a.dx[(r0 + r) * a.blocks + b]);
        sum[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[r]), _mm256_mul_ps(d, dx), sum[r][h]);
        if constexpr (K == Kind::q4k) {
          const __m256 dmin = _mm256_cvtph_ps(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 + 16 * h)));
          sum[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins[r]),
                                      _mm256_xor_ps(_mm256_mul_ps(dmin, dx), sign), sum[r][h]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      q[r] += 256;
      sums[r] += K == Kind::q4k ? 8 : 16;
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc + r * kRows, sum[r][0]);
    _mm256_storeu_ps(acc + r * kRows + 8, sum[r][1]);
  }
}

// Q6_K with several activation rows: each superblock's 6-bit values are unpacked once into
// bytes (unit g = weights 4g..4g+3 of the 16 rows, 4 KB, in L1) and its group scales into the
// int16 pairs vpmaddwd takes, which every tile of rows then reads. Units 2j and 2j + 1 lie in
// one group of 16 weights, and two pair sums of 6-bit values (each at most 2 * 63 * 127) fit
// in int16: they are added before the one vpmaddwd that weighs them by the group's scale,
// half the vpmaddwd (the multiply ports' other tenant) of q6k_sums. The integers, and so the
// float steps and bits, are q6k_sums'.
struct Q6kUnpacked {
  alignas(64) uint8_t values[64][kUnit];  // [unit][row][4 weights]
  alignas(32) int32_t scales[16][kRows];  // (sc_g, sc_g) int16 pairs, rows 8h.. at [g][8h]
  alignas(32) int32_t offsets[8][kRows];  // (sc_2p, sc_2p+1) int16 pairs
};

RS_AVX2 inline void unpack(const uint8_t* block, Q6kUnpacked& u) {
  const uint8_t* units = block + kQ6_K.units_at;
  for (int half = 0; half < 2; ++half)
    for (int v = 0; v < 8; ++v)
      for (int h = 0; h < 2; ++h) {
        const __m256i a = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(units + (16 * half + v) * kUnit + 32 * h));
        const __m256i b = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(units + (16 * half + 8 + v) * kUnit + 32 * h));
        const __m256i hb = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(units + (32 + 8 * half + v) * kUnit + 32 * h));
        __m256i quads[4];
        q6k_quads(a, b, hb, quads);
        for (int i = 0; i < 4; ++i)
          _mm256_store_si256(
              reinterpret_cast<__m256i*>(u.values[32 * half + 8 * i + v] + 32 * h), quads[i]);
      }
  for (int g = 0; g < 16; ++g) {
    const uint8_t* sc = block + kQ6kScales + 16 * g;
    row_pairs<true>(sc, sc, reinterpret_cast<__m256i*>(u.scales[g]));
  }
  for (int p = 0; p < 8; ++p)
    row_pairs<true>(block + kQ6kScales + 16 * (2 * p), block + kQ6kScales + 16 * (2 * p + 1),
                    reinterpret_cast<__m256i*>(u.offsets[p]));
}

RS_AVX2 inline __m256i load_pairs(const int32_t* p) {
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
}

// One superblock b of rows [r0, r0 + R) from its unpacked values, added to acc (the rows'
// float sums so far, acc[r * 16 + lane]).
template <int R>
RS_AVX2 inline void block_rows(const uint8_t* block, const Q6kUnpacked& u,
                               const QuantizedRows& a, int64_t r0, int64_t b, float* acc) {
  const int8_t* q[R];
  const int16_t* sums16[R];
  for (int r = 0; r < R; ++r) {
    q[r] = a.q + (r0 + r) * a.k + 256 * b;
    sums16[r] = a.sums16 + (r0 + r) * (a.k / 16) + 16 * b;
  }
  for (int h = 0; h < 2; ++h) {
    __m256i total[R];
    for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_si256();
    #pragma GCC unroll 16
    for (int g = 0; g < 16; ++g) {
      const __m256i sc = load_pairs(u.scales[g] + 8 * h);
      for (int pair = 0; pair < 2; ++pair) {
        const int unit = 4 * g + 2 * pair;
        const __m256i u0 =
            _mm256_load_si256(reinterpret_cast<const __m256i*>(u.values[unit] + 32 * h));
        const __m256i u1 =
            _mm256_load_si256(reinterpret_cast<const __m256i*>(u.values[unit + 1] + 32 * h));
        for (int r = 0; r < R; ++r) {
          const __m256i sum =
              _mm256_add_epi16(_mm256_maddubs_epi16(u0, broadcast4(q[r] + 4 * unit)),
                               _mm256_maddubs_epi16(u1, broadcast4(q[r] + 4 * unit + 4)));
          total[r] = chained(_mm256_add_epi32(total[r], _mm256_madd_epi16(sum, sc)));
        }
      }
    }
    for (int p = 0; p < 8; ++p) {  // - 32 * sum_g sc_g * sums16_g, as q6k_offset
      const __m256i sc = load_pairs(u.offsets[p] + 8 * h);
      for (int r = 0; r < R; ++r)
        total[r] = _mm256_sub_epi32(
            total[r],
            _mm256_slli_epi32(_mm256_madd_epi16(sc, broadcast_pair(sums16[r] + 2 * p)), 5));
    }
    const __m256 d =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * h)));
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(a.dx[(r0 + r) * a.blocks + b]);
      float* out = acc + r * kRows + 8 * h;
      _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[r]), _mm256_mul_ps(d, dx),
                                            _mm256_loadu_ps(out)));
    }
  }
}

// Q4_K with many activation rows: each superblock's nibbles are unpacked once into bytes by
// sub-block (unit t of sub-block s = weights 32s+4t.. of the 16 rows, 4 KB, in L1) and its
// scales and mins into the int16 pairs vpmaddwd takes, which every tile of rows then reads.
// A tile takes both halves of the panel per activation broadcast and never unpacks: per 4
// activations of a row (against the 16 panel rows) one broadcast, two vpmaddubsw and two
// adds. q4k_sums' tiles each unpack the nibbles and widen the scales again (work shared by
// only their four rows) and broadcast the activations once per half. The integers, and so
// the float steps and bits, are q4k_sums'.
struct Q4kUnpacked {
  alignas(64) uint8_t values[8][8][kUnit];  // [sub-block][t][row][4 weights]
  alignas(32) int32_t scales[8][kRows];     // (sc, sc) int16 pairs, rows 8h.. at [s][8h]
  alignas(32) int32_t mins[4][kRows];       // (m_2p, m_2p+1) int16 pairs
};

RS_AVX2 inline void unpack(const uint8_t* block, Q4kUnpacked& u) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const uint8_t* units = block + kQ4_K.units_at;
  for (int c = 0; c < 4; ++c)
    for (int t = 0; t < 8; ++t)
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(units + (8 * c + t) * kUnit + 32 * h));
        _mm256_store_si256(reinterpret_cast<__m256i*>(u.values[2 * c][t] + 32 * h),
                           _mm256_and_si256(v, low));
        _mm256_store_si256(reinterpret_cast<__m256i*>(u.values[2 * c + 1][t] + 32 * h),
                           _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
      }
  for (int s = 0; s < 8; ++s) {
    const uint8_t* sc = block + kQ4kScales + 16 * s;
    row_pairs<false>(sc, sc, reinterpret_cast<__m256i*>(u.scales[s]));
  }
  for (int p = 0; p < 4; ++p)
    row_pairs<false>(block + kQ4kMins + 16 * (2 * p), block + kQ4kMins + 16 * (2 * p + 1),
                     reinterpret_cast<__m256i*>(u.mins[p]));
}

// One superblock b of rows [r0, r0 + R) from its unpacked values, added to acc (the rows'
// float sums so far, acc[r * 16 + lane]).
template <int R>
RS_AVX2 inline void block_rows(const uint8_t* block, const Q4kUnpacked& u,
                               const QuantizedRows& a, int64_t r0, int64_t b, float* acc) {
  const int8_t* q[R];
  for (int r = 0; r < R; ++r) q[r] = a.q + (r0 + r) * a.k + 256 * b;
  __m256i total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_si256();
  for (int s = 0; s < 8; ++s) {
    __m256i pairs[R][2];
    #pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m256i u0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.values[s][t]));
      const __m256i u1 =
          _mm256_load_si256(reinterpret_cast<const __m256i*>(u.values[s][t] + 32));
      for (int r = 0; r < R; ++r) {
        // At most 8 * 15 * 127 * 2 = 30480 per int16: no overflow.
        const __m256i x = broadcast4(q[r] + 32 * s + 4 * t);
        const __m256i p0 = _mm256_maddubs_epi16(u0, x), p1 = _mm256_maddubs_epi16(u1, x);
        pairs[r][0] = t == 0 ? p0 : chained(_mm256_add_epi16(pairs[r][0], p0));
        pairs[r][1] = t == 0 ? p1 : chained(_mm256_add_epi16(pairs[r][1], p1));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i sc = load_pairs(u.scales[s] + 8 * h);
      for (int r = 0; r < R; ++r) {
        total[r][h] = _mm256_add_epi32(total[r][h], _mm256_madd_epi16(pairs[r][h], sc));
      }
    }
  }
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int r = 0; r < R; ++r) {
    const int16_t* sums32 = a.sums32 + (r0 + r) * (a.k / 32) + 8 * b;
    const __m256 dx = _mm256_set1_ps(a.dx[(r0 + r) * a.blocks + b]);
    for (int h = 0; h < 2; ++h) {
      __m256i mins = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p)
        mins = _mm256_add_epi32(
            mins, _mm256_madd_epi16(load_pairs(u.mins[p] + 8 * h), broadcast_pair(sums32 + 2 * p)));
      const __m256 d =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * h)));
      const __m256 dmin =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 + 16 * h)));
      float* out = acc + r * kRows + 8 * h;
      __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[r][h]), _mm256_mul_ps(d, dx),
                                   _mm256_loadu_ps(out));
      sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_xor_ps(_mm256_mul_ps(dmin, dx), sign),
                            sum);
      _mm256_storeu_ps(out, sum);
    }
  }
}

// A K-quant's panel for many activation rows: each superblock unpacked once (Q4kUnpacked or
// Q6kUnpacked), then read by every tile of rows.
template <Kind K, class Unpacked>
RS_AVX2 void unpacked_panel_rows(const uint8_t* panel, const QuantizedRows& a, int64_t r0,
                                 int64_t rows, float* acc) {
  Unpacked unpacked;
  constexpr int64_t stride = format_for<K>().panel_bytes;
  std::fill(acc, acc + rows * kRows, 0.f);
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* block = panel + b * stride;
    for (int64_t line = 0; line < stride; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block + kAheadK * stride + line), _MM_HINT_T0);
    unpack(block, unpacked);
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) block_rows<4>(block, unpacked, a, r0 + r, b, acc + r * kRows);
    for (; r + 2 <= rows; r += 2) block_rows<2>(block, unpacked, a, r0 + r, b, acc + r * kRows);
    for (; r < rows; ++r) block_rows<1>(block, unpacked, a, r0 + r, b, acc + r * kRows);
  }
}

// Activation rows [r0, r0 + R) against one panel, by the format's tile.
template <Kind K, int R>
RS_AVX2 inline void tile_of(const uint8_t* panel, const QuantizedRows& a, int64_t r0,
                            float* acc) {
  if constexpr (K == Kind::q4k || K == Kind::q6k)
    tile_k<K, R>(panel, a, r0, acc);
  else
    tile<K, R>(panel, a, r0, acc);
}

template <Kind K>
RS_AVX2 void rows_of_panel(const uint8_t* panel, const QuantizedRows& a, int64_t r0,
                           int64_t rows, float* acc) {
  if constexpr (K == Kind::q6k) {
    // Below ~24 rows the unpack is shared by too few tiles (measured slower at 8, even at 16).
    if (rows >= 24) return unpacked_panel_rows<K, Q6kUnpacked>(panel, a, r0, rows, acc);
  }
  if constexpr (K == Kind::q4k) {
    // From 8 rows the unpack pays for itself (16 rows 5-15% faster, 512 rows ~20%; 8 even).
    if (rows >= 8) return unpacked_panel_rows<K, Q4kUnpacked>(panel, a, r0, rows, acc);
  }
  // Tiles of four rows share each block's unpacked (K-quants) or loaded and, for Q8_0,
  // sign-stripped weights among more rows: for the block-32 formats 7-16% faster than tiles
  // of two at 4-256 rows (Q8_0, Q4_0, Q4_1).
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) tile_of<K, 4>(panel, a, r0 + r, acc + r * kRows);
  for (; r + 2 <= rows; r += 2) tile_of<K, 2>(panel, a, r0 + r, acc + r * kRows);
  for (; r < rows; ++r) tile_of<K, 1>(panel, a, r0 + r, acc + r * kRows);
}

RS_AVX2 inline float max_abs(const float* x, int n) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 top8 = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8)
    top8 = _mm256_max_ps(top8, _mm256_and_ps(_mm256_loadu_ps(x + i), magnitude));
  __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top8), _mm256_extractf128_ps(top8, 1));
  top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
  top4 = _mm_max_ss(top4, _mm_movehdup_ps(top4));
  return _mm_cvtss_f32(top4);
}

RS_AVX2 inline int32_t sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// 32 values times `id`, rounded to nearest even, stored as int8; their sums by halves.
RS_AVX2 inline void quantize32(const float* x, __m256 id, int8_t* q, int32_t* sums) {
  __m256i n[4];
  for (int i = 0; i < 4; ++i)
    n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), id));
  // packs interleave 128-bit lanes; the permute puts the 32 bytes back in order.
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  sums[0] = sum8(_mm256_add_epi32(n[0], n[1]));
  sums[1] = sum8(_mm256_add_epi32(n[2], n[3]));
}

RS_AVX2 inline __m256 inverse_scale(float top) {
  return _mm256_set1_ps(inverse_of_top(top));
}

}  // namespace

RS_AVX2 void quantize_row32_avx2(const float* x, int64_t k, int8_t* q, float* dx, int32_t* sums,
                                 float* dxs) {
  for (int64_t b = 0; b < k / 32; ++b) {
    const float top = max_abs(x + 32 * b, 32);
    int32_t halves[2];
    quantize32(x + 32 * b, inverse_scale(top), q + 32 * b, halves);
    dx[b] = top / 127.f;
    sums[b] = halves[0] + halves[1];
    dxs[b] = dx[b] * static_cast<float>(sums[b]);
  }
}

RS_AVX2 void quantize_row256_avx2(const float* x, int64_t k, int8_t* q, float* dx,
                                  int16_t* sums16, int16_t* sums32) {
  for (int64_t b = 0; b < k / 256; ++b) {
    const float top = max_abs(x + 256 * b, 256);
    const __m256 id = inverse_scale(top);
    for (int j = 0; j < 8; ++j) {
      int32_t halves[2];
      quantize32(x + 256 * b + 32 * j, id, q + 256 * b + 32 * j, halves);
      sums16[16 * b + 2 * j] = static_cast<int16_t>(halves[0]);
      sums16[16 * b + 2 * j + 1] = static_cast<int16_t>(halves[1]);
      sums32[8 * b + j] = static_cast<int16_t>(halves[0] + halves[1]);
    }
    dx[b] = top / 127.f;
  }
}

RS_AVX2 void panel_avx2(const Format& f, const uint8_t* panel, const QuantizedRows& a, int64_t r0,
                        int64_t rows, float* acc) {
  with_kind(f.kind, [&](auto kind) RS_AVX2 {
    rows_of_panel<decltype(kind)::value>(panel, a, r0, rows, acc);
  });
}

}  // namespace radixserve::gguf
#endif
