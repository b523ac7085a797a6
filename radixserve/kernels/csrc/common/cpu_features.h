// What this CPU can do, probed once (CPUID through the compiler's builtins, XGETBV, and Linux's
// permission for AMX tile data), and the paths each kernel family runs. Every family picks its
// path here: no kernel reads CPUID itself. The paths' names live only in cpu_features.cpp,
// and Python reads them from its ops (kernel_path_names) instead of mirroring them.

#pragma once

#include <cstdint>

namespace radixserve {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512dq = false, avx512bw = false, avx512vl = false;
  bool avx512vnni = false, avx512bf16 = false;
  // Tile multiplies whose register state the OS enables and this process may use.
  bool amx_int8 = false, amx_bf16 = false;

  // AVX2 with FMA and F16C: the matmuls' 256-bit paths.
  bool avx2_fma_f16c() const { return avx2 && fma && f16c; }
  // AVX-512 F and DQ: attention's 512-bit path.
  bool avx512() const { return avx512f && avx512dq; }
  // That with BW, VL and BF16 dot products: bfloat16 attention and the bfloat16 matmul.
  bool avx512_bf16() const { return avx512() && avx512bw && avx512vl && avx512bf16; }
  // AVX-512 F, DQ, BW and VL with VNNI dot products: the quantized matmul's 512-bit path.
  bool avx512_vnni() const { return avx512() && avx512bw && avx512vl && avx512vnni; }
};

// This CPU's features, probed on the first call.
const CpuFeatures& cpu_features();

// The kernel families whose vector path a call's `max_path` caps.
enum class Family { attention, gguf, float_panels };

// The highest path of `family` this CPU runs.
int64_t best_path(Family family);

}  // namespace radixserve
