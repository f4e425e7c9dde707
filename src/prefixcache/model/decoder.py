"""One configurable decoder for every supported architecture (Llama, Mistral, Qwen2, Qwen3, Gemma 3, and the
hybrids Qwen3.5, Granite 4.0-H and LFM2) on a paged KV cache and, for the hybrids' recurrent layers, a state cache.

The architectures differ only in settings of :class:`~prefixcache.model.config.ModelConfig`: biases, q/k
norms, Gemma's norm layout and embedding scale, the MLP activation, per-layer sliding windows and RoPE bases,
partial RoPE and gated attention (Qwen3.5), Granite's multipliers, and which layers are recurrent
(:mod:`prefixcache.model.recurrent`).
The math mirrors HF transformers' implementation op for op (RMSNorm in float32, RoPE cos/sin computed in
float32 then cast, SDPA with the same scale) so that logits match it. Q/K/V and gate/up projections are fused
into one matmul each; :meth:`DecoderForCausalLM.load_weights` maps HF's separate weights onto them.
"""

from __future__ import annotations

import logging
import math
import time
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.model.attention import (
    AttentionMetadata,
    DecodeAttention,
    DecodeInputs,
    GatherWorkspace,
    write_kv_cache,
)
from prefixcache.model.config import SUPPORTED_ARCHITECTURES, KVCacheGroup, ModelConfig
from prefixcache.model.cpu_linear import OneDNNLinear, linear_layout, pack_linears
from prefixcache.model.native import native_ops
from prefixcache.model.pages import huge_page_bytes
from prefixcache.model.recurrent import RECURRENT_MODULE_NAMES, build_recurrent_layer, state_dtype
from prefixcache.model.state import StateMetadata

logger = logging.getLogger(__name__)

# The state cache: per recurrent layer (in ``config.state_layers`` order) its tensors, slot-major.
StateCache = list[tuple[torch.Tensor, ...]]

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}
# prefixcache's fused CPU kernel (model/native/fused_ops.cpp) of ``act(gate) * up`` for each activation.
_FUSED_ACTIVATIONS = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul"}
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Positions a RoPE table holds at first; it doubles whenever a step reaches past its end.
_ROPE_TABLE_ROWS = 4096


def fused_ops_loaded() -> bool:
    """Whether the norms, RoPE and gated activations can run as prefixcache's fused CPU kernels (one call each
    instead of 3-8 torch ops, which at batch 1 cost more in dispatch than in arithmetic).

    Modules decide once, at construction; each call then also needs a CPU tensor of a dtype the kernels take
    (:func:`_runs_fused`), else the torch code runs: other devices, float64, or no kernels (``native_ops()`` is
    None: no compiler, ``PREFIXCACHE_NATIVE_KERNELS=0``).
    """
    if native_ops() is None:
        return False
    _register_fused_fakes()
    return True


def _runs_fused(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _FUSED_DTYPES


@cache
def _register_fused_fakes() -> None:
    """The kernels' shapes without running them (fake impls), so that ``torch.compile`` traces them as opaque ops
    in a compiled step; the in-place ones return nothing (their schemas declare what they mutate)."""
    register = torch.library.register_fake
    register("prefixcache::rms_norm")(
        lambda x, weight, eps, unit_offset: torch.empty_like(x, memory_format=torch.contiguous_format)
    )
    register("prefixcache::add_rms_norm_")(lambda x, residual, weight, eps, unit_offset: None)
    register("prefixcache::rotary_embedding_")(lambda x, cos, signed_sin: None)
    register("prefixcache::rotary_kv_write_")(lambda q, k, v, k_cache, v_cache, slot_mapping, cos, signed_sin: None)
    for name in _FUSED_ACTIVATIONS.values():
        register(f"prefixcache::{name}")(lambda x: x.new_empty((*x.shape[:-1], x.shape[-1] // 2)))


def rope_inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """RoPE inverse frequencies (float32, CPU), computed exactly as transformers does."""
    dim = head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as HF does.

    Llama's scales by ``weight`` after casting back; Gemma's (``unit_offset``) by ``1 + weight`` before. On CPU
    it is one call of prefixcache's fused kernel (the same math and roundings; its sum of squares, in another
    order, may differ in float32's last bits), and :meth:`add_forward` adds the residual stream in the same call.
    """

    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if unit_offset else torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset
        self.fused = fused_ops_loaded()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and _runs_fused(x) and self.weight.dtype == x.dtype:
            return torch.ops.prefixcache.rms_norm(x, self.weight, self.eps, self.unit_offset)
        return self._torch_forward(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: a pre-norm layer's residual add and the norm after it. The
        fused kernel computes them in place (the sum into ``residual``, its norm into ``x``), so both must be the
        step's own tensors."""
        if self.fused and _runs_fused(x) and self.weight.dtype == x.dtype:
            torch.ops.prefixcache.add_rms_norm_(x, residual, self.weight, self.eps, self.unit_offset)
            return x, residual
        residual = x + residual
        return self._torch_forward(residual), residual

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        # F.rms_norm computes x * rsqrt(mean(x^2) + eps), HF's ops in HF's order, in one call.
        x32 = F.rms_norm(x.to(torch.float32), self.weight.shape, eps=self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's RoPE ``x * cos + rotate_half(x) * sin``, where the halves of head_dim form the (real, imaginary)
    pairs and ``rotate_half(x) = cat(-x2, x1)``: written as ``roll(x) * cat(-sin, sin)``, the same products
    bit for bit (a negation is exact), in four ops instead of seven."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, fused: bool) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of each head of ``x`` ``[T, heads, head_dim]`` (all of them, or
    partial RoPE's); the rest pass through. With ``fused`` (a module's :func:`fused_ops_loaded`), on CPU,
    prefixcache's kernel rotates ``x`` in place, the same values bit for bit: ``x`` must be the step's own."""
    if fused and _runs_fused(x):
        torch.ops.prefixcache.rotary_embedding_(x, cos, signed_sin)
        return x
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return apply_rope(x, cos, signed_sin)
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((apply_rope(rotated, cos, signed_sin), passed), dim=-1)


class DecoderAttention(nn.Module):
    """GQA self-attention with one fused QKV matmul; K/V go to the paged cache (see paged_attention).

    With ``qk_norm`` each head's query and key are RMS-normed before RoPE (Qwen3, Gemma 3, Qwen3.5, LFM2). With
    ``attention_output_gate`` (Qwen3.5) q_proj yields each head's query followed by its gate, and the output is
    multiplied by ``sigmoid(gate)``. RoPE rotates the first ``rotary_dim`` dims of each head (all of them but on
    Qwen3.5), or none without ``use_rope``.
    """

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.layer_window(layer)
        self.rotary_dim = config.rotary_dim if config.use_rope else 0
        self.output_gate = config.attention_output_gate
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.split_sizes = [2 * q_size if self.output_gate else q_size, kv_size, kv_size]
        self.head_splits = [config.num_heads, config.num_kv_heads, config.num_kv_heads]
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.split_sizes), bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        self.fused = fused_ops_loaded()
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_unit_offset)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_unit_offset)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata | DecodeAttention,
        workspace: GatherWorkspace | None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        gate = None
        if self.output_gate:
            q_size = self.split_sizes[0]
            q, gate = qkv[:, :q_size].reshape(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            k, v = qkv[:, q_size:].view(num_tokens, 2 * self.num_kv_heads, self.head_dim).chunk(2, dim=1)
            q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        else:
            # the Q, K and V heads side by side in the projection: views of it, in two ops
            heads = qkv.view(num_tokens, -1, self.head_dim)
            q, k, v = heads.split_with_sizes(self.head_splits, dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        k_cache, v_cache = kv_cache
        if self.rotary_dim and self._writes_fused(k, k_cache):
            torch.ops.prefixcache.rotary_kv_write_(q, k, v, k_cache, v_cache, metadata.slot_mapping, cos, sin)
        else:
            if self.rotary_dim == self.head_dim and self.q_norm is None and not self.output_gate:
                # Q and K side by side in the projection: one rotation for both
                qk = heads[:, : self.num_heads + self.num_kv_heads]
                q, k = rotate(qk, cos, sin, self.fused).split_with_sizes(self.head_splits[:2], dim=1)
            elif self.rotary_dim:
                q, k = rotate(q, cos, sin, self.fused), rotate(k, cos, sin, self.fused)
            write_kv_cache(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = metadata.attend(q, k, v, kv_cache, self.scale, self.sliding_window, workspace)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(num_tokens, -1))
        return self.o_proj(out)

    def _writes_fused(self, k: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether RoPE and the K/V write run as one ``rotary_kv_write_`` call (eager, on CPU, the cache in K's
        dtype): the same values bit for bit as :func:`rotate` and :func:`write_kv_cache`, one op a layer instead
        of three. A compiled step takes the torch ops, which inductor fuses into its own kernels: with the opaque
        op in its graph an earlier measurement had the compiled step 1.1x slower."""
        return self.fused and _runs_fused(k) and k_cache.dtype == k.dtype and not torch.compiler.is_compiling()


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with tanh GELU; gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.act = _ACTIVATIONS[config.hidden_act]
        # act(gate) * up in one call on CPU (the same values; tanh-GELU's may differ in float32's last bit)
        self.fused_act = (
            getattr(torch.ops.prefixcache, _FUSED_ACTIVATIONS[config.hidden_act]) if fused_ops_loaded() else None
        )
        self.hidden_act = config.hidden_act
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused_act is not None and _runs_fused(gate_up):
            return self.down_proj(self.fused_act(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


@dataclass(frozen=True, slots=True)
class PackedDecodeLayer:
    """What ``prefixcache::gguf_decode_layer_`` (native/decode_layer.cpp) needs of a layer whose four products
    hold GGUF-packed weights: the packed tensors of its qkv, o, gate-up and down products and their output sizes.
    :func:`~prefixcache.model.quantization.quantize_from_gguf` leaves one on each layer it can run so, once its
    weights are final (nothing replaces or moves them after loading)."""

    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    out_features: tuple[int, int, int, int]


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + mix(norm(x)), then x + mlp(norm(x)); the mixer is attention or, in a hybrid's
    recurrent layers, the recurrent layer (named as in transformers: ``linear_attn``, ``mamba``, ``conv``).

    With ``sandwich_norm`` (Gemma) the attention and MLP outputs are normed too before each residual add; HF
    names those four norms input, post_attention, pre_feedforward and post_feedforward, while Llama's
    ``post_attention_layernorm`` is the norm before the MLP. Granite scales both residual branches by
    ``residual_multiplier``.
    """

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        eps, offset = config.rms_norm_eps, config.norm_unit_offset
        self.is_attention = layer not in config.state_layers
        if self.is_attention:
            self.mixer_name = "self_attn"
            self.self_attn = DecoderAttention(config, layer)
        else:
            self.mixer_name = RECURRENT_MODULE_NAMES[config.layer_types[layer]]
            self.add_module(self.mixer_name, build_recurrent_layer(config, layer))
        self.mlp = GatedMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.residual_multiplier = config.residual_multiplier
        self.sandwich_norm = config.sandwich_norm
        if self.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.packed_decode: PackedDecodeLayer | None = None

    def computes_as_packed_decode(self) -> bool:
        """Whether this layer is the one ``gguf_decode_layer_`` computes: attention with one QKV product, RoPE on
        every dim, no norms or gate inside it; plain pre-norm residuals; SwiGLU; the fused CPU kernels loaded."""
        if not self.is_attention or self.sandwich_norm or self.residual_multiplier is not None:
            return False
        attention, mlp = self.self_attn, self.mlp
        return (
            attention.fused
            and attention.q_norm is None
            and not attention.output_gate
            and attention.rotary_dim == attention.head_dim
            and mlp.hidden_act == "silu"
            and mlp.fused_act is not None
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, *mixer_inputs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the residual stream ``x + residual`` (at the first layer ``x``, the embeddings, and no
        residual); returns the layer's output and the stream before it, whose sum is the stream after it. Each
        residual add is left to the norm after it (:meth:`RMSNorm.add_forward`, one fused call on CPU), which may
        overwrite ``x`` and ``residual``. ``mixer_inputs``: attention's (cos, sin, kv_cache, metadata, workspace)
        or a recurrent layer's (its state tensors, StateMetadata).

        An eager decode step of a layer with :attr:`packed_decode` runs as one ``gguf_decode_layer_`` call: the
        same kernels on the same tensors in the same order (the same results bit for bit), without the Python
        between them, which cost an eager batch-1 step about as much as a third of its kernels."""
        if self.packed_decode is not None and self._decodes_packed(x, *mixer_inputs):
            return self._packed_decode_forward(x, residual, *mixer_inputs)
        if residual is None:
            residual, normed = x, self.input_layernorm(x)
        else:
            normed, residual = self.input_layernorm.add_forward(x, residual)
        mixed = getattr(self, self.mixer_name)(normed, *mixer_inputs)
        if self.sandwich_norm:
            normed, residual = self.pre_feedforward_layernorm.add_forward(
                self.post_attention_layernorm(mixed), residual
            )
            return self.post_feedforward_layernorm(self.mlp(normed)), residual
        if self.residual_multiplier is not None:
            normed, residual = self.post_attention_layernorm.add_forward(mixed * self.residual_multiplier, residual)
            return self.mlp(normed) * self.residual_multiplier, residual
        normed, residual = self.post_attention_layernorm.add_forward(mixed, residual)
        return self.mlp(normed), residual

    def _decodes_packed(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata | DecodeAttention,
        workspace: GatherWorkspace | None,
    ) -> bool:
        """Whether this call is one ``gguf_decode_layer_`` computes as the modules would: an eager decode step
        whose attention is the native kernel's (no prefix attended once for the batch: :func:`_cascade_decode`),
        on CPU tensors of the norms' and the cache's dtype."""
        return (
            not torch.compiler.is_compiling()
            and isinstance(metadata, DecodeAttention)
            and metadata.native
            and metadata.shared_prefix is None
            and _runs_fused(x)
            and x.dtype == kv_cache[0].dtype == self.input_layernorm.weight.dtype
        )

    def _packed_decode_forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: DecodeAttention,
        workspace: GatherWorkspace | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attention, norm, packed = self.self_attn, self.input_layernorm, self.packed_decode
        assert packed is not None
        first = residual is None
        residual = x if residual is None else residual
        out = torch.ops.prefixcache.gguf_decode_layer_(
            x,
            residual,
            first,
            norm.weight,
            self.post_attention_layernorm.weight,
            norm.eps,
            norm.unit_offset,
            packed.weights,
            packed.out_features,
            attention.num_heads,
            attention.num_kv_heads,
            kv_cache[0],
            kv_cache[1],
            metadata.slot_mapping,
            cos,
            sin,
            metadata.block_tables,
            metadata.seq_lens,
            attention.scale,
            attention.sliding_window,
        )
        return out, residual


class DecoderModel(nn.Module):
    """The decoder stack, named like HF's ``model.*`` so checkpoint names map directly."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_unit_offset)


def _with_own_code(method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``method`` bound to a copy of its function under a code object of its own.

    Dynamo keeps the graphs it compiled, and their guards, per code object: with the model's own, the graphs
    compiled for one model are never tried on another model's calls (two engines in one process, a test's second
    model), which is what lets :func:`_guards_on_inputs` drop the guards on the model.
    """
    function = method.__func__  # type: ignore[attr-defined]
    code = function.__code__.replace()  # equal to the original, but another object
    copy = types.FunctionType(code, function.__globals__, None, function.__defaults__, function.__closure__)
    return types.MethodType(copy, method.__self__)  # type: ignore[attr-defined]


def _guards_on_inputs(entries: Sequence[Any]) -> list[bool]:
    """Of a compiled step's guards (dynamo's ``GuardFilterEntry`` s), the ones checked on each call: all but those
    on the model (``self``: its modules' attributes, weights and tables).

    Those are most of them (SmolLM2's step: about 4,000 of 5,000, with a Python check of each norm's eps), and
    they can only fail if the model changed after it was compiled, which nothing does: weights are loaded before
    :meth:`DecoderForCausalLM.compile_decode`, and the modules' settings come from the frozen config. The graphs
    are the model's own (:func:`_with_own_code`). What can differ between calls stays guarded: the inputs' dtypes,
    devices and sizes (a batch of one or more, another K/V pool), the grad and inference modes, the global state.
    """
    return [entry.name != "self" and not entry.name.startswith(("self.", "self[")) for entry in entries]


# HF checkpoint names of the weights stored inside fused parameters: (fused name, shard index).
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "in_proj_qkv": ("in_proj_qkvzba", 0),
    "in_proj_z": ("in_proj_qkvzba", 1),
    "in_proj_b": ("in_proj_qkvzba", 2),
    "in_proj_a": ("in_proj_qkvzba", 3),
}
_FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvzba": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
}
# Checkpoint module paths that differ from ours, per architecture: (transformers' path, ours).
_RENAMED_MODULES: dict[str, tuple[tuple[str, str], ...]] = {
    "Qwen3_5ForConditionalGeneration": (("model.language_model", "model"),),
    # Granite's shared MLP: input_linear is gate and up already fused (loaded whole, see _WHOLE_FUSED).
    "GraniteMoeHybridForCausalLM": (
        ("shared_mlp.input_linear", "mlp.gate_up_proj"),
        ("shared_mlp.output_linear", "mlp.down_proj"),
    ),
    "Lfm2ForCausalLM": (
        ("feed_forward.w1", "mlp.gate_proj"),
        ("feed_forward.w3", "mlp.up_proj"),
        ("feed_forward.w2", "mlp.down_proj"),
        ("operator_norm", "input_layernorm"),
        ("ffn_norm", "post_attention_layernorm"),
        ("self_attn.out_proj", "self_attn.o_proj"),
        ("self_attn.q_layernorm", "self_attn.q_norm"),
        ("self_attn.k_layernorm", "self_attn.k_norm"),
        ("model.embedding_norm", "model.norm"),
    ),
}
# Fused parameters a checkpoint stores already fused, per architecture.
_WHOLE_FUSED: dict[str, frozenset[str]] = {"GraniteMoeHybridForCausalLM": frozenset({"gate_up_proj"})}
# Checkpoint weights the text decoder does not use: Qwen3.5's multi-token-prediction head and vision tower.
_UNUSED_WEIGHT_PREFIXES: dict[str, tuple[str, ...]] = {
    "Qwen3_5ForCausalLM": ("mtp.",),
    "Qwen3_5ForConditionalGeneration": ("mtp.", "model.visual."),
}


def _rename(name: str, renames: Iterable[tuple[str, str]]) -> str:
    """``name`` with each whole dotted module path ``old`` in it replaced by ``new``."""
    dotted = f".{name}."
    for old, new in renames:
        dotted = dotted.replace(f".{old}.", f".{new}.")
    return dotted[1:-1]


class DecoderForCausalLM(nn.Module):
    """Decoder whose attention reads and writes a paged KV cache (see :mod:`prefixcache.model.attention`) and
    whose recurrent layers, in a hybrid, read and write a state cache (see :mod:`prefixcache.model.state`).

    Parameter names follow HF's except for the fused ``qkv_proj``, ``gate_up_proj`` and ``in_proj_qkvzba``, and
    the modules of ``_RENAMED_MODULES``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {config.architecture!r}")
        if not config.is_causal:
            raise ValueError("only causal decoders are implemented")
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # RoPE tables: one per distinct (base, scaling) among the layers (Gemma 3 has two), and each layer's.
        # Plain attributes, not buffers: built on CPU even under a meta-device context, and not part of the
        # state dict; copied to each device the model runs on when first needed.
        ropes = [config.layer_rope(i) for i in range(config.num_layers)]
        distinct = {repr(rope): rope for rope in ropes}  # scaling dicts are not hashable
        keys = list(distinct)
        self._layer_rope = [keys.index(repr(rope)) for rope in ropes]
        self._inv_freq_cpu = [rope_inv_freq(config.rotary_dim, theta, scaling) for theta, scaling in distinct.values()]
        self._rope_tables: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        self._workspace = GatherWorkspace()
        self._decode_step = self._eager_decode_step
        self._static_kv_id: int | None = None  # the K/V list the compiled step has marked (_mark_static_sizes)
        self._compute_logits = self._logits
        # Per KV cache layout, keyed by its number of groups (mask-only: 1; hybrid: len(kv_cache_groups()), the
        # same layout when the model has one attention spec): each attention layer's group, and each group's
        # windows. kv_caches[i] belongs to attention layer attention_layers[i].
        self._layouts: dict[int, tuple[tuple[int, ...], tuple[frozenset[int | None], ...]]] = {}
        for hybrid in (False, True):
            groups = config.kv_cache_groups(hybrid)
            group_of = {layer: g for g, group in enumerate(groups) for layer in group.layers}
            windows = tuple(frozenset(config.layer_window(layer) for layer in group.layers) for group in groups)
            self._layouts[len(groups)] = (tuple(group_of[i] for i in config.attention_layers), windows)
        self._kv_index = {layer: i for i, layer in enumerate(config.attention_layers)}
        self._state_index = {layer: i for i, layer in enumerate(config.state_layers)}

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        group_metadata: Sequence[AttentionMetadata],
        state_cache: StateCache | None = None,
        state_metadata: StateMetadata | None = None,
    ) -> torch.Tensor:
        """Run the step's new tokens ``[T]`` at ``positions`` ``[T]``; returns final-normed hidden ``[T, H]``.

        ``group_metadata`` has one entry per KV cache group of the layout ``kv_caches`` was allocated for
        (``config.kv_cache_groups(hybrid)``, in that order); each attention layer attends with its group's. The
        new tokens' K/V are written into ``kv_caches`` (one (K, V) pair per attention layer) at the group's
        ``slot_mapping`` before attention reads them. A hybrid's recurrent layers continue each request's state
        in ``state_cache`` (``allocate_state_cache``) as ``state_metadata`` says, and leave the saves it asks for.
        """
        config = self.config
        if len(kv_caches) != len(config.attention_layers):
            raise ValueError(f"expected {len(config.attention_layers)} KV cache layers, got {len(kv_caches)}")
        if config.state_layers and (state_cache is None or state_metadata is None):
            raise ValueError(
                f"{config.architecture} has recurrent layers: forward needs state_cache and state_metadata"
            )
        if state_cache is not None and len(state_cache) != len(config.state_layers):
            raise ValueError(f"expected {len(config.state_layers)} recurrent layer states, got {len(state_cache)}")
        layout = self._layouts.get(len(group_metadata))
        if layout is None:
            raise ValueError(
                f"expected one attention metadata per KV cache group ({' or '.join(map(str, self._layouts))} of them), "
                f"got {len(group_metadata)}"
            )
        windows = layout[1]
        for group, metadata in enumerate(group_metadata):
            if metadata.sliding_window is not None and windows[group] != {metadata.sliding_window}:
                raise ValueError(
                    f"KV cache group {group} has layers of windows {sorted(windows[group], key=str)}; its "
                    f"attention metadata gathers a window of {metadata.sliding_window}"
                )
        # the groups' token layout is the same: their positions, and the longest sequence
        ropes = self._rope(positions, group_metadata[0].max_seq_len)
        if not config.state_layers:
            eager = self._decode_step == self._eager_decode_step  # only an eager step attends shared prefixes once
            decode = [metadata.decode_inputs(share_prefixes=eager) for metadata in group_metadata]
            if all(inputs is not None for inputs in decode):
                return self._decode_step(input_ids, ropes, kv_caches, decode)
        return self._step(input_ids, ropes, kv_caches, group_metadata, self._workspace, state_cache, state_metadata)

    def _step(
        self,
        input_ids: torch.Tensor,
        ropes: Sequence[torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        group_metadata: Sequence[AttentionMetadata | DecodeAttention],
        workspace: GatherWorkspace | None,
        state_cache: StateCache | None = None,
        state_metadata: StateMetadata | None = None,
    ) -> torch.Tensor:
        """The layers of :meth:`forward` on checked inputs and the step's rows of the RoPE tables (:meth:`_rope`);
        decode steps may run it compiled (:meth:`compile_decode`), with no workspace (the compiled graph plans its
        own buffers)."""
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale is not None:
            # Rounded to the model dtype first, as HF's Gemma does (sqrt(3072) becomes 55.5 in bfloat16).
            x = x * torch.tensor(self.config.embed_scale, dtype=torch.float32).to(x.dtype)
        cos_sin = [(rows[:, :1], rows[:, 1:]) for rows in ropes]  # [T, 1, rotary_dim] views, once a step
        group_of = self._layouts[len(group_metadata)][0]
        residual = None
        for i, layer in enumerate(self.model.layers):
            if layer.is_attention:
                cos, sin = cos_sin[self._layer_rope[i]]
                kv = self._kv_index[i]
                x, residual = layer(x, residual, cos, sin, kv_caches[kv], group_metadata[group_of[kv]], workspace)
            else:
                x, residual = layer(x, residual, state_cache[self._state_index[i]], state_metadata)  # type: ignore[index]
        return self.model.norm.add_forward(x, residual)[0]

    def _decode(
        self,
        input_ids: torch.Tensor,
        ropes: Sequence[torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        decode: Sequence[DecodeInputs],
        workspace: GatherWorkspace | None,
    ) -> torch.Tensor:
        """A step of decodes only, from each group's :meth:`AttentionMetadata.decode_inputs`."""
        block_size = kv_caches[0][0].shape[1]
        windows = self._layouts[len(decode)][1]
        dtype = self.model.norm.weight.dtype
        attention = [DecodeAttention.build(inputs, block_size, windows[g], dtype) for g, inputs in enumerate(decode)]
        return self._step(input_ids, ropes, kv_caches, attention, workspace)

    def _eager_decode_step(self, *inputs: Any) -> torch.Tensor:
        return self._decode(*inputs, self._workspace)

    def _graph_decode_step(self, *inputs: Any) -> torch.Tensor:
        """The decode step as :meth:`compile_decode` compiles it: no workspace (the graph plans its buffers)."""
        return self._decode(*inputs, None)

    def compile_decode(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], groups: Sequence[KVCacheGroup], block_size: int
    ) -> float | None:
        """Run decode steps and the logits through ``torch.compile`` (inductor) from now on, compiled here; returns
        the seconds compiling took, or None when decode steps stay eager.

        The batch size and the block table width are dynamic dimensions and a decode table is at least two
        blocks wide (:meth:`AttentionMetadata.decode`), so two graphs cover every decode step: one request, and
        more. Both are compiled now, on a decode of block 0, which is zeroed again after (no request holds a
        block yet). Compilation that fails (no C++ compiler, an op inductor cannot trace) logs one warning and the
        steps run eagerly: nothing was written before it failed, and the eager step writes the same K/V. A model
        with recurrent layers or sliding-window groups (``groups``) never takes the decode path: None.
        """
        if self.config.state_layers or any(group.sliding_window is not None for group in groups):
            return None
        device = kv_caches[0][0].device
        self._decode_step = self._compiled(
            "_decode_step",
            "the decode step",
            device,
            self._graph_decode_step,
            self._eager_decode_step,
            self._mark_static_sizes,
        )
        self._compute_logits = self._compiled("_compute_logits", "the logits", device, self._logits, self._logits)
        start = time.perf_counter()
        dtype = self.model.norm.weight.dtype
        import torch._dynamo  # imported by torch.compile (seconds): not at module level, for the eager steps' sake

        # inference mode as the engine's steps run (a tensor's inference mode is part of a graph's key); the modules'
        # floats (norm eps, attention scale) as constants from the start: traced as inputs first, dynamo would turn
        # them into constants on seeing them used and trace the whole step a second time
        with torch.inference_mode(), torch._dynamo.config.patch(specialize_float=True):
            for batch in (1, 2):
                metadata = AttentionMetadata.build([[0]] * batch, [0] * batch, [1] * batch, block_size, device)
                ids = torch.zeros(batch, dtype=torch.long, device=device)
                self(ids, metadata.positions, kv_caches, [metadata] * len(groups))
                self.compute_logits(torch.zeros(batch, self.config.hidden_size, dtype=dtype, device=device))
        for key_cache, value_cache in kv_caches:
            key_cache[0].zero_()
            value_cache[0].zero_()
        return None if self._decode_step == self._eager_decode_step else time.perf_counter() - start

    def _compiled(
        self,
        attribute: str,
        what: str,
        device: torch.device,
        function: Callable[..., torch.Tensor],
        eager: Callable[..., torch.Tensor],
        prepare: Callable[..., None] | None = None,
    ) -> Callable[..., torch.Tensor]:
        """``function`` compiled with dynamic shapes, guarded on its inputs only (:func:`_guards_on_inputs`, under a
        code object of its own: :func:`_with_own_code`); ``prepare`` sees each call's inputs first. When compiling
        fails, one warning and from then on ``eager`` in ``attribute``.

        On a CPU the graph's wrapper is C++ (inductor's ``cpp_wrapper``): a batch-1 step of SmolLM2 calls about
        400 kernels, and the Python wrapper's call of each cost a fifth of the step (5.5 against 4.5 ms a step,
        GGUF, 2 threads), for a cold compile of about 90 s instead of 40 (its cache makes later starts seconds).
        """
        options: dict[str, Any] = {"guard_filter_fn": _guards_on_inputs, "cpp_wrapper": device.type == "cpu"}
        compiled = torch.compile(_with_own_code(function), dynamic=True, options=options)

        def run(*inputs: Any) -> torch.Tensor:
            try:
                if prepare is not None:
                    prepare(*inputs)
                return compiled(*inputs)
            except Exception as exc:  # compilation is an optimisation: any failure falls back to eager
                logger.warning("torch.compile of %s failed, running it eagerly: %s", what, str(exc).split("\n")[0])
                setattr(self, attribute, eager)
                return eager(*inputs)

        return run

    def _mark_static_sizes(self, *inputs: Any) -> None:
        """Mark the sizes of the compiled step's inputs that never change static: the RoPE rows' (cos and sin, the
        rotary size) on every call, and the K/V tensors' but their number of blocks once per list.

        A dynamic size equal to another when traced shares its symbol (duck sizing): the RoPE rows' 2 (cos, sin),
        once specialised, took the block tables' width of 2 with it, so the first request of more than two blocks
        compiled the step again (8 s of a served stream's first 64 tokens, with the graphs cached; a cold compile
        there would take a minute).
        With every size dynamic, each of the 2 x layers K/V tensors adds its sizes and strides to the shape guards,
        which run as Python on every call (about 960 lines for SmolLM2's 60 tensors). With only the number of
        blocks dynamic (one graph for every pool size) a tensor adds one line: its number of blocks is the
        others'. The list is recognised by its id; a new list that reuses a freed one's id leaves its tensors
        unmarked, which their guards see (the step compiles again, never runs a wrong graph).
        """
        import torch._dynamo

        _, ropes, kv_caches, _ = inputs  # the step's (input_ids, ropes, kv_caches, decode)
        for rows in ropes:
            torch._dynamo.mark_static(rows, [1, 2])  # [T, cos and sin, rotary size]
        if id(kv_caches) == self._static_kv_id:
            return
        for key_cache, value_cache in kv_caches:
            torch._dynamo.mark_static(key_cache, [1, 2, 3])  # block size, KV heads, head size
            torch._dynamo.mark_static(value_cache, [1, 2, 3])
        self._static_kv_id = id(kv_caches)

    def _rope(self, positions: torch.Tensor, max_seq_len: int) -> list[torch.Tensor]:
        """The step's rows ``[T, 2, rotary_dim]`` (cos, then signed sin: see :func:`apply_rope`) of each RoPE
        table, one gather a table for every layer, from tables that cover ``max_seq_len`` positions
        (:meth:`_rope_tables_for`)."""
        tables = self._rope_tables_for(positions.device, self.model.norm.weight.dtype, max_seq_len)
        return [table.index_select(0, positions) for table in tables]

    def _rope_tables_for(self, device: torch.device, dtype: torch.dtype, max_seq_len: int) -> list[torch.Tensor]:
        """Per distinct RoPE, cos and signed sin of every position below a power-of-two multiple of
        _ROPE_TABLE_ROWS that covers ``max_seq_len``, ``[N, 2, rotary_dim]`` on ``device`` in ``dtype``: built once
        (and again, twice as long, when a step reaches past the end) instead of in each step.

        Computed in float32 from the positions, then cast (HF's order of ops). A position's values do not depend
        on the table's length or the step's batch: N x rotary_dim is a multiple of torch's vector width, so every
        element takes its vectorized cos and sin (a per-step computation takes a scalar tail where a step's
        elements are no such multiple)."""
        tables = self._rope_tables.get((device, dtype))
        if tables is not None and tables[0].shape[0] >= max_seq_len:
            return tables
        rows = _ROPE_TABLE_ROWS if tables is None else tables[0].shape[0]
        while rows < max_seq_len:
            rows *= 2
        positions = torch.arange(rows, dtype=torch.float32, device=device)[:, None, None]
        tables = []
        for inv_freq in self._inv_freq_cpu:
            freqs = positions * inv_freq.to(device)
            sin = freqs.sin().to(dtype)
            cos = torch.cat((freqs, freqs), dim=-1).cos().to(dtype)
            tables.append(torch.cat((cos, torch.cat((-sin, sin), dim=-1)), dim=1))
        self._rope_tables[(device, dtype)] = tables
        return tables

    @torch.inference_mode()
    def pack_linears(self) -> int:
        """Run the linear layers on weights laid out once for the CPU's kernel (:mod:`prefixcache.model.cpu_linear`)
        where it pays (bfloat16 on a CPU with AMX tiles, float32 on a CPU with MKL), for eager steps only (a
        compiled step cannot lower oneDNN's layout); returns how many layers were packed (0: none, the model is
        unchanged).

        In bfloat16 a tied output projection gets a packed copy of the embedding (the embedding keeps its rows for
        lookups): the vocabulary's product is a step's largest, and packed it took 1.1 against 1.9 ms at batch 1
        and 2.1 against 5.5 at 64 (SmolLM2-135M, 2 threads), for 57 MB more memory.
        """
        norm = self.model.norm.weight
        layout = linear_layout(norm.dtype, norm.device)
        if layout is None:
            return 0
        packed = pack_linears(self, layout)
        tied = self.lm_head is None and type(self.model.embed_tokens) is nn.Embedding  # a quantized one serves both
        if tied and layout is OneDNNLinear:
            self.lm_head = OneDNNLinear(self.model.embed_tokens.weight, None)
            packed += 1
        return packed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` in the model's dtype for the given hidden states (typically each request's last).

        Not float32: the sampler's greedy rows are picked from them as they are, and only the rows that need float32
        values are converted (a batch's float32 copy costs more than picking its greedy tokens)."""
        return self._compute_logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`compute_logits`, which :meth:`compile_decode` compiles too (the output projection is a third of
        a quantized decode step)."""
        # lm_head is a module of its own (or, quantized and tied, the embedding's int8 table).
        logits = F.linear(hidden, self.model.embed_tokens.weight) if self.lm_head is None else self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if self.config.logits_scaling is not None:
            logits = logits / self.config.logits_scaling
        return logits

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        groups: Sequence[KVCacheGroup] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed (K, V) per attention layer (``config.attention_layers``, in order), each ``[num_blocks,
        block_size, num_kv_heads, head_dim]``.

        ``groups`` (default: one group of every attention layer, the mask-only layout) lay the layers out in
        slots: layer ``groups[g].layers[j]`` gets slot j's tensors, shared with the layers at slot j of the other
        groups (a block id belongs to one group at a time). Zeroed rather than empty: masked-out slots and the null
        block still enter the attention matmuls, and uninitialised memory could hold NaN/inf that would
        poison the result (0 * NaN = NaN). On a CPU they lie in huge pages where the OS gives them
        (:func:`~prefixcache.model.pages.huge_page_bytes`): a decode step reads every request's K/V.
        """
        param = self.model.norm.weight  # a float parameter in the model's dtype, even with quantized weights
        dtype = dtype or param.dtype
        device = device or param.device
        groups = self._check_groups(groups)
        shape = (num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
        num_slots = max(len(group.layers) for group in groups)
        nbytes = math.prod(shape) * dtype.itemsize

        def zeroed() -> torch.Tensor:  # each its own storage: no two inputs of a compiled step alias
            if torch.device(device).type == "cpu":
                return huge_page_bytes(nbytes).view(dtype).view(shape)
            return torch.zeros(shape, dtype=dtype, device=device)

        slots = [(zeroed(), zeroed()) for _ in range(num_slots)]
        caches: list[tuple[torch.Tensor, torch.Tensor]] = [slots[0]] * len(self.config.attention_layers)
        for group in groups:
            for slot, layer in enumerate(group.layers):
                caches[self._kv_index[layer]] = slots[slot]
        return caches

    def kv_bytes_per_block(
        self, block_size: int, dtype: torch.dtype | None = None, groups: Sequence[KVCacheGroup] | None = None
    ) -> int:
        """Bytes one block of the pool takes (K and V of each slot), to size the cache from a memory budget.

        A block serves one group, so it spans the largest group's layers; with the default single group, all.
        """
        itemsize = (dtype or self.model.norm.weight.dtype).itemsize
        return self.config.kv_bytes_per_block(block_size, itemsize, tuple(self._check_groups(groups)))

    def _check_groups(self, groups: Sequence[KVCacheGroup] | None) -> Sequence[KVCacheGroup]:
        """The groups (default: the mask-only single group); ValueError unless they hold every attention layer once
        (and no recurrent layer)."""
        if groups is None:
            return self.config.kv_cache_groups(hybrid=False)
        layers = sorted(layer for group in groups for layer in group.layers)
        expected = list(self.config.attention_layers)
        if layers != expected:
            raise ValueError(
                f"KV cache groups must hold each of the {len(expected)} layers once (the attention layers {expected}): "
                f"{groups}"
            )
        return groups

    def state_bytes_per_slot(self, dtype: torch.dtype | None = None) -> int:
        """Bytes one sequence's state takes across all recurrent layers (0 without any): each conv window in
        ``dtype`` (default: the model's) and each matrix state in ``state_dtype(dtype)`` (float32 at least)."""
        return self.config.state_bytes_per_slot((dtype or self.model.embed_tokens.weight.dtype).itemsize)

    def allocate_state_cache(
        self, num_slots: int, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> StateCache:
        """Zeroed state tensors per recurrent layer (``config.state_layers`` order), slot-major: the conv window
        ``[num_slots, kernel - 1, channels]`` in ``dtype`` and, for Gated DeltaNet and Mamba2, the matrix
        state ``[num_slots, heads, ...]`` in float32 (or float64 for a float64 model). A zeroed slot is the state
        before any token."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        param = self.model.embed_tokens.weight
        dtype = dtype or param.dtype
        device = device or param.device
        cache: StateCache = []
        for layer in self.config.state_layers:
            conv, *matrices = self.config.state_shapes(layer)
            tensors = [torch.zeros((num_slots, *conv), dtype=dtype, device=device)]
            tensors += [torch.zeros((num_slots, *shape), dtype=state_dtype(dtype), device=device) for shape in matrices]
            cache.append(tuple(tensors))
        return cache

    @staticmethod
    def copy_states(state_cache: StateCache, src: list[int], dst: list[int]) -> None:
        """Copy slot ``src[i]`` into slot ``dst[i]`` in every recurrent layer (restore or take a checkpoint)."""
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source slots for {len(dst)} destinations")
        if not src or not state_cache:
            return
        device = state_cache[0][0].device
        src_index = torch.tensor(src, dtype=torch.long, device=device)
        dst_index = torch.tensor(dst, dtype=torch.long, device=device)
        for tensors in state_cache:
            for tensor in tensors:
                tensor[dst_index] = tensor[src_index]

    @staticmethod
    def zero_states(state_cache: StateCache, slots: list[int]) -> None:
        """Reset ``slots`` in every recurrent layer to the state before any token."""
        if not slots or not state_cache:
            return
        index = torch.tensor(slots, dtype=torch.long, device=state_cache[0][0].device)
        for tensors in state_cache:
            for tensor in tensors:
                tensor[index] = 0

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], device: torch.device | str | None = None
    ) -> None:
        """Install HF-named weights as the parameters; ValueError on unknown, missing or mis-shaped ones.

        Tensors are assigned rather than copied into the existing storage (only the fused projections are
        concatenated), so a model built on the meta device loads without a second copy of its weights; pass
        ``device`` then. Each weight is cast to its parameter's current dtype.
        """
        arch = self.config.architecture
        renames = _RENAMED_MODULES.get(arch, ())
        unused = _UNUSED_WEIGHT_PREFIXES.get(arch, ())
        whole = _WHOLE_FUSED.get(arch, frozenset())
        params = dict(self.named_parameters())
        shards: dict[str, dict[int, torch.Tensor]] = {name: {} for name in params}
        unexpected: list[str] = []
        for hf_name, tensor in weights:
            if hf_name.startswith(unused):
                continue
            name = _rename(hf_name, renames)
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
                continue
            *prefix, module, kind = name.split(".")
            fused, index = (module, 0) if module in whole else _STACKED.get(module, (module, 0))
            target = ".".join([*prefix, fused, kind])
            if target in shards:
                shards[target][index] = tensor
            else:
                unexpected.append(hf_name)
        missing = [
            name
            for target, parts in shards.items()
            for index, name in enumerate(self.hf_names(target))
            if index not in parts
        ]
        if unexpected or missing:
            raise ValueError(f"checkpoint does not match the model: unexpected {unexpected}, missing {missing}")
        state = {}
        for target, parts in shards.items():
            param = params[target]
            tensor = parts[0] if len(parts) == 1 else torch.cat([parts[i] for i in range(len(parts))])
            if tensor.shape != param.shape:
                raise ValueError(f"weight {target} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            state[target] = tensor.to(device=param.device if device is None else device, dtype=param.dtype)
        self.load_state_dict(state, strict=True, assign=True)

    def hf_names(self, param_name: str) -> list[str]:
        """The HF checkpoint names stored in one of our parameters, in shard order."""
        arch = self.config.architecture
        *prefix, module, kind = param_name.split(".")
        parts = (module,) if module in _WHOLE_FUSED.get(arch, ()) else _FUSED_PARTS.get(module, (module,))
        back = [(ours, theirs) for theirs, ours in _RENAMED_MODULES.get(arch, ())]
        return [_rename(".".join([*prefix, part, kind]), back) for part in parts]
