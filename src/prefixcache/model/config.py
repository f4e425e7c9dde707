"""The architecture of a checkpoint as one frozen config, read from a transformers config (v4 or v5 names).

Every supported architecture is the same decoder with different settings (see
:class:`~prefixcache.model.decoder.DecoderForCausalLM`); this module says which settings each one uses.
No torch here: the config is read before any weights are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# HF's names: SwiGLU (Llama, Mistral, Qwen) and GeGLU with the tanh approximation of GELU (Gemma).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
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
        for scaling in (self.rope_scaling, self.sliding_rope_scaling):
            if scaling is not None and scaling.get("rope_type") not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"unsupported RoPE scaling {scaling!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if self.sliding_rope_scaling is not None and self.sliding_rope_theta is None:
            raise ValueError("sliding_rope_scaling needs sliding_rope_theta")
        if self.sliding_rope_theta is not None and not self.layer_types:
            raise ValueError("sliding_rope_theta needs layer_types to tell which layers use it")

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
        """The layers' KV cache groups, in order of their first layer.

        Without ``hybrid`` (or with one attention spec) one group of every layer: the mask-only layout, whose
        group is full attention to the cache even where layers slide (they mask their window). With it, the
        layers of each window (None: full attention) are cut into groups of equal size, so that all groups' pages
        are alike; the last group of a kind may have fewer layers (its spare slots stay unused). Gemma 3's five
        sliding layers per full one give groups of one layer; 2 full + 2 sliding layers two groups of two.
        """
        all_layers = tuple(range(self.num_layers))
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
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes one token's K and V take across all layers, to size a cache before any model is loaded."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> ModelConfig:
        """Read a transformers config (v4 or v5 field names); ValueError for anything unsupported."""
        architectures = getattr(hf_config, "architectures", None) or []
        model_type = getattr(hf_config, "model_type", None)
        arch = architectures[0] if architectures else _ARCH_BY_MODEL_TYPE.get(model_type or "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch or model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
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

        attention_bias = o_proj_bias = mlp_bias = False
        if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"):
            attention_bias = o_proj_bias = bool(getattr(hf_config, "attention_bias", False))
        if arch == "LlamaForCausalLM":
            mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        elif arch == "Qwen2ForCausalLM":
            attention_bias = True

        sliding_window, layer_types = _sliding_window(hf_config, arch, num_layers)
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)
        softcap = getattr(hf_config, "final_logit_softcapping", None)
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=full_rope[0],
            max_position_embeddings=hf_config.max_position_embeddings,
            rope_scaling=full_rope[1],
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            is_causal=True,
            eos_token_ids=eos_ids,
            architecture=arch,
            o_proj_bias=o_proj_bias,
            mlp_bias=mlp_bias,
            sliding_window=sliding_window,
            layer_types=layer_types,
            hidden_act=act,
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            norm_unit_offset=gemma,
            sandwich_norm=gemma,
            embed_scale=hf_config.hidden_size**0.5 if gemma else None,
            query_pre_attn_scalar=float(hf_config.query_pre_attn_scalar) if gemma else None,
            final_logit_softcapping=None if softcap is None else float(softcap),
            sliding_rope_theta=None if sliding_rope is None else sliding_rope[0],
            sliding_rope_scaling=None if sliding_rope is None else sliding_rope[1],
        )


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
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if factor not in (None, 1.0):
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor={factor}) are not supported")
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
