// y = x W^T (+ bias) with W kept as GGUF quantized panels (gguf_pack.cpp), on the CPU.
//
// Why: a decode step reads every weight once, so its time is the weights' bytes over the
// memory bandwidth; kept quantized, Q4_x weights are 4.5-5 bits instead of 16 or 32. As in
// llama.cpp, activations are quantized to int8 with a float scale per block of 32 (per 256 for
// K-quants, as its q8_K), the dot products are exact int32 sums, and the scales are applied
// per block. Unlike a float matmul, each output's float operations are fixed (gguf_blocks.h,
// panel_portable), so a row's result is bitwise the same whatever M, thread count or vector
// path: the prefix cache's on == off holds exactly, and the portable path is the vector paths'
// oracle in the tests. One kernel serves every M, decode and prefill.
//
// One call takes a list of parts (a fused qkv or gate_up whose tensors have different types
// or row counts): x is quantized once per block size and each part is written at its column
// offset, with no concatenation.
//
// Work: threads share out runs of output panels (16 rows each, of all parts), each working
// through its share in order and then helping with the others' (RunShares); within a panel
// the path runs tiles of activation rows, the first streaming the panel from memory and the
// others finding it in cache. Never split over k.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "common/cpu_features.h"
#include "gguf/gguf_blocks.h"
#include "gguf/gguf_matmul.h"

namespace radixserve::gguf {

// The largest |x| of a block and the quantization of its values: q = nearbyint(x * 127 / top)
// (ties to even, the default rounding mode, as _mm256_cvtps_epi32), in [-127, 127].
inline float quantize_block(const float* x, int n, int8_t* q) {
  float top = 0.f;
  for (int i = 0; i < n; ++i) top = std::max(top, std::fabs(x[i]));
  const float id = inverse_of_top(top);
  for (int i = 0; i < n; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * id));
  return top;
}

inline int32_t sum_of(const int8_t* q, int n) {
  int32_t s = 0;
  for (int i = 0; i < n; ++i) s += q[i];
  return s;
}

void quantize_row32_portable(const float* x, int64_t k, int8_t* q, float* dx, int32_t* sums,
                             float* dxs) {
  for (int64_t b = 0; b < k / 32; ++b) {
    dx[b] = quantize_block(x + 32 * b, 32, q + 32 * b) / 127.f;
    sums[b] = sum_of(q + 32 * b, 32);
    dxs[b] = dx[b] * static_cast<float>(sums[b]);
  }
}

void quantize_row256_portable(const float* x, int64_t k, int8_t* q, float* dx, int16_t* sums16,
                              int16_t* sums32) {
  for (int64_t b = 0; b < k / 256; ++b)
    dx[b] = quantize_block(x + 256 * b, 256, q + 256 * b) / 127.f;
  for (int64_t g = 0; g < k / 16; ++g) sums16[g] = static_cast<int16_t>(sum_of(q + 16 * g, 16));
  for (int64_t j = 0; j < k / 32; ++j) sums32[j] = static_cast<int16_t>(sum_of(q + 32 * j, 32));
}

// acc of one (activation row, panel row) pair after block b, given the block's weight
// integers w of that panel row: the terms gguf_blocks.h lists, in its order.
float add_block(const Format& f, const uint8_t* block, const int* w, const QuantizedRows& a,
                int64_t row, int64_t b, int lane, float acc) {
  const int8_t* q = a.q + row * a.k + b * f.block;
  const int64_t at = row * a.blocks + b;
  const float dx = a.dx[at];
  auto dot = [&](int first, int n) {
    int32_t sum = 0;
    for (int i = first; i < first + n; ++i) sum += w[i] * q[i];
    return sum;
  };
  switch (f.kind) {
    case Kind::q8s:
    case Kind::q4:
    case Kind::q4m: {
      const int32_t p = dot(0, 32) - (f.kind == Kind::q4 ? 8 * a.sums[at] : 0);
      acc = std::fma(static_cast<float>(p), scale_at(block, 0, lane) * dx, acc);
      if (f.kind == Kind::q4m) acc = std::fma(scale_at(block, 1, lane), a.dxs[at], acc);
      return acc;
    }
    case Kind::q4k: {
      const int16_t* sums32 = a.sums32 + row * (a.k / 32) + b * 8;
      int32_t total = 0, mins = 0;
      for (int j = 0; j < 8; ++j) {
        total += block[kQ4kScales + 16 * j + lane] * dot(32 * j, 32);
        mins += block[kQ4kMins + 16 * j + lane] * sums32[j];
      }
      acc = std::fma(static_cast<float>(total), scale_at(block, 0, lane) * dx, acc);
      return std::fma(static_cast<float>(mins), -(scale_at(block, 1, lane) * dx), acc);
    }
    case Kind::q6k: {
      const int16_t* sums16 = a.sums16 + row * (a.k / 16) + b * 16;
      int32_t total = 0;
      for (int g = 0; g < 16; ++g)
        total += static_cast<int8_t>(block[kQ6kScales + 16 * g + lane]) *
                 (dot(16 * g, 16) - 32 * sums16[g]);
      return std::fma(static_cast<float>(total), scale_at(block, 0, lane) * dx, acc);
    }
  }
  return acc;
}

void panel_portable(const Format& f, const uint8_t* panel, const QuantizedRows& a, int64_t r0,
                    int64_t rows, float* acc) {
  std::fill(acc, acc + rows * kRows, 0.f);
  std::vector<int> w(kRows * f.block);
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* block = panel + b * f.panel_bytes;
    for (int lane = 0; lane < kRows; ++lane)  // unpacked once for all rows
      for (int i = 0; i < f.block; ++i) w[lane * f.block + i] = weight_int(f, block, lane, i);
    for (int64_t r = 0; r < rows; ++r)
      for (int lane = 0; lane < kRows; ++lane) {
        float& sum = acc[r * kRows + lane];
        sum = add_block(f, block, w.data() + lane * f.block, a, r0 + r, b, lane, sum);
      }
  }
}

constexpr int64_t kRunPanels = 4;     // fewest panels per run: 64 columns, 2 lines of bfloat16
constexpr int64_t kWideRunRows = 64;  // from this many rows of x

Quantized quantize(const at::Tensor& x, int block, int path, bool tile_scales) {
  const int64_t m = x.size(0), k = x.size(1), blocks = k / block;
  const int64_t n32 = block == 32 ? blocks : 0, n256 = block == 256 ? 1 : 0;
  auto aligned = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
  const int64_t tiled_rows = path >= 3 ? m / 16 * 16 : 0;  // whole groups of 16 (AMX)
  const int64_t tiled_dx_rows = tile_scales && block == 32 ? tiled_rows : 0;  // (Q8_0 reads)
  const int64_t sizes[8] = {aligned(m * k), aligned(m * blocks * 4), aligned(m * n32 * 4),
                            aligned(m * n32 * 4), aligned(m * n256 * k / 16 * 2),
                            aligned(m * n256 * k / 32 * 2), aligned(tiled_rows * k),
                            aligned(tiled_dx_rows * blocks * 4)};
  int64_t total = 0;
  for (int64_t size : sizes) total += size;
  Quantized out{at::empty({std::max<int64_t>(total, 1)}, x.options().dtype(at::kByte))};
  uint8_t* cursor = out.buffer.data_ptr<uint8_t>();  // 64-byte aligned, as every CPU allocation
  uint8_t* arrays[8];
  for (int i = 0; i < 8; ++i) {
    arrays[i] = cursor;
    cursor += sizes[i];
  }
  int8_t* q = reinterpret_cast<int8_t*>(arrays[0]);
  float* dx = reinterpret_cast<float*>(arrays[1]);
  int32_t* sums = reinterpret_cast<int32_t*>(arrays[2]);
  float* dxs = reinterpret_cast<float*>(arrays[3]);
  int16_t* sums16 = reinterpret_cast<int16_t*>(arrays[4]);
  int16_t* sums32 = reinterpret_cast<int16_t*>(arrays[5]);
  int8_t* tiles = tiled_rows > 0 ? reinterpret_cast<int8_t*>(arrays[6]) : nullptr;
  float* tile_dx = tiled_dx_rows > 0 ? reinterpret_cast<float*>(arrays[7]) : nullptr;
  out.rows = {q, dx, sums, dxs, sums16, sums32, k, blocks, tiles, tile_dx};
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const char* src = static_cast<const char*>(x.data_ptr());
  const int64_t row_bytes = k * x.element_size();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(bf16 ? k : 0);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = reinterpret_cast<const float*>(src + r * row_bytes);
      if (bf16) {
        const auto* h = reinterpret_cast<const c10::BFloat16*>(src + r * row_bytes);
        for (int64_t i = 0; i < k; ++i) widened[i] = static_cast<float>(h[i]);
        row = widened.data();
      }
      int8_t* qr = q + r * k;
      float* dxr = dx + r * blocks;
      if (block == 32) {
#ifdef RS_X86
        if (path >= 1) {
          quantize_row32_avx2(row, k, qr, dxr, sums + r * blocks, dxs + r * blocks);
          continue;
        }
#endif
        quantize_row32_portable(row, k, qr, dxr, sums + r * blocks, dxs + r * blocks);
      } else {
#ifdef RS_X86
        if (path >= 1) {
          quantize_row256_avx2(row, k, qr, dxr, sums16 + r * k / 16, sums32 + r * k / 32);
          continue;
        }
#endif
        quantize_row256_portable(row, k, qr, dxr, sums16 + r * k / 16, sums32 + r * k / 32);
      }
    }
  });
  if (tiles != nullptr)
    at::parallel_for(0, tiled_rows / 16, 1, [&](int64_t begin, int64_t end) {
      for (int64_t group = begin; group < end; ++group)
        for (int64_t j = 0; j < k / 32; ++j)
          for (int64_t r = 0; r < 16; ++r)
            std::memcpy(tiles + ((group * (k / 32) + j) * 16 + r) * 32,
                        q + (group * 16 + r) * k + 32 * j, 32);
      if (tile_dx != nullptr)
        for (int64_t group = begin; group < end; ++group)
          for (int64_t j = 0; j < n32; ++j)
            for (int64_t r = 0; r < 16; ++r)
              tile_dx[(group * n32 + j) * 16 + r] = dx[(group * 16 + r) * n32 + j];
    });
  return out;
}

PanelPath panel_path(int path) {
#ifdef RS_X86
  if (path >= 3) return panel_amx;
  if (path >= 2) return panel_avx512;
  if (path >= 1) return panel_avx2;
#endif
  return panel_portable;
}

int checked_path(int64_t max_path) {
  TORCH_CHECK_VALUE(max_path >= 0,
                    "max_path must be 0 (portable), 1 (AVX2), 2 (AVX-512 VNNI) or 3 (AMX)");
  return static_cast<int>(
      std::min<int64_t>(max_path, radixserve::best_path(radixserve::Family::gguf)));
}

}  // namespace radixserve::gguf

namespace {

using namespace radixserve::gguf;

// One weight of the op: its panels and where its rows land in the output.
struct Part {
  const Format* format;
  const uint8_t* panels;
  int64_t rows, panel_count, panel_stride, column;
};

// y [M, sum(rows)] = x @ concat(W_i)^T + bias: part i is [rows[i], K] held as panels[i] of GGUF
// type ggml_types[i], written at column sum(rows[:i]). Parts share one quantization of x, so a
// fused projection (qkv, gate_up) of mixed types is one call with no concatenation.
at::Tensor gguf_linear(const at::Tensor& x, at::TensorList panels, at::IntArrayRef ggml_types,
                       at::IntArrayRef rows, const c10::optional<at::Tensor>& bias,
                       int64_t max_path) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "x: contiguous float32 or bfloat16 [M, K] on the CPU");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK_VALUE(!panels.empty() && panels.size() == ggml_types.size() &&
                        panels.size() == rows.size(),
                    "panels, ggml_types and rows: one entry per part");
  std::vector<Part> parts;
  int64_t columns = 0, total_panels = 0;
  bool blocks32 = false, blocks256 = false;
  for (size_t i = 0; i < panels.size(); ++i) {
    const Format* f = format_of(ggml_types[i]);
    TORCH_CHECK_VALUE(f != nullptr, "GGUF type ", ggml_types[i],
                      " has no panel layout (supported: Q8_0 = 8, Q4_0 = 2, Q4_1 = 3, "
                      "Q4_K = 12, Q6_K = 14)");
    TORCH_CHECK_VALUE(k >= f->block && k % f->block == 0, "K = ", k,
                      " is not a multiple of part ", i, "'s block (", f->block, ")");
    (f->block == 32 ? blocks32 : blocks256) = true;
    const at::Tensor& p = panels[i];
    TORCH_CHECK_VALUE(rows[i] >= 1, "part ", i, " has no rows");
    TORCH_CHECK_VALUE(p.device().is_cpu() && p.scalar_type() == at::kByte && p.dim() == 2 &&
                          p.is_contiguous() && p.size(0) == (rows[i] + kRows - 1) / kRows &&
                          p.size(1) == k / f->block * f->panel_bytes,
                      "part ", i, ": panels must be uint8 [ceil(", rows[i], " / 16), K / ",
                      f->block, " * ", f->panel_bytes, "] for K = ", k);
    parts.push_back({f, p.data_ptr<uint8_t>(), rows[i], p.size(0), p.size(1), columns});
    columns += rows[i];
    total_panels += p.size(0);
  }
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == columns,
                      "bias must have one value per output column (", columns, ")");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({m, columns}, x.options());
  if (m == 0) return out;
  const int path = checked_path(max_path);
  // x quantized once per block size that the parts use.
  Quantized quantized32, quantized256;
  const bool q8 = std::any_of(parts.begin(), parts.end(),
                              [](const Part& p) { return p.format->kind == Kind::q8s; });
  if (blocks32) quantized32 = quantize(x, 32, path, q8);
  if (blocks256) quantized256 = quantize(x, 256, path);
  const QuantizedRows& a32 = quantized32.rows;
  const QuantizedRows& a256 = quantized256.rows;
  const PanelPath run = panel_path(path);
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  float* yf = bf16 ? nullptr : out.data_ptr<float>();
  c10::BFloat16* yh = bf16 ? out.data_ptr<c10::BFloat16>() : nullptr;
  // Each thread takes an equal contiguous share of the runs (about 32 KB of weights each) and
  // works through it front to back, as one stream; one that finishes early then takes runs
  // from the back of the others' shares. Cores need not run at one speed (a VM's vCPU whose
  // host core is busy with a neighbour, a laptop's efficiency cores), and with fixed shares
  // the fast one would wait for the slow one. From kWideRunRows rows of x on, a run holds up
  // to kRunPanels panels (while each thread still gets two runs), so that its outputs are
  // written in whole lines (write_run); a decode step's few rows keep small runs, and the
  // threads end together.
  const int64_t max_threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t wide = std::clamp<int64_t>(total_panels / (2 * max_threads), 1, kRunPanels);
  const int64_t run_panels =
      std::max<int64_t>(m >= kWideRunRows ? wide : 1, 32768 / parts[0].panel_stride);
  const int64_t runs = (total_panels + run_panels - 1) / run_panels;
  const int64_t threads = std::min(max_threads, runs);
  RunShares shares(runs, threads);
  // Where panel `index` of all parts' panels lies.
  struct Place {
    const Part* part;
    int64_t panel, live, column;
  };
  const int64_t chunk = std::min(m, kRowChunk);  // rows of acc per panel
  auto place_of = [&](int64_t index) {
    size_t part = 0;
    int64_t first = 0;  // index of parts[part]'s first panel
    while (index >= first + parts[part].panel_count) first += parts[part++].panel_count;
    const Part& p = parts[part];
    const int64_t panel = index - first;
    return Place{&p, panel, std::min<int64_t>(kRows, p.rows - panel * kRows),
                 p.column + panel * kRows};
  };
  // Run `claimed` for every row of x: per chunk of rows, its panels one after another, then
  // the chunk's outputs row by row. A row's columns from the run's panels lie side by side,
  // so each row is written in whole cache lines. One panel's 32-byte pieces of many rows lie
  // a row of outputs apart (4 KB for 2,048 bfloat16 columns), all in one set of L1, where
  // they evict each other: written that way, the outputs cost 15-20% of a 512-row matmul.
  auto write_run = [&](int64_t claimed, float* acc, Place* places) {
    const int64_t first = claimed * run_panels;
    const int64_t count = std::min(total_panels, first + run_panels) - first;
    for (int64_t i = 0; i < count; ++i) places[i] = place_of(first + i);
    for (int64_t r0 = 0; r0 < m; r0 += kRowChunk) {
      const int64_t n_rows = std::min(kRowChunk, m - r0);
      for (int64_t i = 0; i < count; ++i) {
        const Part& p = *places[i].part;
        run(*p.format, p.panels + places[i].panel * p.panel_stride,
            p.format->block == 32 ? a32 : a256, r0, n_rows, acc + i * chunk * kRows);
      }
      for (int64_t r = 0; r < n_rows; ++r)
        for (int64_t i = 0; i < count; ++i) {
          float* row = acc + (i * chunk + r) * kRows;
          const Place& at = places[i];
          if (bp)
            for (int64_t lane = 0; lane < at.live; ++lane) row[lane] += bp[at.column + lane];
          const int64_t offset = (r0 + r) * columns + at.column;
          if (bf16)
            write_bf16(row, at.live, yh + offset);
          else
            std::copy(row, row + at.live, yf + offset);
        }
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t first_share, int64_t end_share) {
    std::vector<float> acc(run_panels * chunk * kRows);
    std::vector<Place> places(run_panels);
    for (int64_t claimed; (claimed = shares.take(first_share, end_share)) >= 0;)
      write_run(claimed, acc.data(), places.data());
  });
  return out;
}

// The activation quantization on its own, for tests: (q int8 [M, K], dx [M, K / block]; for
// blocks of 32 sums int32 and dxs float [M, K / 32]; for 256 sums16 [M, K / 16] and sums32
// [M, K / 32] int16; the other pair empty).
std::vector<at::Tensor> gguf_quantize_activations(const at::Tensor& x, int64_t block,
                                                  int64_t max_path) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "x: contiguous float32 or bfloat16 [M, K] on the CPU");
  TORCH_CHECK_VALUE(block == 32 || block == 256, "block must be 32 or 256");
  TORCH_CHECK_VALUE(x.size(1) >= block && x.size(1) % block == 0,
                    "K = ", x.size(1), " is not a multiple of ", block);
  const Quantized out = quantize(x, static_cast<int>(block), checked_path(max_path));
  const QuantizedRows& a = out.rows;
  const int64_t m = x.size(0), k = x.size(1), n32 = block == 32 ? k / 32 : 0;
  const int64_t n256 = block == 256 ? 1 : 0;
  auto copy = [&](const void* data, at::IntArrayRef sizes, at::ScalarType type) {
    return at::from_blob(const_cast<void*>(data), sizes, x.options().dtype(type)).clone();
  };
  return {copy(a.q, {m, k}, at::kChar), copy(a.dx, {m, a.blocks}, at::kFloat),
          copy(a.sums, {m, n32}, at::kInt), copy(a.dxs, {m, n32}, at::kFloat),
          copy(a.sums16, {m, n256 * k / 16}, at::kShort),
          copy(a.sums32, {m, n256 * k / 32}, at::kShort)};
}


}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("gguf_linear(Tensor x, Tensor[] panels, int[] ggml_types, int[] rows, Tensor? bias, "
        "int max_path) -> Tensor");
  m.impl("gguf_linear", c10::DispatchKey::CPU, TORCH_FN(gguf_linear));
  m.def("gguf_quantize_activations(Tensor x, int block, int max_path) -> Tensor[]");
  m.impl("gguf_quantize_activations", c10::DispatchKey::CPU, TORCH_FN(gguf_quantize_activations));
}
