// The kernels' AVX-512 paths as plain functions, for tests/emulated_cpu.py to run on an
// emulated CPU. Built with g++ into a static image with no C library: the kernel sources are
// included as they are, and each entry point takes one struct of pointers into the arena.

#include <cpuid.h>

#include <cstddef>
#include <cstdint>

#include "decode_attention_avx512.h"
#include "gguf_matmul_avx512.cpp"
#include "skinny_float_paths.h"

extern "C" {

// GCC may call these for copies and fills; nothing else of a C library is used. The attribute
// keeps it from compiling the loops back into calls to themselves.
#define RS_PLAIN_LOOP __attribute__((optimize("no-tree-loop-distribute-patterns")))

RS_PLAIN_LOOP void* memcpy(void* to, const void* from, size_t n) {
  auto* d = static_cast<unsigned char*>(to);
  const auto* s = static_cast<const unsigned char*>(from);
  for (size_t i = 0; i < n; ++i) d[i] = s[i];
  return to;
}

RS_PLAIN_LOOP void* memmove(void* to, const void* from, size_t n) {
  auto* d = static_cast<unsigned char*>(to);
  const auto* s = static_cast<const unsigned char*>(from);
  if (d < s)
    for (size_t i = 0; i < n; ++i) d[i] = s[i];
  else
    for (size_t i = n; i > 0; --i) d[i - 1] = s[i - 1];
  return to;
}

RS_PLAIN_LOOP void* memset(void* to, int value, size_t n) {
  auto* d = static_cast<unsigned char*>(to);
  for (size_t i = 0; i < n; ++i) d[i] = static_cast<unsigned char>(value);
  return to;
}

// out = eax, ebx, ecx, edx of CPUID (leaf, subleaf): what the emulated CPU says it has.
void rs_cpuid(uint32_t leaf, uint32_t subleaf, uint32_t* out) {
  __cpuid_count(leaf, subleaf, out[0], out[1], out[2], out[3]);
}

// panel_avx512 over every panel of a packed weight, rows of x taken `chunk` at a time as
// gguf_linear does: out[panel][row][lane], the accumulators as the path leaves them.
struct GgufCall {
  int64_t ggml_type, panel_count, panel_bytes, m, k, chunk;
  const uint8_t* panels;
  const int8_t* q;
  const float* dx;
  const int32_t* sums;
  const float* dxs;
  const int16_t* sums16;
  const int16_t* sums32;
  float* out;
};

void rs_gguf_panels(const GgufCall* c) {
  using namespace radixserve::gguf;
  const Format* f = format_of(c->ggml_type);
  const QuantizedRows a{c->q, c->dx, c->sums, c->dxs, c->sums16, c->sums32, c->k, c->k / f->block};
  for (int64_t p = 0; p < c->panel_count; ++p)
    for (int64_t r0 = 0; r0 < c->m; r0 += c->chunk) {
      const int64_t rows = c->m - r0 < c->chunk ? c->m - r0 : c->chunk;
      panel_avx512(*f, c->panels + p * c->panel_bytes, a, r0, rows,
                   c->out + (p * c->m + r0) * kRows);
    }
}

// skinny_float's AVX-512 path over panels [p0, p1) of w, whose type is 0 float32, 1 float16
// or 2 bfloat16.
void rs_skinny_float(const radixserve::skinny_float::Problem* problem, const void* w,
                     int64_t type, int64_t p0, int64_t p1) {
  using namespace radixserve::skinny_float;
  if (type == 0)
    panels_vector<Avx512>(*problem, static_cast<const float*>(w), p0, p1);
  else if (type == 1)
    panels_vector<Avx512>(*problem, static_cast<const c10::Half*>(w), p0, p1);
  else
    panels_vector<Avx512>(*problem, static_cast<const c10::BFloat16*>(w), p0, p1);
}

// One row's attention over one kv head's pool, as paged_attention's AVX-512 paths compute it:
// path 2 (attend_avx512: float32 q, a float32 or bfloat16 pool) or 3 (attend_bf16: bfloat16 q
// and pool); dim 64 or 128. Scratch: scores [groups * n], probs [groups * (n + 2)], totals
// [groups].
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
};

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
        qh, k, v, c->slots, c->n, c->groups, scale, c->scores, c->probs, c->totals, out);
  } else if (c->bf16) {
    const auto* k = static_cast<const BFloat16*>(c->keys);
    const auto* v = static_cast<const BFloat16*>(c->values);
    auto* out = static_cast<BFloat16*>(c->out);
    (c->dim == 64 ? attend_avx512<BFloat16, 64> : attend_avx512<BFloat16, 128>)(
        q, k, v, c->slots, c->n, c->groups, scale, c->scores, out);
  } else {
    const auto* k = static_cast<const float*>(c->keys);
    const auto* v = static_cast<const float*>(c->values);
    auto* out = static_cast<float*>(c->out);
    (c->dim == 64 ? attend_avx512<float, 64> : attend_avx512<float, 128>)(
        q, k, v, c->slots, c->n, c->groups, scale, c->scores, out);
  }
}

}  // extern "C"
