// What both kernels share: which CPU features are here, and the AVX-512 pieces they build on.
//
// Functions that use AVX-512 carry a target attribute instead of the library being built with
// -march=native: the library then loads on any x86-64 CPU, and callers pick a path by
// cpu_level() at run time.

#pragma once

#include <c10/util/BFloat16.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
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
// Attention's AMX path (decode_attention_amx.h).
#define RS_AMXBF16 \
  __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
#endif

namespace radixserve {

// 0: portable C++ only; 1: AVX-512 (F, DQ); 2: also AVX512-BF16 dot products.
inline int cpu_level() {
#ifdef RS_X86
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512dq")) return 0;
  const bool bf16 = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                    __builtin_cpu_supports("avx512bf16");
  return bf16 ? 2 : 1;
#else
  return 0;
#endif
}

// AMX-TILE and the tile multiply `feature` (CPUID.7.0:EDX bit 25 AMX-INT8, bit 22 AMX-BF16)
// in CPUID, their register state enabled by the OS (XCR0 bits 17 and 18), and this process
// allowed to use it: Linux hands the tile data's 8 KB of state to a process only once asked
// (arch_prctl ARCH_REQ_XCOMP_PERM), here on the first call.
inline bool amx_usable(int feature) {
#if defined(RS_X86) && defined(__linux__)
  // CPUID once: in a virtual machine each one is a trip to the hypervisor.
  static const unsigned features = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx >> 27 & 1)) return 0u;  // OSXSAVE
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx >> 24 & 1)) return 0u;
    unsigned xcr0_low, xcr0_high;
    asm volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
    if ((xcr0_low >> 17 & 3) != 3) return 0u;  // XTILECFG, XTILEDATA
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0 ? edx : 0u;
  }();
  return features >> feature & 1;
#else
  (void)feature;
  return false;
#endif
}
constexpr int kAmxInt8 = 25, kAmxBf16 = 22;

// The quantized matmul's path: 0 portable C++; 1 AVX2 with FMA and F16C; 2 AVX-512 (F, DQ,
// BW, VL) with VNNI dot products; 3 that and AMX-INT8 tile multiplies for groups of 16
// activation rows. AVX-512 without VNNI runs the AVX2 path.
inline int quant_path() {
#ifdef RS_X86
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512vnni"))
    return amx_usable(kAmxInt8) ? 3 : 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return 1;
#endif
  return 0;
}

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
