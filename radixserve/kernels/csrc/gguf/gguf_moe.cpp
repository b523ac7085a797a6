// A mixture-of-experts layer's experts with GGUF-quantized weights, on the CPU, in one call:
// y[t] = sum_j w[t, j] * down_e(act(gate_e(x[t]), up_e(x[t]))) over the experts e = ids[t, j]
// that the router chose for token t.
//
// Why one call: a decode step's token reads only its chosen experts' weights, and a prefill
// step's tokens are grouped by expert so that each chosen expert's panels stream from memory
// once for all its tokens (as llama.cpp's mul_mat_id does). The experts' weights are one
// [experts * rows, k] matrix per projection, packed as gguf_linear's panels (gguf_pack.cpp), so
// expert e's rows are a contiguous run of panels; the rows of an expert's tokens are gathered
// into one segment of the quantized activations. The panel paths (portable, AVX2, AVX-512 VNNI,
// AMX) are gguf_linear's, chosen once per call from the one CPU probe, so each expert's
// projection gives gguf_linear's bits for the same rows, and a token's result never depends on
// the tokens beside it: the prefix cache's on == off holds exactly.
//
// Work: phase 1 runs (expert, gate or up, panel) items, phase 2 (expert, down panel) items,
// shared out in runs of about 32 KB of weights as gguf_linear shares its panels (RunShares).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gguf/gguf_blocks.h"
#include "gguf/gguf_matmul.h"

namespace {

using namespace radixserve::gguf;

// How an expert combines its gate and up projections (the C++ side of Python's
// ExpertActivation codes).
enum class Activation : int64_t {
  silu = 0,            // silu(gate) * up (Qwen3-MoE, Mixtral, ...)
  clamped_swiglu = 1,  // gpt-oss: (clamp(up, -l, l) + 1) * g * sigmoid(alpha * g), g = min(gate, l)
};

// All experts' weights of one projection: expert e's `rows` output rows are panels
// [e * rows / 16, (e + 1) * rows / 16).
struct ExpertMatrix {
  const Format* format;
  const uint8_t* panels;
  int64_t stride;  // bytes per panel
  int64_t panels_per_expert;

  const uint8_t* panel(int64_t expert, int64_t p) const {
    return panels + (expert * panels_per_expert + p) * stride;
  }
};

ExpertMatrix checked_matrix(const char* name, const at::Tensor& panels, int64_t ggml_type,
                            int64_t experts, int64_t rows, int64_t k) {
  const Format* f = format_of(ggml_type);
  TORCH_CHECK_VALUE(f != nullptr, name, ": GGUF type ", ggml_type,
                    " has no panel layout (supported: Q8_0 = 8, Q4_0 = 2, Q4_1 = 3, Q4_K = 12, "
                    "Q6_K = 14)");
  TORCH_CHECK_VALUE(k >= f->block && k % f->block == 0, name, ": K = ", k,
                    " is not a multiple of its block (", f->block, ")");
  TORCH_CHECK_VALUE(rows % kRows == 0, name, ": an expert's rows (", rows,
                    ") must be a multiple of 16");
  TORCH_CHECK_VALUE(panels.device().is_cpu() && panels.scalar_type() == at::kByte &&
                        panels.dim() == 2 && panels.is_contiguous() &&
                        panels.size(0) == experts * rows / kRows &&
                        panels.size(1) == k / f->block * f->panel_bytes,
                    name, ": panels must be uint8 [", experts, " * ", rows, " / 16, K / ",
                    f->block, " * ", f->panel_bytes, "] for K = ", k);
  return {f, panels.data_ptr<uint8_t>(), panels.size(1), rows / kRows};
}

// A float32 [experts, n] bias, or nullptr.
const float* checked_bias(const char* name, const c10::optional<at::Tensor>& bias,
                          int64_t experts, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK_VALUE(bias->device().is_cpu() && bias->scalar_type() == at::kFloat &&
                        bias->dim() == 2 && bias->size(0) == experts && bias->size(1) == n &&
                        bias->is_contiguous(),
                    name, ": float32 [", experts, ", ", n, "]");
  return bias->data_ptr<float>();
}

// Which rows of the gathered activations each chosen expert owns.
struct Routing {
  std::vector<int64_t> experts;  // the chosen experts, ascending
  std::vector<int64_t> begin;    // their segments' first rows (aligned to 16 on the AMX path)
  std::vector<int64_t> count;    // their segments' rows
  std::vector<int64_t> row_of;   // [T * top_k]: the segment row of (token, choice)
  std::vector<int64_t> token_of; // [rows]: the token of a segment row; -1 for padding
  int64_t rows = 0;              // rows of the gathered activations
};

Routing route(const int64_t* ids, int64_t tokens, int64_t top_k, int64_t experts, bool align) {
  std::vector<int64_t> hits(experts, 0);
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    TORCH_CHECK_VALUE(ids[i] >= 0 && ids[i] < experts, "expert id ", ids[i], " is not one of ",
                      experts, " experts");
    ++hits[ids[i]];
  }
  Routing r;
  std::vector<int64_t> segment(experts, -1);
  for (int64_t e = 0; e < experts; ++e) {
    if (hits[e] == 0) continue;
    segment[e] = static_cast<int64_t>(r.experts.size());
    r.experts.push_back(e);
    r.begin.push_back(r.rows);
    r.count.push_back(0);
    r.rows += align ? (hits[e] + kRows - 1) / kRows * kRows : hits[e];
  }
  r.row_of.resize(tokens * top_k);
  r.token_of.assign(r.rows, -1);
  // Tokens in order within each segment.
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t s = segment[ids[t * top_k + j]];
      const int64_t row = r.begin[s] + r.count[s]++;
      r.row_of[t * top_k + j] = row;
      r.token_of[row] = t;
    }
  return r;
}

// Runs `items` (each one panel of one chosen expert) in runs of about 32 KB of weights,
// shared out over the threads as gguf_linear shares its panels. body(item, acc) computes one
// item for every row of its expert's segment, with acc scratch of kRowChunk * 16 floats.
template <typename Body>
void run_items(int64_t items, int64_t stride, const Body& body) {
  if (items == 0) return;
  const int64_t run_items = std::max<int64_t>(1, 32768 / stride);
  const int64_t runs = (items + run_items - 1) / run_items;
  const int64_t threads = std::min<int64_t>(std::max(1, at::get_num_threads()), runs);
  RunShares shares(runs, threads);
  at::parallel_for(0, threads, 1, [&](int64_t first_share, int64_t end_share) {
    std::vector<float> acc(kRowChunk * kRows);
    for (int64_t run; (run = shares.take(first_share, end_share)) >= 0;)
      for (int64_t i = run * run_items; i < std::min(items, (run + 1) * run_items); ++i)
        body(i, acc.data());
  });
}

// One panel of expert segment s for all its rows, written at `column` of `out` (float32 rows
// of `width`), plus bias[column..] where given.
void panel_rows(PanelPath run, const Format& f, const uint8_t* panel, const QuantizedRows& a,
                const Routing& r, int64_t s, float* acc, float* out, int64_t width,
                int64_t column, const float* bias) {
  for (int64_t r0 = 0; r0 < r.count[s]; r0 += kRowChunk) {
    const int64_t rows = std::min(kRowChunk, r.count[s] - r0);
    run(f, panel, a, r.begin[s] + r0, rows, acc);
    for (int64_t i = 0; i < rows; ++i) {
      float* y = out + (r.begin[s] + r0 + i) * width + column;
      const float* v = acc + i * kRows;
      if (bias != nullptr)
        for (int lane = 0; lane < kRows; ++lane) y[lane] = v[lane] + bias[lane];
      else
        std::copy(v, v + kRows, y);
    }
  }
}

inline float sigmoid_of(float v) { return 1.f / (1.f + std::exp(-v)); }

// act [rows, I] from gate_up [rows, 2I] (gate in the first half).
void activate(Activation kind, float alpha, float limit, const float* gate_up, int64_t rows,
              int64_t inter, float* act) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gate_up + r * 2 * inter;
      const float* u = g + inter;
      float* out = act + r * inter;
      if (kind == Activation::silu) {
        for (int64_t i = 0; i < inter; ++i) out[i] = g[i] * sigmoid_of(g[i]) * u[i];
      } else {
        for (int64_t i = 0; i < inter; ++i) {
          const float gate = std::min(g[i], limit);
          const float up = std::clamp(u[i], -limit, limit);
          out[i] = (up + 1.f) * (gate * sigmoid_of(gate * alpha));
        }
      }
    }
  });
}

// y [T, H] = the experts' weighted outputs. x: float32 or bfloat16 [T, H]; ids int64 and
// weights float32 [T, top_k]; gate and up [E * I, H] and down [E * H, I] as panels of their
// GGUF types; biases float32 [E, 2I] (gate then up) and [E, H] where the family has them.
at::Tensor gguf_moe(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                    const at::Tensor& gate, int64_t gate_type, const at::Tensor& up,
                    int64_t up_type, const at::Tensor& down, int64_t down_type,
                    int64_t experts, int64_t inter,
                    const c10::optional<at::Tensor>& gate_up_bias,
                    const c10::optional<at::Tensor>& down_bias, int64_t activation,
                    double alpha, double limit, int64_t max_path) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "x: contiguous float32 or bfloat16 [T, H] on the CPU");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK_VALUE(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 2 &&
                        ids.size(0) == tokens && ids.is_contiguous(),
                    "ids: contiguous int64 [T, top_k]");
  const int64_t top_k = ids.size(1);
  TORCH_CHECK_VALUE(weights.device().is_cpu() && weights.scalar_type() == at::kFloat &&
                        weights.sizes() == ids.sizes() && weights.is_contiguous(),
                    "weights: contiguous float32 [T, top_k], as ids");
  TORCH_CHECK_VALUE(experts >= 1 && inter >= 1, "experts and the expert FFN size must be >= 1");
  TORCH_CHECK_VALUE(activation == 0 || activation == 1,
                    "activation must be 0 (silu) or 1 (clamped swiglu)");
  const ExpertMatrix gm = checked_matrix("gate", gate, gate_type, experts, inter, hidden);
  const ExpertMatrix um = checked_matrix("up", up, up_type, experts, inter, hidden);
  const ExpertMatrix dm = checked_matrix("down", down, down_type, experts, hidden, inter);
  const float* gate_up_b = checked_bias("gate_up_bias", gate_up_bias, experts, 2 * inter);
  const float* down_b = checked_bias("down_bias", down_bias, experts, hidden);
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  if (tokens == 0 || top_k == 0) return out.zero_();
  const int path = checked_path(max_path);
  const PanelPath run = panel_path(path);
  const Routing r = route(ids.data_ptr<int64_t>(), tokens, top_k, experts, path >= 3);
  const int64_t segments = static_cast<int64_t>(r.experts.size());

  // Each token's row of x once per choice, in segment order (padding rows zero).
  at::Tensor gathered = path >= 3 ? at::zeros({r.rows, hidden}, x.options())
                                  : at::empty({r.rows, hidden}, x.options());
  {
    const auto* src = static_cast<const char*>(x.data_ptr());
    auto* dst = static_cast<char*>(gathered.data_ptr());
    const int64_t bytes = hidden * x.element_size();
    at::parallel_for(0, r.rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row)
        if (r.token_of[row] >= 0) std::memcpy(dst + row * bytes, src + r.token_of[row] * bytes, bytes);
    });
  }
  auto quantized = [&](const at::Tensor& rows, std::initializer_list<const Format*> formats,
                       int block) {
    bool used = false, q8 = false;
    for (const Format* f : formats) {
      used |= f->block == block;
      q8 |= f->block == block && f->kind == Kind::q8s;
    }
    return used ? quantize(rows, block, path, q8) : Quantized{};
  };

  // Phase 1: gate and up for every row of each chosen expert, into gate_up [rows, 2I].
  at::Tensor gate_up = at::empty({r.rows, 2 * inter}, x.options().dtype(at::kFloat));
  {
    const Quantized q32 = quantized(gathered, {gm.format, um.format}, 32);
    const Quantized q256 = quantized(gathered, {gm.format, um.format}, 256);
    float* h = gate_up.data_ptr<float>();
    const int64_t per_matrix = gm.panels_per_expert, per_expert = 2 * per_matrix;
    run_items(segments * per_expert, gm.stride, [&](int64_t item, float* acc) {
      const int64_t s = item / per_expert, within = item % per_expert;
      const int64_t is_up = within / per_matrix, p = within % per_matrix;
      const ExpertMatrix& m = is_up ? um : gm;
      const int64_t column = is_up * inter + p * kRows;
      panel_rows(run, *m.format, m.panel(r.experts[s], p),
                 (m.format->block == 32 ? q32 : q256).rows, r, s, acc, h, 2 * inter, column,
                 gate_up_b ? gate_up_b + r.experts[s] * 2 * inter + column : nullptr);
    });
  }
  at::Tensor act = at::empty({r.rows, inter}, gate_up.options());
  activate(static_cast<Activation>(activation), static_cast<float>(alpha),
           static_cast<float>(limit), gate_up.data_ptr<float>(), r.rows, inter,
           act.data_ptr<float>());
  gate_up = at::Tensor();

  // Phase 2: down for the same rows, into expert_out [rows, H].
  at::Tensor expert_out = at::empty({r.rows, hidden}, act.options());
  {
    const Quantized qa = quantize(act, dm.format->block, path, dm.format->kind == Kind::q8s);
    float* y = expert_out.data_ptr<float>();
    run_items(segments * dm.panels_per_expert, dm.stride, [&](int64_t item, float* acc) {
      const int64_t s = item / dm.panels_per_expert, p = item % dm.panels_per_expert;
      panel_rows(run, *dm.format, dm.panel(r.experts[s], p), qa.rows, r, s, acc, y, hidden,
                 p * kRows, down_b ? down_b + r.experts[s] * hidden + p * kRows : nullptr);
    });
  }

  // Each token's choices summed in their order: a token's bits never depend on its batch.
  const float* y = expert_out.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(hidden);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t j = 0; j < top_k; ++j) {
        const float wj = w[t * top_k + j];
        const float* row = y + r.row_of[t * top_k + j] * hidden;
        for (int64_t i = 0; i < hidden; ++i) sum[i] = std::fma(wj, row[i], sum[i]);
      }
      if (bf16) {
        auto* o = out.data_ptr<c10::BFloat16>() + t * hidden;
        for (int64_t i = 0; i < hidden; i += kRows) write_bf16(sum.data() + i, kRows, o + i);
      } else {
        std::copy(sum.begin(), sum.end(), out.data_ptr<float>() + t * hidden);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("gguf_moe(Tensor x, Tensor ids, Tensor weights, Tensor gate, int gate_type, Tensor up, "
        "int up_type, Tensor down, int down_type, int experts, int inter, Tensor? gate_up_bias, "
        "Tensor? down_bias, int activation, float alpha, float limit, int max_path) -> Tensor");
  m.impl("gguf_moe", c10::DispatchKey::CPU, TORCH_FN(gguf_moe));
}
