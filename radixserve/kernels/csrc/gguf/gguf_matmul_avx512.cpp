// The quantized matmul's AVX-512 path (F, DQ, BW, VL with VNNI).
//
// A zmm register holds all 16 rows of a panel (a whole 64-byte unit), 4 weights per int32
// lane, and vpdpbusd multiplies unsigned by signed bytes and adds each group of 4 into int32
// in one instruction, with no int16 step to overflow. Q4 nibbles are the unsigned operand
// as they are. Q8_0's signed weights take the activations as the unsigned operand, shifted
// to q + 128, and subtract 128 * sum(w) per block (one vpdpbusd of ones against the weights,
// shared by the tile's rows): the int32 dot products are exact either way. K-quants keep one
// int32 sum per sub-block (Q4_K) or group of 16 (Q6_K) and weigh it by its scale with
// vpmulld. Float operations follow panel_portable exactly.

#include <cstdint>
#include <cstring>

#include "gguf/gguf_blocks.h"

#ifdef RS_X86
namespace radixserve::gguf {
namespace {

RS_AVX512VNNI inline int32_t four(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

constexpr int64_t kAhead = 4;  // panel blocks to prefetch ahead, as the AVX2 path

// Activation rows [r0, r0 + R) against one panel: acc[(r - r0) * 16 + lane].
template <Kind K, int R>
RS_AVX512VNNI void tile(const uint8_t* panel, const QuantizedRows& a, int64_t r0, float* acc) {
  constexpr int64_t stride = format_for<K>().panel_bytes, units_at = format_for<K>().units_at;
  __m512 sum[R];
  const int8_t* q[R];
  for (int r = 0; r < R; ++r) {
    sum[r] = _mm512_setzero_ps();
    q[r] = a.q + (r0 + r) * a.k;
  }
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* block = panel + b * stride;
    for (int64_t line = 0; line < stride; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block + kAhead * stride + line), _MM_HINT_T0);
    const uint8_t* units = block + units_at;
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    if constexpr (K == Kind::q8s) {
      const __m512i one = _mm512_set1_epi8(1);
      __m512i weights = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        const __m512i w = _mm512_loadu_si512(units + j * kUnit);
        weights = _mm512_dpbusd_epi32(weights, one, w);
        for (int r = 0; r < R; ++r) {
          const int32_t shifted = four(q[r] + 4 * j) ^ static_cast<int32_t>(0x80808080);
          dot[r] = _mm512_dpbusd_epi32(dot[r], _mm512_set1_epi32(shifted), w);  // (q + 128) * w
        }
      }
      const __m512i shift = _mm512_slli_epi32(weights, 7);
      for (int r = 0; r < R; ++r) dot[r] = _mm512_sub_epi32(dot[r], shift);
    } else {
      const __m512i low = _mm512_set1_epi8(0x0F);
      for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_loadu_si512(units + t * kUnit);
        const __m512i lo = _mm512_and_si512(v, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(four(q[r] + 4 * t)));
          dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_set1_epi32(four(q[r] + 16 + 4 * t)));
        }
      }
    }
    for (int r = 0; r < R; ++r) q[r] += 32;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * a.blocks + b;
      __m512i p = dot[r];
      if constexpr (K == Kind::q4) p = _mm512_sub_epi32(p, _mm512_set1_epi32(8 * a.sums[at]));
      sum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(d, _mm512_set1_ps(a.dx[at])),
                               sum[r]);
      if constexpr (K == Kind::q4m) {
        const __m512 m =
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32)));
        sum[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.dxs[at]), sum[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * kRows, sum[r]);
}

RS_AVX512VNNI inline __m512i scales_u8(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

RS_AVX512VNNI inline __m512i scales_i8(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

RS_AVX512VNNI inline __m512i load_unit(const uint8_t* units, int unit) {
  return _mm512_loadu_si512(units + unit * kUnit);
}

RS_AVX512VNNI inline int32_t pair(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// K-quant superblocks for activation rows [r0, r0 + R) against one panel.
template <Kind K, int R>
RS_AVX512VNNI void tile_k(const uint8_t* panel, const QuantizedRows& a, int64_t r0, float* acc) {
  constexpr int64_t stride = format_for<K>().panel_bytes;
  const __m512i low = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  __m512 sum[R];
  const int8_t* q[R];
  const int16_t* sums[R];
  for (int r = 0; r < R; ++r) {
    sum[r] = _mm512_setzero_ps();
    q[r] = a.q + (r0 + r) * a.k;
    sums[r] = K == Kind::q4k ? a.sums32 + (r0 + r) * (a.k / 32) : a.sums16 + (r0 + r) * (a.k / 16);
  }
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* block = panel + b * stride;
    const uint8_t* units = block + format_for<K>().units_at;
    __m512i total[R];
    for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_si512();
    if constexpr (K == Kind::q4k) {
      for (int c = 0; c < 4; ++c) {
        __m512i lo_dot[R], hi_dot[R];
        for (int r = 0; r < R; ++r) lo_dot[r] = hi_dot[r] = _mm512_setzero_si512();
        for (int t = 0; t < 8; ++t) {
          const __m512i v = load_unit(units, 8 * c + t);
          const __m512i lo = _mm512_and_si512(v, low);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          for (int r = 0; r < R; ++r) {
            lo_dot[r] = _mm512_dpbusd_epi32(lo_dot[r], lo,
                                            _mm512_set1_epi32(four(q[r] + 64 * c + 4 * t)));
            hi_dot[r] = _mm512_dpbusd_epi32(hi_dot[r], hi,
                                            _mm512_set1_epi32(four(q[r] + 64 * c + 32 + 4 * t)));
          }
        }
        const __m512i sc_lo = scales_u8(block + kQ4kScales + 16 * (2 * c));
        const __m512i sc_hi = scales_u8(block + kQ4kScales + 16 * (2 * c + 1));
        for (int r = 0; r < R; ++r)
          total[r] = _mm512_add_epi32(total[r],
                                      _mm512_add_epi32(_mm512_mullo_epi32(lo_dot[r], sc_lo),
                                                       _mm512_mullo_epi32(hi_dot[r], sc_hi)));
      }
      __m512i mins[R];
      for (int r = 0; r < R; ++r) mins[r] = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) {  // int16 pairs (m_2p, m_2p+1) per lane
        const __m512i m_even = scales_u8(block + kQ4kMins + 16 * (2 * p));
        const __m512i m_odd = scales_u8(block + kQ4kMins + 16 * (2 * p + 1));
        const __m512i m = _mm512_or_si512(m_even, _mm512_slli_epi32(m_odd, 16));
        for (int r = 0; r < R; ++r)
          mins[r] = _mm512_add_epi32(
              mins[r], _mm512_madd_epi16(m, _mm512_set1_epi32(pair(sums[r] + 2 * p))));
      }
      const __m512 dmin =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32)));
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
      for (int r = 0; r < R; ++r) {
        const __m512 dx = _mm512_set1_ps(a.dx[(r0 + r) * a.blocks + b]);
        sum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), _mm512_mul_ps(d, dx), sum[r]);
        const __m512 negative = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(_mm512_mul_ps(dmin, dx)), _mm512_set1_epi32(INT32_MIN)));
        sum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins[r]), negative, sum[r]);
      }
    } else {
      for (int half = 0; half < 2; ++half) {
        for (int vq = 0; vq < 2; ++vq) {
          __m512i dot[R][4];  // groups 8 half + 2i + vq
          for (int r = 0; r < R; ++r)
            for (int i = 0; i < 4; ++i) dot[r][i] = _mm512_setzero_si512();
          for (int v = 4 * vq; v < 4 * vq + 4; ++v) {
            const __m512i lo_a = load_unit(units, 16 * half + v);
            const __m512i lo_b = load_unit(units, 16 * half + 8 + v);
            const __m512i hb = load_unit(units, 32 + 8 * half + v);
            __m512i u[4];
            u[0] = _mm512_or_si512(_mm512_and_si512(lo_a, low),
                                   _mm512_and_si512(_mm512_slli_epi16(hb, 4), bits45));
            u[1] = _mm512_or_si512(_mm512_and_si512(lo_b, low),
                                   _mm512_and_si512(_mm512_slli_epi16(hb, 2), bits45));
            u[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo_a, 4), low),
                                   _mm512_and_si512(hb, bits45));
            u[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo_b, 4), low),
                                   _mm512_and_si512(_mm512_srli_epi16(hb, 2), bits45));
            for (int r = 0; r < R; ++r)
              for (int i = 0; i < 4; ++i)
                dot[r][i] = _mm512_dpbusd_epi32(
                    dot[r][i], u[i], _mm512_set1_epi32(four(q[r] + 128 * half + 32 * i + 4 * v)));
          }
          for (int i = 0; i < 4; ++i) {
            const int g = 8 * half + 2 * i + vq;
            const __m512i sc = scales_i8(block + kQ6kScales + 16 * g);
            for (int r = 0; r < R; ++r) {
              const __m512i centred =  // sum of (u - 32) * q over the group
                  _mm512_sub_epi32(dot[r][i], _mm512_set1_epi32(32 * sums[r][g]));
              total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(centred, sc));
            }
          }
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
      for (int r = 0; r < R; ++r) {
        const __m512 dx = _mm512_set1_ps(a.dx[(r0 + r) * a.blocks + b]);
        sum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), _mm512_mul_ps(d, dx), sum[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      q[r] += 256;
      sums[r] += K == Kind::q4k ? 8 : 16;
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * kRows, sum[r]);
}

template <Kind K>
RS_AVX512VNNI void rows_of_panel(const uint8_t* panel, const QuantizedRows& a, int64_t r0,
                                 int64_t rows, float* acc) {
  constexpr int kTile = K == Kind::q6k ? 2 : 4;  // Q6_K keeps 4 sums per row in registers
  int64_t r = 0;
  if constexpr (K == Kind::q4k || K == Kind::q6k) {
    for (; r + kTile <= rows; r += kTile) tile_k<K, kTile>(panel, a, r0 + r, acc + r * kRows);
    for (; r < rows; ++r) tile_k<K, 1>(panel, a, r0 + r, acc + r * kRows);
  } else {
    for (; r + kTile <= rows; r += kTile) tile<K, kTile>(panel, a, r0 + r, acc + r * kRows);
    for (; r < rows; ++r) tile<K, 1>(panel, a, r0 + r, acc + r * kRows);
  }
}

}  // namespace

RS_AVX512VNNI void panel_avx512(const Format& f, const uint8_t* panel, const QuantizedRows& a,
                                int64_t r0, int64_t rows, float* acc) {
  with_kind(f.kind, [&](auto kind) RS_AVX512VNNI {
    rows_of_panel<decltype(kind)::value>(panel, a, r0, rows, acc);
  });
}

}  // namespace radixserve::gguf
#endif
