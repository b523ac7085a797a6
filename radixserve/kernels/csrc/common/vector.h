// What the kernels share: the target attributes of their vector paths, and the AVX-512 pieces
// they build on.
//
// Functions that use AVX2 or AVX-512 carry a target attribute instead of the library being
// built with -march=native: the library then loads on any x86-64 CPU, and callers pick a path
// at run time from the one probe (cpu_features.h).

#pragma once

#include <c10/util/BFloat16.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define RS_X86 1
#define RS_AVX512 __attribute__((target("avx512f,avx512dq")))
#define RS_AVX512BF16 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16")))
// The quantized matmul's paths (gguf_matmul_avx2.cpp, gguf_matmul_avx512.cpp).
#define RS_AVX2 __attribute__((target("avx2,fma,f16c")))
#define RS_AVX512VNNI \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl,avx512vnni")))
#define RS_AMX                                                                              \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl,avx512vnni,"     \
                        "amx-tile,amx-int8")))
// Attention's AMX path (attention_amx.h).
#define RS_AMXBF16 \
  __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
#endif

namespace radixserve {

#ifdef RS_X86
// out[j] = sum of the 16 lanes of v[kReduceSlot[j]]: four rounds of pairwise shuffles and adds
// instead of one horizontal sum per vector. The shuffles leave the sums in this (self-inverse)
// order, so callers store the accumulator of item j at v[kReduceSlot[j]] and read the 16 sums
// in item order.
constexpr int kReduceSlot[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

RS_AVX512 inline __m512 reduce16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44),
                         _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88),
                         _mm512_shuffle_f32x4(w[i], w[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[i], x[i + 2], 0x44),
                         _mm512_shuffle_ps(x[i], x[i + 2], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

RS_AVX512BF16 inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// 32 bfloat16 values as one operand of vdpbf16ps.
RS_AVX512BF16 inline __m512bh load_bh(const c10::BFloat16* p) {
  return as_bh(_mm512_loadu_si512(p));
}
#endif

}  // namespace radixserve
