// GGUF blocks to panels once at load (gguf_pack), and panel rows back to floats
// (gguf_dequantize_rows, for quantized embedding tables). See gguf_blocks.h for the layout.
//
// Packing is a byte gather: a block's scales go to their panel slots and its quant bytes, 4
// at a time, to the units, so panels take the file's bytes (Q4_K: 1.03x, its 6-bit scales and
// mins unpacked to bytes) and packing runs at about memcpy speed. Dequantizing repeats
// gguf-py's float operations in its order (Q8_0 q * d, Q4_0 d * (u - 8), Q4_1 d * u + m,
// Q4_K (d * sc) * u - dmin * m, Q6_K (d * sc) * (u - 32), never fused), so its output is bitwise
// equal to gguf.quants.dequantize.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf/gguf_blocks.h"
#include "common/huge_pages.h"

namespace {

using radixserve::gguf::format_of;
using radixserve::gguf::Format;
using radixserve::gguf::kQ4kMins;
using radixserve::gguf::kQ4kScales;
using radixserve::gguf::kQ6kScales;
using radixserve::gguf::Kind;
using radixserve::gguf::kRows;
using radixserve::gguf::kUnit;

const Format& checked_format(int64_t ggml_type) {
  const Format* f = format_of(ggml_type);
  TORCH_CHECK_VALUE(f != nullptr, "GGUF type ", ggml_type,
                    " has no panel layout (supported: Q8_0 = 8, Q4_0 = 2, Q4_1 = 3, Q4_K = 12, "
                    "Q6_K = 14)");
  return *f;
}

// One GGUF block of row `lane` into its panel block (layouts in gguf_blocks.h).
void pack_block(const Format& f, const uint8_t* in, uint8_t* block, int lane) {
  auto quads = [&](const uint8_t* from, int count, int first_unit) {
    for (int p = 0; p < count; ++p)
      std::memcpy(block + f.units_at + (first_unit + p) * kUnit + 4 * lane, from + 4 * p, 4);
  };
  switch (f.kind) {
    case Kind::q8s:
    case Kind::q4:
    case Kind::q4m: {
      const int halves = f.kind == Kind::q4m ? 2 : 1;  // d, or d and m
      for (int s = 0; s < halves; ++s) std::memcpy(block + 32 * s + 2 * lane, in + 2 * s, 2);
      quads(in + 2 * halves, (f.type_bytes - 2 * halves) / 4, 0);
      break;
    }
    case Kind::q4k: {  // d, dmin, scales[12], qs[128]
      std::memcpy(block + 2 * lane, in, 2);
      std::memcpy(block + 32 + 2 * lane, in + 2, 2);
      const uint8_t* s = in + 4;
      for (int j = 0; j < 8; ++j) {  // 6-bit scale and min of sub-block j
        const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        const int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        block[kQ4kScales + 16 * j + lane] = static_cast<uint8_t>(sc);
        block[kQ4kMins + 16 * j + lane] = static_cast<uint8_t>(m);
      }
      quads(in + 16, 32, 0);
      break;
    }
    case Kind::q6k: {  // ql[128], qh[64], scales int8[16], d
      quads(in, 48, 0);
      for (int g = 0; g < 16; ++g) block[kQ6kScales + 16 * g + lane] = in[192 + g];
      std::memcpy(block + 2 * lane, in + 208, 2);
      break;
    }
  }
}

// Bytes of the panels of N rows of `row_bytes` bytes in format f, which must be whole blocks.
int64_t packed_bytes(const Format& f, int64_t n, int64_t row_bytes) {
  TORCH_CHECK_VALUE(n >= 1 && row_bytes >= 1 && row_bytes % f.type_bytes == 0,
                    "raw rows of ", row_bytes, " bytes are not whole blocks of ", f.type_bytes);
  return (n + kRows - 1) / kRows * (row_bytes / f.type_bytes) * f.panel_bytes;
}

int64_t gguf_packed_bytes(int64_t ggml_type, int64_t n, int64_t row_bytes) {
  return packed_bytes(checked_format(ggml_type), n, row_bytes);
}

// Checks raw (uint8 [N, row_bytes], whole blocks of f) and row_order; their row count.
int64_t checked_rows(const Format& f, const at::Tensor& raw,
                     const c10::optional<at::Tensor>& row_order) {
  TORCH_CHECK_VALUE(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.dim() == 2 &&
                        raw.is_contiguous(),
                    "raw: contiguous uint8 [rows, row_bytes] on the CPU");
  const int64_t n = raw.size(0);
  packed_bytes(f, n, raw.size(1));  // whole blocks
  if (row_order.has_value() && row_order->defined()) {
    TORCH_CHECK_VALUE(row_order->scalar_type() == at::kLong && row_order->dim() == 1 &&
                          row_order->numel() == n && row_order->is_contiguous(),
                      "row_order: int64 [rows]");
    const int64_t* order = row_order->data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK_VALUE(order[i] >= 0 && order[i] < n, "row_order[", i, "] = ", order[i],
                        " is not a row");
  }
  return n;
}

// The panels of raw's rows (in row_order where given) into dst, packed_bytes long.
void pack_into(const Format& f, const at::Tensor& raw, const c10::optional<at::Tensor>& row_order,
               uint8_t* dst) {
  const int64_t n = raw.size(0), row_bytes = raw.size(1), blocks = row_bytes / f.type_bytes;
  const int64_t panels = (n + kRows - 1) / kRows;
  const int64_t* order =
      row_order.has_value() && row_order->defined() ? row_order->data_ptr<int64_t>() : nullptr;
  const uint8_t* src = raw.data_ptr<uint8_t>();
  // Not zeroed as a whole: the 16 rows of a full panel write every byte of it (gguf_blocks.h's
  // layouts leave no gap), and zeroing a 1.25 GB model first took as long as the packing.
  // Only a last, partial panel has rows past N, which must be zero blocks (d = 0).
  if (n % kRows != 0) std::memset(dst + (panels - 1) * blocks * f.panel_bytes, 0,
                                  blocks * f.panel_bytes);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      uint8_t* panel = dst + p * blocks * f.panel_bytes;
      for (int lane = 0; lane < kRows && p * kRows + lane < n; ++lane) {
        const uint8_t* in = src + (order ? order[p * kRows + lane] : p * kRows + lane) * row_bytes;
        for (int64_t b = 0; b < blocks; ++b)
          pack_block(f, in + b * f.type_bytes, panel + b * f.panel_bytes, lane);
      }
    }
  });
}

// raw uint8 [N, row_bytes] (one GGUF tensor's rows) -> panels uint8 [ceil(N/16), blocks *
// panel_bytes], on huge pages where they are 4 MB or more. Panel row n takes raw row
// row_order[n] where given (a row permutation, such as the q/k un-permute, costs nothing
// extra here).
at::Tensor gguf_pack(const at::Tensor& raw, int64_t ggml_type,
                     const c10::optional<at::Tensor>& row_order) {
  const Format& f = checked_format(ggml_type);
  const int64_t n = checked_rows(f, raw, row_order);
  at::Tensor out = radixserve::empty_on_huge_pages(
      {(n + kRows - 1) / kRows, raw.size(1) / f.type_bytes * f.panel_bytes}, at::kByte);
  pack_into(f, raw, row_order, out.data_ptr<uint8_t>());
  return out;
}

// gguf_pack into `out`, uint8 contiguous of gguf_packed_bytes: a slice of a larger buffer, so
// that weights of any size share its huge pages.
void gguf_pack_into(const at::Tensor& raw, int64_t ggml_type,
                    const c10::optional<at::Tensor>& row_order, const at::Tensor& out) {
  const Format& f = checked_format(ggml_type);
  const int64_t n = checked_rows(f, raw, row_order);
  const int64_t bytes = packed_bytes(f, n, raw.size(1));
  TORCH_CHECK_VALUE(out.device().is_cpu() && out.scalar_type() == at::kByte &&
                        out.is_contiguous() && out.numel() == bytes,
                    "out: contiguous uint8 of ", bytes, " bytes on the CPU");
  pack_into(f, raw, row_order, out.data_ptr<uint8_t>());
}

// a * b - c with both roundings, as numpy computes it: volatile keeps the compiler from fusing
// them into one fma on a target that has it.
inline float product_minus(float a, float b, float c) {
  volatile float product = a * b;
  return product - c;
}

// One row (panel row `lane`) as floats, in gguf-py's order of operations.
void dequantize_row(const Format& f, const uint8_t* panel, int lane, int64_t blocks, float* y) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = panel + b * f.panel_bytes;
    const float d = radixserve::gguf::scale_at(block, 0, lane);
    float* out = y + b * f.block;
    for (int i = 0; i < f.block; ++i) {
      const int w = radixserve::gguf::weight_int(f, block, lane, i);
      switch (f.kind) {
        case Kind::q8s: out[i] = static_cast<float>(w) * d; break;
        case Kind::q4: out[i] = d * static_cast<float>(w - 8); break;
        case Kind::q4m:
          out[i] = product_minus(d, static_cast<float>(w),
                                 -radixserve::gguf::scale_at(block, 1, lane));
          break;
        case Kind::q4k: {
          const int j = i / 32;
          const float scale = d * static_cast<float>(block[kQ4kScales + 16 * j + lane]);
          const float min = radixserve::gguf::scale_at(block, 1, lane) *
                            static_cast<float>(block[kQ4kMins + 16 * j + lane]);
          out[i] = product_minus(scale, static_cast<float>(w), min);
          break;
        }
        case Kind::q6k: {
          const auto sc = static_cast<int8_t>(block[kQ6kScales + 16 * (i / 16) + lane]);
          out[i] = (d * static_cast<float>(sc)) * static_cast<float>(w - 32);
          break;
        }
      }
    }
  }
}

// Rows `ids` of an [n_rows, k] weight held as panels -> [len(ids), k] in `dtype`.
at::Tensor gguf_dequantize_rows(const at::Tensor& panels, int64_t ggml_type, int64_t n_rows,
                                int64_t k, const at::Tensor& ids, at::ScalarType dtype) {
  const Format& f = checked_format(ggml_type);
  TORCH_CHECK_VALUE(k >= f.block && k % f.block == 0, "k = ", k, " is not a multiple of ",
                    f.block);
  const int64_t blocks = k / f.block;
  TORCH_CHECK_VALUE(panels.device().is_cpu() && panels.scalar_type() == at::kByte &&
                        panels.dim() == 2 && panels.is_contiguous() &&
                        panels.size(0) == (n_rows + kRows - 1) / kRows &&
                        panels.size(1) == blocks * f.panel_bytes,
                    "panels must be uint8 [ceil(n_rows / 16), k / ", f.block, " * ",
                    f.panel_bytes, "]");
  TORCH_CHECK_VALUE(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(),
                    "ids: int64 [T]");
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                    "dtype: float32, bfloat16 or float16");
  const int64_t t = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK_INDEX(id[i] >= 0 && id[i] < n_rows, "id ", id[i], " is not a row of ", n_rows);
  at::Tensor out = at::empty({t, k}, panels.options().dtype(at::kFloat));
  const uint8_t* src = panels.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      dequantize_row(f, src + (id[i] / kRows) * panels.size(1), static_cast<int>(id[i] % kRows),
                     blocks, y + i * k);
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("gguf_pack(Tensor raw, int ggml_type, Tensor? row_order=None) -> Tensor");
  m.impl("gguf_pack", c10::DispatchKey::CPU, TORCH_FN(gguf_pack));
  m.def("gguf_pack_into(Tensor raw, int ggml_type, Tensor? row_order, Tensor(a!) out) -> ()");
  m.impl("gguf_pack_into", c10::DispatchKey::CPU, TORCH_FN(gguf_pack_into));
  m.def("gguf_packed_bytes(int ggml_type, int rows, int row_bytes) -> int", &gguf_packed_bytes);
  m.def("gguf_dequantize_rows(Tensor panels, int ggml_type, int n_rows, int k, Tensor ids, "
        "ScalarType dtype) -> Tensor");
  m.impl("gguf_dequantize_rows", c10::DispatchKey::CPU, TORCH_FN(gguf_dequantize_rows));
}
