// Matrix products with a GGUF's block-quantized weights, as llama.cpp computes them: the activations are
// quantized per block of 32 to int8 and each block's dot product is an integer one (AVX-512 VNNI `vpdpbusd`,
// unsigned 8-bit times signed 8-bit into 32-bit lanes), scaled in float32 by the weight's and the activation's
// block scales. torch's weight-only kernels dequantize in the inner loop and read 4-7 GB/s a core; integer dot
// products over the packed bytes keep up with the memory.
//
// Weights, repacked at load from the GGUF's blocks (prefixcache/model/quantization.py), one row per output:
// - q4 (Q4_0, Q4_1, Q4_K): `nibbles` uint8 [N, K/2], byte i of each 32-block holding q[i] (low nibble) and
//   q[i + 16] (high), the GGUF's Q4_0/Q4_1 order; `scale` and `minimum` float16 [N, K/32]: w = scale * q + min.
// - q8 (Q8_0): `q` int8 [N, K], `scale` float16 [N, K/32]: w = scale * q.
// A 64-byte load of nibbles is 4 blocks: its low nibbles are the first halves of the 4 blocks, its high nibbles
// the second halves, so the activations are quantized into that order (per group of 4 blocks, the 4 first
// halves then the 4 second halves) and two `vpdpbusd` leave each block's partial sums in 4 of the 16 lanes.
// The minimum's term is min times the block's float sum of x (exact, not the quantized sum). Q8_0's signed
// weights become unsigned by flipping their sign bit (w + 128), which `- 128 * (sum of the block's quantized x)`
// undoes exactly.
//
// Every output row reads its weights once for all M activation rows (M = 1 for a decode step of one stream):
// a tile of R weight rows is unpacked once per MT activation rows. A portable path computes the same products
// with scalar loops where AVX-512 VNNI is absent.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PREFIXCACHE_VNNI512 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4GroupBlocks = 4;  // blocks per 64-byte load of nibbles
constexpr int64_t kQ8GroupBlocks = 2;  // blocks per 64-byte load of int8 weights
constexpr int64_t kLanes = 16;         // float32 / int32 lanes of a 512-bit register

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// The activations quantized for one weight type's layout.
struct QuantizedRows {
  int64_t blocks;        // K / 32
  int64_t groups;        // ceil(blocks / blocks a group)
  at::Tensor q;          // int8 [M, groups * 64 * (2 for q4, 1 for q8)]
  at::Tensor step;       // float [M, groups * 16]: each lane's block scale (0 past the last block)
  at::Tensor sums;       // float [M, round_up(blocks, 16)]: q4: the block's float sum; q8: scale * sum of q
  // the same, as raw rows for the kernels' loops
  const int8_t* q_data;
  const float* step_data;
  const float* sums_data;
  int64_t q_stride, step_stride, sums_stride;
};

// Quantizes x [M, K] per block of 32 to int8 with a float scale (amax / 127, rounded to nearest), into the q4 or
// q8 order described above.
QuantizedRows quantize_rows(const at::Tensor& x, bool q4) {
  const int64_t rows = x.size(0), k = x.size(1);
  const int64_t group_blocks = q4 ? kQ4GroupBlocks : kQ8GroupBlocks;
  QuantizedRows out;
  out.blocks = k / kBlock;
  out.groups = (out.blocks + group_blocks - 1) / group_blocks;
  const int64_t q_stride = out.groups * 64 * (q4 ? 2 : 1);
  const int64_t step_stride = out.groups * kLanes, sums_stride = round_up(out.blocks, kLanes);
  out.q = at::zeros({rows, q_stride}, at::kChar);
  out.step = at::zeros({rows, step_stride}, at::kFloat);
  out.sums = at::zeros({rows, sums_stride}, at::kFloat);
  out.q_data = out.q.data_ptr<int8_t>();
  out.step_data = out.step.data_ptr<float>();
  out.sums_data = out.sums.data_ptr<float>();
  out.q_stride = q_stride;
  out.step_stride = step_stride;
  out.sums_stride = sums_stride;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* src = xf.data_ptr<float>();
  int8_t* q = out.q.data_ptr<int8_t>();
  float* step = out.step.data_ptr<float>();
  float* sums = out.sums.data_ptr<float>();
  const int64_t lanes_per_block = kLanes / group_blocks;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < out.blocks; ++b) {
        const float* v = src + m * k + b * kBlock;
        float amax = 0.f, total = 0.f;
        for (int64_t i = 0; i < kBlock; ++i) {
          amax = std::max(amax, std::fabs(v[i]));
          total += v[i];
        }
        const float d = amax / 127.f, inverse = d > 0.f ? 1.f / d : 0.f;
        const int64_t g = b / group_blocks, j = b % group_blocks;
        int8_t* dst = q + m * q_stride;
        int32_t qsum = 0;
        for (int64_t i = 0; i < kBlock; ++i) {
          const int8_t value = static_cast<int8_t>(std::nearbyint(v[i] * inverse));
          qsum += value;
          const int64_t at = q4 ? g * 128 + (i < 16 ? 16 * j + i : 64 + 16 * j + i - 16) : b * kBlock + i;
          dst[at] = value;
        }
        for (int64_t lane = 0; lane < lanes_per_block; ++lane) {
          step[m * step_stride + g * kLanes + j * lanes_per_block + lane] = d;
        }
        sums[m * sums_stride + b] = q4 ? total : d * static_cast<float>(qsum);
      }
    }
  });
  return out;
}

template <typename T>
void store(T* out, float value) {
  *out = static_cast<T>(value);
}

// What a kernel tile needs: the weight rows [n0, n0 + R), the activation rows [m0, m0 + MT).
struct Problem {
  const uint8_t* weights;  // q4: nibbles; q8: int8 bytes
  int64_t weight_stride;   // bytes a row
  const c10::Half* scale;
  const c10::Half* minimum;  // q4 only
  int64_t blocks;
  const QuantizedRows* x;
};

#ifdef PREFIXCACHE_VNNI512

// How far ahead of its loads a tile asks for its weights: the rows are contiguous, so this is a later tile's
// bytes; the hardware's prefetchers alone kept one core at about a third of its streaming bandwidth.
constexpr int64_t kPrefetchBytes = 4096;

inline float sum_lanes(__m512 v) { return _mm512_reduce_add_ps(v); }

// sum over the row's blocks of half[b] * sums[b], 16 blocks at a time
inline __m512 half_dot(const c10::Half* half, const float* sums, int64_t blocks) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; b += kLanes) {
    const __mmask16 mask = blocks - b >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << (blocks - b)) - 1);
    const __m512 h = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, half + b));
    acc = _mm512_fmadd_ps(h, _mm512_loadu_ps(sums + b), acc);
  }
  return acc;
}

template <int R, int MT, typename T>
void q4_tile(const Problem& p, int64_t n0, int64_t m0, T* out, int64_t out_stride) {
  const QuantizedRows& x = *p.x;
  const int64_t blocks = p.blocks, groups = x.groups;
  const uint8_t* __restrict weights[R];
  const c10::Half* __restrict scales[R];
  for (int r = 0; r < R; ++r) {
    weights[r] = p.weights + (n0 + r) * p.weight_stride;
    scales[r] = p.scale + (n0 + r) * blocks;
  }
  const int8_t* __restrict qx[MT];
  const float* __restrict step[MT];
  for (int m = 0; m < MT; ++m) {
    qx[m] = x.q_data + (m0 + m) * x.q_stride;
    step[m] = x.step_data + (m0 + m) * x.step_stride;
  }
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t count = std::min<int64_t>(kQ4GroupBlocks, blocks - g * kQ4GroupBlocks);
    const __mmask64 byte_mask = count == kQ4GroupBlocks ? ~0ULL : (1ULL << (16 * count)) - 1;
    const __mmask8 half_mask = static_cast<__mmask8>((1u << count) - 1);
    __m512i lo[R], hi[R];
    __m512 scale[R];
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(weights[r] + g * 64 + kPrefetchBytes), _MM_HINT_T0);
      const __m512i w = _mm512_maskz_loadu_epi8(byte_mask, weights[r] + g * 64);
      lo[r] = _mm512_and_si512(w, low_mask);
      hi[r] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low_mask);
      const __m128 s4 = _mm_cvtph_ps(_mm_maskz_loadu_epi16(half_mask, scales[r] + g * kQ4GroupBlocks));
      scale[r] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(s4));
    }
    for (int m = 0; m < MT; ++m) {
      const __m512i xl = _mm512_loadu_si512(qx[m] + g * 128);
      const __m512i xh = _mm512_loadu_si512(qx[m] + g * 128 + 64);
      const __m512 d = _mm512_loadu_ps(step[m] + g * kLanes);
      for (int r = 0; r < R; ++r) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], xl), hi[r], xh);
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale[r], d), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < MT; ++m) {
      const float* sums = x.sums_data + (m0 + m) * x.sums_stride;
      const __m512 offset = half_dot(p.minimum + (n0 + r) * blocks, sums, blocks);
      store(out + (m0 + m) * out_stride + n0 + r, sum_lanes(_mm512_add_ps(acc[r][m], offset)));
    }
  }
}

template <int R, int MT, typename T>
void q8_tile(const Problem& p, int64_t n0, int64_t m0, T* out, int64_t out_stride) {
  const QuantizedRows& x = *p.x;
  const int64_t blocks = p.blocks, groups = x.groups;
  const uint8_t* __restrict weights[R];
  const c10::Half* __restrict scales[R];
  for (int r = 0; r < R; ++r) {
    weights[r] = p.weights + (n0 + r) * p.weight_stride;
    scales[r] = p.scale + (n0 + r) * blocks;
  }
  const int8_t* __restrict qx[MT];
  const float* __restrict step[MT];
  for (int m = 0; m < MT; ++m) {
    qx[m] = x.q_data + (m0 + m) * x.q_stride;
    step[m] = x.step_data + (m0 + m) * x.step_stride;
  }
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t count = std::min<int64_t>(kQ8GroupBlocks, blocks - g * kQ8GroupBlocks);
    const __mmask64 byte_mask = count == kQ8GroupBlocks ? ~0ULL : (1ULL << (32 * count)) - 1;
    const __mmask8 half_mask = static_cast<__mmask8>((1u << count) - 1);
    __m512i w[R];
    __m512 scale[R];
    for (int r = 0; r < R; ++r) {
      // past the row's end the bytes load as 0 and flip to 128, against activations that are 0 there
      _mm_prefetch(reinterpret_cast<const char*>(weights[r] + g * 64 + kPrefetchBytes), _MM_HINT_T0);
      w[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(byte_mask, weights[r] + g * 64), sign);
      const __m128 s2 = _mm_cvtph_ps(_mm_maskz_loadu_epi16(half_mask, scales[r] + g * kQ8GroupBlocks));
      scale[r] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(s2));
    }
    for (int m = 0; m < MT; ++m) {
      const __m512i xq = _mm512_loadu_si512(qx[m] + g * 64);
      const __m512 d = _mm512_loadu_ps(step[m] + g * kLanes);
      for (int r = 0; r < R; ++r) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r], xq);
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale[r], d), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < MT; ++m) {
      const float* sums = x.sums_data + (m0 + m) * x.sums_stride;
      const __m512 offset = half_dot(scales[r], sums, blocks);
      store(out + (m0 + m) * out_stride + n0 + r, sum_lanes(_mm512_fnmadd_ps(_mm512_set1_ps(128.f), offset, acc[r][m])));
    }
  }
}

#else  // portable: the same products with scalar loops, over the same layouts

template <int R, int MT, typename T>
void q4_tile(const Problem& p, int64_t n0, int64_t m0, T* out, int64_t out_stride) {
  const QuantizedRows& x = *p.x;
  const int64_t q_stride = x.q_stride, step_stride = x.step_stride, sums_stride = x.sums_stride;
  for (int r = 0; r < R; ++r) {
    const uint8_t* row = p.weights + (n0 + r) * p.weight_stride;
    const c10::Half* scale = p.scale + (n0 + r) * p.blocks;
    const c10::Half* minimum = p.minimum + (n0 + r) * p.blocks;
    for (int m = 0; m < MT; ++m) {
      const int8_t* qx = x.q_data + (m0 + m) * q_stride;
      const float* step = x.step_data + (m0 + m) * step_stride;
      const float* sums = x.sums_data + (m0 + m) * sums_stride;
      float total = 0.f;
      for (int64_t b = 0; b < p.blocks; ++b) {
        const int64_t g = b / kQ4GroupBlocks, j = b % kQ4GroupBlocks;
        const int8_t* first = qx + g * 128 + 16 * j;
        int32_t dot = 0;
        for (int64_t i = 0; i < 16; ++i) {
          const uint8_t byte = row[b * 16 + i];
          dot += (byte & 15) * first[i] + (byte >> 4) * first[64 + i];
        }
        const float d = step[g * kLanes + j * (kLanes / kQ4GroupBlocks)];
        total += static_cast<float>(dot) * static_cast<float>(scale[b]) * d + static_cast<float>(minimum[b]) * sums[b];
      }
      store(out + (m0 + m) * out_stride + n0 + r, total);
    }
  }
}

template <int R, int MT, typename T>
void q8_tile(const Problem& p, int64_t n0, int64_t m0, T* out, int64_t out_stride) {
  const QuantizedRows& x = *p.x;
  const int64_t q_stride = x.q_stride, step_stride = x.step_stride;
  for (int r = 0; r < R; ++r) {
    const int8_t* row = reinterpret_cast<const int8_t*>(p.weights + (n0 + r) * p.weight_stride);
    const c10::Half* scale = p.scale + (n0 + r) * p.blocks;
    for (int m = 0; m < MT; ++m) {
      const int8_t* qx = x.q_data + (m0 + m) * q_stride;
      const float* step = x.step_data + (m0 + m) * step_stride;
      float total = 0.f;
      for (int64_t b = 0; b < p.blocks; ++b) {
        int32_t dot = 0;
        for (int64_t i = 0; i < kBlock; ++i) dot += row[b * kBlock + i] * qx[b * kBlock + i];
        const int64_t g = b / kQ8GroupBlocks, j = b % kQ8GroupBlocks;
        total += static_cast<float>(dot) * static_cast<float>(scale[b]) * step[g * kLanes + j * (kLanes / kQ8GroupBlocks)];
      }
      store(out + (m0 + m) * out_stride + n0 + r, total);
    }
  }
}

#endif

// One tile of R weight rows against activation rows [m0, m0 + mt), 1 <= mt <= 4.
template <bool Q4, int R, typename T>
void tile(const Problem& p, int64_t n0, int64_t m0, int64_t mt, T* out, int64_t out_stride) {
  switch (mt) {
#define PREFIXCACHE_TILE(MT)                                                \
  case MT:                                                                  \
    if constexpr (Q4) q4_tile<R, MT, T>(p, n0, m0, out, out_stride);        \
    else q8_tile<R, MT, T>(p, n0, m0, out, out_stride);                     \
    break;
    PREFIXCACHE_TILE(1)
    PREFIXCACHE_TILE(2)
    PREFIXCACHE_TILE(3)
    PREFIXCACHE_TILE(4)
#undef PREFIXCACHE_TILE
  }
}

// out[m, n] for every n: tiles of 4 weight rows for one activation row, of 2 for several (their accumulators
// and unpacked weights fit the 32 vector registers), each tile's rows read once for all M.
template <bool Q4, typename T>
void matmul_rows(const Problem& p, int64_t rows_m, int64_t rows_n, T* out) {
  constexpr int64_t kMaxMT = 4;
  const int64_t tile_n = rows_m == 1 ? 4 : 2;
  const int64_t tiles = (rows_n + tile_n - 1) / tile_n;
  // about 16 KiB of weights a task: enough to amortize a task, small enough to split a 576-row product in two
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, tile_n * p.weight_stride));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile_n;
      const int64_t rows = std::min(tile_n, rows_n - n0);
      for (int64_t m0 = 0; m0 < rows_m; m0 += kMaxMT) {
        const int64_t mt = std::min(kMaxMT, rows_m - m0);
        if (rows == 4) {
          tile<Q4, 4, T>(p, n0, m0, mt, out, rows_n);
        } else if (rows == 2) {
          tile<Q4, 2, T>(p, n0, m0, mt, out, rows_n);
        } else {
          for (int64_t r = 0; r < rows; ++r) tile<Q4, 1, T>(p, n0 + r, m0, mt, out, rows_n);
        }
      }
    }
  });
}

at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& minimum, bool q4) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "x must be float32, bfloat16 or float16, got ", x.scalar_type());
  const int64_t m = x.size(0), k = x.size(1), n = weights.size(0);
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32, got ", k);
  TORCH_CHECK(weights.dim() == 2 && weights.size(1) == (q4 ? k / 2 : k) && weights.is_contiguous(),
              "weights must be contiguous [N, ", q4 ? k / 2 : k, "], got ", weights.sizes());
  TORCH_CHECK(weights.scalar_type() == (q4 ? at::kByte : at::kChar), "weights must be ", q4 ? "uint8" : "int8");
  const auto check_scales = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous() && t.dim() == 2 && t.size(0) == n &&
                    t.size(1) == k / kBlock,
                name, " must be contiguous float16 [N, K/32]");
  };
  check_scales(scale, "scale");
  if (q4) check_scales(*minimum, "minimum");
  const QuantizedRows quantized = quantize_rows(x, q4);
  const Problem problem{static_cast<const uint8_t*>(weights.data_ptr()), weights.size(1),
                        scale.data_ptr<c10::Half>(), q4 ? minimum->data_ptr<c10::Half>() : nullptr,
                        k / kBlock, &quantized};
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gguf_matmul", [&] {
    if (q4) {
      matmul_rows<true, scalar_t>(problem, m, n, out.data_ptr<scalar_t>());
    } else {
      matmul_rows<false, scalar_t>(problem, m, n, out.data_ptr<scalar_t>());
    }
  });
  return out;
}

at::Tensor gguf_q4_matmul(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scale,
                          const at::Tensor& minimum) {
  return block_matmul(x, nibbles, scale, minimum, true);
}

at::Tensor gguf_q8_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  return block_matmul(x, q, scale, c10::nullopt, false);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixcache, m) {
  m.def("gguf_q4_matmul(Tensor x, Tensor nibbles, Tensor scale, Tensor minimum) -> Tensor");
  m.def("gguf_q8_matmul(Tensor x, Tensor q, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, m) {
  m.impl("gguf_q4_matmul", &gguf_q4_matmul);
  m.impl("gguf_q8_matmul", &gguf_q8_matmul);
}
