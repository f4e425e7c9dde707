// Matrix products with a GGUF's block-quantized weights, as llama.cpp computes them: the activations are
// quantized per block of 32 to int8 and each block's dot product is an integer one (AVX-512 VNNI `vpdpbusd`:
// unsigned 8-bit times signed 8-bit, four at a time into 32-bit lanes), scaled in float32 by the weight's and
// the activation's block scales. torch's weight-only kernels dequantize in their inner loop and read 4-7 GB/s
// a core; integer dot products over the packed bytes keep up with the memory.
//
// The weights are repacked at load (prefixcache/model/quantization.py, `pack_gguf_weight`) into tiles of 16
// output rows, one lane of a 512-bit register a row, so that one load holds 4 bytes of each of 16 rows, one
// `vpdpbusd` against 4 activation bytes broadcast to every lane advances 16 dot products, and the tile's 16
// outputs come out of the lanes with no horizontal sums. A tile's blocks follow each other in one stream:
// - q4 (Q4_0, Q4_1, Q4_K: w = scale * q + min, q in 0..15), 320 bytes a block of 16 rows x 32 weights: 4 chunks
//   x 16 rows x 4 bytes, byte j of chunk c holding q[4c + j] (low nibble) and q[16 + 4c + j] (high nibble), the
//   GGUF's Q4_0 byte order; then the 16 rows' scales and the 16 minimums as float16.
// - q8 (Q8_0: w = scale * q, q int8), 544 bytes a block: 8 chunks x 16 rows x 4 bytes (q[4c + j]), then the 16
//   scales as float16. `vpdpbusd` wants unsigned weights: flipping the sign bit gives q + 128, and
//   `- 128 * scale * (sum of the block's quantized activations)` takes the 128 back out exactly.
// The minimum's term is min times the sum of the block's quantized activations (scale * sum of q), as llama.cpp's
// Q8_1 has it: with the float sum instead, the two terms of a weight centred on zero (min = -8 * scale) cancel
// each other's but not the quantization's error, 1.8% of the output on SmolLM2's layers against 1.0%.
//
// Up to 4 activation rows share each unpacked weight register (a decode batch reads its weights once), so M
// rows cost one pass over the weights per 4 rows, from the cache after the first. One row (batch-1 decode) runs 4
// tiles side by side instead, independent chains of `vpdpbusd` and 4 streams of loads in flight: 1.08-1.31x the
// one-tile kernel on one thread at SmolLM2's shapes, the same results bit for bit (a row's products do not depend
// on M). A portable path computes the same products with scalar loops where AVX-512 VNNI is absent.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PREFIXCACHE_VNNI512 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTileRows = 16;
constexpr int64_t kQ4BlockBytes = 320;  // 256 of nibbles, 32 of scales, 32 of minimums
constexpr int64_t kQ8BlockBytes = 544;  // 512 of int8, 32 of scales
constexpr int64_t kMaxRows = 4;         // activation rows a weight register is used for
// Weights a thread takes at least: about 32 KiB, enough to amortize a task, small enough to split a 576-row product
// in two. (Keeping products under 256 KiB on one thread was slower at 2 threads: 576 x 576 took 18 us against 12.)
constexpr int64_t kGrainBytes = 32768;

// The activations quantized per block of 32: q int8 [M, K], their scale (amax / 127) and, per block, the sum of
// the quantized activations times their scale.
struct QuantizedRows {
  const int8_t* q;
  const float* step;
  const float* sums;
  int64_t k, blocks;
};

// Where quantize_rows' float scales start in its buffer: after the int8 rows [rows, k], to a multiple of 64.
inline int64_t int8_rows_bytes(int64_t rows, int64_t k) { return (rows * k + 63) / 64 * 64; }

// Bytes quantize_rows writes for [rows, k]: the int8 rows, then a float scale and a float sum per block.
inline int64_t quantized_bytes(int64_t rows, int64_t k) { return int8_rows_bytes(rows, k) + 8 * rows * (k / kBlock); }

// What a call quantizes into a buffer on its stack, with no allocation (a row at SmolLM2's K = 1536 takes 1.9 KiB);
// more rows than that take a heap tensor.
constexpr int64_t kStackBytes = 16384;

#ifdef PREFIXCACHE_VNNI512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// One block of 32 activations: its int8 values into q, its scale; returns the sum of q.
template <typename T>
inline int32_t quantize_block(const T* src, int8_t* q, float* step) {
#if defined(PREFIXCACHE_VNNI512)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>) {
    const __m512 a = load16(src), b = load16(src + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float d = amax / 127.f, inverse = d > 0.f ? 1.f / d : 0.f;
    // rounded to nearest even, as lrintf in the default rounding mode
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inverse)));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inverse)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
    *step = d;
    return _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  }
#endif
  float v[kBlock];
  float amax = 0.f;
  for (int64_t i = 0; i < kBlock; ++i) {
    v[i] = static_cast<float>(src[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
  const float d = amax / 127.f, inverse = d > 0.f ? 1.f / d : 0.f;
  int32_t qsum = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    const int32_t value = static_cast<int32_t>(std::lrintf(v[i] * inverse));
    qsum += value;
    q[i] = static_cast<int8_t>(value);
  }
  *step = d;
  return qsum;
}

// x [M, K] quantized into buffer (quantized_bytes(M, K) of them, 4-byte aligned)
template <typename T>
QuantizedRows quantize_rows(const at::Tensor& x, uint8_t* buffer) {
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock;
  int8_t* q = reinterpret_cast<int8_t*>(buffer);
  float* step = reinterpret_cast<float*>(buffer + int8_rows_bytes(rows, k));
  float* sums = step + rows * blocks;
  const T* src = x.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t at = m * blocks + b;
        const int32_t qsum = quantize_block(src + m * k + b * kBlock, q + m * k + b * kBlock, step + at);
        sums[at] = step[at] * static_cast<float>(qsum);
      }
    }
  });
  return {q, step, sums, k, blocks};
}

template <typename T>
inline void store_tile(T* out, int64_t rows, const float* values) {
  for (int64_t r = 0; r < rows; ++r) out[r] = static_cast<T>(values[r]);
}

inline float half_at(const uint8_t* tile, int64_t offset, int64_t row) {
  c10::Half h;
  std::memcpy(&h, tile + offset + 2 * row, 2);
  return static_cast<float>(h);
}

#ifdef PREFIXCACHE_VNNI512

// How far ahead of its loads a tile asks for its weights (a few blocks of the same stream). The hardware's
// prefetchers alone were 2-9% slower on one thread (SmolLM2's products, 100-200 MB of weights streamed).
constexpr int64_t kPrefetchBytes = 2048;

inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// NT tiles of 16 rows (tile_bytes apart) times activation rows [m0, m0 + MT): tile t's results for row m into
// values[t * MT + m]. At one row a tile's block is a chain of dependent vpdpbusd; tiles side by side keep several
// chains (and several streams of loads) in flight.
template <int NT, int MT>
void q4_tile(const uint8_t* __restrict tile, int64_t tile_bytes, const QuantizedRows& x, int64_t m0,
             float (*values)[kTileRows]) {
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  __m512 acc[NT][MT];
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m) acc[t][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b, tile += kQ4BlockBytes) {
    // the high nibbles stay in place (16 q): their dot products are 16 times theirs, exactly, one shift a block
    __m512i dot_low[NT][MT], dot_high[NT][MT];
    for (int t = 0; t < NT; ++t) {
      const uint8_t* at = tile + t * tile_bytes;
      for (int64_t line = 0; line < kQ4BlockBytes; line += 64) prefetch(at + kPrefetchBytes + line);
      for (int m = 0; m < MT; ++m) dot_low[t][m] = dot_high[t][m] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        const __m512i w = _mm512_loadu_si512(at + 64 * c);
        const __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(w, high);
        for (int m = 0; m < MT; ++m) {
          const int8_t* qx = x.q + (m0 + m) * x.k + b * kBlock + 4 * c;
          dot_low[t][m] = _mm512_dpbusd_epi32(dot_low[t][m], lo, _mm512_set1_epi32(load4(qx)));
          dot_high[t][m] = _mm512_dpbusd_epi32(dot_high[t][m], hi, _mm512_set1_epi32(load4(qx + 16)));
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      const uint8_t* at = tile + t * tile_bytes;
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 256)));
      const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 288)));
      for (int m = 0; m < MT; ++m) {
        const int64_t i = (m0 + m) * x.blocks + b;
        const __m512i dot = _mm512_add_epi32(dot_low[t][m], _mm512_srai_epi32(dot_high[t][m], 4));
        acc[t][m] =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(x.step[i])), acc[t][m]);
        acc[t][m] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(x.sums[i]), acc[t][m]);
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m) _mm512_storeu_ps(values[t * MT + m], acc[t][m]);
}

template <int NT, int MT>
void q8_tile(const uint8_t* __restrict tile, int64_t tile_bytes, const QuantizedRows& x, int64_t m0,
             float (*values)[kTileRows]) {
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[NT][MT];
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m) acc[t][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b, tile += kQ8BlockBytes) {
    __m512i dot[NT][MT];
    for (int t = 0; t < NT; ++t) {
      const uint8_t* at = tile + t * tile_bytes;
      for (int64_t line = 0; line < kQ8BlockBytes; line += 64) prefetch(at + kPrefetchBytes + line);
      for (int m = 0; m < MT; ++m) dot[t][m] = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(at + 64 * c), sign);
        for (int m = 0; m < MT; ++m) {
          const int8_t* qx = x.q + (m0 + m) * x.k + b * kBlock + 4 * c;
          dot[t][m] = _mm512_dpbusd_epi32(dot[t][m], w, _mm512_set1_epi32(load4(qx)));
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      const __m512 scale =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + t * tile_bytes + 512)));
      for (int m = 0; m < MT; ++m) {
        const int64_t i = (m0 + m) * x.blocks + b;
        const __m512 dots = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t][m]), _mm512_set1_ps(x.step[i]),
                                            _mm512_set1_ps(-128.f * x.sums[i]));
        acc[t][m] = _mm512_fmadd_ps(dots, scale, acc[t][m]);
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m) _mm512_storeu_ps(values[t * MT + m], acc[t][m]);
}

#else  // portable: the same products with scalar loops, over the same layouts

template <int MT>
void q4_one_tile(const uint8_t* tile, const QuantizedRows& x, int64_t m0, float (*values)[kTileRows]) {
  for (int m = 0; m < MT; ++m) std::fill(values[m], values[m] + kTileRows, 0.f);
  for (int64_t b = 0; b < x.blocks; ++b, tile += kQ4BlockBytes) {
    for (int m = 0; m < MT; ++m) {
      const int8_t* qx = x.q + (m0 + m) * x.k + b * kBlock;
      const int64_t at = (m0 + m) * x.blocks + b;
      for (int64_t r = 0; r < kTileRows; ++r) {
        int32_t dot = 0;
        for (int64_t c = 0; c < 4; ++c) {
          for (int64_t j = 0; j < 4; ++j) {
            const uint8_t byte = tile[64 * c + 4 * r + j];
            dot += (byte & 15) * qx[4 * c + j] + (byte >> 4) * qx[16 + 4 * c + j];
          }
        }
        values[m][r] += static_cast<float>(dot) * (half_at(tile, 256, r) * x.step[at]) +
                        half_at(tile, 288, r) * x.sums[at];
      }
    }
  }
}

template <int MT>
void q8_one_tile(const uint8_t* tile, const QuantizedRows& x, int64_t m0, float (*values)[kTileRows]) {
  for (int m = 0; m < MT; ++m) std::fill(values[m], values[m] + kTileRows, 0.f);
  for (int64_t b = 0; b < x.blocks; ++b, tile += kQ8BlockBytes) {
    for (int m = 0; m < MT; ++m) {
      const int8_t* qx = x.q + (m0 + m) * x.k + b * kBlock;
      const int64_t at = (m0 + m) * x.blocks + b;
      for (int64_t r = 0; r < kTileRows; ++r) {
        int32_t dot = 0;
        for (int64_t c = 0; c < 8; ++c) {
          for (int64_t j = 0; j < 4; ++j) dot += static_cast<int8_t>(tile[64 * c + 4 * r + j]) * qx[4 * c + j];
        }
        values[m][r] += static_cast<float>(dot) * x.step[at] * half_at(tile, 512, r);
      }
    }
  }
}

template <int NT, int MT>
void q4_tile(const uint8_t* tile, int64_t tile_bytes, const QuantizedRows& x, int64_t m0, float (*values)[kTileRows]) {
  for (int t = 0; t < NT; ++t) q4_one_tile<MT>(tile + t * tile_bytes, x, m0, values + t * MT);
}

template <int NT, int MT>
void q8_tile(const uint8_t* tile, int64_t tile_bytes, const QuantizedRows& x, int64_t m0, float (*values)[kTileRows]) {
  for (int t = 0; t < NT; ++t) q8_one_tile<MT>(tile + t * tile_bytes, x, m0, values + t * MT);
}

#endif

// tiles [t, t + NT) (NT > 1 only for one activation row) times activation rows [m0, m0 + MT)
template <bool Q4, int NT, int MT>
void run_tiles(const uint8_t* tile, int64_t tile_bytes, const QuantizedRows& x, int64_t m0,
               float (*values)[kTileRows]) {
  static_assert(NT * MT <= kMaxRows, "values holds kMaxRows tiles' rows");
  if constexpr (Q4) {
    q4_tile<NT, MT>(tile, tile_bytes, x, m0, values);
  } else {
    q8_tile<NT, MT>(tile, tile_bytes, x, m0, values);
  }
}

template <bool Q4, typename T>
void tiles_times_rows(const uint8_t* weights, int64_t tile_bytes, const QuantizedRows& x, int64_t m, int64_t n,
                      int64_t begin, int64_t end, T* y) {
  float values[kMaxRows][kTileRows];
  const auto store = [&](int64_t t, int64_t m0, int64_t i) {
    store_tile(y + m0 * n + t * kTileRows, std::min(kTileRows, n - t * kTileRows), values[i]);
  };
  if (m == 1) {  // 4 tiles at a time (then 2, 1): 3-7% faster than 2 on one thread, 8 no faster than 4
    int64_t t = begin;
    for (; t + 4 <= end; t += 4) {
      run_tiles<Q4, 4, 1>(weights + t * tile_bytes, tile_bytes, x, 0, values);
      for (int64_t i = 0; i < 4; ++i) store(t + i, 0, i);
    }
    if (t + 2 <= end) {
      run_tiles<Q4, 2, 1>(weights + t * tile_bytes, tile_bytes, x, 0, values);
      store(t, 0, 0);
      store(t + 1, 0, 1);
      t += 2;
    }
    if (t < end) {
      run_tiles<Q4, 1, 1>(weights + t * tile_bytes, tile_bytes, x, 0, values);
      store(t, 0, 0);
    }
    return;
  }
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* tile = weights + t * tile_bytes;
    for (int64_t m0 = 0; m0 < m; m0 += kMaxRows) {
      const int64_t mt = std::min(kMaxRows, m - m0);
      switch (mt) {
        case 1: run_tiles<Q4, 1, 1>(tile, tile_bytes, x, m0, values); break;
        case 2: run_tiles<Q4, 1, 2>(tile, tile_bytes, x, m0, values); break;
        case 3: run_tiles<Q4, 1, 3>(tile, tile_bytes, x, m0, values); break;
        default: run_tiles<Q4, 1, 4>(tile, tile_bytes, x, m0, values); break;
      }
      for (int64_t i = 0; i < mt; ++i) store(t, m0 + i, i);
    }
  }
}

at::Tensor tiled_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool q4) {
  const int64_t block_bytes = q4 ? kQ4BlockBytes : kQ8BlockBytes;
  TORCH_CHECK(x.dim() == 2, "x must be [M, K], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "x must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == block_bytes,
              "packed weights must be contiguous uint8 [N / 16, K / 32, ", block_bytes, "], got ", packed.sizes());
  const int64_t m = x.size(0), k = x.size(1), tiles = packed.size(0);
  TORCH_CHECK(packed.size(1) * kBlock == k, "x has K = ", k, " but the weights ", packed.size(1) * kBlock);
  TORCH_CHECK(n > (tiles - 1) * kTileRows && n <= tiles * kTileRows, "n = ", n, " does not fit ", tiles, " tiles");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  const at::Tensor xc = x.contiguous();
  alignas(64) uint8_t stack[kStackBytes];
  at::Tensor heap;
  uint8_t* buffer = stack;
  if (quantized_bytes(m, k) > kStackBytes) {
    heap = at::empty({quantized_bytes(m, k)}, x.options().dtype(at::kByte));
    buffer = heap.data_ptr<uint8_t>();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gguf_matmul", [&] {
    const QuantizedRows quantized = quantize_rows<scalar_t>(xc, buffer);
    const uint8_t* weights = packed.data_ptr<uint8_t>();
    scalar_t* y = out.data_ptr<scalar_t>();
    const int64_t tile_bytes = packed.size(1) * block_bytes;
    const int64_t grain = std::max<int64_t>(1, kGrainBytes / tile_bytes);
    at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
      if (q4) {
        tiles_times_rows<true>(weights, tile_bytes, quantized, m, n, begin, end, y);
      } else {
        tiles_times_rows<false>(weights, tile_bytes, quantized, m, n, begin, end, y);
      }
    });
  });
  return out;
}

at::Tensor gguf_q4_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  return tiled_matmul(x, packed, n, true);
}

at::Tensor gguf_q8_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  return tiled_matmul(x, packed, n, false);
}

// Which path this build runs: the scalar loops are slower than torch's int4 / int8 kernels, so the loader keeps
// those where it is "scalar".
std::string gguf_matmul_isa() {
#ifdef PREFIXCACHE_VNNI512
  return "avx512-vnni";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixcache, m) {
  m.def("gguf_q4_matmul(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("gguf_q8_matmul(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("gguf_matmul_isa() -> str", &gguf_matmul_isa);  // no tensor to dispatch on: one kernel for every key
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, m) {
  m.impl("gguf_q4_matmul", &gguf_q4_matmul);
  m.impl("gguf_q8_matmul", &gguf_q8_matmul);
}
