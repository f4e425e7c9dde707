"""The architecture of a checkpoint as one frozen config, read from a transformers config (v4 or v5 names).

Every supported architecture is the same decoder with different settings (see
:class:`~prefixcache.model.decoder.DecoderForCausalLM`); this module says which settings each one uses. Hybrid
models (Qwen3.5, Granite 4.0-H, LFM2) mix attention layers with recurrent ones (``RECURRENT_LAYER_TYPES``), which
keep a fixed-size state per sequence instead of K/V per token: they are in no KV cache group.
No torch here: the config is read before any weights are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "GraniteMoeHybridForCausalLM",
    "Lfm2ForCausalLM",
)
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
}
QWEN3_5_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
# Architectures whose ``attention_bias`` puts a bias on q, k, v and o_proj alike.
_BIASED_O_PROJ = (
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "GraniteMoeHybridForCausalLM",
    *QWEN3_5_ARCHITECTURES,
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# HF's names: SwiGLU (Llama, Mistral, Qwen) and GeGLU with the tanh approximation of GELU (Gemma).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Recurrent layers: Gated DeltaNet (Qwen3.5), Mamba2 (Granite 4.0-H), LFM2's gated short convolution.
RECURRENT_LAYER_TYPES = ("gated_delta_net", "mamba2", "short_conv")
LAYER_TYPES = ATTENTION_LAYER_TYPES + RECURRENT_LAYER_TYPES
# transformers' names of a hybrid's layer kinds (v5 normalises "mamba" and "attention"; v4 configs keep them).
_HF_LAYER_TYPES = {
    "full_attention": "full_attention",
    "attention": "full_attention",
    "linear_attention": "recurrent",
    "mamba": "recurrent",
    "conv": "recurrent",
}
# Gemma 3 configs without ``layer_types``: every sixth layer is full attention (transformers' default).
_GEMMA3_SLIDING_WINDOW_PATTERN = 6


# Groups of sliding-window and full layers get the most layers of one kind as their size when the kinds are
# this close in number (fewer padding slots), else the fewest (vLLM's rule).
_GROUP_SIZE_BY_MAX_BELOW = 1.5


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one attention spec and one block table per request (see ``kv_cache_groups``).

    Layer ``layers[j]`` keeps its K/V in slot j of the cache; a block id handed to the group addresses that
    block in the group's slots, so groups of the same pool share storage by slot.
    """

    sliding_window: int | None
    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.layers or list(self.layers) != sorted(set(self.layers)) or self.layers[0] < 0:
            raise ValueError(f"a KV cache group needs distinct layers in increasing order, got {self.layers}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """Qwen3.5's linear attention: a causal conv over q, k, v, then the gated delta rule per value head.

    The state per sequence: the conv window (``conv_kernel - 1`` inputs of ``conv_channels``) and one
    ``[head_k_dim, head_v_dim]`` matrix per value head.
    """

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        _check_positive(self)
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"num_v_heads ({self.num_v_heads}) must be a multiple of num_k_heads ({self.num_k_heads})")

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


@dataclass(frozen=True)
class Mamba2Spec:
    """A Mamba2 mixer (Granite 4.0-H): a causal conv over x, B, C, then the selective state space scan (SSD).

    The state per sequence: the conv window and one ``[state_size, head_dim]`` matrix per head.
    """

    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool = True
    proj_bias: bool = False
    # Bounds of the softplus'ed time step (transformers' ``time_step_limit``).
    time_step_min: float = 0.0
    time_step_max: float = float("inf")

    def __post_init__(self) -> None:
        _check_positive(self)
        if self.num_heads % self.num_groups:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_groups ({self.num_groups})")

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return self.inner_size + 2 * self.num_groups * self.state_size


@dataclass(frozen=True)
class ShortConvSpec:
    """LFM2's gated short convolution: ``C * conv(B * x)`` over the hidden size; the state is the conv window."""

    conv_kernel: int
    bias: bool = False

    def __post_init__(self) -> None:
        _check_positive(self)


def _check_positive(spec: Any) -> None:
    """ValueError unless every integer field of a layer spec is positive and its conv has a window to keep."""
    for field in fields(spec):
        value = getattr(spec, field.name)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError(f"{type(spec).__name__}.{field.name} must be positive, got {value}")
    if spec.conv_kernel < 2:
        raise ValueError(f"{type(spec).__name__}.conv_kernel must be at least 2, got {spec.conv_kernel}")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture hyper-parameters the model needs, independent of the transformers version.

    Sliding-window attention (Mistral, Qwen2/Qwen3 with ``use_sliding_window``, Gemma 3's local layers) lets a
    query at position p see keys at positions > p - W in a layer with window W.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    is_causal: bool = True
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    # Llama's ``attention_bias`` also puts a bias on o_proj; Qwen2 has one on q/k/v only.
    o_proj_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    # Per layer "full_attention" or "sliding_attention"; empty means every layer uses ``sliding_window``.
    layer_types: tuple[str, ...] = ()
    # The activation of the gated MLP: act(gate(x)) * up(x).
    hidden_act: str = "silu"
    # Per-head RMSNorm of the queries and keys before RoPE (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Gemma's RMSNorm: scale by (1 + weight), multiplied in float32 before casting back.
    norm_unit_offset: bool = False
    # Gemma's four norms per layer: the attention and MLP outputs are normed too, before the residual add.
    sandwich_norm: bool = False
    # Embeddings are multiplied by this (rounded to the model dtype, as Gemma does with sqrt(hidden_size)).
    embed_scale: float | None = None
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5 (Gemma).
    query_pre_attn_scalar: float | None = None
    # Logits become cap * tanh(logits / cap).
    final_logit_softcapping: float | None = None
    # RoPE of the sliding-window layers when it differs from the full layers' (Gemma 3's local base).
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict[str, Any] | None = None
    # RoPE rotates the first ``int(head_dim * partial_rotary_factor)`` dims of each head (Qwen3.5: a quarter).
    partial_rotary_factor: float = 1.0
    # False: the attention layers have no positional encoding at all (Granite 4.0-H's "nope").
    use_rope: bool = True
    # Qwen3.5's gated attention: q_proj also yields a per-head gate, the output is multiplied by sigmoid(gate).
    attention_output_gate: bool = False
    # Granite's multipliers: scores scaled by attention_multiplier (instead of head_dim ** -0.5), each residual
    # branch by residual_multiplier, and logits divided by logits_scaling.
    attention_multiplier: float | None = None
    residual_multiplier: float | None = None
    logits_scaling: float | None = None
    # The recurrent layers' settings, one per kind present in ``layer_types``.
    gated_delta_net: GatedDeltaNetSpec | None = None
    mamba2: Mamba2Spec | None = None
    short_conv: ShortConvSpec | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}")
        sizes = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
        }
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"{len(self.layer_types)} layer_types for {self.num_layers} layers")
            unknown = set(self.layer_types) - set(LAYER_TYPES)
            if unknown:
                raise ValueError(f"unsupported layer types {sorted(unknown)}; supported: {', '.join(LAYER_TYPES)}")
            for kind in RECURRENT_LAYER_TYPES:
                if kind in self.layer_types and getattr(self, kind) is None:
                    raise ValueError(f"{kind} layers need their settings ({kind}=...)")
            if not self.attention_layers:
                raise ValueError("a model needs at least one attention layer (recurrent-only models are not supported)")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} must leave an even number of rotary dims in "
                f"(0, head_dim={self.head_dim}]"
            )
        for scaling in (self.rope_scaling, self.sliding_rope_scaling):
            if scaling is not None and scaling.get("rope_type") not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"unsupported RoPE scaling {scaling!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if self.sliding_rope_scaling is not None and self.sliding_rope_theta is None:
            raise ValueError("sliding_rope_scaling needs sliding_rope_theta")
        if self.sliding_rope_theta is not None and not self.layer_types:
            raise ValueError("sliding_rope_theta needs layer_types to tell which layers use it")

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The recurrent layers (a fixed-size state per sequence, no K/V); empty for attention-only models."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind in RECURRENT_LAYER_TYPES)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with K/V in the paged cache, in order: every layer but the recurrent ones."""
        recurrent = set(self.state_layers)
        return tuple(i for i in range(self.num_layers) if i not in recurrent)

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each attention head RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer, or None for full attention."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    def layer_rope(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """(RoPE base, scaling or None) of a layer: sliding layers may have their own (Gemma 3)."""
        if self.sliding_rope_theta is not None and self.layer_types[layer] == "sliding_attention":
            return self.sliding_rope_theta, self.sliding_rope_scaling
        return self.rope_theta, self.rope_scaling

    def kv_cache_groups(self, hybrid: bool = True) -> tuple[KVCacheGroup, ...]:
        """The attention layers' KV cache groups, in order of their first layer (recurrent layers are in none).

        Without ``hybrid`` (or with one attention spec) one group of every layer: the mask-only layout, whose
        group is full attention to the cache even where layers slide (they mask their window). With it, the
        layers of each window (None: full attention) are cut into groups of equal size, so that all groups' pages
        are alike; the last group of a kind may have fewer layers (its spare slots stay unused). Gemma 3's five
        sliding layers per full one give groups of one layer; 2 full + 2 sliding layers two groups of two.
        """
        all_layers = self.attention_layers
        if not hybrid:
            return (KVCacheGroup(None, all_layers),)
        by_window: dict[int | None, list[int]] = {}
        for layer in all_layers:
            by_window.setdefault(self.layer_window(layer), []).append(layer)
        counts = [len(layers) for layers in by_window.values()]
        size = max(counts) if max(counts) < _GROUP_SIZE_BY_MAX_BELOW * min(counts) else min(counts)
        groups = [
            KVCacheGroup(window, tuple(layers[i : i + size]))
            for window, layers in by_window.items()
            for i in range(0, len(layers), size)
        ]
        return tuple(sorted(groups, key=lambda group: group.layers[0]))

    @property
    def attention_scale(self) -> float:
        """The factor applied to q·k before the softmax."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes one token's K and V take across the attention layers, to size a cache before any model is loaded."""
        return 2 * len(self.attention_layers) * self.num_kv_heads * self.head_dim * itemsize

    def kv_bytes_per_block(self, block_size: int, itemsize: int, groups: tuple[KVCacheGroup, ...] | None = None) -> int:
        """Bytes one block of the pool takes (K and V of each group slot), to size the cache from a memory budget
        without the model: a block serves one group, so it spans the largest group's layers (default: the
        mask-only single group, all of them)."""
        slots = max(len(group.layers) for group in groups or self.kv_cache_groups(hybrid=False))
        return block_size * slots * 2 * self.num_kv_heads * self.head_dim * itemsize

    def state_shapes(self, layer: int) -> tuple[tuple[int, ...], ...]:
        """One sequence's state in recurrent ``layer``: its conv window ``[kernel - 1, channels]`` (in the model's
        dtype), then for Gated DeltaNet ``[Hv, Dk, Dv]`` and for Mamba2 ``[H, N, P]``, its matrix state (float32
        at least). What the model allocates and what sizing a cache without the model counts."""
        kind = self.layer_types[layer] if self.layer_types else None
        if kind == "gated_delta_net":
            gdn = self.gated_delta_net
            return (gdn.conv_kernel - 1, gdn.conv_channels), (gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim)
        if kind == "mamba2":
            mamba = self.mamba2
            return (mamba.conv_kernel - 1, mamba.conv_channels), (mamba.num_heads, mamba.state_size, mamba.head_dim)
        if kind == "short_conv":
            return ((self.short_conv.conv_kernel - 1, self.hidden_size),)
        raise ValueError(f"layer {layer} is not a recurrent layer")

    def state_bytes_per_slot(self, itemsize: int) -> int:
        """Bytes one sequence's state takes across the recurrent layers (0 without any), the conv windows in a dtype
        of ``itemsize`` bytes and the matrix states in float32 at least (``model.recurrent.state_dtype``)."""
        matrix_itemsize = max(itemsize, 4)
        total = 0
        for layer in self.state_layers:
            conv, *matrices = self.state_shapes(layer)
            total += math.prod(conv) * itemsize + sum(math.prod(shape) for shape in matrices) * matrix_itemsize
        return total

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> ModelConfig:
        """Read a transformers config (v4 or v5 field names); ValueError for anything unsupported.

        ``Qwen3_5ForConditionalGeneration`` is read as its text model (``text_config``); its vision tower is
        not loaded.
        """
        architectures = getattr(hf_config, "architectures", None) or []
        model_type = getattr(hf_config, "model_type", None)
        arch = architectures[0] if architectures else _ARCH_BY_MODEL_TYPE.get(model_type or "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch or model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if arch == "Qwen3_5ForConditionalGeneration":
            hf_config = hf_config.text_config
        gemma = arch == "Gemma3ForCausalLM"
        act = getattr(hf_config, "hidden_activation", None) if gemma else None
        act = act or getattr(hf_config, "hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
        if getattr(hf_config, "attn_logit_softcapping", None) is not None:
            raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported")
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")

        num_heads = hf_config.num_attention_heads
        num_layers = hf_config.num_hidden_layers
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        full_rope, sliding_rope = _rope_params(hf_config, gemma)
        partial_rotary_factor = _partial_rotary_factor(hf_config)
        if partial_rotary_factor != 1.0 and arch not in QWEN3_5_ARCHITECTURES:
            raise ValueError(
                f"partial rotary embeddings (partial_rotary_factor={partial_rotary_factor}) are not supported"
            )

        attention_bias = o_proj_bias = mlp_bias = False
        if arch in _BIASED_O_PROJ:
            attention_bias = o_proj_bias = bool(getattr(hf_config, "attention_bias", False))
        if arch == "LlamaForCausalLM":
            mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        elif arch == "Qwen2ForCausalLM":
            attention_bias = True

        sliding_window, layer_types = _sliding_window(hf_config, arch, num_layers)
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)
        softcap = getattr(hf_config, "final_logit_softcapping", None)
        settings: dict[str, Any] = dict(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size,
            rms_norm_eps=float(getattr(hf_config, "rms_norm_eps", None) or getattr(hf_config, "norm_eps", 1e-6)),
            rope_theta=full_rope[0],
            max_position_embeddings=hf_config.max_position_embeddings,
            rope_scaling=full_rope[1],
            tie_word_embeddings=tie_word_embeddings,
            attention_bias=attention_bias,
            is_causal=True,
            eos_token_ids=eos_ids,
            architecture=arch,
            o_proj_bias=o_proj_bias,
            mlp_bias=mlp_bias,
            sliding_window=sliding_window,
            layer_types=layer_types,
            hidden_act=act,
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Lfm2ForCausalLM", *QWEN3_5_ARCHITECTURES),
            norm_unit_offset=gemma or arch in QWEN3_5_ARCHITECTURES,
            sandwich_norm=gemma,
            embed_scale=hf_config.hidden_size**0.5 if gemma else None,
            query_pre_attn_scalar=float(hf_config.query_pre_attn_scalar) if gemma else None,
            final_logit_softcapping=None if softcap is None else float(softcap),
            sliding_rope_theta=None if sliding_rope is None else sliding_rope[0],
            sliding_rope_scaling=None if sliding_rope is None else sliding_rope[1],
            partial_rotary_factor=partial_rotary_factor,
        )
        settings |= _hybrid_settings(hf_config, arch, num_layers)
        return cls(**settings)


def _hybrid_settings(hf_config: Any, arch: str, num_layers: int) -> dict[str, Any]:
    """The settings of a hybrid architecture's recurrent layers and its own layout (none for the others)."""
    if arch not in (*QWEN3_5_ARCHITECTURES, "GraniteMoeHybridForCausalLM", "Lfm2ForCausalLM"):
        return {}
    hf_types = list(getattr(hf_config, "layer_types", None) or getattr(hf_config, "layers_block_type", None) or [])
    if len(hf_types) != num_layers:
        raise ValueError(f"{len(hf_types)} layer_types for {num_layers} layers")
    unknown = sorted(set(hf_types) - set(_HF_LAYER_TYPES))
    if unknown:
        raise ValueError(f"unsupported layer types {unknown} in a {arch} config")
    settings: dict[str, Any] = {}
    if arch in QWEN3_5_ARCHITECTURES:
        recurrent = "gated_delta_net"
        settings["gated_delta_net"] = GatedDeltaNetSpec(
            num_k_heads=hf_config.linear_num_key_heads,
            num_v_heads=hf_config.linear_num_value_heads,
            head_k_dim=hf_config.linear_key_head_dim,
            head_v_dim=hf_config.linear_value_head_dim,
            conv_kernel=hf_config.linear_conv_kernel_dim,
        )
        settings["attention_output_gate"] = True
    elif arch == "GraniteMoeHybridForCausalLM":
        experts = getattr(hf_config, "num_local_experts", 0) or 0
        if experts > 0:
            raise ValueError(
                f"Granite 4.0-H with experts (num_local_experts={experts}) is not supported; only dense configs are"
            )
        recurrent = "mamba2"
        limit = tuple(getattr(hf_config, "time_step_limit", None) or (0.0, float("inf")))
        settings["mamba2"] = Mamba2Spec(
            num_heads=hf_config.mamba_n_heads,
            head_dim=int(hf_config.mamba_d_head),
            state_size=hf_config.mamba_d_state,
            num_groups=hf_config.mamba_n_groups,
            conv_kernel=hf_config.mamba_d_conv,
            chunk_size=hf_config.mamba_chunk_size,
            conv_bias=bool(hf_config.mamba_conv_bias),
            proj_bias=bool(hf_config.mamba_proj_bias),
            time_step_min=float(limit[0]),
            time_step_max=float(limit[1]),
        )
        if settings["mamba2"].inner_size != int(hf_config.mamba_expand * hf_config.hidden_size):
            raise ValueError("mamba_n_heads * mamba_d_head must equal mamba_expand * hidden_size")
        settings["intermediate_size"] = hf_config.shared_intermediate_size
        settings["use_rope"] = getattr(hf_config, "position_embedding_type", None) == "rope"
        multiplier = float(hf_config.embedding_multiplier)
        settings["embed_scale"] = None if multiplier == 1.0 else multiplier
        settings["attention_multiplier"] = float(hf_config.attention_multiplier)
        # 1.0 is no scaling: None skips the multiply.
        settings["residual_multiplier"] = (
            float(hf_config.residual_multiplier) if hf_config.residual_multiplier != 1 else None
        )
        settings["logits_scaling"] = float(hf_config.logits_scaling) if hf_config.logits_scaling != 1 else None
    else:
        recurrent = "short_conv"
        settings["short_conv"] = ShortConvSpec(conv_kernel=hf_config.conv_L_cache, bias=bool(hf_config.conv_bias))
        settings["intermediate_size"] = _lfm2_intermediate_size(hf_config)
    settings["layer_types"] = tuple(
        recurrent if _HF_LAYER_TYPES[kind] == "recurrent" else "full_attention" for kind in hf_types
    )
    return settings


def _lfm2_intermediate_size(hf_config: Any) -> int:
    """LFM2's MLP width: ``intermediate_size`` as transformers adjusts it (two thirds, times the multiplier,
    rounded up to ``block_multiple_of``)."""
    size = hf_config.intermediate_size
    if not getattr(hf_config, "block_auto_adjust_ff_dim", False):
        return size
    size = int(2 * size / 3)
    multiplier = getattr(hf_config, "block_ffn_dim_multiplier", None)
    if multiplier is not None:
        size = int(multiplier * size)
        step = hf_config.block_multiple_of
        size = step * ((size + step - 1) // step)
    return size


def _partial_rotary_factor(hf_config: Any) -> float:
    """The share of each head RoPE rotates: in ``rope_parameters`` (v5) or on the config (v4); 1.0 without."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if factor is None:
        factor = getattr(hf_config, "partial_rotary_factor", None)
    return 1.0 if factor is None else float(factor)


RopeParams = tuple[float, dict[str, Any] | None]


def _rope_params(hf_config: Any, gemma: bool) -> tuple[RopeParams, RopeParams | None]:
    """RoPE (base, scaling) of the full layers, and of the sliding layers where they have their own.

    transformers v5 keeps them in ``rope_parameters`` (per layer type for Gemma 3); v4 in ``rope_theta`` and
    ``rope_scaling``, with Gemma 3's local base in ``rope_local_base_freq``.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    per_type = bool(params) and all(isinstance(v, dict) for v in params.values())
    if per_type:
        unknown = set(params) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"RoPE parameters for unknown layer types {sorted(unknown)}")
        full = _one_rope(dict(params.get("full_attention") or {}), hf_config)
        sliding = params.get("sliding_attention")
        return full, None if sliding is None else _one_rope(dict(sliding), hf_config)
    full = _one_rope(params, hf_config)
    if not gemma:
        return full, None
    # v4 Gemma 3: rope_scaling applies to the full layers only; the local layers have their own base.
    return full, (float(getattr(hf_config, "rope_local_base_freq", None) or 10000.0), None)


def _one_rope(params: dict[str, Any], hf_config: Any) -> RopeParams:
    """(rope_theta, scaling dict or None) from one set of RoPE parameters."""
    theta = params.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return float(theta), None
    params.pop("type", None)
    params["rope_type"] = rope_type
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    return float(theta), params


def _sliding_window(hf_config: Any, arch: str, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """Window size and per-layer types, following how HF's Mistral, Qwen2/3 and Gemma 3 apply ``sliding_window``.

    Gemma 3 keeps its layer types even without an effective window: they also pick each layer's RoPE.
    """
    layer_types: tuple[str, ...] = ()
    if arch == "Gemma3ForCausalLM":
        pattern = getattr(hf_config, "sliding_window_pattern", None) or _GEMMA3_SLIDING_WINDOW_PATTERN
        default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        layer_types = tuple(getattr(hf_config, "layer_types", None) or default)
    if arch == "LlamaForCausalLM" or not getattr(hf_config, "use_sliding_window", True):
        return None, layer_types
    window = getattr(hf_config, "sliding_window", None)
    if window is None or window >= hf_config.max_position_embeddings:
        return None, layer_types
    if arch == "MistralForCausalLM":
        return int(window), ()
    if not layer_types:
        first = getattr(hf_config, "max_window_layers", 0)
        default = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        layer_types = tuple(getattr(hf_config, "layer_types", None) or default)
    if "sliding_attention" not in layer_types:
        return None, ()
    return int(window), layer_types
