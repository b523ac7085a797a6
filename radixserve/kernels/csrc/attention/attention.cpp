// Attention read straight out of the paged KV pool, on the CPU, for decode rows and prefill
// rows alike.
//
// Why a kernel: with PyTorch ops, each decode step first copies every request's context K/V
// out of the pool into a padded batch (index_select), then multiplies it. At eight requests on
// 1,500-token contexts that copy and its extra kernels were a third of the step. Here each
// (row, kv head) walks its slot table and reads K/V rows where they lie.
//
// Why prefill rows too: a row's result is a function of its query and its context's K/V
// alone, computed the same way whatever rows share the call. So a position gets the same bits
// whether it is prefilled in one chunk or several or decoded, and the K/V it leaves in the
// pool (and every token after) are the same with the prefix cache on or off. PyTorch's SDPA
// blocks its work by the chunk's shape, so its last bits move with chunking.
//
// Layout (see kv_pool.py): a layer's pool is head-major, [kv_heads, slots, head_dim], so one
// slot of one head is a contiguous row of head_dim values. q is [rows, heads, head_dim] with
// the query heads of kv head h at h*G .. h*G+G-1 (G = heads / kv_heads, as HF's repeat_kv).
// Row r's context is slots[begins[r] .. begins[r] + lengths[r]), in position order; its own
// K/V are already written to the pool. The arithmetic is the same whatever slots a context
// sits in, so an output does not depend on whether its prefix came from the prefix cache.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "attention/attention_amx.h"
#include "common/cpu_features.h"
#include "attention/attention_avx512.h"
#include "common/vector.h"

namespace {

#ifdef RS_X86
using radixserve::attention::AmxScratch;
using radixserve::attention::attend_amx;
using radixserve::attention::attend_avx512;
using radixserve::attention::attend_bf16;
using radixserve::attention::kAttentionConfig;
using radixserve::attention::sink_of;
using radixserve::attention::TiledContext;
using radixserve::attention::top_with_sink;
#endif

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// One (request, kv head) in plain C++: the reference the vector paths are tested against, and
// what runs on CPUs without AVX2. q is unscaled; probabilities are e^(scale (s - max s)).
// scores holds G * n floats. sinks: the G query heads' attention sinks (a logit each that joins
// the softmax's denominator only, as gpt-oss's), or null; the maximum then takes them in.
template <typename T>
void attend_portable(const float* q, const T* keys, const T* values, const int32_t* slots,
                     int64_t n, int64_t groups, int64_t dim, float scale, const float* sinks,
                     float* scores, T* out) {
  std::vector<float> acc(dim);
  for (int64_t g = 0; g < groups; ++g) {
    const float* qg = q + g * dim;
    float* s = scores + g * n;
    const float sink = sinks ? sinks[g] : -std::numeric_limits<float>::infinity();
    float top = sink / scale;
    for (int64_t t = 0; t < n; ++t) {
      const T* k = keys + static_cast<int64_t>(slots[t]) * dim;
      float dot = 0.f;
      for (int64_t d = 0; d < dim; ++d) dot += qg[d] * to_float(k[d]);
      s[t] = dot;
      top = std::max(top, dot);
    }
    float total = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      s[t] = std::exp((s[t] - top) * scale);
      total += s[t];
    }
    total += std::exp(sink - top * scale);  // 0 for no sink
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t t = 0; t < n; ++t) {
      const T* v = values + static_cast<int64_t>(slots[t]) * dim;
      for (int64_t d = 0; d < dim; ++d) acc[d] += s[t] * to_float(v[d]);
    }
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = static_cast<T>(acc[d] / total);
  }
}

#ifdef RS_X86
// AVX2 + FMA (most CPUs without AVX-512): the same two passes as attend_avx512
// (attention_avx512.h), 8 floats at a time. Scores are summed four keys at a time and
// reduced together (hadd), not one horizontal sum per key.
RS_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
RS_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

RS_AVX2 inline float sum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

RS_AVX2 inline float max8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// The sums of a, b, c, d's eight lanes, in that order.
RS_AVX2 inline __m128 sum8x4(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// e^x for x <= 0, as exp16 (attention_avx512.h): the same Cephes polynomial, 2^n built
// in the exponent bits.
RS_AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // n >= -126 after the clamp: 2^n is a normal float with exponent bits n + 127.
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// Lanes [0, count) set, for count in [0, 8].
RS_AVX2 inline __m256i first_lanes(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// s[t] = e^(scale (s[t] - top)) for t < n, top their maximum and the sink's (-inf: none);
// returns their sum and the sink's weight.
RS_AVX2 inline float softmax_in_place_avx2(float* s, int64_t n, float scale, float sink) {
  __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + t));
  float m = max8(top);
  for (; t < n; ++t) m = std::max(m, s[t]);
  m = top_with_sink(m, sink, scale);
  const __m256 mv = _mm256_set1_ps(m), sv = _mm256_set1_ps(scale);
  __m256 sum = _mm256_setzero_ps();
  for (t = 0; t + 8 <= n; t += 8) {
    __m256 e = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv), sv));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (t < n) {
    const __m256i tail = first_lanes(n - t);
    __m256 e = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_maskload_ps(s + t, tail), mv), sv));
    e = _mm256_and_ps(e, _mm256_castsi256_ps(tail));
    _mm256_maskstore_ps(s + t, tail, e);
    sum = _mm256_add_ps(sum, e);
  }
  return sum8(sum) + std::exp(sink - m * scale);  // + 0 for no sink
}

template <typename T, int D>
RS_AVX2 inline __m256 dot_avx2(const __m256* q, const T* k) {
  __m256 acc = _mm256_mul_ps(q[0], load8(k));
  for (int j = 1; j < D / 8; ++j) acc = _mm256_fmadd_ps(q[j], load8(k + 8 * j), acc);
  return acc;
}

// A tile of R rows that share a prefix (one prefill chunk's rows; decode rows of requests on
// one cached prefix) and their G query heads each, against one kv head; row r reads keys
// tables[r][0 .. n[r]). Keys and values are read in blocks that stay in L1 while every query
// of the tile uses them (a shared prefix's block is the same memory for every row); each
// query's arithmetic is still its own, in key order, so a row's result is bitwise the same in
// a tile of one or of eight, with whatever rows beside it.
// q: [R][G][D] floats; scores: R * G rows of `stride` floats; acc: R * G * D floats; sinks:
// the G query heads' sinks, or null.
template <typename T, int D>
RS_AVX2 void attend_tile_avx2(const float* q, int64_t tile, const int64_t* n, const T* keys,
                              const T* values, const int32_t* const* tables, int64_t groups,
                              float scale, const float* sinks, float* scores, int64_t stride,
                              float* acc, T* const* outs) {
  constexpr int W = D / 8;
  constexpr int64_t kBlock = 4096 / D;  // 16 KB of float32 keys: an L1-sized block
  constexpr int kSlice = std::min(D, 128);  // dims whose value sums are in registers at once
  int64_t longest = 0;
  for (int64_t r = 0; r < tile; ++r) longest = std::max(longest, n[r]);
  for (int64_t start = 0; start < longest; start += kBlock) {
    for (int64_t r = 0; r < tile; ++r) {
      const int64_t end = std::min(start + kBlock, n[r]);
      const int32_t* slots = tables[r];
      for (int64_t g = 0; g < groups && start < end; ++g) {
        __m256 qg[W];
        for (int j = 0; j < W; ++j) qg[j] = _mm256_loadu_ps(q + (r * groups + g) * D + 8 * j);
        float* s = scores + (r * groups + g) * stride;
        int64_t t = start;
        for (; t + 4 <= end; t += 4) {
          const T* k0 = keys + static_cast<int64_t>(slots[t]) * D;
          const T* k1 = keys + static_cast<int64_t>(slots[t + 1]) * D;
          const T* k2 = keys + static_cast<int64_t>(slots[t + 2]) * D;
          const T* k3 = keys + static_cast<int64_t>(slots[t + 3]) * D;
          _mm_storeu_ps(s + t, sum8x4(dot_avx2<T, D>(qg, k0), dot_avx2<T, D>(qg, k1),
                                      dot_avx2<T, D>(qg, k2), dot_avx2<T, D>(qg, k3)));
        }
        for (; t < end; ++t)
          s[t] = sum8(dot_avx2<T, D>(qg, keys + static_cast<int64_t>(slots[t]) * D));
      }
    }
  }
  std::vector<float> total(tile * groups);
  for (int64_t r = 0; r < tile; ++r)
    for (int64_t g = 0; g < groups; ++g)
      total[r * groups + g] = softmax_in_place_avx2(scores + (r * groups + g) * stride, n[r],
                                                    scale, sink_of(sinks, g));
  std::fill(acc, acc + tile * groups * D, 0.f);
  for (int64_t start = 0; start < longest; start += kBlock) {
    for (int64_t r = 0; r < tile; ++r) {
      const int64_t end = std::min(start + kBlock, n[r]);
      const int32_t* slots = tables[r];
      for (int64_t g = 0; g < groups && start < end; ++g) {
        const float* s = scores + (r * groups + g) * stride;
        // At most 128 dims' sums at a time stay in the 16 registers (head_dim 256 in two
        // passes over the block's values, each reading its half of every row).
        for (int d0 = 0; d0 < D; d0 += kSlice) {
          float* a = acc + (r * groups + g) * D + d0;
          __m256 sum[kSlice / 8];
          for (int j = 0; j < kSlice / 8; ++j) sum[j] = _mm256_loadu_ps(a + 8 * j);
          for (int64_t t = start; t < end; ++t) {
            const T* v = values + static_cast<int64_t>(slots[t]) * D + d0;
            const __m256 p = _mm256_set1_ps(s[t]);
            for (int j = 0; j < kSlice / 8; ++j)
              sum[j] = _mm256_fmadd_ps(p, load8(v + 8 * j), sum[j]);
          }
          for (int j = 0; j < kSlice / 8; ++j) _mm256_storeu_ps(a + 8 * j, sum[j]);
        }
      }
    }
  }
  for (int64_t r = 0; r < tile; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* a = acc + (r * groups + g) * D;
      const __m256 inv = _mm256_set1_ps(1.0f / total[r * groups + g]);
      alignas(32) float row[D];
      for (int j = 0; j < W; ++j) _mm256_store_ps(row + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(a + 8 * j), inv));
      for (int d = 0; d < D; ++d) outs[r][g * D + d] = static_cast<T>(row[d]);
    }
}
#endif

// The vector path (an index of the family's names in cpu_features.cpp, which also says what
// each needs of the CPU): 0 portable C++, 1 AVX2 with FMA, 2 AVX-512, 3 AVX-512 with BF16
// (bfloat16 pools only; float32 ones run path 2 there), 4 that and AMX-BF16 tile multiplies
// (bfloat16 pools with head_dim 64, 128 or 256 and 2 to 16 query heads per kv head; others run
// path 3: with one query per kv head, a decode row's tile would hold one query, and runs slower
// than path 3 (benchmarks/bench_decode_attention.py --compare-path)).
inline int64_t best_path() { return radixserve::best_path(radixserve::Family::attention); }

// The head dims the vector paths are built for: Llama-likes' and Qwen3's 128, gpt-oss's and
// small models' 64, Phi-3-mini's 96, Gemma 3's 256. Paths 1-3 need a multiple of 32 (path 3
// reads keys 32 dims at a time); others (Phi-2's 80) run portable C++.
inline bool vector_dim(int64_t dim) { return dim == 64 || dim == 96 || dim == 128 || dim == 256; }

// The path a call runs at, for its dtype and shape: the vector paths take vector_dim's head
// dims (others run portable C++), path 3 only bfloat16 pools (float32 ones run path 2), path
// 4 only bfloat16 pools with 2 to 16 query heads per kv head and a head_dim that is a multiple
// of 64 (its value tiles are 64 dims wide; others run path 3).
inline int64_t path_for(bool bfloat16, int64_t groups, int64_t dim, int64_t max_path) {
  int64_t path = std::min<int64_t>(max_path, best_path());
  if (!vector_dim(dim)) return 0;
  // AMX takes head dims 64 and 128: its 256 pass has not run on an AMX CPU yet, and the
  // AVX512-BF16 path (checked on the emulated CPU) gives those rows their own exact bits.
  if (path == 4 && (!bfloat16 || groups < 2 || groups > 16 || dim % 64 != 0 || dim > 128))
    path = 3;
  if (path == 3 && !bfloat16) path = 2;
  return path;
}

constexpr int64_t kTileRows = 8;
constexpr int64_t kSerialKeys = 1024;  // below this many keys read, one thread does a call

// Work items (kv head, tile), item i = head i / tiles, tile i % tiles, cut into one
// contiguous run per thread of about equal cost (a tile's cost: keys read); part p is items
// [edges[p], edges[p + 1]).
std::vector<int64_t> split(const std::vector<int64_t>& cost, int64_t kv_heads) {
  const int64_t num_tiles = static_cast<int64_t>(cost.size());
  const int64_t items = kv_heads * num_tiles;
  int64_t total = 0;
  for (int64_t c : cost) total += c * kv_heads;
  // Short contexts stay on the calling thread (at::parallel_for runs one part inline): waking
  // the others costs more than their share of a few hundred keys.
  const int64_t parts =
      total < kSerialKeys ? 1 : std::min<int64_t>(at::get_num_threads(), items);
  std::vector<int64_t> edges(parts + 1, items);
  edges[0] = 0;
  for (int64_t i = 0, part = 1, done = 0; i < items && part < parts; ++i) {
    done += cost[i % num_tiles];
    while (part < parts && done * parts >= total * part) edges[part++] = i + 1;
  }
  return edges;
}

// Rows are cut into tiles: runs of up to kTileRows consecutive rows whose contexts start at
// the same slot (one prefill chunk's rows; decode rows on one cached prefix). Work items are (kv head,
// tile); they go to threads in contiguous runs of about equal work (the sum of the rows'
// context lengths): a chunk's rows grow longer row by row, so equal counts of items would
// leave one thread with most of the work. Items run kv head by kv head, and rows sharing a
// prefix are adjacent (the runner orders them), so a thread reads a shared prefix from DRAM
// once per head and finds it in cache for the next tile. The path (and head_dim D of the vector
// paths; 0 for the portable one, which takes any) is a template argument, chosen once per call
// by `run_path`: the loop over work items holds no branch on it.
template <typename T, int kPath, int D>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& slots, const at::Tensor& begins, const at::Tensor& lengths,
         float scale, const float* sinks, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_slots = k_cache.size(1);
  const int64_t groups = heads / kv_heads;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* sp = slots.data_ptr<int32_t>();
  const int64_t* bp = begins.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  std::vector<int64_t> tiles{0};  // tile i is rows [tiles[i], tiles[i + 1])
  std::vector<int64_t> cost;  // a tile's work, in keys read
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r) {
    longest = std::max(longest, lp[r]);
    const bool joins = r > tiles.back() && r - tiles.back() < kTileRows &&
                       sp[bp[r]] == sp[bp[r - 1]];
    if (r > 0 && !joins) tiles.push_back(r);
    if (cost.size() < tiles.size()) cost.push_back(0);
    cost.back() += lp[r] + 16;  // a row's fixed cost, in keys
  }
  tiles.push_back(rows);
  const int64_t num_tiles = static_cast<int64_t>(cost.size());
  const std::vector<int64_t> edges = split(cost, kv_heads);
  const int64_t parts = static_cast<int64_t>(edges.size()) - 1;
  at::parallel_for(0, parts, 1, [&](int64_t first_part, int64_t last_part) {
    std::vector<float> scores(kTileRows * groups * longest);
    std::vector<uint16_t> probs(groups * (longest + 2));
    std::vector<float> totals(groups);
    std::vector<float> qf(kTileRows * groups * dim), acc(kTileRows * groups * dim);
    for (int64_t item = edges[first_part]; item < edges[last_part]; ++item) {
      const int64_t h = item / num_tiles, first = tiles[item % num_tiles];
      const int64_t tile = tiles[item % num_tiles + 1] - first;
      const T* keys = kp + h * num_slots * dim;
      const T* values = vp + h * num_slots * dim;
      const int32_t* tables[kTileRows];
      T* outs[kTileRows];
      for (int64_t i = 0; i < tile; ++i) {
        tables[i] = sp + bp[first + i];
        outs[i] = op + ((first + i) * heads + h * groups) * dim;
      }
      const auto query = [&](int64_t i) { return qp + ((first + i) * heads + h * groups) * dim; };
      const float* head_sinks = sinks ? sinks + h * groups : nullptr;
#ifdef RS_X86
      if constexpr (kPath == 3) {
        for (int64_t i = 0; i < tile; ++i)
          attend_bf16<D>(query(i), keys, values, tables[i], lp[first + i], groups, scale,
                         head_sinks, scores.data(), probs.data(), totals.data(), outs[i]);
        continue;
      }
#endif
      for (int64_t i = 0; i < tile; ++i)
        for (int64_t j = 0; j < groups * dim; ++j) qf[i * groups * dim + j] = to_float(query(i)[j]);
#ifdef RS_X86
      if constexpr (kPath == 1) {
        attend_tile_avx2<T, D>(qf.data(), tile, lp + first, keys, values, tables, groups, scale,
                               head_sinks, scores.data(), longest, acc.data(), outs);
        continue;
      }
#endif
      for (int64_t i = 0; i < tile; ++i) {
        const float* qi = qf.data() + i * groups * dim;
        const int64_t n = lp[first + i];
#ifdef RS_X86
        if constexpr (kPath == 2) {
          attend_avx512<T, D>(qi, keys, values, tables[i], n, groups, scale, head_sinks,
                              scores.data(), outs[i]);
          continue;
        }
#endif
        attend_portable<T>(qi, keys, values, tables[i], n, groups, dim, scale, head_sinks,
                           scores.data(), outs[i]);
      }
    }
  });
}

#ifdef RS_X86
// `run` at path kPath with D the call's head_dim (one of vector_dim's).
template <typename T, int kPath>
void run_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const at::Tensor& slots, const at::Tensor& begins, const at::Tensor& lengths,
             float scale, const float* sinks, at::Tensor& out) {
  const int64_t dim = q.size(2);
  const auto at_dim = dim == 64    ? run<T, kPath, 64>
                      : dim == 96  ? run<T, kPath, 96>
                      : dim == 128 ? run<T, kPath, 128>
                                   : run<T, kPath, 256>;
  at_dim(q, k_cache, v_cache, slots, begins, lengths, scale, sinks, out);
}
#endif

// `run` at a call's path (from path_for: the vector paths only see vector_dim's head dims,
// path 3 only bfloat16).
template <typename T>
void run_path(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slots, const at::Tensor& begins, const at::Tensor& lengths,
              float scale, const float* sinks, int path, at::Tensor& out) {
#ifdef RS_X86
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (path == 3)
      return run_dim<T, 3>(q, k_cache, v_cache, slots, begins, lengths, scale, sinks, out);
  }
  if (path >= 2)
    return run_dim<T, 2>(q, k_cache, v_cache, slots, begins, lengths, scale, sinks, out);
  if (path == 1)
    return run_dim<T, 1>(q, k_cache, v_cache, slots, begins, lengths, scale, sinks, out);
#endif
  run<T, 0, 0>(q, k_cache, v_cache, slots, begins, lengths, scale, sinks, out);
}

#ifdef RS_X86
// Path 4 (attention_amx.h): tiles of up to 16 queries, the G query heads of up to 16 / G
// consecutive rows that read one table (the rows of a prefill chunk; a decode row alone). A
// thread lays out a context once for the tiles that read it, kv head by kv head, and streams
// a context that one tile reads.
template <int D>
void run_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const at::Tensor& slots, const at::Tensor& begins, const at::Tensor& lengths,
             float scale, const float* sinks, at::Tensor& out) {
  using BF16 = c10::BFloat16;
  const int64_t rows = q.size(0), heads = q.size(1);
  const int64_t kv_heads = k_cache.size(0), num_slots = k_cache.size(1);
  const int64_t groups = heads / kv_heads, rows_per_tile = 16 / groups;
  const BF16* qp = q.data_ptr<BF16>();
  const BF16* kp = k_cache.data_ptr<BF16>();
  const BF16* vp = v_cache.data_ptr<BF16>();
  const int32_t* sp = slots.data_ptr<int32_t>();
  const int64_t* bp = begins.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  BF16* op = out.data_ptr<BF16>();
  std::vector<int64_t> tiles{0};  // tile i is rows [tiles[i], tiles[i + 1])
  std::vector<int64_t> cost;  // a tile's work, in keys read (its longest row's)
  std::vector<int64_t> reach(rows);  // the longest row reading row r's table
  for (int64_t r = 0; r < rows; ++r) {
    const bool joins = r > tiles.back() && r - tiles.back() < rows_per_tile && bp[r] == bp[r - 1];
    if (r > 0 && !joins) tiles.push_back(r);
    if (cost.size() < tiles.size()) cost.push_back(0);
    cost.back() = std::max(cost.back(), lp[r] + 16);
    reach[r] = r > 0 && bp[r] == bp[r - 1] ? std::max(reach[r - 1], lp[r]) : lp[r];
  }
  for (int64_t r = rows - 1; r > 0; --r)
    if (bp[r] == bp[r - 1]) reach[r - 1] = reach[r];
  tiles.push_back(rows);
  const int64_t num_tiles = static_cast<int64_t>(cost.size());
  const std::vector<int64_t> edges = split(cost, kv_heads);
  const int64_t parts = static_cast<int64_t>(edges.size()) - 1;
  at::parallel_for(0, parts, 1, [&](int64_t first_part, int64_t last_part) {
    TiledContext<D> context;
    auto scratch = std::make_unique<AmxScratch>();
    // Each call configures the tiles (other code on this thread, as oneDNN's AMX matmuls, sets
    // its own between ours) and releases them, so a context switch need not save them.
    RS_TILE_CONFIG(kAttentionConfig);
    for (int64_t item = edges[first_part]; item < edges[last_part]; ++item) {
      const int64_t h = item / num_tiles, first = tiles[item % num_tiles];
      const int64_t tile = tiles[item % num_tiles + 1] - first;
      const BF16* queries[16];
      BF16* outs[16];
      int64_t n[16];
      float tile_sinks[16];
      std::fill(tile_sinks, tile_sinks + 16, -std::numeric_limits<float>::infinity());
      int64_t longest = 0;
      for (int64_t i = 0; i < tile * groups; ++i) {
        const int64_t r = first + i / groups, at = (r * heads + h * groups + i % groups) * D;
        if (sinks) tile_sinks[i] = sinks[h * groups + i % groups];
        queries[i] = qp + at;
        outs[i] = op + at;
        n[i] = lp[r];
        longest = std::max(longest, n[i]);
      }
      const int64_t t = item % num_tiles;
      const bool alone = (t == 0 || bp[tiles[t - 1]] != bp[first]) &&
                         (t + 1 == num_tiles || bp[tiles[t + 1]] != bp[first]);
      if (alone)  // a decode row: no other tile reads its context
        context.stream(kp + h * num_slots * D, vp + h * num_slots * D, sp + bp[first], longest);
      else
        context.lay_out(kp + h * num_slots * D, vp + h * num_slots * D, sp + bp[first], longest,
                        reach[first]);
      attend_amx<D>(queries, n, static_cast<int>(tile * groups), context, scale,
                    sinks ? tile_sinks : nullptr, *scratch, outs);
    }
    RS_TILE_RELEASE();
  });
}
#endif

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& slots,
                           const at::Tensor& begins, const at::Tensor& lengths, double scale,
                           int64_t max_path, const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "q [rows, heads, dim] and caches [kv_heads, slots, dim]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q and caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "q and caches must share a dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(2) && q.size(1) % k_cache.size(0) == 0,
              "head_dim must match and heads must be a multiple of kv_heads");
  TORCH_CHECK(slots.scalar_type() == at::kInt && slots.is_contiguous(), "slots: int32");
  TORCH_CHECK(begins.scalar_type() == at::kLong && begins.is_contiguous() &&
                  lengths.scalar_type() == at::kLong && lengths.is_contiguous() &&
                  begins.numel() == q.size(0) && lengths.numel() == q.size(0),
              "begins and lengths: int64 [rows]");
  const int64_t* bp = begins.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int32_t* sp = slots.data_ptr<int32_t>();
  for (int64_t r = 0; r < q.size(0); ++r) {
    TORCH_CHECK(lp[r] >= 1 && bp[r] >= 0, "every row needs at least one slot");
    TORCH_CHECK(bp[r] + lp[r] <= slots.numel(), "a row's context runs past slots");
  }
  // A bad slot would read outside the pool: check them all. Rows of a prefill chunk share one
  // table, so this is once per slot, not once per row (microseconds per step).
  const int64_t num_slots = k_cache.size(1);
  for (int64_t i = 0; i < slots.numel(); ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "slot ", sp[i], " is outside the pool");
  TORCH_CHECK(scale > 0, "scale must be positive");
  const float* sp_sinks = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->dim() == 1 && sinks->size(0) == q.size(1),
                "sinks: float32 [heads]");
    sp_sinks = sinks->data_ptr<float>();
  }
  at::Tensor out = at::empty_like(q);
  const int path = static_cast<int>(
      path_for(q.scalar_type() == at::kBFloat16, q.size(1) / k_cache.size(0), q.size(2), max_path));
  const float fscale = static_cast<float>(scale);
#ifdef RS_X86
  if (path == 4) {
    const int64_t dim = q.size(2);
    const auto at_dim = dim == 64 ? run_amx<64> : dim == 128 ? run_amx<128> : run_amx<256>;
    at_dim(q, k_cache, v_cache, slots, begins, lengths, fscale, sp_sinks, out);
    return out;
  }
#endif
  if (q.scalar_type() == at::kFloat) {
    run_path<float>(q, k_cache, v_cache, slots, begins, lengths, fscale, sp_sinks, path, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    run_path<c10::BFloat16>(q, k_cache, v_cache, slots, begins, lengths, fscale, sp_sinks, path,
                            out);
  } else {
    TORCH_CHECK(false, "paged_attention supports float32 and bfloat16");
  }
  return out;
}

int64_t attention_path_for(bool bfloat16, int64_t groups, int64_t dim, int64_t max_path) {
  return path_for(bfloat16, groups, dim, max_path);
}

}  // namespace

TORCH_LIBRARY(radixserve, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, "
        "Tensor begins, Tensor lengths, float scale, int max_path, Tensor? sinks=None) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
  m.def("attention_path_for(bool bfloat16, int groups, int dim, int max_path) -> int",
        &attention_path_for);
}
