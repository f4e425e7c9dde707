// Paged decode attention: one query token a request attends to its K/V blocks where they lie in the cache.
//
// torch's path gathers every request's blocks into a padded [B, kv_heads, S, head_dim] tensor (a copy of all
// the K/V a step reads, written and read again) and runs a masked SDPA over the padding. Here each work item
// reads its request's keys and values in place, row by row through the block table, once for all the query
// heads that share a KV head (GQA), with the softmax computed online in float32 (a running max and sum per head,
// the output rescaled once per tile of keys).
//
// Work items are (request, KV head, split), shared as said below: a request's keys are cut into splits of
// kSplitTokens from its first visible key, so that one long sequence still spreads over the threads. The cut
// depends only on the sequence, never on the batch or the thread count, so a request's output is the same bit
// for bit however it is batched (outputs with and without the prefix cache must agree). Each split leaves its
// max, sum and unnormalised output; a second pass combines the splits of each (request, KV head) in order.
//
// Requests that share a prefix in the cache decode side by side, and their splits over it are the same keys in
// the same blocks: such a split is one work item for as many of them as fill one turn of kMaxGroup heads (two
// requests of three heads a KV head), its rows read once for all their heads, and the next such item runs right
// after it, its rows still in the core's cache. A head's arithmetic does not depend on which heads it is computed
// beside, so sharing changes no bit of any output: a request decodes the same with the cache (shared blocks) as
// without it.
//
// Vectors are 16 float32 lanes: AVX-512 registers where the compiler targets AVX-512 (F, BW, VL: bfloat16 and
// half rows widened in registers, a polynomial exp; with AVX512-BF16 a bfloat16 query's dot products with
// bfloat16 keys taken on the pairs directly), else arrays of 16 that the compiler vectorises as it can.

#include <ATen/ATen.h>

#include "elements.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PREFIXCACHE_AVX512 1
#include <immintrin.h>
#if defined(__AVX512BF16__)
// bfloat16 queries and keys: dot products on pairs of bfloat16 (exact products, float32 sums), no widening.
#define PREFIXCACHE_AVX512_BF16 1
#endif
#endif

#include <type_traits>

namespace {

constexpr int64_t kLanes = 16;
// Keys scored before their softmax weights update the output: two blocks of 16, small enough that the rows and
// the scores of all heads of a KV head stay in L1.
constexpr int64_t kTileTokens = 32;
// Keys per split (a multiple of kTileTokens, so that splitting never changes a tile).
constexpr int64_t kSplitTokens = 256;
// Query heads of one KV head attended together (their accumulators held in registers); more are done in turns.
constexpr int kMaxGroup = 8;

using prefixcache_native::to_float;

#if defined(PREFIXCACHE_AVX512)
using Vec = __m512;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec splat(float x) { return _mm512_set1_ps(x); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float sum_lanes(Vec a) { return _mm512_reduce_add_ps(a); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec a) { _mm512_storeu_ps(p, a); }
inline __mmask16 lanes_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
// The first n lanes of a row (zero beyond).
inline Vec load_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(lanes_mask(n), p); }
inline Vec load_n(const c10::BFloat16* p, int64_t n) {
  // bfloat16 is the high half of a float32: widen to 32 bits and shift into place.
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes_mask(n), p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline Vec load_n(const c10::Half* p, int64_t n) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes_mask(n), p));
}
// exp(x) for x <= 0 (scores minus their running max): 2^k e^r with |r| <= ln2 / 2, e^r by its Taylor series to
// degree 7 (relative error about 1e-9, below float32's rounding); below -88 it is 0.
inline Vec exp_nonpositive(Vec x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-88.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
  Vec k = _mm512_roundscale_ps(mul(x, splat(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm512_fnmadd_ps(k, splat(0.693359375f), x);  // ln2 in two parts, the first exact in float32
  r = _mm512_fnmadd_ps(k, splat(-2.12194440e-4f), r);
  Vec p = splat(1.0f / 5040.0f);
  for (float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f}) p = fma(p, r, splat(c));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, k));
}
// Lane i of the result: the sum of row i of 16 rows of 16 floats (a transpose and add: three shuffles' worth
// of work a row instead of a horizontal sum each).
inline Vec sum_rows(const float* rows) {
  Vec x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i) {
    const Vec a = load(rows + 32 * i), b = load(rows + 32 * i + 16);
    x[i] = add(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // per 128 bits: a02 b02 a13 b13
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = add(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));  // 4 rows
  }
  for (int i = 0; i < 2; ++i) {
    z[i] = add(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88), _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
  }
  return add(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}
inline float max_lanes(Vec a) { return _mm512_reduce_max_ps(a); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
#else
struct Vec {
  float v[kLanes];
};
inline Vec zero() { return Vec{}; }
inline Vec splat(float x) {
  Vec r;
  for (int64_t i = 0; i < kLanes; ++i) r.v[i] = x;
  return r;
}
inline Vec fma(Vec a, Vec b, Vec c) {
  for (int64_t i = 0; i < kLanes; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline Vec mul(Vec a, Vec b) {
  for (int64_t i = 0; i < kLanes; ++i) a.v[i] *= b.v[i];
  return a;
}
inline Vec add(Vec a, Vec b) {
  for (int64_t i = 0; i < kLanes; ++i) a.v[i] += b.v[i];
  return a;
}
inline float sum_lanes(Vec a) {
  float s = 0.0f;
  for (int64_t i = 0; i < kLanes; ++i) s += a.v[i];
  return s;
}
inline Vec load(const float* p) {
  Vec r;
  for (int64_t i = 0; i < kLanes; ++i) r.v[i] = p[i];
  return r;
}
inline void store(float* p, Vec a) {
  for (int64_t i = 0; i < kLanes; ++i) p[i] = a.v[i];
}
template <typename T>
inline Vec load_n(const T* p, int64_t n) {
  Vec r{};
  for (int64_t i = 0; i < n; ++i) r.v[i] = to_float(p[i]);
  return r;
}
inline Vec exp_nonpositive(Vec x) {
  for (int64_t i = 0; i < kLanes; ++i) x.v[i] = std::exp(x.v[i]);
  return x;
}
inline Vec sum_rows(const float* rows) {
  Vec r;
  for (int64_t i = 0; i < kLanes; ++i) r.v[i] = sum_lanes(load(rows + i * kLanes));
  return r;
}
inline float max_lanes(Vec a) { return *std::max_element(a.v, a.v + kLanes); }
inline Vec vmax(Vec a, Vec b) {
  for (int64_t i = 0; i < kLanes; ++i) a.v[i] = std::max(a.v[i], b.v[i]);
  return a;
}
#endif

struct Shapes {
  int64_t batch, heads, kv_heads, group, dim, block_size, table_width, num_splits;
  int64_t chunks;      // 16-lane chunks of a head (the last one partial when head_dim is not a multiple of 16)
  int64_t padded_dim;  // chunks * 16: the stride of the float32 rows of queries and outputs
  float scale;
};

// Whether the scores are dot products of bfloat16 pairs (bfloat16 query and keys, AVX512-BF16).
template <typename QT, typename KT>
constexpr bool kPairDots =
#if defined(PREFIXCACHE_AVX512_BF16)
    std::is_same_v<QT, c10::BFloat16> && std::is_same_v<KT, c10::BFloat16>;
#else
    false;
#endif
constexpr int64_t kPairLanes = 32;  // bfloat16 values in a 512-bit vector

// The lanes of chunk c of a head.
inline int64_t lanes_of(const Shapes& s, int64_t c) { return std::min(kLanes, s.dim - c * kLanes); }

// Asks for the n rows of a tile (head_dim values each) before they are needed: a tile's rows lie in blocks
// anywhere in the cache, which the hardware's stride prefetchers cannot guess.
template <typename KT>
inline void prefetch_rows(const KT* cache, const int64_t* rows, int64_t n, int64_t dim) {
  constexpr int64_t kLine = 64;
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(KT));
  for (int64_t j = 0; j < n; ++j) {
    const char* row = reinterpret_cast<const char*>(cache + rows[j]);
    for (int64_t b = 0; b < bytes; b += kLine) __builtin_prefetch(row + b, 0, 3);
  }
}

// Per thread: the work item's query heads (float32 rows of padded_dim, or bfloat16 rows of pair_dim for pair
// dots; zero past head_dim), their running outputs, a tile of scores per head (and their 16 lanes before the
// sum), the tile's row offsets; sized for the most heads an item attends.
struct Scratch {
  std::vector<float> q, out, scores, lanes, max, sum;
  std::vector<c10::BFloat16> q_pairs;
  std::vector<int64_t> rows;
  int64_t pair_dim;
  Scratch(const Shapes& s, int64_t heads)
      : q(heads * s.padded_dim), out(heads * s.padded_dim), scores(heads * kTileTokens),
        lanes(kMaxGroup * kTileTokens * kLanes), max(heads), sum(heads), rows(2 * kTileTokens),
        pair_dim((s.dim + kPairLanes - 1) / kPairLanes * kPairLanes) {
    q_pairs.resize(heads * pair_dim);
  }
};

#if defined(PREFIXCACHE_AVX512_BF16)
// q . k for G heads on bfloat16 pairs, in 16 lanes a head: each key row read once.
template <int G>
inline void pair_dots(const Shapes& s, const c10::BFloat16* q, int64_t pair_dim, const c10::BFloat16* k,
                      __m512* acc) {
  for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t c = 0; c < pair_dim; c += kPairLanes) {
    const int64_t n = std::min(kPairLanes, s.dim - c);
    const __mmask32 mask = n == kPairLanes ? ~__mmask32(0) : static_cast<__mmask32>((1u << n) - 1);
    const __m512bh kv = (__m512bh)_mm512_maskz_loadu_epi16(mask, k + c);
    for (int g = 0; g < G; ++g) acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)_mm512_loadu_si512(q + g * pair_dim + c), kv);
  }
}
#endif

// Heads [g0, g0 + G) of one split: keys [begin, end) of the request's table. The scratch rows of these heads
// hold their queries and, on return, their unnormalised outputs, max and sum.
template <typename KT, int G, bool kPairs>
void attend_heads(const Shapes& s, const KT* k_cache, const KT* v_cache, const int64_t* table, int64_t kvh,
                  int64_t begin, int64_t end, int64_t g0, Scratch& w) {
  const int64_t pd = s.padded_dim;
  const float* q = w.q.data() + g0 * pd;
  float* out = w.out.data() + g0 * pd;
  float* scores = w.scores.data() + g0 * kTileTokens;
  float* maxes = w.max.data() + g0;
  float* sums = w.sum.data() + g0;
  const int64_t row_stride = s.kv_heads * s.dim;  // between the rows of a block
  // Each tile's row offsets, found (and its key rows asked for) while the tile before it is computed.
  auto find_rows = [&](int64_t t0, int64_t* rows) {
    const int64_t n = std::min(kTileTokens, end - t0);
    for (int64_t j = 0, block = t0 / s.block_size, offset = t0 % s.block_size; j < n; ++j) {
      rows[j] = (table[block] * s.block_size + offset) * row_stride + kvh * s.dim;
      if (++offset == s.block_size) offset = 0, ++block;
    }
    prefetch_rows(k_cache, rows, n, s.dim);
  };
  find_rows(begin, w.rows.data());
  for (int64_t t0 = begin, tile = 0; t0 < end; t0 += kTileTokens, ++tile) {
    const int64_t n = std::min(kTileTokens, end - t0);
    const int64_t* rows = w.rows.data() + (tile % 2) * kTileTokens;
    prefetch_rows(v_cache, rows, n, s.dim);
    // Scores: each key row is read once for the G heads; 16 lanes a head and key, summed 16 keys at a time.
    float* lanes = w.lanes.data();
    for (int64_t j = 0; j < n; ++j) {
      const KT* k = k_cache + rows[j];
      Vec acc[G];
#if defined(PREFIXCACHE_AVX512_BF16)
      if constexpr (kPairs) {
        pair_dots<G>(s, w.q_pairs.data() + g0 * w.pair_dim, w.pair_dim, k, acc);
      } else
#endif
      {
        for (int g = 0; g < G; ++g) acc[g] = zero();
        for (int64_t c = 0; c < s.chunks; ++c) {
          const Vec kv = load_n(k + c * kLanes, lanes_of(s, c));
          for (int g = 0; g < G; ++g) acc[g] = fma(load(q + g * pd + c * kLanes), kv, acc[g]);
        }
      }
      for (int g = 0; g < G; ++g) store(lanes + (g * kTileTokens + j) * kLanes, acc[g]);
    }
    // Online softmax: the tile's weights against the new running max; earlier outputs and sums rescaled.
    float rescale[G];
    for (int g = 0; g < G; ++g) {
      float* sc = scores + g * kTileTokens;
      Vec top = splat(-std::numeric_limits<float>::infinity());
      for (int64_t j = 0; j < n; j += kLanes) {
        // lanes past n sum rows no key wrote: their scores are set to -inf (weight 0) below
        store(sc + j, mul(sum_rows(lanes + (g * kTileTokens + j) * kLanes), splat(s.scale)));
      }
      std::fill(sc + n, sc + kTileTokens, -std::numeric_limits<float>::infinity());  // a last, short tile
      for (int64_t j = 0; j < n; j += kLanes) top = vmax(top, load(sc + j));
      const float old_max = maxes[g];
      const float new_max = std::max(old_max, max_lanes(top));
      Vec total = zero();
      for (int64_t j = 0; j < n; j += kLanes) {
        const Vec e = exp_nonpositive(add(load(sc + j), splat(-new_max)));
        store(sc + j, e);
        total = add(total, e);
      }
      rescale[g] = old_max == new_max ? 1.0f : std::exp(old_max - new_max);  // 0 on the first tile
      maxes[g] = new_max;
      sums[g] = sums[g] * rescale[g] + sum_lanes(total);
    }
    if (t0 + kTileTokens < end) find_rows(t0 + kTileTokens, w.rows.data() + ((tile + 1) % 2) * kTileTokens);
    // Outputs: chunk by chunk, the G heads' accumulators in registers over the tile's value rows.
    for (int64_t c = 0; c < s.chunks; ++c) {
      Vec acc[G];
      for (int g = 0; g < G; ++g) acc[g] = mul(load(out + g * pd + c * kLanes), splat(rescale[g]));
      for (int64_t j = 0; j < n; ++j) {
        const Vec vv = load_n(v_cache + rows[j] + c * kLanes, lanes_of(s, c));
        for (int g = 0; g < G; ++g) acc[g] = fma(splat(scores[g * kTileTokens + j]), vv, acc[g]);
      }
      for (int g = 0; g < G; ++g) store(out + g * pd + c * kLanes, acc[g]);
    }
  }
}

template <typename KT, bool kPairs>
void attend_group_chunk(const Shapes& s, const KT* k_cache, const KT* v_cache, const int64_t* table, int64_t kvh,
                        int64_t begin, int64_t end, int64_t g0, int64_t count, Scratch& w) {
  switch (count) {
    case 1: return attend_heads<KT, 1, kPairs>(s, k_cache, v_cache, table, kvh, begin, end, g0, w);
    case 2: return attend_heads<KT, 2, kPairs>(s, k_cache, v_cache, table, kvh, begin, end, g0, w);
    case 3: return attend_heads<KT, 3, kPairs>(s, k_cache, v_cache, table, kvh, begin, end, g0, w);
    case 4: return attend_heads<KT, 4, kPairs>(s, k_cache, v_cache, table, kvh, begin, end, g0, w);
    case 5: return attend_heads<KT, 5, kPairs>(s, k_cache, v_cache, table, kvh, begin, end, g0, w);
    case 6: return attend_heads<KT, 6, kPairs>(s, k_cache, v_cache, table, kvh, begin, end, g0, w);
    case 7: return attend_heads<KT, 7, kPairs>(s, k_cache, v_cache, table, kvh, begin, end, g0, w);
    default: return attend_heads<KT, kMaxGroup, kPairs>(s, k_cache, v_cache, table, kvh, begin, end, g0, w);
  }
}

// Row size of a split's partial result per head: the unnormalised output, then its max and sum.
inline int64_t partial_row(const Shapes& s) { return s.dim + 2; }

// One split of one KV head for `count` requests that read it alike (`members`, one where nothing is shared): keys
// [begin, end) of the table they share there, all their heads of the KV head (in turns of kMaxGroup). Leaves each
// member's `partial` [group, dim + 2] at partial + member_offsets[m].
template <typename QT, typename KT>
void attend_split(const Shapes& s, const QT* query, int64_t q_stride_b, int64_t q_stride_h, const KT* k_cache,
                  const KT* v_cache, const int64_t* table, const int64_t* members, int64_t count, int64_t kvh,
                  int64_t begin, int64_t end, Scratch& w, float* partial, const int64_t* member_offsets) {
  const int64_t pd = s.padded_dim, heads = count * s.group;
  for (int64_t h = 0; h < heads; ++h) {
    const QT* src = query + members[h / s.group] * q_stride_b + (kvh * s.group + h % s.group) * q_stride_h;
    if constexpr (kPairDots<QT, KT>) {
      c10::BFloat16* q = w.q_pairs.data() + h * w.pair_dim;
      std::copy(src, src + s.dim, q);
      std::fill(q + s.dim, q + w.pair_dim, c10::BFloat16(0.0f));
    } else {
      float* q = w.q.data() + h * pd;
      for (int64_t d = 0; d < s.dim; ++d) q[d] = to_float(src[d]);
      std::fill(q + s.dim, q + pd, 0.0f);
    }
    w.max[h] = -std::numeric_limits<float>::infinity();
    w.sum[h] = 0.0f;
  }
  std::fill(w.out.begin(), w.out.begin() + heads * pd, 0.0f);
  for (int64_t g0 = 0; g0 < heads; g0 += kMaxGroup) {
    attend_group_chunk<KT, kPairDots<QT, KT>>(s, k_cache, v_cache, table, kvh, begin, end, g0,
                                              std::min<int64_t>(kMaxGroup, heads - g0), w);
  }
  const int64_t row = partial_row(s);
  for (int64_t h = 0; h < heads; ++h) {
    float* p = partial + member_offsets[h / s.group] + (h % s.group) * row;
    std::copy(w.out.begin() + h * pd, w.out.begin() + h * pd + s.dim, p);
    p[s.dim] = w.max[h];
    p[s.dim + 1] = w.sum[h];
  }
}

// The first key a request attends: seq_len - window, or 0.
inline int64_t first_key(int64_t seq_len, const std::optional<int64_t>& window) {
  return window.has_value() ? std::max<int64_t>(0, seq_len - *window) : 0;
}

inline int64_t splits_of(int64_t keys) { return (keys + kSplitTokens - 1) / kSplitTokens; }

// Split `split` of a set of requests that read the same keys [first, last) in the same blocks.
struct SplitWork {
  int64_t split, first, last;
  std::vector<int64_t> members;
};

// Every request's splits, those that read alike (the same split, the same keys, the same blocks: a prefix they
// share in the cache) gathered into items of as many requests as one turn of kMaxGroup heads takes (at least
// one); the items in the order of their first request, then split, as the threads take them in turn (each thread
// a run of requests, as without sharing).
std::vector<SplitWork> split_work(const Shapes& s, const int64_t* tables, const int64_t* lens,
                                  const std::optional<int64_t>& window) {
  struct Entry {
    int64_t b, split, first, last;
  };
  std::vector<Entry> entries;
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t start = first_key(lens[b], window);
    for (int64_t i = 0; i < splits_of(lens[b] - start); ++i) {
      const int64_t first = start + i * kSplitTokens;
      entries.push_back({b, i, first, std::min(lens[b], first + kSplitTokens)});
    }
  }
  auto blocks = [&](const Entry& e) {  // the table entries the split reads
    const int64_t* row = tables + e.b * s.table_width;
    return std::pair{row + e.first / s.block_size, row + (e.last - 1) / s.block_size + 1};
  };
  auto before = [&](const Entry& x, const Entry& y) {
    if (x.split != y.split || x.first != y.first || x.last != y.last) {
      return std::tie(x.split, x.first, x.last) < std::tie(y.split, y.first, y.last);
    }
    const auto [xb, xe] = blocks(x);
    const auto [yb, ye] = blocks(y);
    return std::lexicographical_compare(xb, xe, yb, ye);
  };
  std::stable_sort(entries.begin(), entries.end(), before);  // alike splits next to each other, by request
  const size_t sharers = std::max<int64_t>(1, kMaxGroup / s.group);
  std::vector<SplitWork> work;
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    const bool alike = i > 0 && !before(entries[i - 1], e) && !before(e, entries[i - 1]);
    if (!alike || work.back().members.size() == sharers) work.push_back({e.split, e.first, e.last, {}});
    work.back().members.push_back(e.b);
  }
  std::sort(work.begin(), work.end(), [](const SplitWork& x, const SplitWork& y) {
    return std::pair{x.members[0], x.split} < std::pair{y.members[0], y.split};
  });
  return work;
}

// Attention already computed over keys before the table's (a prefix every request of the step shares, attended
// once for all of them): per request and head its normalised output [B, heads, head_dim] in the query's dtype and
// its log-sum-exp [B, heads] in float32. Merged as one more split whose max is the log-sum-exp and whose sum is 1.
template <typename QT>
struct Prefix {
  const QT* out = nullptr;
  const float* lse = nullptr;
};

// Each head's output from its splits (and the prefix, first, where there is one):
// sum_i e^(m_i - M) o_i / sum_i e^(m_i - M) l_i, splits in order.
template <typename QT>
void combine(const Shapes& s, const float* partial, int64_t b, int64_t kvh, int64_t splits, const Prefix<QT>& prefix,
             QT* out) {
  const int64_t row = partial_row(s), split_stride = s.group * row;
  const float* base = partial + (b * s.kv_heads + kvh) * s.num_splits * split_stride;
  std::vector<float> acc(s.dim);
  for (int64_t g = 0; g < s.group; ++g) {
    const int64_t head = b * s.heads + kvh * s.group + g;
    float top = prefix.lse == nullptr ? -std::numeric_limits<float>::infinity() : prefix.lse[head];
    for (int64_t i = 0; i < splits; ++i) top = std::max(top, base[i * split_stride + g * row + s.dim]);
    std::fill(acc.begin(), acc.end(), 0.0f);
    float total = 0.0f;
    if (prefix.lse != nullptr) {
      const float weight = std::exp(prefix.lse[head] - top);
      const QT* p = prefix.out + head * s.dim;
      for (int64_t d = 0; d < s.dim; ++d) acc[d] += weight * to_float(p[d]);
      total += weight;
    }
    for (int64_t i = 0; i < splits; ++i) {
      const float* p = base + i * split_stride + g * row;
      const float weight = std::exp(p[s.dim] - top);
      for (int64_t d = 0; d < s.dim; ++d) acc[d] += weight * p[d];
      total += weight * p[s.dim + 1];
    }
    const float inv = 1.0f / total;
    QT* o = out + b * s.heads * s.dim + (kvh * s.group + g) * s.dim;
    for (int64_t d = 0; d < s.dim; ++d) o[d] = static_cast<QT>(acc[d] * inv);
  }
}

template <typename QT, typename KT>
void run(const Shapes& s, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const int64_t* tables, const int64_t* lens, const std::optional<int64_t>& window, const Prefix<QT>& prefix,
         at::Tensor& out) {
  const QT* q = query.const_data_ptr<QT>();
  const int64_t q_stride_b = query.stride(0), q_stride_h = query.stride(1);
  const KT* k = k_cache.const_data_ptr<KT>();
  const KT* v = v_cache.const_data_ptr<KT>();
  const int64_t split_size = s.group * partial_row(s);
  std::vector<float> partial(s.batch * s.kv_heads * s.num_splits * split_size);
  const std::vector<SplitWork> work = split_work(s, tables, lens, window);
  int64_t most = 1;
  for (const SplitWork& w : work) most = std::max<int64_t>(most, w.members.size());
  at::parallel_for(0, static_cast<int64_t>(work.size()) * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(s, most * s.group);
    std::vector<int64_t> offsets(most);
    for (int64_t item = begin; item < end; ++item) {
      const SplitWork& w = work[item / s.kv_heads];
      const int64_t kvh = item % s.kv_heads, count = w.members.size();
      for (int64_t m = 0; m < count; ++m) {
        offsets[m] = ((w.members[m] * s.kv_heads + kvh) * s.num_splits + w.split) * split_size;
      }
      attend_split<QT, KT>(s, q, q_stride_b, q_stride_h, k, v, tables + w.members[0] * s.table_width,
                           w.members.data(), count, kvh, w.first, w.last, scratch, partial.data(), offsets.data());
    }
  });
  QT* o = out.mutable_data_ptr<QT>();
  at::parallel_for(0, s.batch * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / s.kv_heads;
      combine<QT>(s, partial.data(), b, pair % s.kv_heads, splits_of(lens[b] - first_key(lens[b], window)), prefix,
                  o);
    }
  });
}

template <typename QT>
void run_for_cache(const Shapes& s, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const int64_t* tables, const int64_t* lens, const std::optional<int64_t>& window,
                   const std::optional<at::Tensor>& prefix_out, const std::optional<at::Tensor>& prefix_lse,
                   at::Tensor& out) {
  Prefix<QT> prefix;
  if (prefix_lse.has_value()) prefix = {prefix_out->const_data_ptr<QT>(), prefix_lse->const_data_ptr<float>()};
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      return run<QT, float>(s, query, k_cache, v_cache, tables, lens, window, prefix, out);
    case at::kBFloat16:
      return run<QT, c10::BFloat16>(s, query, k_cache, v_cache, tables, lens, window, prefix, out);
    case at::kHalf:
      return run<QT, c10::Half>(s, query, k_cache, v_cache, tables, lens, window, prefix, out);
    default:
      TORCH_CHECK(false, "paged_decode_attention: the K/V cache must be float32, bfloat16 or float16, not ",
                  k_cache.scalar_type());
  }
}

// query [B, heads, head_dim]; k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]; block_tables
// [B, width] and seq_lens [B] int64: request b attends to keys [seq_len - window (or 0), seq_len) of its table.
// Table entries outside those keys (padding, blocks left of the window) are never read. With prefix_out and
// prefix_lse (see Prefix; both or neither) the result also attends the keys they were computed over, as if they
// came before the table's. Returns [B, heads * head_dim] in the query's dtype.
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  std::optional<int64_t> window, const std::optional<at::Tensor>& prefix_out,
                                  const std::optional<at::Tensor>& prefix_lse) {
  TORCH_CHECK(query.dim() == 3, "paged_decode_attention: query must be [batch, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged_decode_attention: k_cache and v_cache must be [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_decode_attention: K and V dtypes differ");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode_attention: caches must be contiguous");
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  block_tables.device().is_cpu() && seq_lens.device().is_cpu(),
              "paged_decode_attention: all inputs must be on the CPU");
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim, "paged_decode_attention: the query's head_dim is ", dim, ", the cache's ",
              k_cache.size(3));
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "paged_decode_attention: ", heads,
              " query heads are not a multiple of ", kv_heads, " KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.size(0) == batch,
              "paged_decode_attention: block_tables must be int64 [batch, width]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.dim() == 1 && seq_lens.size(0) == batch,
              "paged_decode_attention: seq_lens must be int64 [batch]");
  TORCH_CHECK(!window.has_value() || *window > 0, "paged_decode_attention: window must be positive");
  TORCH_CHECK(prefix_out.has_value() == prefix_lse.has_value(),
              "paged_decode_attention: prefix_out and prefix_lse go together");
  std::optional<at::Tensor> p_out, p_lse;
  if (prefix_lse.has_value()) {
    TORCH_CHECK(!window.has_value(), "paged_decode_attention: a prefix and a window do not go together");
    TORCH_CHECK(prefix_out->device().is_cpu() && prefix_lse->device().is_cpu(),
                "paged_decode_attention: the prefix must be on the CPU");
    TORCH_CHECK(prefix_out->scalar_type() == query.scalar_type() && prefix_out->sizes() == query.sizes(),
                "paged_decode_attention: prefix_out must be [batch, heads, head_dim] in the query's dtype");
    TORCH_CHECK(prefix_lse->scalar_type() == at::kFloat && prefix_lse->dim() == 2 &&
                    prefix_lse->size(0) == query.size(0) && prefix_lse->size(1) == query.size(1),
                "paged_decode_attention: prefix_lse must be float32 [batch, heads]");
    p_out = prefix_out->contiguous();
    p_lse = prefix_lse->contiguous();
  }
  const at::Tensor q = query.stride(2) == 1 ? query : query.contiguous();
  const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const int64_t width = tables.size(1);
  const int64_t* table_data = tables.const_data_ptr<int64_t>();
  const int64_t* len_data = lens.const_data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = len_data[b];
    TORCH_CHECK(len >= 1 && len <= width * block_size, "paged_decode_attention: request ", b, " has ", len,
                " keys; its table holds 1 to ", width * block_size);
    const int64_t first = first_key(len, window);
    for (int64_t i = first / block_size; i <= (len - 1) / block_size; ++i) {
      const int64_t block = table_data[b * width + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_attention: request ", b, " reads block ", block,
                  " of a cache of ", num_blocks);
    }
    longest = std::max(longest, len - first);
  }
  at::Tensor out = at::empty({batch, heads * dim}, query.options());
  if (batch == 0) return out;
  const int64_t chunks = (dim + kLanes - 1) / kLanes;
  const Shapes s{batch, heads, kv_heads, heads / kv_heads, dim, block_size, width, splits_of(longest),
                 chunks, chunks * kLanes, static_cast<float>(scale)};
  switch (q.scalar_type()) {
    case at::kFloat:
      run_for_cache<float>(s, q, k_cache, v_cache, table_data, len_data, window, p_out, p_lse, out);
      break;
    case at::kBFloat16:
      run_for_cache<c10::BFloat16>(s, q, k_cache, v_cache, table_data, len_data, window, p_out, p_lse, out);
      break;
    case at::kHalf:
      run_for_cache<c10::Half>(s, q, k_cache, v_cache, table_data, len_data, window, p_out, p_lse, out);
      break;
    default:
      TORCH_CHECK(false, "paged_decode_attention: the query must be float32, bfloat16 or float16, not ",
                  q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixcache, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale, int? window, Tensor? prefix_out=None, Tensor? prefix_lse=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
