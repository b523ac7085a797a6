// A model's decoder layers run by one call per step: the same kernels the Python layers call
// (the GGUF or float matmuls, layer_ops/layer_ops.cpp's norms, rotation and K/V write, the paged
// attention), in the same order on the same tensors, so the result has the same bits; only
// the Python between them goes.
//
// Why: a decode step's matmuls stream the weights, and every small call between them then
// starts with cold caches: a small op right after a large one costs many times what it costs
// alone, and a Llama layer makes about twenty calls through Python and the dispatcher between
// its four matmuls (benchmarks/bench_vs_llama_cpp.py measures the decode this gives).
//
// The other kernels are reached through the dispatcher (one typed handle each, looked up once),
// so each file keeps its kernels to itself.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace {

// How a projection runs: the methods of radixserve/layers/linear.py and quantized.py.
enum class Kind : int64_t { kGGUF = 0, kFloatPanels = 1 };

struct Projection {
  Kind kind;
  std::vector<at::Tensor> panels;  // GGUF parts, or one tensor of float panels
  std::vector<int64_t> types, rows;
  c10::optional<at::Tensor> bias;  // float32 for float panels (as the Python method passes it)
  int64_t out_features;
  int64_t max_path;
};

// The signatures of the ops the stack calls, as registered.
using Tensor = at::Tensor;
using OptionalTensor = c10::optional<at::Tensor>;
using GGUFLinear = Tensor(const Tensor&, at::TensorList, at::IntArrayRef, at::IntArrayRef,
                          const OptionalTensor&, int64_t);
using FloatLinear = Tensor(const Tensor&, const Tensor&, int64_t, const OptionalTensor&, int64_t);
using RMSNorm = Tensor(const Tensor&, const Tensor&, double);
using AddRMSNorm = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double);
using SiluMul = Tensor(const Tensor&);
using Rotary = void(Tensor&, const Tensor&, const Tensor&, int64_t);
using WriteKV = void(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&);
using Attention = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         const Tensor&, const Tensor&, double, int64_t,
                         const c10::optional<Tensor>&);

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

class DecoderStack : public torch::CustomClassHolder {
 public:
  DecoderStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        gguf_linear_(op<GGUFLinear>("radixserve::gguf_linear")),
        float_linear_(op<FloatLinear>("radixserve::float_panels_linear")),
        rms_norm_(op<RMSNorm>("radixserve::rms_norm")),
        add_rms_norm_(op<AddRMSNorm>("radixserve::add_rms_norm")),
        silu_mul_(op<SiluMul>("radixserve::silu_mul")),
        rotary_(op<Rotary>("radixserve::rotary_embedding_")),
        write_kv_(op<WriteKV>("radixserve::write_kv_")),
        attention_(op<Attention>("radixserve::paged_attention")) {
    TORCH_CHECK_VALUE(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 2 == 0,
                      "heads must be a multiple of kv_heads, head_dim even");
  }

  // Appends a projection; a layer is four, in order: qkv, o, gate_up, down.
  void add_projection(int64_t kind, std::vector<at::Tensor> panels, std::vector<int64_t> types,
                      std::vector<int64_t> rows, c10::optional<at::Tensor> bias,
                      int64_t out_features, int64_t max_path) {
    TORCH_CHECK_VALUE(kind == 0 || kind == 1, "projection kind ", kind, " is unknown");
    Projection p{static_cast<Kind>(kind), std::move(panels), std::move(types), std::move(rows),
                 std::move(bias), out_features, max_path};
    if (p.kind == Kind::kGGUF)
      TORCH_CHECK_VALUE(!p.panels.empty() && p.panels.size() == p.types.size() &&
                            p.panels.size() == p.rows.size(),
                        "a GGUF projection needs panels, types and rows per part");
    if (p.kind == Kind::kFloatPanels)
      TORCH_CHECK_VALUE(p.panels.size() == 1, "a float projection has one tensor of panels");
    projections_.push_back(std::move(p));
  }

  // Appends a layer's two norm weights, after its four projections.
  void add_norms(at::Tensor input_norm, at::Tensor post_norm) {
    norms_.emplace_back(std::move(input_norm), std::move(post_norm));
    TORCH_CHECK_VALUE(projections_.size() == 4 * norms_.size(),
                      "a layer's four projections come before its norms");
  }

  int64_t num_layers() const { return static_cast<int64_t>(norms_.size()); }

  // The decoder layers over the step's embedded tokens x [T, hidden]: returns the last layer's
  // output before the final norm (LlamaModel.hidden_states) for rows output_rows (all where
  // undefined). Row t's new K/V go to slot write_slots[t] of each layer's caches, and row t
  // attends to slots[begins[t] : begins[t] + lengths[t]] (paged_attention's arguments, for
  // every row of the step).
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin,
                     std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                     at::Tensor write_slots, at::Tensor slots, at::Tensor begins,
                     at::Tensor lengths, int64_t attention_path,
                     c10::optional<at::Tensor> output_rows) {
    const int64_t layers = num_layers();
    TORCH_CHECK_VALUE(static_cast<int64_t>(k_caches.size()) == layers &&
                          static_cast<int64_t>(v_caches.size()) == layers,
                      "one K and one V cache per layer (", layers, ")");
    TORCH_CHECK_VALUE(x.dim() == 2, "x: [T, hidden]");
    int64_t tokens = x.size(0);
    at::Tensor residual = x.contiguous(), h;
    for (int64_t i = 0; i < layers; ++i) {
      const auto& [input_norm, post_norm] = norms_[i];
      const Projection* p = &projections_[4 * i];
      at::Tensor normed;
      if (h.defined())
        std::tie(residual, normed) = add_rms_norm_.call(residual, h, input_norm, eps_);
      else
        normed = rms_norm_.call(residual, input_norm, eps_);

      at::Tensor qkv = project(p[0], normed).view({tokens, -1, head_dim_}).contiguous();
      rotary_.call(qkv, cos, sin, heads_ + kv_heads_);
      write_kv_.call(k_caches[i], v_caches[i], write_slots, qkv.narrow(1, heads_, kv_heads_),
                     qkv.narrow(1, heads_ + kv_heads_, kv_heads_));
      at::Tensor q = qkv.narrow(1, 0, heads_);
      if (i == layers - 1 && output_rows.has_value()) {
        // Every row's K/V is written; the rest of the last layer only for the rows read.
        const at::Tensor& rows = *output_rows;
        q = q.index_select(0, rows);
        begins = begins.index_select(0, rows);
        lengths = lengths.index_select(0, rows);
        residual = residual.index_select(0, rows);
        tokens = rows.numel();
      }
      at::Tensor attended = attention_.call(q.contiguous(), k_caches[i], v_caches[i], slots,
                                            begins, lengths, scale_, attention_path,
                                            c10::nullopt);
      h = project(p[1], attended.view({tokens, heads_ * head_dim_}));

      std::tie(residual, normed) = add_rms_norm_.call(residual, h, post_norm, eps_);
      h = mlp(p[2], p[3], normed);
    }
    return h.defined() ? at::add(residual, h) : residual;
  }

 private:
  // down(silu(gate) * up) of x, at most kMlpRows rows at a time. A prefill's gate_up output is
  // the step's largest tensor (64 KB a row for a 1B model): whole, 113 MB at 1,728 tokens,
  // above the size (32 MB) up to which glibc's malloc reuses freed memory, so each layer's
  // was fresh pages from the kernel, faulted in and zeroed (hundreds of thousands of page
  // faults a long prefill step). Rows are independent in every kernel here,
  // so the bits are the same; each chunk still reads every weight panel once for its rows.
  at::Tensor mlp(const Projection& gate_up, const Projection& down, const at::Tensor& x) const {
    const int64_t tokens = x.size(0);
    if (tokens <= kMlpRows) return project(down, silu_mul_.call(project(gate_up, x)));
    at::Tensor out = at::empty({tokens, down.out_features}, x.options());
    for (int64_t first = 0; first < tokens; first += kMlpRows) {
      const int64_t rows = std::min(kMlpRows, tokens - first);
      out.narrow(0, first, rows)
          .copy_(project(down, silu_mul_.call(project(gate_up, x.narrow(0, first, rows)))));
    }
    return out;
  }

  static constexpr int64_t kMlpRows = 256;

  at::Tensor project(const Projection& p, const at::Tensor& x) const {
    switch (p.kind) {
      case Kind::kGGUF:
        return gguf_linear_.call(x.contiguous(), p.panels, p.types, p.rows, p.bias, p.max_path);
      case Kind::kFloatPanels:
        return float_linear_
            .call(x.to(at::kFloat).contiguous(), p.panels[0], p.out_features, p.bias, p.max_path)
            .to(x.scalar_type());
    }
    TORCH_CHECK(false, "unreachable");
  }

  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  std::vector<Projection> projections_;
  std::vector<std::tuple<at::Tensor, at::Tensor>> norms_;
  c10::TypedOperatorHandle<GGUFLinear> gguf_linear_;
  c10::TypedOperatorHandle<FloatLinear> float_linear_;
  c10::TypedOperatorHandle<RMSNorm> rms_norm_;
  c10::TypedOperatorHandle<AddRMSNorm> add_rms_norm_;
  c10::TypedOperatorHandle<SiluMul> silu_mul_;
  c10::TypedOperatorHandle<Rotary> rotary_;
  c10::TypedOperatorHandle<WriteKV> write_kv_;
  c10::TypedOperatorHandle<Attention> attention_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double>())
      .def("add_projection", &DecoderStack::add_projection)
      .def("add_norms", &DecoderStack::add_norms)
      .def("num_layers", &DecoderStack::num_layers)
      .def("forward", &DecoderStack::forward);
}
