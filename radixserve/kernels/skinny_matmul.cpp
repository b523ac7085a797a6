// y = x W^T (+ bias) for a few rows of x and bfloat16 weights, on the CPU.
//
// Why: a decode step multiplies a handful of rows (one per running request) by every weight
// matrix. At 8 rows oneDNN reached about 21 GB/s of weight reads in the engine, under half of
// what the memory delivers, and the weights are the whole cost of such a step. Here each
// thread streams its share of W's rows once and dots each row with every row of x (AVX512-BF16,
// float32 sums), so a step costs about one read of the weights.
//
// x [M, K] and W [N, K] are bfloat16, K a multiple of 32, M at most kMaxRows: measured faster
// than oneDNN up to 48 rows (1.5-1.7x at 1-24 rows, 1.2-1.4x at 32-48; even at 64); above that
// the caller uses oneDNN, where the product is compute-bound and oneDNN is good at it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "vector.h"

namespace {

constexpr int64_t kMaxRows = 48;
constexpr int64_t kPrefetchRows = 16;

#ifdef RS_X86
using radixserve::kReduceSlot;
using radixserve::load_bh;
using radixserve::reduce16;

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
RS_AVX512BF16 void rows_block(const c10::BFloat16* x, const c10::BFloat16* w, int64_t m_rows,
                        int64_t k, int64_t n, int64_t n0, float* out) {
  int64_t m = 0;
  for (; m + 8 <= m_rows; m += 8)
    for (int j = 0; j < 16; j += 2) tile<2, 8>(x, w, k, n0 + j, m, out, n);
  for (; m + 4 <= m_rows; m += 4)
    for (int j = 0; j < 16; j += 4) tile<4, 4>(x, w, k, n0 + j, m, out, n);
  for (; m + 2 <= m_rows; m += 2)
    for (int j = 0; j < 16; j += 8) tile<8, 2>(x, w, k, n0 + j, m, out, n);
  if (m < m_rows) tile<16, 1>(x, w, k, n0, m, out, n);
}
#endif

at::Tensor skinny_matmul(const at::Tensor& x, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(radixserve::cpu_level() >= 2, "skinny_matmul needs AVX512-BF16");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "bfloat16 x and weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "x [M, K] and weight [N, K]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous x and weight");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(m >= 1 && m <= kMaxRows, "1 to ", kMaxRows, " rows");
  TORCH_CHECK(k % 32 == 0 && n % 16 == 0, "K a multiple of 32, N of 16");
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
#ifdef RS_X86
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = weight.data_ptr<c10::BFloat16>();
  float* op = out.data_ptr<float>();
  // Blocks of 16 output rows; a thread takes a contiguous range of them.
  at::parallel_for(0, n / 16, 8, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) rows_block(xp, wp, m, k, n, block * 16, op);
  });
#endif
  if (bias.has_value() && bias->defined()) out.add_(bias->to(at::kFloat));
  return out.to(at::kBFloat16);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("skinny_matmul(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("skinny_matmul", c10::DispatchKey::CPU, TORCH_FN(skinny_matmul));
}
