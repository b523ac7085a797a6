// The small per-layer operations of a decoder layer, one call each: RMSNorm and the rotary
// embedding of q and k; and, as small and as dispatch-bound, a grammar's token mask applied
// to the sampler's logits.
//
// Why: in a decode step their tensors are a few thousand numbers, and what they cost is the
// dispatch of the PyTorch kernels they are made of. F.rms_norm on the CPU is six of them
// (pow, mean, add, rsqrt, mul, and the weight's mul), the rotation six more (two slices,
// neg, cat, two muls and an add); between matmuls that stream megabytes each one starts cold.
// At batch 1 the norms alone then cost a noticeable share of a token (benchmarks/
// bench_engine.py measures the step). Here each is one pass over the rows (threads split the rows of a prefill step).
//
// Arithmetic: in float32 whatever the dtype (bfloat16 is read and rounded once on the way
// out), in a fixed order per row, so a row's result does not depend on the rows beside it.
// bfloat16 rows run 16 values at a time on CPUs with AVX512-BF16 (a prefill's norms and
// products are megabytes, and the scalar loops are far slower there), the same way for every
// row.

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>

#include "common/cpu_features.h"
#include "common/vector.h"

namespace {

// Elements of rows handled per parallel_for chunk: a decode step's rows stay on one thread.
constexpr int64_t kGrainElements = 1 << 16;

template <typename T>
inline float load(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

#ifdef RS_X86
// bfloat16 rows on CPUs with AVX512-BF16, 16 values at a time; `count` (<= 16) of them at the
// tail. vcvtneps2bf16 rounds to nearest even, as c10::BFloat16 does (it flushes denormals,
// below 1.2e-38, to zero).
RS_AVX512BF16 inline __m512 load16(const c10::BFloat16* p, int64_t count = 16) {
  const __mmask16 live = static_cast<__mmask16>((1u << count) - 1);
  const __m256i half = _mm256_maskz_loadu_epi16(live, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

RS_AVX512BF16 inline void store16(c10::BFloat16* p, __m512 v, int64_t count = 16) {
  const __m256bh h = _mm512_cvtneps_pbh(v);
  _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << count) - 1),
                           reinterpret_cast<const __m256i&>(h));
}

// rms_norm_row for bfloat16 (below): the sum of squares in 16 lanes, reduced in one fixed
// order, the rest as there.
RS_AVX512BF16 void rms_norm_row_bf16(const c10::BFloat16* xr, const c10::BFloat16* w,
                                     c10::BFloat16* yr, int64_t h, double eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < h; i += 16) {
    const __m512 v = load16(xr + i, std::min<int64_t>(16, h - i));
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  const float sum = _mm512_reduce_add_ps(acc);
  const __m512 scale = _mm512_set1_ps(
      1.f / std::sqrt(sum / static_cast<float>(h) + static_cast<float>(eps)));
  for (int64_t c = 0; c < h; c += 16) {
    const int64_t count = std::min<int64_t>(16, h - c);
    const __m512 normed = _mm512_mul_ps(load16(xr + c, count), scale);
    const __m256bh rounded = _mm512_cvtneps_pbh(normed);  // to the dtype, as HF does
    const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(rounded)), 16));
    store16(yr + c, _mm512_mul_ps(load16(w + c, count), back), count);
  }
}

RS_AVX512BF16 void add_rows_bf16(const c10::BFloat16* x, const c10::BFloat16* d,
                                 c10::BFloat16* s, int64_t h) {
  for (int64_t c = 0; c < h; c += 16) {
    const int64_t count = std::min<int64_t>(16, h - c);
    store16(s + c, _mm512_add_ps(load16(x + c, count), load16(d + c, count)), count);
  }
}

// y[i] *= up[i]: PyTorch's bfloat16 product (float32, rounded once), 16 at a time.
RS_AVX512BF16 void mul_rows_bf16(c10::BFloat16* y, const c10::BFloat16* up, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t count = std::min<int64_t>(16, n - i);
    store16(y + i, _mm512_mul_ps(load16(y + i, count), load16(up + i, count)), count);
  }
}
#endif

// Whether the bfloat16 rows above run here.
inline bool bf16_rows() {
#ifdef RS_X86
  return radixserve::cpu_features().avx512_bf16();
#else
  return false;
#endif
}

// y = w * to_dtype(x * rsqrt(mean(x^2) + eps)) of one row: HF's LlamaRMSNorm, whose product
// with the weight is in the model's dtype (for bfloat16 a second rounding, kept).
template <typename T>
inline void rms_norm_row(const T* xr, const T* w, T* yr, int64_t h, double eps) {
  // Eight partial sums in a fixed order: vectorisable, and the same bits every call.
  float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= h; i += 8)
    for (int j = 0; j < 8; ++j) {
      const float v = load(xr, i + j);
      partial[j] += v * v;
    }
  for (; i < h; ++i) {
    const float v = load(xr, i);
    partial[0] += v * v;
  }
  const float sum = ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
                    ((partial[4] + partial[5]) + (partial[6] + partial[7]));
  const float scale = 1.f / std::sqrt(sum / static_cast<float>(h) + static_cast<float>(eps));
  for (int64_t c = 0; c < h; ++c) {
    const T normed = static_cast<T>(load(xr, c) * scale);
    yr[c] = static_cast<T>(load(w, c) * static_cast<float>(normed));
  }
}

// One row, on the vector path where it applies (the same for every row on a machine).
template <typename T>
inline void norm_row(const T* xr, const T* w, T* yr, int64_t h, double eps, bool vector) {
#ifdef RS_X86
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (vector) return rms_norm_row_bf16(xr, w, yr, h, eps);
  }
#endif
  rms_norm_row(xr, w, yr, h, eps);
}

// s = x + d rounded to the dtype, on the vector path where it applies.
template <typename T>
inline void add_row(const T* xr, const T* dr, T* sr, int64_t h, bool vector) {
#ifdef RS_X86
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (vector) return add_rows_bf16(xr, dr, sr, h);
  }
#endif
  for (int64_t c = 0; c < h; ++c) sr[c] = static_cast<T>(load(xr, c) + load(dr, c));
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t h, double eps) {
  const int64_t grain = std::max<int64_t>(1, kGrainElements / h);
  const bool vector = bf16_rows();
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(x + r * h, w, y + r * h, h, eps, vector);
  });
}

// s = x + d (rounded to the dtype, as PyTorch's add) and y = RMSNorm(s), row by row: the
// residual add before each norm of a decoder layer, in one pass.
template <typename T>
void add_rms_norm_rows(const T* x, const T* d, const T* w, T* s, T* y, int64_t rows, int64_t h,
                       double eps) {
  const int64_t grain = std::max<int64_t>(1, kGrainElements / h);
  const bool vector = bf16_rows();
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      add_row(x + r * h, d + r * h, s + r * h, h, vector);
      norm_row(s + r * h, w, y + r * h, h, eps, vector);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "x: contiguous float32 or bfloat16 [M, H] on the CPU");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == x.size(1) &&
                        weight.scalar_type() == x.scalar_type() && weight.is_contiguous(),
                    "weight: [H] in x's dtype");
  at::Tensor y = at::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(),
                  x.size(0), x.size(1), eps);
  else
    rms_norm_rows(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
                  y.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), eps);
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& d,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "x: contiguous float32 or bfloat16 [M, H] on the CPU");
  TORCH_CHECK_VALUE(d.sizes() == x.sizes() && d.scalar_type() == x.scalar_type() &&
                        d.is_contiguous() && d.device().is_cpu(),
                    "d: contiguous, x's shape and dtype");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == x.size(1) &&
                        weight.scalar_type() == x.scalar_type() && weight.is_contiguous(),
                    "weight: [H] in x's dtype");
  at::Tensor s = at::empty_like(x), y = at::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    add_rms_norm_rows(x.data_ptr<float>(), d.data_ptr<float>(), weight.data_ptr<float>(),
                      s.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1), eps);
  else
    add_rms_norm_rows(x.data_ptr<c10::BFloat16>(), d.data_ptr<c10::BFloat16>(),
                      weight.data_ptr<c10::BFloat16>(), s.data_ptr<c10::BFloat16>(),
                      y.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), eps);
  return {s, y};
}

// silu(gate) * up of gate_up [M, 2I] (gate the first I columns): PyTorch's own kernels,
// called from here, so the bits are those of F.silu(gate) * up on each row alone, and only the
// Python dispatch of a split, a silu and a mul goes. Threads take whole rows: at::silu over
// the whole [M, I] splits its elements evenly between threads, cuts that can fall inside a
// row, and its vector and scalar code round some values differently (4% of random inputs),
// so a row's bits would depend on M and the thread count. Within a chunk of rows (one
// thread) each row is computed from its first element, whatever the chunk.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
                    "gate_up: [M, 2I], the gate first");
  const int64_t rows = gate_up.size(0), half = gate_up.size(1) / 2;
  at::Tensor y = at::empty({rows, half}, gate_up.options());
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(half, 1));
  // The callers' thread-local state (inference mode above all) on every thread of the team:
  // ATen ops on a worker thread would otherwise run outside it.
  const at::ThreadLocalState state;
  const bool vector = bf16_rows() && gate_up.scalar_type() == at::kBFloat16 &&
                      gate_up.is_contiguous();
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(state);
    const at::Tensor part = gate_up.narrow(0, begin, end - begin);
    at::Tensor out = y.narrow(0, begin, end - begin);
    at::silu_out(out, part.narrow(1, 0, half));
#ifdef RS_X86
    if (vector) {  // PyTorch's bfloat16 mul_, without its strided iteration (3x the time)
      c10::BFloat16* products = y.data_ptr<c10::BFloat16>();
      const c10::BFloat16* up = gate_up.data_ptr<c10::BFloat16>() + half;
      for (int64_t r = begin; r < end; ++r)
        mul_rows_bf16(products + r * half, up + r * 2 * half, half);
      return;
    }
#endif
    out.mul_(part.narrow(1, half, half));
  });
  return y;
}

// Heads [0, heads) of every token of qkv rotated in place (GPT-NeoX/Llama "rotate half":
// element i pairs with i + D/2): x' = x * cos + rotate_half(x) * sin, cos and sin [T, D/2]
// in float32 (the two halves of HF's cos/sin are equal).
template <typename T>
void rotate_rows(T* qkv, const float* cos, const float* sin, int64_t tokens, int64_t heads,
                 int64_t stride, int64_t d) {
  const int64_t half = d / 2;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / (heads * d));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t head = 0; head < heads; ++head) {
        T* x = qkv + t * stride + head * d;
        for (int64_t i = 0; i < half; ++i) {
          const float a = static_cast<float>(x[i]), b = static_cast<float>(x[i + half]);
          x[i] = static_cast<T>(a * c[i] - b * s[i]);
          x[i + half] = static_cast<T>(b * c[i] + a * s[i]);
        }
      }
    }
  });
}

void rotary_embedding_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                       int64_t heads) {
  TORCH_CHECK_VALUE(qkv.device().is_cpu() && qkv.dim() == 3 && qkv.is_contiguous() &&
                        (qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16),
                    "qkv: contiguous float32 or bfloat16 [T, heads, D] on the CPU");
  const int64_t tokens = qkv.size(0), d = qkv.size(2);
  TORCH_CHECK_VALUE(heads >= 0 && heads <= qkv.size(1) && d % 2 == 0,
                    "heads must be at most qkv's heads, D even");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                          t->size(0) == tokens && t->size(1) == d / 2,
                      "cos and sin: contiguous float32 [T, D / 2]");
  const int64_t stride = qkv.size(1) * d;
  if (qkv.scalar_type() == at::kFloat)
    rotate_rows(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), tokens,
                heads, stride, d);
  else
    rotate_rows(qkv.data_ptr<c10::BFloat16>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                tokens, heads, stride, d);
}

// k_cache[h, slots[t]] = k[t, h] and the same for v: a step's new keys and values stored in
// the head-major pool ([Hkv, S, D]), read where they lie in the qkv projection (any strides but
// a contiguous last dim), in one call instead of two index_copy_ calls per layer.
void write_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
               const at::Tensor& k, const at::Tensor& v) {
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK_VALUE(c->device().is_cpu() && c->dim() == 3 && c->is_contiguous() &&
                          c->sizes() == k_cache.sizes() &&
                          c->scalar_type() == k_cache.scalar_type(),
                      "caches: contiguous [Hkv, slots, D] on the CPU, one shape and dtype");
  const int64_t heads = k_cache.size(0), capacity = k_cache.size(1), d = k_cache.size(2);
  TORCH_CHECK_VALUE(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
                    "slots: contiguous int64 [T]");
  const int64_t tokens = slots.size(0);
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->dim() == 3 && t->size(0) == tokens &&
                          t->size(1) == heads && t->size(2) == d && t->stride(2) == 1 &&
                          t->scalar_type() == k_cache.scalar_type(),
                      "k and v: [T, Hkv, D] in the caches' dtype, the last dim contiguous");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK_INDEX(slot[t] >= 0 && slot[t] < capacity, "slot ", slot[t], " is outside the pool");
  const int64_t bytes = d * k_cache.element_size();
  char* caches[2] = {static_cast<char*>(k_cache.data_ptr()),
                     static_cast<char*>(v_cache.data_ptr())};
  const at::Tensor* rows[2] = {&k, &v};
  at::parallel_for(0, tokens, std::max<int64_t>(1, kGrainElements / (heads * d)),
                   [&](int64_t begin, int64_t end) {
    for (int which = 0; which < 2; ++which) {
      const at::Tensor& src = *rows[which];
      const char* base = static_cast<const char*>(src.data_ptr());
      const int64_t e = src.element_size();
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h)
          std::memcpy(caches[which] + (h * capacity + slot[t]) * bytes,
                      base + (t * src.stride(0) + h * src.stride(1)) * e, bytes);
    }
  });
}

// torch.argmax(logits, dim=-1) of float32 [R, V]: the first index of the largest value, a NaN
// counting as larger than any number (as torch's). One pass per row, where torch's reduction
// is slower over a large vocabulary (benchmarks/bench_sampler.py).
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                        logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
                    "logits: contiguous float32 [R, V > 0] on the CPU");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* best = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * vocab;
      // Eight running maxima with their first indices (ties keep the earlier index), merged
      // in index order: the same answer as one scan, in a loop the compiler vectorises.
      float top[8];
      int64_t at_[8];
      for (int j = 0; j < 8; ++j) {
        top[j] = -std::numeric_limits<float>::infinity();
        at_[j] = -1;
      }
      int64_t i = 0, nan = -1;
      for (; i + 8 <= vocab && nan < 0; i += 8)
        for (int j = 0; j < 8; ++j) {
          const float v = row[i + j];
          if (v != v) nan = i + j;
          if (v > top[j]) {
            top[j] = v;
            at_[j] = i + j;
          }
        }
      if (nan >= 0) {  // the first NaN wins: find it from the block it showed in
        for (int64_t n = i - 8; n < i; ++n)
          if (row[n] != row[n]) {
            best[r] = n;
            break;
          }
        continue;
      }
      float top_value = -std::numeric_limits<float>::infinity();
      int64_t top_index = -1;
      for (int j = 0; j < 8; ++j)
        if (at_[j] >= 0 && (top[j] > top_value || (top[j] == top_value && at_[j] < top_index))) {
          top_value = top[j];
          top_index = at_[j];
        }
      if (top_index < 0 && i > 0) top_index = 0;  // all -inf so far: the first of them
      for (; i < vocab; ++i) {
        const float v = row[i];
        if (v != v) {
          top_index = i;
          break;
        }
        if (v > top_value || top_index < 0) {
          top_value = v;
          top_index = i;
        }
      }
      best[r] = top_index < 0 ? 0 : top_index;  // every value -inf: the first, as torch
    }
  });
  return out;
}

// Sets logits[rows[m], v] to -inf for every token v that grammar mask m does not allow (bit
// v % 32 of word v / 32 clear, or v past the mask). One pass over the masked rows: in PyTorch
// the same takes five kernels over [rows, vocab] (benchmarks/bench_structured_output.py).
void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& masks, const at::Tensor& rows) {
  TORCH_CHECK_VALUE(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                        logits.dim() == 2 && logits.is_contiguous(),
                    "logits: contiguous float32 [R, vocab] on the CPU");
  TORCH_CHECK_VALUE(masks.scalar_type() == at::kInt && masks.dim() == 2 && masks.is_contiguous(),
                    "masks: contiguous int32 [M, words]");
  TORCH_CHECK_VALUE(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() &&
                        rows.size(0) == masks.size(0),
                    "rows: int64 [M], the logits row of each mask");
  const int64_t vocab = logits.size(1), words = masks.size(1);
  const int64_t* row_of = rows.data_ptr<int64_t>();
  for (int64_t m = 0; m < rows.size(0); ++m)
    TORCH_CHECK_INDEX(row_of[m] >= 0 && row_of[m] < logits.size(0), "rows out of range");
  float* out = logits.data_ptr<float>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(masks.data_ptr<int32_t>());
  const float minus_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      float* row = out + row_of[m] * vocab;
      const uint32_t* mask = bits + m * words;
      const int64_t covered = std::min(vocab, 32 * words);
      // A grammar's mask is mostly whole words of 0 (forbidden) or of 1 (allowed); the others
      // take a branch-free select per token (a bit-test branch mispredicts half the time).
      for (int64_t w = 0; w * 32 < covered; ++w) {
        const uint32_t word = mask[w];
        const int64_t first = 32 * w, n = std::min<int64_t>(32, covered - first);
        if (word == ~0u) continue;
        for (int64_t i = 0; i < n; ++i)
          row[first + i] = ((word >> i) & 1u) ? row[first + i] : minus_inf;
      }
      for (int64_t v = covered; v < vocab; ++v) row[v] = minus_inf;
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor masks, Tensor rows) -> ()");
  m.impl("apply_token_bitmask_", c10::DispatchKey::CPU, TORCH_FN(apply_token_bitmask_));
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("add_rms_norm(Tensor x, Tensor d, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.def("write_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor k, Tensor v) "
        "-> ()");
  m.impl("write_kv_", c10::DispatchKey::CPU, TORCH_FN(write_kv_));
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, TORCH_FN(argmax_rows));
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.def("rotary_embedding_(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads) -> ()");
  m.impl("rotary_embedding_", c10::DispatchKey::CPU, TORCH_FN(rotary_embedding_));
}
