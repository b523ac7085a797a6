// y = x W^T (+ bias) for a few rows of x and bfloat16 weights, on the CPU.
//
// Why: a decode step multiplies a handful of rows (one per running request) by every weight
// matrix. At such row counts oneDNN reads the weights well under what the memory delivers,
// and the weights are the whole cost of such a step. Here each
// thread streams its share of W's rows once and dots each row with every row of x (AVX512-BF16,
// float32 sums), so a step costs about one read of the weights.
//
// x [M, K] and W [N, K] are bfloat16, K a multiple of 32, M at most kMaxRows, up to which it
// beats oneDNN (benchmarks/bench_skinny_matmul.py); above that
// the caller uses oneDNN, where the product is compute-bound and oneDNN is good at it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>

#include "common/cpu_features.h"
#include "bf16_matmul/skinny_matmul_avx512bf16.h"
#include "common/vector.h"

namespace {

constexpr int64_t kMaxRows = 48;

#ifdef RS_X86
using radixserve::skinny_matmul::rows_block;
#endif

at::Tensor skinny_matmul(const at::Tensor& x, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(radixserve::cpu_features().avx512_bf16(), "skinny_matmul needs AVX512-BF16");
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
