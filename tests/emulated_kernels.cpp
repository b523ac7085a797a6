// The kernels' AVX-512 paths as plain functions, for tests/emulated_cpu.py to run on an
// emulated CPU. Built with g++ into a static image with no C library (emulated_libc.cpp has
// the little it needs): the kernel sources are included as they are, and each entry point
// takes one struct of pointers into the arena, whose layout test_emulated_avx512.py packs.

#include <cpuid.h>

#include <cstddef>
#include <cstdint>

#include "attention/attention_avx512.h"
#include "gguf/gguf_matmul_avx512.cpp"
#include "float_panels/float_panels_paths.h"
#include "bf16_matmul/skinny_matmul_avx512bf16.h"

extern "C" {

// out = eax, ebx, ecx, edx of CPUID (leaf, subleaf): what the emulated CPU says it has.
void rs_cpuid(uint32_t leaf, uint32_t subleaf, uint32_t* out) {
  __cpuid_count(leaf, subleaf, out[0], out[1], out[2], out[3]);
}

// panel_avx512 over every panel of a packed weight, rows of x taken `chunk` at a time as
// gguf_linear does: out[panel][row][lane], the accumulators as the path leaves them.
struct GgufCall {
  int64_t ggml_type, panel_count, panel_stride, m, k, chunk;
  const uint8_t* panels;
  const int8_t* q;
  const float* dx;
  const int32_t* sums;
  const float* dxs;
  const int16_t* sums16;
  const int16_t* sums32;
  float* out;
};

static_assert(sizeof(GgufCall) == 112 && offsetof(GgufCall, out) == 104, "packed as <6q8Q");

void rs_gguf_panels(const GgufCall* c) {
  using namespace radixserve::gguf;
  const Format* f = format_of(c->ggml_type);
  const QuantizedRows a{c->q, c->dx, c->sums, c->dxs, c->sums16, c->sums32, c->k, c->k / f->block};
  for (int64_t p = 0; p < c->panel_count; ++p)
    for (int64_t r0 = 0; r0 < c->m; r0 += c->chunk) {
      const int64_t rows = c->m - r0 < c->chunk ? c->m - r0 : c->chunk;
      panel_avx512(*f, c->panels + p * c->panel_stride, a, r0, rows,
                   c->out + (p * c->m + r0) * kRows);
    }
}

static_assert(sizeof(radixserve::float_panels::Problem) == 48 &&
                  offsetof(radixserve::float_panels::Problem, out) == 40,
              "packed as <Q3qQQ");

// skinny_float's AVX-512 path over panels [p0, p1) of w, whose type is 0 float32, 1 float16
// or 2 bfloat16.
void rs_skinny_float(const radixserve::float_panels::Problem* problem, const void* w,
                     int64_t type, int64_t p0, int64_t p1) {
  using namespace radixserve::float_panels;
  if (type == 0)
    panels_vector<Avx512>(*problem, static_cast<const float*>(w), p0, p1);
  else if (type == 1)
    panels_vector<Avx512>(*problem, static_cast<const c10::Half*>(w), p0, p1);
  else
    panels_vector<Avx512>(*problem, static_cast<const c10::BFloat16*>(w), p0, p1);
}

// One row's attention over one kv head's pool, as paged_attention's AVX-512 paths compute it:
// path 2 (attend_avx512: float32 q, a float32 or bfloat16 pool) or 3 (attend_bf16: bfloat16 q
// and pool); dim 64 or 128; with attention sinks or none. Scratch: scores [groups * n], probs
// [groups * (n + 2)], totals [groups].
struct AttendCall {
  int64_t path, bf16, dim, n, groups;
  double scale;
  const void* q;
  const void* keys;
  const void* values;
  const int32_t* slots;
  float* scores;
  uint16_t* probs;
  float* totals;
  void* out;
  const float* sinks;  // [groups], or null
};

static_assert(sizeof(AttendCall) == 120 && offsetof(AttendCall, sinks) == 112, "packed as <5qd9Q");

void rs_attend(const AttendCall* c) {
  using radixserve::attention::attend_avx512;
  using radixserve::attention::attend_bf16;
  using c10::BFloat16;
  const auto scale = static_cast<float>(c->scale);
  const auto* q = static_cast<const float*>(c->q);
  if (c->path == 3) {
    const auto* qh = static_cast<const BFloat16*>(c->q);
    const auto* k = static_cast<const BFloat16*>(c->keys);
    const auto* v = static_cast<const BFloat16*>(c->values);
    auto* out = static_cast<BFloat16*>(c->out);
    (c->dim == 64 ? attend_bf16<64> : attend_bf16<128>)(
        qh, k, v, c->slots, c->n, c->groups, scale, c->sinks, c->scores, c->probs, c->totals, out);
  } else if (c->bf16) {
    const auto* k = static_cast<const BFloat16*>(c->keys);
    const auto* v = static_cast<const BFloat16*>(c->values);
    auto* out = static_cast<BFloat16*>(c->out);
    (c->dim == 64 ? attend_avx512<BFloat16, 64> : attend_avx512<BFloat16, 128>)(
        q, k, v, c->slots, c->n, c->groups, scale, c->sinks, c->scores, out);
  } else {
    const auto* k = static_cast<const float*>(c->keys);
    const auto* v = static_cast<const float*>(c->values);
    auto* out = static_cast<float*>(c->out);
    (c->dim == 64 ? attend_avx512<float, 64> : attend_avx512<float, 128>)(
        q, k, v, c->slots, c->n, c->groups, scale, c->sinks, c->scores, out);
  }
}

// skinny_matmul's AVX512-BF16 path: out [m, n] float32 = x [m, k] @ w [n, k]^T, both
// bfloat16, over blocks of 16 output rows as the op's threads take them.
void rs_skinny_matmul(const c10::BFloat16* x, const c10::BFloat16* w, int64_t m, int64_t k,
                      int64_t n, float* out) {
  for (int64_t block = 0; block < n / 16; ++block)
    radixserve::skinny_matmul::rows_block(x, w, m, k, n, block * 16, out);
}

}  // extern "C"
