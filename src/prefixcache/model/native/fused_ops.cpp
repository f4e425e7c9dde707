// Fused elementwise ops of a decoder layer: RMSNorm (alone, or with the residual add before it, in place),
// RoPE on a head tensor in place (alone, or of Q and K with the K/V cache write after it), and the gated MLP's
// activation (SiLU or tanh-GELU of the gate times up); and the sampler's greedy pick, the argmax of each row of
// the logits (read in their own dtype: no float32 copy first).
//
// At batch 1 each of these is several torch ops of a few microseconds of dispatch each over a few hundred
// elements; here each is one call. The math is the torch fallback's in model/decoder.py, op for op: every value
// the fallback rounds to the tensor's dtype (bfloat16, float16) is rounded here at the same point, products and
// sums are separate instructions (no fused multiply-add), and exp / tanh are SLEEF's, as ATen's vectorized CPU
// kernels use. What may differ is the order of the RMSNorm's sum of squares (a float32 rounding, ~1e-7).
// Each row (token, or token and head) is computed alone, so a row's result never depends on the batch around it
// or on the threads; rows are split over threads (at::parallel_for) only when there are many.

#include <ATen/ATen.h>

#include "elements.h"
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include <sleef.h>
#define PREFIXCACHE_FUSED_AVX512 1
#endif

// The fallback rounds each product before the sum: no contraction into fused multiply-adds (g++ contracts at -O3).
#pragma GCC optimize("fp-contract=off")

// float32, bfloat16 and float16 (the decoder runs float64 on torch's ops).
#define DISPATCH_FUSED(TYPE, NAME, ...)                                                                   \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                               \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace {

// Elements a thread takes at least before at::parallel_for splits rows (a decode step's rows stay on one thread).
constexpr int64_t kGrainElements = 1 << 15;

// Rows of a tensor whose last dim is contiguous: the leading dims, each with its stride (any layout: a view of
// the fused QKV projection's output is strided across tokens).
struct Rows {
  int64_t count = 1;
  int64_t width = 0;
  int64_t sizes[4] = {1, 1, 1, 1};
  int64_t strides[4] = {0, 0, 0, 0};
  int dims = 0;

  explicit Rows(const at::Tensor& t) {
    TORCH_CHECK(t.dim() >= 1 && t.dim() <= 5, "prefixcache fused ops take 1 to 5 dims, got ", t.dim());
    TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) == 1, "prefixcache fused ops need the last dim contiguous");
    width = t.size(-1);
    dims = static_cast<int>(t.dim()) - 1;
    for (int d = 0; d < dims; ++d) {
      sizes[d] = t.size(d);
      strides[d] = t.stride(d);
      count *= sizes[d];
    }
  }

  // Row ``r``'s element offset and its index in each leading dim (row-major), and then the next rows' by steps:
  // finding an offset costs an integer division a dim, more than a head's RoPE of 64 elements, so threads
  // walking short rows take one Cursor and step it.
  struct Cursor {
    const Rows& rows;
    int64_t offset = 0;
    int64_t index[4] = {0, 0, 0, 0};

    Cursor(const Rows& rows, int64_t r) : rows(rows) {
      for (int d = rows.dims - 1; d >= 0; --d) {
        index[d] = r % rows.sizes[d];
        offset += index[d] * rows.strides[d];
        r /= rows.sizes[d];
      }
    }

    void next() {
      for (int d = rows.dims - 1; d >= 0; --d) {
        offset += rows.strides[d];
        if (++index[d] < rows.sizes[d] || d == 0) return;
        offset -= index[d] * rows.strides[d];
        index[d] = 0;
      }
    }
  };

  int64_t offset(int64_t r) const { return Cursor(*this, r).offset; }
};

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(width, 1)); }

// Scalar conversions (the portable path, and per element where vectors do not fit).
using prefixcache_native::to_float;
// ``v`` rounded to T and back: what the fallback's intermediate tensor of dtype T holds.
template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

#ifdef PREFIXCACHE_FUSED_AVX512
// 16 floats from ``n`` (<= 16) elements of T; the rest of the lanes zero.
inline __mmask16 lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

inline __m512 load(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(lanes(n), p); }
inline __m512 load(const at::BFloat16* p, int64_t n) {
  __m256i bits = _mm256_maskz_loadu_epi16(lanes(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load(const at::Half* p, int64_t n) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes(n), p)); }

// bfloat16 rounding as c10's (round to nearest even; NaN to the canonical quiet NaN): the float's bits, low 16 zero.
inline __m512i bf16_bits(__m512 v) {
  __m512i i = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(i, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC00000));
}

inline void store(float* p, __m512 v, int64_t n) { _mm512_mask_storeu_ps(p, lanes(n), v); }
// Where the host has AVX512-BF16, by its conversion (vcvtneps2bf16: 2 instructions, not bf16_bits' 7 and a
// narrowing 2): it rounds to nearest even as c10 does, except for NaNs (it keeps the payload) and denormals (it
// flushes them to zero), so a vector holding one of those (rare) takes bf16_bits. In silu_and_mul the rounding
// emulation is a quarter of the op's time; this store is most of what it costs.
inline void store(at::BFloat16* p, __m512 v, int64_t n) {
#ifdef __AVX512BF16__
  constexpr int kNanOrDenormal = 0x01 | 0x20 | 0x80;  // vfpclassps: quiet NaN, denormal, signalling NaN
  if (!_mm512_fpclass_ps_mask(v, kNanOrDenormal)) {
    _mm256_mask_storeu_epi16(p, lanes(n), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    return;
  }
#endif
  _mm256_mask_storeu_epi16(p, lanes(n), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16)));
}
inline void store(at::Half* p, __m512 v, int64_t n) {
  _mm256_mask_storeu_epi16(p, lanes(n), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <typename T>
inline __m512 round_to(__m512 v);
template <>
inline __m512 round_to<float>(__m512 v) {
  return v;
}
template <>
inline __m512 round_to<at::BFloat16>(__m512 v) {
  return _mm512_castsi512_ps(bf16_bits(v));
}
template <>
inline __m512 round_to<at::Half>(__m512 v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

// ---- RMSNorm ---------------------------------------------------------------------------------------------------

// 1 / sqrt(mean(x^2) + eps) of one row, from float32 values (``x`` already in T's precision).
template <typename T>
inline float inverse_rms(const T* x, int64_t n, float eps) {
  float sum = 0.f;
  int64_t i = 0;
#ifdef PREFIXCACHE_FUSED_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; i < n; i += 16) {
    __m512 v = load(x + i, n - i);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  sum = _mm512_reduce_add_ps(acc);
#else
  for (; i < n; ++i) {
    float v = to_float(x[i]);
    sum += v * v;
  }
#endif
  float mean = sum / static_cast<float>(n);
  return 1.f / std::sqrt(mean + eps);
}

// out = the normed row, as the fallback computes it: Llama's ``weight * T(x * r)``, Gemma's ``T(x * r * (1 + w))``.
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float r, bool unit_offset) {
#ifdef PREFIXCACHE_FUSED_AVX512
  const __m512 vr = _mm512_set1_ps(r);
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    int64_t m = n - i;
    __m512 y = _mm512_mul_ps(load(x + i, m), vr);
    __m512 wv = load(w + i, m);
    store(out + i, unit_offset ? _mm512_mul_ps(y, _mm512_add_ps(one, wv)) : _mm512_mul_ps(wv, round_to<T>(y)), m);
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    float y = to_float(x[i]) * r;
    float wv = to_float(w[i]);
    out[i] = static_cast<T>(unit_offset ? y * (1.f + wv) : wv * round_to<T>(y));
  }
#endif
}

void check_norm_weight(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "prefixcache::rms_norm runs on CPU tensors");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous(),
              "prefixcache::rms_norm: weight must be contiguous [", x.size(-1), "]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "prefixcache::rms_norm: weight dtype ", weight.scalar_type(),
              " differs from the input's ", x.scalar_type());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  check_norm_weight(x, weight);
  Rows rows(x);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n = rows.width;
  DISPATCH_FUSED(x.scalar_type(), "prefixcache_rms_norm", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows.count, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = xp + rows.offset(r);
        norm_row(row, wp, op + r * n, n, inverse_rms(row, n, static_cast<float>(eps)), unit_offset);
      }
    });
  });
  return out;
}

// residual = T(x + residual); x = norm(residual): the residual stream's add and the next norm in one pass each.
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps, bool unit_offset) {
  check_norm_weight(x, weight);
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "prefixcache::add_rms_norm_: x and residual must have one shape and dtype");
  Rows xr(x), rr(residual);
  const int64_t n = xr.width;
  DISPATCH_FUSED(x.scalar_type(), "prefixcache_add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    at::parallel_for(0, xr.count, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* xrow = xp + xr.offset(r);
        scalar_t* rrow = rp + rr.offset(r);
#ifdef PREFIXCACHE_FUSED_AVX512
        for (int64_t i = 0; i < n; i += 16) {
          int64_t m = n - i;
          store(rrow + i, _mm512_add_ps(load(xrow + i, m), load(rrow + i, m)), m);
        }
#else
        for (int64_t i = 0; i < n; ++i) rrow[i] = static_cast<scalar_t>(to_float(xrow[i]) + to_float(rrow[i]));
#endif
        norm_row(rrow, wp, xrow, n, inverse_rms(rrow, n, static_cast<float>(eps)), unit_offset);
      }
    });
  });
}

// ---- RoPE ------------------------------------------------------------------------------------------------------

// Checks that cos / signed sin [T, 1, R] (or [T, R]) rotate the first R dims of each head of x [T, heads, head_dim].
void check_rotary(const char* op, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.device().is_cpu(), "prefixcache::", op, " runs on CPU tensors");
  TORCH_CHECK(x.dim() == 3, "prefixcache::", op, ": x must be [tokens, heads, head_dim]");
  TORCH_CHECK(cos.sizes() == signed_sin.sizes() && cos.strides() == signed_sin.strides(), "prefixcache::", op,
              ": cos and sin must have one shape and layout");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && signed_sin.scalar_type() == x.scalar_type(), "prefixcache::",
              op, ": cos and sin must be in x's dtype");
  TORCH_CHECK((cos.dim() == 3 && cos.size(1) == 1) || cos.dim() == 2, "prefixcache::", op,
              ": cos must be [tokens, 1, rotary_dim] or [tokens, rotary_dim]");
  const int64_t rotary = cos.size(-1);
  TORCH_CHECK(cos.size(0) == x.size(0) && rotary % 2 == 0 && rotary <= x.size(2) && cos.stride(-1) == 1,
              "prefixcache::", op, ": cos must hold an even rotary_dim <= head_dim for each token");
}

// x [T, heads, head_dim] rotated in place on its first R dims by cos / signed sin [T, 1, R] (or [T, R]): HF's
// ``x * cos + rotate_half(x) * sin`` with the halves of R as the (real, imaginary) pairs, written as the fallback's
// ``x * cos + roll(x) * signed_sin`` (signed_sin = cat(-sin, sin)), each product and the sum rounded to T.
template <typename T>
void rotate_rows(at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), rotary = cos.size(-1), half = rotary / 2;
  Rows rows(x);
  const int64_t cos_stride = cos.stride(0);
  T* xp = x.data_ptr<T>();
  const T* cp = cos.const_data_ptr<T>();
  const T* sp = signed_sin.const_data_ptr<T>();
  at::parallel_for(0, tokens * heads, grain_rows(rotary), [&](int64_t begin, int64_t end) {
    Rows::Cursor at(rows, begin);
    for (int64_t r = begin; r < end; ++r, at.next()) {
      T* row = xp + at.offset;
      const T* c = cp + at.index[0] * cos_stride;  // the row's token
      const T* s = sp + at.index[0] * cos_stride;
#ifdef PREFIXCACHE_FUSED_AVX512
      for (int64_t i = 0; i < half; i += 16) {
        int64_t m = half - i;
        __m512 lo = load(row + i, m), hi = load(row + half + i, m);
        __m512 new_lo = _mm512_add_ps(round_to<T>(_mm512_mul_ps(lo, load(c + i, m))),
                                      round_to<T>(_mm512_mul_ps(hi, load(s + i, m))));
        __m512 new_hi = _mm512_add_ps(round_to<T>(_mm512_mul_ps(hi, load(c + half + i, m))),
                                      round_to<T>(_mm512_mul_ps(lo, load(s + half + i, m))));
        store(row + i, new_lo, m);
        store(row + half + i, new_hi, m);
      }
#else
      for (int64_t i = 0; i < half; ++i) {
        float lo = to_float(row[i]), hi = to_float(row[half + i]);
        float new_lo = round_to<T>(lo * to_float(c[i])) + round_to<T>(hi * to_float(s[i]));
        float new_hi = round_to<T>(hi * to_float(c[half + i])) + round_to<T>(lo * to_float(s[half + i]));
        row[i] = static_cast<T>(new_lo);
        row[half + i] = static_cast<T>(new_hi);
      }
#endif
    }
  });
}

void rotary_embedding_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  check_rotary("rotary_embedding_", x, cos, signed_sin);
  DISPATCH_FUSED(x.scalar_type(), "prefixcache_rotary", [&] { rotate_rows<scalar_t>(x, cos, signed_sin); });
}

// A layer's RoPE and K/V cache write in one call: q [T, heads, D] and k [T, kv_heads, D] rotated in place (as
// rotary_embedding_), then token t's k and v rows copied to row slot_mapping[t] of the caches [blocks, block_size,
// kv_heads, D] (as the fallback's ``index_copy_`` of the caches viewed as [blocks * block_size, kv_heads, D]).
void rotary_kv_write_(at::Tensor& q, at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                      const at::Tensor& slot_mapping, const at::Tensor& cos, const at::Tensor& signed_sin) {
  check_rotary("rotary_kv_write_", q, cos, signed_sin);
  check_rotary("rotary_kv_write_", k, cos, signed_sin);
  TORCH_CHECK(v.dim() == 3 && v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type() && v.device().is_cpu(),
              "prefixcache::rotary_kv_write_: v must be CPU [tokens, kv_heads, head_dim] in k's dtype");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "prefixcache::rotary_kv_write_: q and k must have one dtype");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "prefixcache::rotary_kv_write_: the caches must be contiguous CPU [blocks, block_size, kv_heads, "
              "head_dim]");
  TORCH_CHECK(k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2),
              "prefixcache::rotary_kv_write_: the caches' heads and head_dim must be k's");
  TORCH_CHECK(k_cache.scalar_type() == k.scalar_type() && v_cache.scalar_type() == k.scalar_type(),
              "prefixcache::rotary_kv_write_: the caches must be in k's dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.device().is_cpu(),
              "prefixcache::rotary_kv_write_: slot_mapping must be CPU int64 [tokens]");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const int64_t tokens = k.size(0), kv_heads = k.size(1), head_dim = k.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "prefixcache::rotary_kv_write_: slot ", sp[t], " of token ", t,
                " is outside the cache's ", num_slots);
  }
  DISPATCH_FUSED(q.scalar_type(), "prefixcache_rotary_kv_write", [&] {
    using T = scalar_t;
    rotate_rows<T>(q, cos, signed_sin);
    rotate_rows<T>(k, cos, signed_sin);
    Rows k_rows(k), v_rows(v);
    const T* kp = k.const_data_ptr<T>();
    const T* vp = v.const_data_ptr<T>();
    T* kc = k_cache.data_ptr<T>();
    T* vc = v_cache.data_ptr<T>();
    at::parallel_for(0, tokens * kv_heads, grain_rows(2 * head_dim), [&](int64_t begin, int64_t end) {
      Rows::Cursor k_at(k_rows, begin), v_at(v_rows, begin);
      for (int64_t r = begin; r < end; ++r, k_at.next(), v_at.next()) {
        const int64_t dst = (sp[k_at.index[0]] * kv_heads + k_at.index[1]) * head_dim;  // token, head
        std::copy_n(kp + k_at.offset, head_dim, kc + dst);
        std::copy_n(vp + v_at.offset, head_dim, vc + dst);
      }
    });
  });
}

// ---- gated activations -----------------------------------------------------------------------------------------

// ATen's formulas (its vectorized CPU kernels): silu(x) = x / (1 + exp(-x)); tanh-GELU(x) =
// 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))).
struct Silu {
#ifdef PREFIXCACHE_FUSED_AVX512
  static __m512 apply(__m512 x) {
    __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), x));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  }
#endif
  static float apply(float x) { return x / (1.f + std::exp(-x)); }
};

struct GeluTanh {
  // sqrt(2) * 2/sqrt(pi) * 0.5 = sqrt(2/pi), in double and then rounded, as ATen's kBetaVec
  static constexpr float kBeta = static_cast<float>(1.41421356237309504880 * 1.12837916709551257390 * 0.5);
  static constexpr float kKappa = 0.044715f;
#ifdef PREFIXCACHE_FUSED_AVX512
  static __m512 apply(__m512 x) {
    __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    __m512 inner = _mm512_mul_ps(_mm512_set1_ps(kBeta), _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(kKappa), cube)));
    __m512 half_x = _mm512_mul_ps(_mm512_set1_ps(0.5f), x);
    return _mm512_mul_ps(half_x, _mm512_add_ps(_mm512_set1_ps(1.f), Sleef_tanhf16_u10(inner)));
  }
#endif
  static float apply(float x) {
    float inner = kBeta * (x + kKappa * (x * x * x));
    return 0.5f * x * (1.f + std::tanh(inner));
  }
};

// [..., 2I] (gate, then up) -> [..., I]: T(T(act(gate)) * up), as the fallback's ``act(gate) * up``.
template <typename Act>
at::Tensor act_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "prefixcache gated activations run on CPU tensors");
  TORCH_CHECK(x.size(-1) % 2 == 0, "prefixcache gated activations need gate and up: an even last dim");
  Rows rows(x);
  const int64_t n = rows.width / 2;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  DISPATCH_FUSED(x.scalar_type(), "prefixcache_act_and_mul", [&] {
    using T = scalar_t;
    const T* xp = x.const_data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows.count, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = xp + rows.offset(r);
        const T* up = gate + n;
        T* o = op + r * n;
#ifdef PREFIXCACHE_FUSED_AVX512
        for (int64_t i = 0; i < n; i += 16) {
          int64_t m = n - i;
          store(o + i, _mm512_mul_ps(round_to<T>(Act::apply(load(gate + i, m))), load(up + i, m)), m);
        }
#else
        for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(round_to<T>(Act::apply(to_float(gate[i]))) * to_float(up[i]));
#endif
      }
    });
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& x) { return act_and_mul<Silu>(x); }
at::Tensor gelu_tanh_and_mul(const at::Tensor& x) { return act_and_mul<GeluTanh>(x); }

// ---- greedy sampling -------------------------------------------------------------------------------------------

// Index of the first maximum of x[0, n) (n >= 1), as torch's argmax picks it: equal values (-0 and +0 included)
// keep the first, and a NaN is greater than any number (the first NaN wins).
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
#ifdef PREFIXCACHE_FUSED_AVX512
  // Four independent per-lane (best value, its first index) pairs, chunk j going to pair j % 4, so that the
  // compare-and-blend chains overlap; each lane's pair is the first maximum of the elements it saw.
  constexpr int kPairs = 4;
  __m512 best[kPairs];
  __m512i where[kPairs];
  for (int p = 0; p < kPairs; ++p) {
    best[p] = _mm512_set1_ps(-INFINITY);
    where[p] = _mm512_set1_epi32(INT32_MAX);
  }
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t i = 0; i < n; i += 16 * kPairs) {
    for (int p = 0; p < kPairs; ++p) {
      const int64_t at = i + 16 * p;
      if (at >= n) break;
      const __mmask16 valid = lanes(n - at);
      const __m512 v = load(x + at, n - at);
      const __mmask16 nan = _mm512_mask_cmp_ps_mask(valid, v, v, _CMP_UNORD_Q);
      if (nan) return at + __builtin_ctz(nan);
      const __mmask16 take = _mm512_mask_cmp_ps_mask(valid, v, best[p], _CMP_GT_OQ);
      best[p] = _mm512_mask_mov_ps(best[p], take, v);
      where[p] = _mm512_mask_mov_epi32(where[p], take, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(at)), iota));
    }
  }
  // The maximum over all lanes, then the least index that holds it; no lane took a value when all are -inf (the
  // pairs start there), and then the first is the answer.
  __m512 top = best[0];
  for (int p = 1; p < kPairs; ++p) top = _mm512_max_ps(top, best[p]);
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512i first = _mm512_set1_epi32(INT32_MAX);
  for (int p = 0; p < kPairs; ++p) {
    first = _mm512_mask_min_epi32(first, _mm512_cmp_ps_mask(best[p], m, _CMP_EQ_OQ), first, where[p]);
  }
  const int32_t arg = _mm512_reduce_min_epi32(first);
  return arg == INT32_MAX ? 0 : arg;
#else
  int64_t arg = 0;
  float best = to_float(x[0]);
  if (std::isnan(best)) return 0;
  for (int64_t i = 1; i < n; ++i) {
    const float v = to_float(x[i]);
    if (std::isnan(v)) return i;
    if (v > best) {
      best = v;
      arg = i;
    }
  }
  return arg;
#endif
}

// logits [rows, vocab] (the last dim contiguous) -> int64 [rows]: each row's argmax, rows split over threads.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu(), "prefixcache::argmax_rows runs on CPU tensors");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.size(1) < INT32_MAX,
              "prefixcache::argmax_rows takes [rows, vocab] with 0 < vocab < 2^31");
  Rows rows(logits);
  const int64_t n = rows.width;
  at::Tensor out = at::empty({rows.count}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  DISPATCH_FUSED(logits.scalar_type(), "prefixcache_argmax_rows", [&] {
    const scalar_t* xp = logits.const_data_ptr<scalar_t>();
    at::parallel_for(0, rows.count, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + rows.offset(r), n);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixcache, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, bool unit_offset) -> ()");
  m.def("rotary_embedding_(Tensor(a!) x, Tensor cos, Tensor signed_sin) -> ()");
  m.def(
      "rotary_kv_write_(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor(c!) k_cache, Tensor(d!) v_cache, "
      "Tensor slot_mapping, Tensor cos, Tensor signed_sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rotary_embedding_", &rotary_embedding_);
  m.impl("rotary_kv_write_", &rotary_kv_write_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("argmax_rows", &argmax_rows);
}
