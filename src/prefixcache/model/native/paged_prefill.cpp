// Paged prefill attention: runs of new queries (whole prompts, or chunks after cached context) attend, causally,
// to their request's K/V where it lies in the paged cache [num_blocks, block_size, kv_heads, head_dim].
//
// torch's path gathers every request's blocks into a padded tensor and runs a masked SDPA over the padding, with
// an additive mask [G, 1, max_q, kv_len] built per step. Here a work item is (request, KV head, query tile): the
// tile's rows are its queries times the query heads sharing that KV head (GQA), up to 64, laid along the vector
// lanes (16 rows a vector, transposed once per tile). Keys come in chunks of 16 positions (16c .. 16c + 15),
// each read once from the cache (widened to float32) for all rows of the tile; scores, the online softmax
// (running max and sum per row, in float32) and the weighted sum of values are lane-wise vector ops, so no
// horizontal reduction is ever needed.
//
// Identity with and without the prefix cache: a row's result depends only on its keys, never on how the prompt
// was cut into cached and new parts, tiles or threads. Every per-row reduction is lane-wise in a fixed order (the
// dot product over head_dim in order, chunks in position order, keys in order within a chunk), and a chunk in
// which a row sees no key leaves that row's state exactly as it was (scale 2^0 = 1, weights 2^-inf = 0), so the
// chunks a tile reads beyond one row's keys change nothing of that row.
//
// AVX-512 where the compiler targets it (bfloat16 / half widened to float32), else portable 16-lane loops that
// the compiler vectorises as it can.

#include <ATen/ATen.h>

#include "elements.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Rows a vector holds and keys a chunk holds.
constexpr int kLanes = 16;
// Rows of a query tile (queries x heads of one KV head): enough to amortise reading a chunk of K/V.
constexpr int64_t kTileRows = 64;
// Row vectors one micro-kernel call keeps in registers.
constexpr int kMaxVecs = 4;

using prefixcache_native::to_float;

// ---------------------------------------------------------------------------------------------------------
// 16 float lanes
#if defined(__AVX512F__)
struct Vec {
  __m512 v;
};
using Mask = __mmask16;
inline Vec vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
inline Vec vset1(float x) { return {_mm512_set1_ps(x)}; }
inline Vec vfma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec vmul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec vadd(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec vsub(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec vdiv(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec vmax(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
// Lanes where lo <= pos <= hi.
inline Mask visible(const int32_t* lo, const int32_t* hi, int32_t pos) {
  __m512i p = _mm512_set1_epi32(pos);
  return _mm512_cmple_epi32_mask(_mm512_loadu_si512(lo), p) & _mm512_cmpge_epi32_mask(_mm512_loadu_si512(hi), p);
}
inline Vec vselect(Mask m, Vec a, Vec b) { return {_mm512_mask_blend_ps(m, b.v, a.v)}; }
inline Mask is_neg_inf(Vec a) {
  return _mm512_cmp_ps_mask(a.v, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
}
inline Vec vround(Vec a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// 2^n for integral n in [-127, 0] (2^-127 flushed to 0).
inline Vec vpow2i(Vec n) {
  __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
}
// Round to the nearest bfloat16 (ties to even), kept as float32; for finite values.
inline Vec vround_bf16(Vec a) {
  __m512i bits = _mm512_castps_si512(a.v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return {_mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
}
// Widen 16 values to float32.
inline void widen16(const float* src, float* dst) { _mm512_storeu_ps(dst, _mm512_loadu_ps(src)); }
inline void widen16(const c10::BFloat16* src, float* dst) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  _mm512_storeu_ps(dst, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
}
inline void widen16(const c10::Half* src, float* dst) {
  _mm512_storeu_ps(dst, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))));
}
#else
struct Vec {
  float v[kLanes];
};
using Mask = uint32_t;
inline Vec vload(const float* p) {
  Vec r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline void vstore(float* p, Vec a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline Vec vset1(float x) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = x;
  return r;
}
#define PREFIXCACHE_LANEWISE(name, expr)     \
  inline Vec name(Vec a, Vec b) {            \
    Vec r;                                   \
    for (int i = 0; i < kLanes; ++i) {       \
      float x = a.v[i], y = b.v[i];          \
      r.v[i] = (expr);                       \
    }                                        \
    return r;                                \
  }
PREFIXCACHE_LANEWISE(vmul, x* y)
PREFIXCACHE_LANEWISE(vadd, x + y)
PREFIXCACHE_LANEWISE(vsub, x - y)
PREFIXCACHE_LANEWISE(vdiv, x / y)
PREFIXCACHE_LANEWISE(vmax, x > y ? x : y)
#undef PREFIXCACHE_LANEWISE
inline Vec vfma(Vec a, Vec b, Vec c) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return r;
}
inline Mask visible(const int32_t* lo, const int32_t* hi, int32_t pos) {
  Mask m = 0;
  for (int i = 0; i < kLanes; ++i) m |= static_cast<Mask>(lo[i] <= pos && pos <= hi[i]) << i;
  return m;
}
inline Vec vselect(Mask m, Vec a, Vec b) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = (m >> i) & 1 ? a.v[i] : b.v[i];
  return r;
}
inline Mask is_neg_inf(Vec a) {
  Mask m = 0;
  for (int i = 0; i < kLanes; ++i) m |= static_cast<Mask>(a.v[i] == -std::numeric_limits<float>::infinity()) << i;
  return m;
}
inline Vec vround(Vec a) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = std::nearbyint(a.v[i]);
  return r;
}
inline Vec vpow2i(Vec n) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) {
    uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n.v[i]) + 127) << 23;
    std::memcpy(&r.v[i], &bits, sizeof(float));
  }
  return r;
}
inline Vec vround_bf16(Vec a) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(c10::BFloat16(a.v[i]));
  return r;
}
template <typename T>
inline void widen16(const T* src, float* dst) {
  for (int i = 0; i < kLanes; ++i) dst[i] = to_float(src[i]);
}
#endif

// 2^x for x <= 0 (scores minus their running max, in log2 units): 2^n * 2^f with |f| <= 1/2, 2^f by its Taylor
// series to degree 7 (relative error about 5e-9, under float32's rounding). Exactly 1 at 0 and 0 at -inf (and
// below -127), which is what makes a chunk without a visible key leave a row unchanged.
inline Vec vexp2(Vec x) {
  x = vmax(x, vset1(-127.0f));
  Vec n = vround(x);
  Vec f = vsub(x, n);
  Vec p = vset1(1.5252733804059841e-05f);
  p = vfma(p, f, vset1(1.5403530393381606e-04f));
  p = vfma(p, f, vset1(1.3333558146428443e-03f));
  p = vfma(p, f, vset1(9.6181291076284772e-03f));
  p = vfma(p, f, vset1(5.5504108664821580e-02f));
  p = vfma(p, f, vset1(2.4022650695910071e-01f));
  p = vfma(p, f, vset1(6.9314718055994531e-01f));
  p = vfma(p, f, vset1(1.0f));
  return vmul(p, vpow2i(n));
}

template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) widen16(src + i, dst + i);
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// ---------------------------------------------------------------------------------------------------------
// Micro-kernels over one chunk of 16 keys and NV row vectors starting at row vector v0, for a multiply-add
// policy: Fp32Madd (float32 products, one an FMA) or, for bfloat16 queries and cache, Bf16Madd (vdpbf16ps: two
// exact bfloat16 products a float32 lane, float32 sums). Either way each lane sums in a fixed order. Layouts,
// in the policy's elements: q [head_dim / per][width] (queries transposed; Fp32Madd's pre-scaled), keys
// [16][head_dim] (as read, widened to float32 for Fp32Madd), weights [16 / per][width] and values
// [16 / per][head_dim] (Bf16Madd: keys 2i and 2i + 1 of a row or dim paired in 32 bits, the lower half first),
// scores [16][width] and out_t [head_dim][width] in float32; width = row vectors x 16, per = products a lane.

struct Fp32Madd {
  using Elem = float;
  using Key = float;
  using Lanes = Vec;
  static constexpr int kPer = 1;
  static Lanes load(const Elem* p) { return vload(p); }
  static Lanes broadcast(Elem x) { return vset1(x); }
  static Lanes key(const Key* row, int64_t step) { return vset1(row[step]); }
  static Vec madd(Vec acc, Lanes a, Lanes b) { return vfma(a, b, acc); }
};

#if defined(__AVX512BF16__)
struct Bf16Madd {
  using Elem = uint32_t;
  using Key = uint16_t;
  using Lanes = __m512i;
  static constexpr int kPer = 2;
  static Lanes load(const Elem* p) { return _mm512_loadu_si512(p); }
  static Lanes broadcast(Elem x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static Lanes key(const Key* row, int64_t step) {
    uint32_t pair;
    std::memcpy(&pair, row + 2 * step, sizeof(pair));
    return broadcast(pair);
  }
  static Vec madd(Vec acc, Lanes a, Lanes b) {
    return {_mm512_dpbf16_ps(acc.v, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b))};
  }
};
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

// scores[j][rows] = scale * sum over the head dims, in order, of keys[j][d] * q[d][rows]: one row vector at a
// time against all 16 keys (16 accumulators), so the tile's queries stream through once a chunk.
template <typename Madd>
void chunk_scores(const typename Madd::Elem* q, const typename Madd::Key* keys, int64_t dim, int64_t width,
                  int64_t num_vecs, float scale, float* scores) {
  for (int64_t v = 0; v < num_vecs; ++v) {
    Vec acc[kLanes];
    for (int j = 0; j < kLanes; ++j) acc[j] = vset1(0.0f);
    for (int64_t step = 0; step < dim / Madd::kPer; ++step) {
      typename Madd::Lanes qv = Madd::load(q + step * width + v * kLanes);
      for (int j = 0; j < kLanes; ++j) acc[j] = Madd::madd(acc[j], Madd::key(keys + j * dim, step), qv);
    }
    for (int j = 0; j < kLanes; ++j)
      vstore(scores + j * width + v * kLanes, scale == 1.0f ? acc[j] : vmul(acc[j], vset1(scale)));
  }
}

// out_t[d][rows] = out_t[d][rows] * alpha[rows] + sum over the keys, in order, of weights[j][rows] * values[j][d].
template <typename Madd, int NV, int DB>
inline void chunk_values_block(const typename Madd::Elem* weights, const typename Madd::Elem* values,
                               const float* alpha, int64_t dim, int64_t width, int64_t v0, int64_t d0,
                               float* out_t) {
  Vec acc[DB][NV];
  for (int v = 0; v < NV; ++v) {
    Vec a = vload(alpha + (v0 + v) * kLanes);
    for (int dd = 0; dd < DB; ++dd) acc[dd][v] = vmul(vload(out_t + (d0 + dd) * width + (v0 + v) * kLanes), a);
  }
  for (int j = 0; j < kLanes / Madd::kPer; ++j) {
    typename Madd::Lanes w[NV];
    for (int v = 0; v < NV; ++v) w[v] = Madd::load(weights + j * width + (v0 + v) * kLanes);
    for (int dd = 0; dd < DB; ++dd) {
      typename Madd::Lanes x = Madd::broadcast(values[j * dim + d0 + dd]);
      for (int v = 0; v < NV; ++v) acc[dd][v] = Madd::madd(acc[dd][v], w[v], x);
    }
  }
  for (int dd = 0; dd < DB; ++dd)
    for (int v = 0; v < NV; ++v) vstore(out_t + (d0 + dd) * width + (v0 + v) * kLanes, acc[dd][v]);
}

template <typename Madd, int NV>
void chunk_values(const typename Madd::Elem* weights, const typename Madd::Elem* values, const float* alpha,
                  int64_t dim, int64_t width, int64_t v0, float* out_t) {
  int64_t d = 0;
  for (; d + 4 <= dim; d += 4) chunk_values_block<Madd, NV, 4>(weights, values, alpha, dim, width, v0, d, out_t);
  for (; d < dim; ++d) chunk_values_block<Madd, NV, 1>(weights, values, alpha, dim, width, v0, d, out_t);
}

#if defined(__AVX512BF16__)
// Packs the bfloat16-rounded weights of keys 2i and 2i + 1 (float32 with zero low halves) into pairs.
inline void pack_weights(const float* weights, int64_t width, int64_t num_vecs, uint32_t* w2) {
  for (int i = 0; i < kLanes / 2; ++i)
    for (int64_t v = 0; v < num_vecs; ++v) {
      __m512i even = _mm512_castps_si512(_mm512_loadu_ps(weights + 2 * i * width + v * kLanes));
      __m512i odd = _mm512_castps_si512(_mm512_loadu_ps(weights + (2 * i + 1) * width + v * kLanes));
      __m512i pair = _mm512_or_si512(_mm512_srli_epi32(even, 16), _mm512_and_si512(odd, _mm512_set1_epi32(-65536)));
      _mm512_storeu_si512(w2 + i * width + v * kLanes, pair);
    }
}
#endif

template <typename F>
void for_vector_groups(int64_t num_vecs, F&& run) {
  for (int64_t v0 = 0; v0 < num_vecs; v0 += kMaxVecs) {
    switch (std::min<int64_t>(kMaxVecs, num_vecs - v0)) {
      case 1: run(std::integral_constant<int, 1>{}, v0); break;
      case 2: run(std::integral_constant<int, 2>{}, v0); break;
      case 3: run(std::integral_constant<int, 3>{}, v0); break;
      default: run(std::integral_constant<int, 4>{}, v0); break;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------

struct WorkItem {
  int64_t request;  // row of block_tables / seq_lens
  int64_t kv_head;
  int64_t first_query;  // batch row of the tile's first query
  int64_t num_queries;
  int64_t first_pos;  // position of the tile's first query
};

struct Buffers {
  std::vector<float> q_t, out_t, keys, values, scores, weights, max, sum, alpha;
  std::vector<int32_t> lo, hi;
  // The bfloat16 pairs of the vdpbf16ps path: queries, keys as stored, weights and values.
  std::vector<uint32_t> q2, w2, v2;
  std::vector<uint16_t> keys_bf16;
  Buffers(int64_t dim, int64_t width)
      : q_t(dim * width), out_t(dim * width), keys(kLanes * dim), values(kLanes * dim), scores(kLanes * width),
        weights(kLanes * width), max(width), sum(width), alpha(width), lo(width), hi(width),
        q2((dim + 1) / 2 * width), w2(kLanes / 2 * width), v2(kLanes / 2 * dim), keys_bf16(kLanes * dim) {}
};

// Whether a tile of these dtypes takes the vdpbf16ps path (bfloat16 queries and cache, an even head_dim).
template <typename KV, typename Q>
constexpr bool bf16_dot() {
  return kBf16Dot && std::is_same_v<KV, c10::BFloat16> && std::is_same_v<Q, c10::BFloat16>;
}

// The chunk's keys (as stored) and values (pairs of keys 2i, 2i + 1 per dim) for the vdpbf16ps path; zeros for
// the positions the tile does not see.
template <typename KV>
void stage_chunk_bf16(const KV* k_cache, const KV* v_cache, const int64_t* table, int64_t block_size,
                      int64_t slot_stride, int64_t kv_head, int64_t dim, int64_t chunk, int64_t first_key,
                      int64_t last_pos, Buffers& buf) {
  const uint16_t* rows[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) {
    const int64_t pos = chunk * kLanes + j;
    uint16_t* k_row = buf.keys_bf16.data() + j * dim;
    if (pos < first_key || pos > last_pos) {
      std::fill(k_row, k_row + dim, uint16_t{0});
      rows[j] = nullptr;
      continue;
    }
    const int64_t slot = (table[pos / block_size] * block_size + pos % block_size) * slot_stride + kv_head * dim;
    std::memcpy(k_row, k_cache + slot, dim * sizeof(uint16_t));
    rows[j] = reinterpret_cast<const uint16_t*>(v_cache + slot);
  }
  for (int64_t i = 0; i < kLanes / 2; ++i) {
    const uint16_t* even = rows[2 * i];
    const uint16_t* odd = rows[2 * i + 1];
    uint32_t* out = buf.v2.data() + i * dim;
    for (int64_t d = 0; d < dim; ++d)
      out[d] = static_cast<uint32_t>(even ? even[d] : 0) | static_cast<uint32_t>(odd ? odd[d] : 0) << 16;
  }
}

template <typename KV, typename Q>
void attend_tile(const WorkItem& item, const Q* query, int64_t q_stride_t, int64_t q_stride_h, const KV* k_cache,
                 const KV* v_cache, const int64_t* table, int64_t block_size, int64_t kv_heads, int64_t group,
                 int64_t dim, float q_scale, int64_t window, Q* out, int64_t out_stride, Buffers& buf) {
  const int64_t rows = item.num_queries * group;
  const int64_t num_vecs = (rows + kLanes - 1) / kLanes;
  const int64_t width = num_vecs * kLanes;
  const int64_t last_pos = item.first_pos + item.num_queries - 1;
  // bfloat16 pairs multiply with vdpbf16ps (the scale applied to the scores), other dtypes in float32.
  const bool pairs = bf16_dot<KV, Q>() && dim % 2 == 0;
  constexpr bool kBf16Weights = std::is_same_v<KV, c10::BFloat16> && std::is_same_v<Q, c10::BFloat16>;
  // Rows are (query, head of the group), query-major; padding rows repeat the last row's positions.
  std::fill(buf.q_t.begin(), buf.q_t.begin() + dim * width, 0.0f);
  std::fill(buf.q2.begin(), buf.q2.end(), 0u);
  std::fill(buf.out_t.begin(), buf.out_t.begin() + dim * width, 0.0f);
  for (int64_t row = 0; row < width; ++row) {
    const int64_t i = std::min(row, rows - 1) / group;
    const int64_t pos = item.first_pos + i;
    buf.hi[row] = static_cast<int32_t>(pos);
    buf.lo[row] = static_cast<int32_t>(window > 0 ? std::max<int64_t>(pos - window + 1, 0) : 0);
    buf.max[row] = -std::numeric_limits<float>::infinity();
    buf.sum[row] = 0.0f;
    if (row >= rows) continue;
    const Q* q = query + (item.first_query + i) * q_stride_t + (item.kv_head * group + row % group) * q_stride_h;
    if (pairs) {
      const uint16_t* bits = reinterpret_cast<const uint16_t*>(q);
      for (int64_t p = 0; p < dim / 2; ++p)
        buf.q2[p * width + row] = static_cast<uint32_t>(bits[2 * p]) | static_cast<uint32_t>(bits[2 * p + 1]) << 16;
    } else {
      for (int64_t d = 0; d < dim; ++d) buf.q_t[d * width + row] = to_float(q[d]) * q_scale;
    }
  }
  const int64_t first_key = window > 0 ? std::max<int64_t>(item.first_pos - window + 1, 0) : 0;
  const int64_t slot_stride = kv_heads * dim;
  for (int64_t chunk = first_key / kLanes; chunk <= last_pos / kLanes; ++chunk) {
    // Read the chunk's keys and values the tile can see; the others are zeros (never NaN from a freed block).
    if (pairs) {
      stage_chunk_bf16(k_cache, v_cache, table, block_size, slot_stride, item.kv_head, dim, chunk, first_key,
                       last_pos, buf);
    } else {
      for (int64_t j = 0; j < kLanes; ++j) {
        const int64_t pos = chunk * kLanes + j;
        float* k_row = buf.keys.data() + j * dim;
        float* v_row = buf.values.data() + j * dim;
        if (pos < first_key || pos > last_pos) {
          std::fill(k_row, k_row + dim, 0.0f);
          std::fill(v_row, v_row + dim, 0.0f);
          continue;
        }
        const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
        widen(k_cache + slot * slot_stride + item.kv_head * dim, k_row, dim);
        widen(v_cache + slot * slot_stride + item.kv_head * dim, v_row, dim);
      }
    }
#if defined(__AVX512BF16__)
    if (pairs)
      chunk_scores<Bf16Madd>(buf.q2.data(), buf.keys_bf16.data(), dim, width, num_vecs, q_scale, buf.scores.data());
    else
#endif
      chunk_scores<Fp32Madd>(buf.q_t.data(), buf.keys.data(), dim, width, num_vecs, 1.0f, buf.scores.data());
    // Online softmax, lane-wise: running max, the old state's scale, weights and running sum.
    const Vec neg_inf = vset1(-std::numeric_limits<float>::infinity());
    for (int64_t v = 0; v < num_vecs; ++v) {
      const int64_t col = v * kLanes;
      Vec chunk_max = neg_inf;
      for (int j = 0; j < kLanes; ++j) {
        Mask seen = visible(buf.lo.data() + col, buf.hi.data() + col, static_cast<int32_t>(chunk * kLanes + j));
        Vec s = vselect(seen, vload(buf.scores.data() + j * width + col), neg_inf);
        vstore(buf.weights.data() + j * width + col, s);
        chunk_max = vmax(chunk_max, s);
      }
      Vec old_max = vload(buf.max.data() + col);
      Vec new_max = vmax(old_max, chunk_max);
      vstore(buf.max.data() + col, new_max);
      // A row that has seen no key yet keeps max -inf; subtracting 0 instead keeps its weights 0, never NaN.
      Vec shift = vselect(is_neg_inf(new_max), vset1(0.0f), new_max);
      vstore(buf.alpha.data() + col, vexp2(vsub(old_max, shift)));
      Vec sum = vmul(vload(buf.sum.data() + col), vload(buf.alpha.data() + col));
      for (int j = 0; j < kLanes; ++j) {
        float* w = buf.weights.data() + j * width + col;
        Vec p = vexp2(vsub(vload(w), shift));
        sum = vadd(sum, p);
        // A bfloat16 model's weights in bfloat16, as SDPA's kernels take them (the sum keeps float32's).
        vstore(w, kBf16Weights ? vround_bf16(p) : p);
      }
      vstore(buf.sum.data() + col, sum);
    }
#if defined(__AVX512BF16__)
    if (pairs) pack_weights(buf.weights.data(), width, num_vecs, buf.w2.data());
#endif
    for_vector_groups(num_vecs, [&](auto nv, int64_t v0) {
      constexpr int NV = decltype(nv)::value;
#if defined(__AVX512BF16__)
      if (pairs) {
        chunk_values<Bf16Madd, NV>(buf.w2.data(), buf.v2.data(), buf.alpha.data(), dim, width, v0, buf.out_t.data());
        return;
      }
#endif
      chunk_values<Fp32Madd, NV>(buf.weights.data(), buf.values.data(), buf.alpha.data(), dim, width, v0,
                                 buf.out_t.data());
    });
  }
  for (int64_t d = 0; d < dim; ++d)
    for (int64_t v = 0; v < num_vecs; ++v) {
      float* o = buf.out_t.data() + d * width + v * kLanes;
      vstore(o, vdiv(vload(o), vload(buf.sum.data() + v * kLanes)));
    }
  for (int64_t row = 0; row < rows; ++row) {
    Q* o = out + (item.first_query + row / group) * out_stride + (item.kv_head * group + row % group) * dim;
    for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<Q>(buf.out_t[d * width + row]);
  }
}

template <typename KV, typename Q>
void run_items(const std::vector<WorkItem>& items, const at::Tensor& query, const at::Tensor& k_cache,
               const at::Tensor& v_cache, const at::Tensor& block_tables, int64_t group, double scale,
               int64_t window, at::Tensor& out) {
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), dim = k_cache.size(3);
  const int64_t max_rows = std::max<int64_t>(kTileRows / group, 1) * group;
  const int64_t width = (max_rows + kLanes - 1) / kLanes * kLanes;
  const float q_scale = static_cast<float>(scale * 1.4426950408889634);
  const Q* q = query.data_ptr<Q>();
  const KV* kc = k_cache.data_ptr<KV>();
  const KV* vc = v_cache.data_ptr<KV>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t table_stride = block_tables.size(1);
  Q* o = out.data_ptr<Q>();
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_items);
  // Items go out one at a time in their order: a thread's next tile mostly reads the same request's K/V (from its
  // own L2, not the L3 or memory), and each (request, KV head) ends with its cheapest tiles, which balances the
  // threads however uneven the tiles.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Buffers buf(dim, width);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
        const WorkItem& item = items[i];
        attend_tile<KV, Q>(item, q, query.stride(0), query.stride(1), kc, vc, tables + item.request * table_stride,
                           block_size, kv_heads, group, dim, q_scale, window, o, out.stride(0), buf);
      }
    }
  });
}

template <typename KV>
void dispatch_query(const std::vector<WorkItem>& items, const at::Tensor& query, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& block_tables, int64_t group, double scale,
                    int64_t window, at::Tensor& out) {
  switch (query.scalar_type()) {
    case at::kFloat: return run_items<KV, float>(items, query, k_cache, v_cache, block_tables, group, scale, window, out);
    case at::kBFloat16:
      return run_items<KV, c10::BFloat16>(items, query, k_cache, v_cache, block_tables, group, scale, window, out);
    case at::kHalf:
      return run_items<KV, c10::Half>(items, query, k_cache, v_cache, block_tables, group, scale, window, out);
    default: TORCH_CHECK(false, "paged_prefill_attention: query must be float32, bfloat16 or float16");
  }
}

at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                   const at::Tensor& seq_lens, const at::Tensor& requests, double scale,
                                   std::optional<int64_t> window) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [tokens, heads, head_dim], rows contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, kv_heads, head_dim] of one dtype");
  for (const at::Tensor* t : {&block_tables, &query_start_loc, &seq_lens, &requests})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(),
                "block_tables, query_start_loc, seq_lens and requests must be contiguous int64 CPU tensors");
  const int64_t num_tokens = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && kv_heads > 0 && heads % kv_heads == 0,
              "query heads must be a multiple of the cache's KV heads, with the same head_dim");
  TORCH_CHECK(block_tables.dim() == 2 && seq_lens.dim() == 1 && query_start_loc.dim() == 1 &&
                  block_tables.size(0) == seq_lens.size(0) && query_start_loc.size(0) == seq_lens.size(0) + 1,
              "need block_tables [R, blocks], seq_lens [R] and query_start_loc [R + 1]");
  const int64_t win = window.value_or(0);
  TORCH_CHECK(!window.has_value() || win > 0, "window must be positive");
  const int64_t group = heads / kv_heads;
  const int64_t tile_queries = std::max<int64_t>(kTileRows / group, 1);
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t table_width = block_tables.size(1);

  std::vector<WorkItem> items;
  const int64_t* reqs = requests.data_ptr<int64_t>();
  for (int64_t n = 0; n < requests.numel(); ++n) {
    const int64_t r = reqs[n];
    TORCH_CHECK(r >= 0 && r < seq_lens.size(0), "request index ", r, " out of range");
    const int64_t start = qsl[r], num_new = qsl[r + 1] - qsl[r], seq_len = lens[r];
    TORCH_CHECK(start >= 0 && num_new >= 0 && start + num_new <= num_tokens && seq_len >= num_new,
                "request ", r, ": its query rows or sequence length are out of range");
    const int64_t first_key = win > 0 ? std::max<int64_t>(seq_len - num_new - win + 1, 0) : 0;
    const int64_t blocks = (seq_len + block_size - 1) / block_size;
    TORCH_CHECK(blocks <= table_width, "request ", r, ": its block table is shorter than its sequence");
    for (int64_t b = first_key / block_size; b < blocks; ++b) {
      const int64_t id = tables[r * table_width + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "request ", r, ": block id ", id, " out of range");
    }
    // A (request, KV head)'s tiles one after another, its last (costliest) first: see run_items.
    const int64_t num_tiles = (num_new + tile_queries - 1) / tile_queries;
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t t = (num_tiles - 1) * tile_queries; t >= 0; t -= tile_queries)
        items.push_back({r, h, start + t, std::min(tile_queries, num_new - t), seq_len - num_new + t});
  }

  at::Tensor out = at::empty({num_tokens, heads * dim}, query.options());
  if (items.empty()) return out;
  switch (k_cache.scalar_type()) {
    case at::kFloat: dispatch_query<float>(items, query, k_cache, v_cache, block_tables, group, scale, win, out); break;
    case at::kBFloat16:
      dispatch_query<c10::BFloat16>(items, query, k_cache, v_cache, block_tables, group, scale, win, out);
      break;
    case at::kHalf:
      dispatch_query<c10::Half>(items, query, k_cache, v_cache, block_tables, group, scale, win, out);
      break;
    default: TORCH_CHECK(false, "paged_prefill_attention: the KV cache must be float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixcache, m) {
  m.def(
      "paged_prefill_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, Tensor requests, float scale, int? window) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }
