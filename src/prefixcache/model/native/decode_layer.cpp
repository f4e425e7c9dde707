// A whole pre-norm decoder layer of a decode step in one call, for the common layer (Llama's: fused QKV without
// norms or gates, RoPE on every dim, SwiGLU) with GGUF-packed weights: the residual add and norm, the QKV product,
// RoPE and the K/V write, paged attention, the output product, the second add and norm, gate-up, silu-and-mul and
// down, each by the same kernel the layer's modules call, in the same order and on the same tensors, so the
// results are the same bit for bit.
//
// Why: at batch 1 a layer's kernels take about 100 us and eager PyTorch spends 40-90 us more between them (about
// 10 Python calls into ops and 8 module calls a layer, for 30 layers a step). Here the kernels are called from C++
// through the dispatcher's typed handles (found once), so an eager decode step costs what a compiled one does.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

namespace {

// The packed weights' bytes per block of 16 rows x 32 weights (gguf_matmul.cpp): which kernel a weight takes.
constexpr int64_t kQ4BlockBytes = 320;
constexpr int64_t kQ8BlockBytes = 544;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Matmul = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);

bool packed_tiles(const at::Tensor& packed) {
  return packed.dim() == 3 && packed.scalar_type() == at::kByte &&
         (packed.size(2) == kQ4BlockBytes || packed.size(2) == kQ8BlockBytes);
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  static const auto q4 = find_op<Matmul>("prefixcache::gguf_q4_matmul");
  static const auto q8 = find_op<Matmul>("prefixcache::gguf_q8_matmul");
  return (packed.size(2) == kQ4BlockBytes ? q4 : q8).call(x, packed, n);
}

// x [B, hidden] (the layer's input; its norm is written into it unless first), residual [B, hidden] (the stream
// before the layer; at the first layer x itself, which is then not written). weights: packed qkv, o, gate-up, down
// and out_features their output sizes. Returns the MLP's output; residual holds the stream after attention, as
// DecoderLayer.forward returns them.
at::Tensor gguf_decode_layer_(at::Tensor& x, at::Tensor& residual, bool first, const at::Tensor& input_norm,
                              const at::Tensor& post_norm, double eps, bool unit_offset, at::TensorList weights,
                              at::IntArrayRef out_features, int64_t heads, int64_t kv_heads, at::Tensor& k_cache,
                              at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& cos,
                              const at::Tensor& signed_sin, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, double scale, std::optional<int64_t> window) {
  static const auto rms_norm = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, double, bool)>(
      "prefixcache::rms_norm");
  static const auto add_rms_norm =
      find_op<void(at::Tensor&, at::Tensor&, const at::Tensor&, double, bool)>("prefixcache::add_rms_norm_");
  static const auto rotary_kv_write = find_op<void(at::Tensor&, at::Tensor&, const at::Tensor&, at::Tensor&,
                                                   at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   const at::Tensor&)>("prefixcache::rotary_kv_write_");
  static const auto attention =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, double, std::optional<int64_t>, const std::optional<at::Tensor>&,
                         const std::optional<at::Tensor>&)>("prefixcache::paged_decode_attention");
  static const auto silu_and_mul = find_op<at::Tensor(const at::Tensor&)>("prefixcache::silu_and_mul");
  // The weights are checked before anything is written; each kernel checks its own inputs, as when the modules call it.
  TORCH_CHECK(weights.size() == 4 && out_features.size() == 4,
              "prefixcache::gguf_decode_layer: expected the qkv, o, gate-up and down weights and their 4 sizes");
  for (const at::Tensor& packed : weights) {
    TORCH_CHECK(packed_tiles(packed),
                "prefixcache::gguf_decode_layer: weights must be packed GGUF tiles uint8 [N / 16, K / 32, 320 or "
                "544], got ",
                packed.sizes());
  }
  TORCH_CHECK(x.dim() == 2 && kv_heads > 0 && heads % kv_heads == 0 &&
                  out_features[0] % (heads + 2 * kv_heads) == 0,
              "prefixcache::gguf_decode_layer: x must be [tokens, hidden] and qkv's ", out_features[0],
              " outputs the heads' ", heads, " + 2 x ", kv_heads);
  TORCH_CHECK(!first || x.is_same(residual), "prefixcache::gguf_decode_layer: the first layer's residual is x");
  const int64_t tokens = x.size(0), head_dim = out_features[0] / (heads + 2 * kv_heads);
  const at::Tensor normed = first ? rms_norm.call(x, input_norm, eps, unit_offset) : x;
  if (!first) add_rms_norm.call(x, residual, input_norm, eps, unit_offset);
  const at::Tensor qkv = gguf_linear(normed, weights[0], out_features[0]).view({tokens, -1, head_dim});
  at::Tensor q = qkv.narrow(1, 0, heads), k = qkv.narrow(1, heads, kv_heads);
  const at::Tensor v = qkv.narrow(1, heads + kv_heads, kv_heads);
  rotary_kv_write.call(q, k, v, k_cache, v_cache, slot_mapping, cos, signed_sin);
  const at::Tensor attended =
      attention.call(q, k_cache, v_cache, block_tables, seq_lens, scale, window, std::nullopt, std::nullopt);
  at::Tensor mixed = gguf_linear(attended, weights[1], out_features[1]);
  add_rms_norm.call(mixed, residual, post_norm, eps, unit_offset);
  const at::Tensor gate_up = gguf_linear(mixed, weights[2], out_features[2]);
  return gguf_linear(silu_and_mul.call(gate_up), weights[3], out_features[3]);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixcache, m) {
  m.def(
      "gguf_decode_layer_(Tensor(a!) x, Tensor(b!) residual, bool first, Tensor input_norm, Tensor post_norm, "
      "float eps, bool unit_offset, Tensor[] weights, int[] out_features, int heads, int kv_heads, "
      "Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping, Tensor cos, Tensor signed_sin, "
      "Tensor block_tables, Tensor seq_lens, float scale, int? window) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, m) { m.impl("gguf_decode_layer_", &gguf_decode_layer_); }
