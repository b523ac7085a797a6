// y = x W^T (+ bias) in float32 arithmetic, W kept at 16 bits (bfloat16 or float16) or as
// float32, for CPUs without bfloat16 dot products: AVX2+FMA+F16C, AVX-512F, portable C++.
//
// Why: on such CPUs oneDNN emulates half-precision matmuls (slowly, even for one row) and runs float32 ones well below the memory bandwidth or the FMA units from 1 to 64 rows.
// A decode step is bound by reading the weights: here each is read once, at 2 bytes, and
// widened in registers. A prefill is bound by FMAs: per panel of weights, tiles of 6 rows of
// x (12 on AVX-512) keep 12 accumulators busy, the first tile streaming the panel from memory
// and the others finding it in L2 (16 x K x 2 bytes: 64 KB at K = 2048). Widening blocks of
// weights into L1 for tiles of packed x (a GEMM's blocking) was no faster from a few rows to
// prefill sizes (benchmarks/bench_skinny_matmul.py), so the simpler loop stays.
//
// Layout (FloatPanelOps.pack in kernels/float_panels.py): panels [P, K, 16], panel p holding W's
// rows 16p..16p+15 k-major (rows past N are zero). A k step of a panel is 16 weights in one
// 32-byte line, multiplied by x[m][k] broadcast: an outer product, no horizontal sums.
//
// Arithmetic: each output is one chain of float32 FMAs over k = 0..K-1 starting from 0, then
// one add of the bias. No path, tile shape, row count or thread split changes that
// chain (threads split the panels, never k), so a row's result is bitwise the same whatever
// the batch, thread count or path; the portable path (std::fma) is the vector paths' oracle.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "common/cpu_features.h"
#include "float_panels/float_panels_paths.h"

namespace {

using namespace radixserve::float_panels;

int64_t best_path() { return radixserve::best_path(radixserve::Family::float_panels); }

at::Tensor float_panels_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                               const c10::optional<at::Tensor>& bias, int64_t max_path) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "float32 x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "contiguous x [M, K]");
  const auto type = panels.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kHalf || type == at::kBFloat16,
              "float32, float16 or bfloat16 panels");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(),
              "contiguous panels [P, K, 16]");
  const int64_t m = x.size(0), k = x.size(1), p = panels.size(0);
  TORCH_CHECK(panels.size(1) == k, "panels of K = ", panels.size(1), " for x of K = ", k);
  TORCH_CHECK(k >= 1 && n >= 1 && (n + kPanel - 1) / kPanel == p, p,
              " panels cannot hold N = ", n, " rows");
  const bool with_bias = bias.has_value() && bias->defined();
  at::Tensor padded_bias;
  if (with_bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n,
                "a float32 bias [N]");
    padded_bias = at::zeros({p * kPanel}, bias->options());
    padded_bias.narrow(0, 0, n).copy_(*bias);
  }
  // Whole panels are written; a last partial panel's columns are cut off after.
  at::Tensor out = at::empty({m, p * kPanel}, x.options());
  if (m > 0) {
    const int64_t path = std::clamp<int64_t>(max_path, kPortable, best_path());
    const Problem pr{x.data_ptr<float>(), m, k, p * kPanel,
                     with_bias ? padded_bias.data_ptr<float>() : nullptr, out.data_ptr<float>()};
    // Threads take contiguous ranges of panels; none splits k.
    at::parallel_for(0, p, 1, [&](int64_t p0, int64_t p1) {
      if (type == at::kFloat)
        run_panels(pr, panels.data_ptr<float>(), path, p0, p1);
      else if (type == at::kHalf)
        run_panels(pr, panels.data_ptr<c10::Half>(), path, p0, p1);
      else
        run_panels(pr, panels.data_ptr<c10::BFloat16>(), path, p0, p1);
    });
  }
  return n == p * kPanel ? out : out.narrow(1, 0, n).contiguous();
}


}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("float_panels_linear(Tensor x, Tensor panels, int n, Tensor? bias, int max_path) "
        "-> Tensor");
  m.impl("float_panels_linear", c10::DispatchKey::CPU, TORCH_FN(float_panels_linear));
}
